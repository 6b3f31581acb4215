"""Token dispatch: the rows each rank's experts compute, and the way back. One protocol, one class per strategy.

A dispatcher takes this rank's tokens ``x (N, H)`` and their routing ``experts (N, k)`` (global
ids; ``keep`` marks the assignments a capacity keeps) and returns the rows its local experts
must compute, grouped by local expert, with the count per local expert; ``combine`` takes the
experts' outputs in that order and gives back ``(N, k, H)``: slot ``[i, j]`` is the output of
token ``i``'s ``j``-th expert (zeros where dropped). The caller weighs and sums the ``k`` slots in
a fixed order, so nothing is accumulated by scattering to duplicate indices: dispatch copies
each token ``k`` times (its gradient is a sum over ``k``), and every other step is a permutation
(a gather, whose gradient writes each row once). Bit-reproducible on any device.

- ``LocalDispatcher``: every expert is here (EP = 1): a stable sort by expert, with static shapes and
  the counts on the device (``torch._grouped_mm`` takes their offsets there): no host sync, and
  ``--compile`` traces it into the block's graph.
- ``AllToAllDispatcher``: experts sharded over the EP group (rank ``r`` holds experts
  ``[r E/EP, (r+1) E/EP)``). The same sort, then one all-to-all of the per-expert counts and one
  all-to-all with variable splits of the rows (``tensor_parallel.collectives.all_to_all``: forward the
  all-to-all, backward the reverse one), whose sizes reach the host in one copy; the received rows, ordered by source
  rank, are regrouped by local expert. A rank may send or receive no rows at all (Megatron #1877).
  Under ``--compile`` both exchanges stay eager, one graph break each.

An all-gather dispatcher, or a DeepEP-class one, would be a third class with the same two methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from megakit.nn import comm as C
from megakit.nn.tensor_parallel.collectives import all_to_all


class Dispatcher(Protocol):
    """Moves each routed token to the rank of its expert and back: local sorting, or an all-to-all over EP."""

    def dispatch(
        self, x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, object]:
        """``(rows (M, H) grouped by local expert, rows per local expert (E/EP,) on the device, plan for
        combine)``; rows past the counts' sum (dropped assignments, at EP 1) are computed by no expert."""

    def combine(self, y: torch.Tensor, plan) -> torch.Tensor:
        """Expert outputs ``(M, H)`` in dispatch order -> ``(N, k, H)``."""


@dataclass
class _Sorted:
    order: torch.Tensor  # (N k,) slot indices sorted by expert (dropped last)
    keep: torch.Tensor | None  # (N, k) the assignments dispatched; None: all of them
    n: int
    k: int


def _sort(
    x: torch.Tensor, experts: torch.Tensor, keep: torch.Tensor | None, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, _Sorted]:
    """``(all N k rows sorted by expert, dropped last (N k, H), kept assignments per expert (E,), plan)``.

    Static shapes, no host sync: the dropped assignments go to a sentinel expert ``E`` that sorts last and
    that no expert computes, and the counts are a scatter-add, not ``bincount`` (whose length is data)."""
    n, k = experts.shape
    flat = experts.reshape(-1)
    if keep is not None:
        flat = torch.where(keep.reshape(-1), flat, num_experts)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts = counts.scatter_add(0, flat, torch.ones_like(flat))[:num_experts]
    copies = x.unsqueeze(1).expand(n, k, x.shape[-1]).reshape(n * k, x.shape[-1])  # grad: a sum over k
    return copies[order], counts, _Sorted(order, keep, n, k)


def _unsort(y: torch.Tensor, plan: _Sorted) -> torch.Tensor:
    """Inverse of ``_sort``: ``(M <= N k, H)`` in sorted order -> ``(N, k, H)``, zeros for dropped slots."""
    total = plan.n * plan.k
    if y.shape[0] < total:  # EP > 1: the dropped rows never travelled
        y = torch.cat([y, y.new_zeros(total - y.shape[0], y.shape[-1])])
    inverse = torch.empty_like(plan.order)
    inverse[plan.order] = torch.arange(total, device=plan.order.device)
    out = y[inverse].view(plan.n, plan.k, y.shape[-1])
    return out if plan.keep is None else torch.where(plan.keep.unsqueeze(-1), out, 0)


class LocalDispatcher:
    """EP = 1: all ``num_experts`` experts on this rank; no host sync (the rows keep their static ``N k``)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts

    def dispatch(self, x, experts, keep):
        """Rows grouped by expert, in this process."""
        return _sort(x, experts, keep, self.num_experts)

    def combine(self, y, plan):
        """The experts' outputs back in token order."""
        return _unsort(y, plan)


@dataclass
class _Exchange:
    local: _Sorted
    send: list[int]  # rows to each EP rank
    recv: list[int]  # rows from each EP rank
    regroup: torch.Tensor  # received rows (by source) -> rows by local expert
    moved: torch.Tensor  # () rows this rank sends to and receives from other EP ranks in dispatch, on the device


@torch.compiler.disable  # the host needs the split sizes: under --compile the exchange stays eager, between 2 graphs
def _exchange(rows: torch.Tensor, counts: torch.Tensor, plan: _Sorted, group, ep: int, local: int):
    received_counts = C.all_to_all(counts.contiguous(), group).view(ep, local)  # [src, local e]
    sent, received = counts.view(ep, local).sum(1), received_counts.sum(1)
    me = C.rank(group)
    moved = sent.sum() - sent[me] + received.sum() - received[me]  # a tensor: the graph after us guards no number
    sizes = torch.cat([sent, received_counts.reshape(-1)]).tolist()  # the one copy to the host
    send, by_source = sizes[:ep], sizes[ep:]
    recv = [sum(by_source[r * local : (r + 1) * local]) for r in range(ep)]
    received = all_to_all(rows[: sum(send)], group, send, recv)  # by source rank, then local expert
    segment = torch.arange(local, device=rows.device).repeat(ep)  # local expert of each received block
    segment = segment.repeat_interleave(received_counts.reshape(-1), output_size=sum(recv))
    regroup = torch.argsort(segment, stable=True)
    rows = received[regroup]
    torch._dynamo.maybe_mark_dynamic(rows, 0)  # how many rows arrive is data: one graph for every count
    return rows, received_counts.sum(0), _Exchange(plan, send, recv, regroup, moved)


class AllToAllDispatcher:
    """Experts sharded over ``group`` (EP ranks); tokens travel by all-to-all with variable splits. One copy to
    the host per dispatch: the split sizes (as Megatron's all-to-all dispatcher)."""

    def __init__(self, num_experts: int, group) -> None:
        self.num_experts, self.group, self.ep = num_experts, group, C.size(group)
        assert num_experts % self.ep == 0, (num_experts, self.ep)  # checked by the MoE layer
        self.local = num_experts // self.ep

    def dispatch(self, x, experts, keep):
        """Rows sorted by expert, then exchanged so each rank holds its own experts' rows."""
        rows, counts, plan = _sort(x, experts, keep, self.num_experts)
        return _exchange(rows, counts, plan, self.group, self.ep, self.local)

    @torch.compiler.disable  # as dispatch: eager between two graphs, whose inputs have static shapes again
    def combine(self, y, plan):
        """The experts' outputs sent back to their tokens' ranks, in token order."""
        inverse = torch.empty_like(plan.regroup)
        inverse[plan.regroup] = torch.arange(plan.regroup.numel(), device=y.device)
        return _unsort(all_to_all(y[inverse], self.group, plan.recv, plan.send), plan.local)


def make_dispatcher(num_experts: int, ep_group) -> Dispatcher:
    """Local sorting without EP, the all-to-all dispatcher with it."""
    return LocalDispatcher(num_experts) if C.size(ep_group) == 1 else AllToAllDispatcher(num_experts, ep_group)
