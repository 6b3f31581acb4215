"""The gradients a pipeline stage shares with other ranks at the end of a step.

Tied parameters (input embedding and LM head, held under one name by the first and
the last virtual stage) must stay equal: their weights start equal and their gradients
are summed, over ``topo.embedding_group`` when two ranks hold them. Every gradient is
averaged over the DP replicas (``topo.dp_group``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from megakit.nn import comm as C


def find_tied_parameters(chunks: Sequence[nn.Module], topo, *, virtual_stages: int) -> list[tuple[nn.Parameter, ...]]:
    """Parameters held under one name by the first and the last virtual stage (tied embeddings).

    With PP > 1 they live on two ranks: names are exchanged once over the embedding group.
    Returns, per tied name, this rank's copies (two when one rank holds both ends). The
    last stage's copy gets ``ds_pipe_replicated = True``, the flag DeepSpeed's own
    PipelineModule sets, so DeepSpeed's gradient norm (clipping) counts it once.
    """
    holds_first, holds_last = topo.pp_rank == 0, topo.pp_rank == topo.pp - 1
    first = dict(chunks[0].named_parameters()) if holds_first else {}
    last = dict(chunks[-1].named_parameters()) if holds_last else {}
    if virtual_stages == 1:
        return []
    if topo.pp == 1:
        tied = [(first[n], last[n]) for n in sorted(first.keys() & last.keys())]
    elif not (holds_first or holds_last):
        return []
    else:
        mine = sorted(first if holds_first else last)
        gathered = C.all_gather_object(mine, topo.embedding_group)
        shared = sorted(set(gathered[0]) & set(gathered[1]))
        own = first if holds_first else last
        tied = [(own[n],) for n in shared]
    for copies in tied:  # the last stage's copy: DeepSpeed's gradient norm must count it once, not twice
        if holds_last and (len(copies) == 2 or not holds_first):
            copies[-1].ds_pipe_replicated = True
    return tied


@torch.no_grad()
def sync_tied_weights(tied: list[tuple[nn.Parameter, ...]], topo) -> None:
    """Make both copies of each tied parameter equal to the first stage's (a broadcast over the embedding group)."""
    for copies in tied:
        if len(copies) == 2:
            copies[1].copy_(copies[0])
        else:
            C.broadcast(copies[0].data, topo.stage_rank(0), topo.embedding_group)


def reduce_tied_grads(tied: list[tuple[nn.Parameter, ...]], topo, gradient=None) -> None:
    """Sum the gradients of tied copies (embedding + LM head), so both copies step identically.

    Forward: nothing. Here (after the last backward): an all-reduce (sum) over
    ``topo.embedding_group`` when the copies live on two ranks, a local sum otherwise.
    ``gradient(p)``: the tensor the optimizer will step ``p`` with (default ``p.grad``; DeepSpeed's
    bf16 optimizer steps from its fp32 accumulator, ``megakit.train.engine.dp_sync.gradient_of``).
    """
    gradient = gradient or (lambda p: p.grad)
    for copies in tied:
        grads = [gradient(p) for p in copies]
        for i, p in enumerate(copies):
            if grads[i] is None:  # no gradient reached this copy in the step
                p.grad = grads[i] = torch.zeros_like(p)
        if len(copies) == 2:
            total = grads[0] + grads[1]
            grads[0].copy_(total)
            grads[1].copy_(total)
        else:
            C.all_reduce(grads[0], topo.embedding_group)


def average_over_dp(chunks: Sequence[nn.Module], topo) -> None:
    """Average every gradient over the DP replicas (DP x CP with context parallelism, whose loss
    gradients are CP times each rank's share): one all-reduce of all of them flattened together."""
    n, group = topo.get_data_parallel_world_size(), topo.get_data_parallel_group()
    if n == 1:
        return
    grads = [p.grad for c in chunks for p in c.parameters() if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    C.all_reduce(flat, group)
    flat /= n
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
