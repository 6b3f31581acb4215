"""Megatron's differentiable collectives (Shoeybi et al. 2019, arXiv:1909.08053; sequence parallelism: Korthikanti
et al. 2022, arXiv:2205.05198), and the all-to-all that MoE's dispatch and Ulysses share.

Each is an autograd function over ``megakit.nn.comm`` that says what runs in forward and what in backward: the
paper's ``f`` (copy to the TP region) and ``g`` (reduce from it), the scatter/gather pair, the sequence-parallel
pair, and an all-to-all with variable splits whose backward is the reverse one. Activations are sequence-first
``(S, B, H)``, so sequence parallelism splits dim 0 and every SP collective moves contiguous blocks. Each takes its
process group explicitly; ``None`` or a group of one means no communication.
"""

from __future__ import annotations

import torch

from megakit.nn import comm as C


# -- TP's f and g, and the sequence-parallel pair -------------------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``. forward: identity; backward: all-reduce (sum) over TP."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return C.all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``. forward: all-reduce (sum) over TP, in place; backward: identity.

    In place because its input is a fresh matmul output that nothing else reads.
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.mark_dirty(x)
        return C.all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTP(torch.autograd.Function):
    """forward: keep this rank's slice of ``dim`` (the last by default); backward: all-gather ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim=-1):
        ctx.group, ctx.dim = group, dim % x.dim()
        return C.split(x, group, dim=ctx.dim)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad.contiguous(), ctx.group, dim=ctx.dim), None, None


class _GatherFromTP(torch.autograd.Function):
    """forward: all-gather ``dim`` (the last by default); backward: keep this rank's slice of ``dim``."""

    @staticmethod
    def forward(ctx, x, group, dim=-1):
        ctx.group, ctx.dim = group, dim % x.dim()
        return C.all_gather(x.contiguous(), group, dim=ctx.dim)

    @staticmethod
    def backward(ctx, grad):
        return C.split(grad, ctx.group, dim=ctx.dim), None, None


class _SPAllGather(torch.autograd.Function):
    """SP's ``g``-bar. forward: all-gather the sequence (dim 0); backward: reduce-scatter it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_gather(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return C.reduce_scatter(grad, ctx.group, dim=0), None


class _SPReduceScatter(torch.autograd.Function):
    """SP's ``g``. forward: reduce-scatter over the sequence (dim 0); backward: all-gather it."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter(x, group, dim=0)

    @staticmethod
    def backward(ctx, grad):
        return C.all_gather(grad, ctx.group, dim=0), None


def _unless_single(fn):
    def apply(x, group, *args):
        return x if C.size(group) == 1 else fn.apply(x, group, *args)

    apply.__doc__ = fn.__doc__
    return apply


copy_to_tp = _unless_single(_CopyToTP)
reduce_from_tp = _unless_single(_ReduceFromTP)
scatter_to_tp = _unless_single(_ScatterToTP)
gather_from_tp = _unless_single(_GatherFromTP)
sp_all_gather = _unless_single(_SPAllGather)
sp_reduce_scatter = _unless_single(_SPReduceScatter)


def enter_tp_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Make a replicated input of column-parallel layers: ``(S', B, H) -> (S, B, H)``.

    With SP, forward: all-gather the sequence, backward: reduce-scatter. Without SP,
    forward: identity, backward: all-reduce. Call it once and share the result between
    column-parallel layers that read the same input (q, k, v; gate, up), so the
    collective runs once per block rather than once per projection.
    """
    return sp_all_gather(x, group) if sequence_parallel else copy_to_tp(x, group)


def leave_tp_region(x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """Sum partial outputs of a row-parallel layer: ``(S, B, H) -> (S', B, H)``.

    With SP, forward: reduce-scatter over the sequence, backward: all-gather. Without
    SP, forward: all-reduce (in place: pass a fresh tensor, such as a matmul output),
    backward: identity.
    """
    return sp_reduce_scatter(x, group) if sequence_parallel else reduce_from_tp(x, group)


def replicated(param: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
    """A TP-replicated parameter as used by one rank's part of the sequence.

    With SP each rank applies norms, biases and position embeddings to its own
    slice of the sequence, so its gradient is partial: forward: identity, backward:
    all-reduce over TP, which leaves every rank the full gradient (Megatron instead
    all-reduces such gradients after backward; autograd keeps it local and exact).
    """
    return copy_to_tp(param, group) if sequence_parallel else param


class _AllToAll(torch.autograd.Function):
    """forward: all-to-all of rows with variable splits over ``group``; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, group, send_splits, recv_splits):
        ctx.group, ctx.send, ctx.recv = group, send_splits, recv_splits
        return C.all_to_all_single(x, group, send_splits=send_splits, recv_splits=recv_splits)

    @staticmethod
    def backward(ctx, grad):
        return C.all_to_all_single(grad, ctx.group, send_splits=ctx.recv, recv_splits=ctx.send), None, None, None


def all_to_all(x: torch.Tensor, group, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Differentiable ``comm.all_to_all_single``: forward the all-to-all, backward the reverse one."""
    return x if C.size(group) == 1 else _AllToAll.apply(x, group, send_splits, recv_splits)
