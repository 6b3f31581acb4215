"""Ulysses context parallelism (DeepSpeed-Ulysses, Jacobs et al. 2023): the heads split over CP, not the keys.

A CP rank holds ``S/cp`` tokens (the load-balanced chunks of ``sequence.positions``) with all of its TP
rank's heads. One all-to-all per tensor turns ``q``, ``k``, ``v`` into all ``S`` tokens, in sequence order, of
``heads/cp`` heads; attention then runs over the whole sequence with any kernel and any mask (causal, window,
documents, dropout), exactly as without CP; one all-to-all takes the output back to the rank's tokens and all its
heads. Per layer that moves ``4 x tokens x hidden / (tp x cp)`` elements per rank (q, k, v and the output; K/V at
their own width under GQA), against the ring's ``cp - 1`` K/V blocks, and needs the heads to divide by CP.

Hybrid (USP, Fang and Zhao 2024; Megatron's ``a2a+p2p``): the all-to-all runs inside runs of ``a`` consecutive CP
ranks (``Layout.groups("cp_a2a")``), and gives each rank the tokens of its run, ``S a / cp``, in sequence order,
which are the zig-zag chunks of a ring of ``cp / a`` ranks (see ``Layout.groups``): ``attend`` is then that ring.

GQA: rank ``j`` gets query heads ``[j n/cp, (j+1) n/cp)``; when the KV heads divide by CP it gets their KV heads,
else every KV head is first repeated once per query head it serves (Megatron's and DeepSpeed's replication), so
each rank holds the KV heads its queries read.
"""

from __future__ import annotations

import torch

from megakit.nn import comm as C
from megakit.nn.sequence import positions
from megakit.nn.tensor_parallel.collectives import all_to_all


def _sequence_order(seq_len: int, cp: int, members: range, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``: the global positions CP ranks ``members`` hold, concatenated in rank order, and the
    permutation that sorts them (``inverse``) and back (``order``, as ranks into the sorted positions)."""
    held = torch.cat([positions(seq_len, cp, r, device=device) for r in members])
    inverse = torch.argsort(held)
    return torch.argsort(inverse), inverse


def _heads_to_sequence(x: torch.Tensor, group, cp: int, inverse: torch.Tensor) -> torch.Tensor:
    """``(B, n, S/cp, d)`` -> ``(B, n/cp, S, d)``: head group ``j`` to rank ``j``, every rank's tokens in sequence
    order."""
    b, n, s, d = x.shape
    parts = x.reshape(b, cp, n // cp, s, d).transpose(0, 1).reshape(cp, -1)  # (cp, B n/cp S/cp d): part j to rank j
    got = all_to_all(parts.contiguous(), group, [1] * cp, [1] * cp)  # part r: rank r's tokens of my heads
    got = got.view(cp, b, n // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, n // cp, cp * s, d)
    return got.index_select(2, inverse)


def _sequence_to_heads(y: torch.Tensor, group, cp: int, order: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_heads_to_sequence``: ``(B, n/cp, S, d)`` -> ``(B, n, S/cp, d)``."""
    b, m, s, d = y.shape
    y = y.index_select(2, order).view(b, m, cp, s // cp, d).permute(2, 0, 1, 3, 4).reshape(cp, -1)  # rank r's rows
    got = all_to_all(y.contiguous(), group, [1] * cp, [1] * cp)  # part j: my tokens of head group j
    return got.view(cp, b, m, s // cp, d).transpose(0, 1).reshape(b, cp * m, s // cp, d)


def ulysses_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, attend, *, cp: int | None = None, first: int = 0
) -> torch.Tensor:
    """``(B, n, S/cp, d)`` out for this rank's tokens: ``attend(q, k, v)`` run on ``(B, n/a, S a/cp, d)``, ``a`` the
    ``group``'s size (the tokens of the group's ranks, in sequence order, of this rank's head group; ``attend``
    knows which heads by ``C.rank(group)``). The group holds CP ranks ``first .. first + a - 1`` of ``cp`` (default:
    the group is the whole CP group, ``a = cp``)."""
    a = C.size(group)
    cp = a if cp is None else cp
    n, kv = q.shape[1], k.shape[1]
    if kv % a:  # fewer KV heads than the a2a degree: one per query head, so every head group has its own
        k, v = (t.repeat_interleave(n // kv, dim=1) for t in (k, v))
    order, inverse = _sequence_order(q.shape[2] * cp, cp, range(first, first + a), q.device)
    q, k, v = (_heads_to_sequence(t, group, a, inverse) for t in (q, k, v))
    return _sequence_to_heads(attend(q, k, v), group, a, order)
