"""The only place tensor parallelism calls raw torch.distributed collectives.

Every wrapper takes the process group explicitly and returns its input untouched
when the group has one member, so a TP = 1 model runs with no communication and
no initialised process group at all. ``group=None`` means "no parallelism here"
(size 1) -- unlike torch.distributed, where it would mean the world group.

torch 2.13 renamed the single-tensor collectives (``all_gather_into_tensor`` ->
``all_gather_single``, ``reduce_scatter_tensor`` -> ``reduce_scatter_single``);
the names are resolved once below, so the next rename is a one-line change.
None of these functions is differentiable: ``megakit.nn.tensor_parallel`` wraps
them in autograd functions that say what runs in forward and in backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def size(group) -> int:
    """Number of ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(group)


def rank(group) -> int:
    """This process's index in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over the group, in place; returns ``x``."""
    if size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); a new tensor."""
    n = size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    if dim == 0:
        _all_gather_single(out, x, group=group)
        return out
    # Gather along dim 0 (one contiguous block per rank), then lay the blocks side by side.
    _all_gather_single(out, x, group=group)
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/n slice along ``dim``."""
    n = size(group)
    if n == 1:
        return x
    assert x.shape[dim] % n == 0, (x.shape, dim, n)
    if dim != 0:
        x = torch.cat(x.chunk(n, dim=dim), dim=0)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's 1/n slice of ``x`` along ``dim`` (no communication)."""
    n = size(group)
    if n == 1:
        return x
    assert x.shape[dim] % n == 0, (x.shape, dim, n)
    return x.chunk(n, dim=dim)[rank(group)].contiguous()
