"""Megatron-style tensor parallelism: autograd collectives, TP layers, vocab-parallel loss.

Three levels, after Shoeybi et al. 2019 (Megatron-LM, arXiv:1909.08053) and, for
sequence parallelism, Korthikanti et al. 2022 (arXiv:2205.05198):

1. differentiable collectives -- the paper's ``f`` (copy to the TP region) and ``g``
   (reduce from it), the scatter/gather pair, and the sequence-parallel pair;
2. layers built on them -- column- and row-parallel linear, vocab-parallel embedding;
3. ``vocab_parallel_cross_entropy``, which never gathers the full logits.

Activations are sequence-first ``(S, B, H)``, so sequence parallelism splits dim 0
and every SP collective moves contiguous blocks. Each function and layer takes the
TP process group explicitly; ``None`` or a group of one means no communication.
Layers allocate their shards uninitialised: ``megakit.nn.weights.init_shard_``
(what ``megakit.nn.model.Transformer`` does) or ``load_full_state_dict`` fills them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakit.core.model_config import padded_vocab
from megakit.nn import comm as C


# -- 1. differentiable collectives -------------------------------------------------------------
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


def mark(param: nn.Parameter, tp_dim: int | None, *, unpadded: int | None = None) -> nn.Parameter:
    """Record how ``param`` is split over TP (read by init, checkpoints and DeepSpeed).

    ``tp_dim`` is the split dimension (None: replicated); ``unpadded`` is the global size
    along it without the padding added to make it divide by TP (vocab rows).
    """
    param.tp_dim = tp_dim
    param.tensor_model_parallel = tp_dim is not None
    param.partition_dim = tp_dim if tp_dim is not None else -1
    param.tp_unpadded = unpadded
    return param


def _empty(*shape, dtype, device) -> nn.Parameter:
    # Values are written later by megakit.nn.weights from the parameter's global name.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


def _divide(total: int, tp: int, what: str) -> int:
    assert total % tp == 0, f"{what} {total} is not divisible by TP {tp}"  # validated by the model
    return total // tp


# -- 2. layers ---------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with W split by output rows: each rank computes ``out/tp`` features.

    Input ``(S', B, in)``; ``enter_region=True`` applies ``enter_tp_region`` first (see there
    for the collectives), ``False`` when the caller already did. Output ``(S, B, out/tp)``,
    or ``(S, B, out)`` with ``gather_output`` (forward: all-gather last dim, backward: split).
    """

    def __init__(self, in_features: int, out_features: int, *, group=None, bias: bool = True,
                 gather_output: bool = False, sequence_parallel: bool = False, enter_region: bool = True,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gather_output, self.enter_region = gather_output, enter_region
        local = _divide(out_features, C.size(group), "output features")
        self.weight = mark(_empty(local, in_features, dtype=dtype, device=device), 0)
        self.bias = mark(_empty(local, dtype=dtype, device=device), 0) if bias else None
        self.matmul = F.linear  # megakit.nn.tensor_parallel.fp8 swaps in a float8 matmul (same weight, same names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_tp_region(x, self.group, self.sequence_parallel)  # (S, B, in)
        y = self.matmul(x, self.weight, self.bias)  # (S, B, out/tp)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with W split by input columns; the input arrives already split.

    Input ``(S, B, in/tp)``; each rank's product is partial and ``leave_tp_region`` sums it
    (all-reduce, or reduce-scatter to ``(S/tp, B, out)`` with SP). The bias is replicated
    and added once, after the sum.
    """

    def __init__(self, in_features: int, out_features: int, *, group=None, bias: bool = True,
                 sequence_parallel: bool = False, dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        local = _divide(in_features, C.size(group), "input features")
        self.weight = mark(_empty(out_features, local, dtype=dtype, device=device), 1)
        self.bias = mark(_empty(out_features, dtype=dtype, device=device), None) if bias else None
        self.matmul = F.linear  # megakit.nn.tensor_parallel.fp8 swaps in a float8 matmul (same weight, same names)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = leave_tp_region(self.matmul(x, self.weight), self.group, self.sequence_parallel)  # (S', B, out)
        if self.bias is not None:
            y = y + replicated(self.bias, self.group, self.sequence_parallel)
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocab rows: rank r holds rows ``[r*V/tp, (r+1)*V/tp)``.

    The vocab is padded with ``padded_vocab``. Each rank looks up the ids it owns (zeros
    elsewhere) and ``leave_tp_region`` sums: forward all-reduce (or reduce-scatter over the
    sequence with SP), backward identity (or all-gather). Ids ``(S, B)`` -> ``(S', B, H)``.
    """

    def __init__(self, vocab_size: int, dim: int, *, group=None, sequence_parallel: bool = False,
                 dtype=torch.float32, device=None) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        tp = C.size(group)
        self.vocab_size, self.local = vocab_size, padded_vocab(vocab_size, tp) // tp
        self.start = C.rank(group) * self.local
        self.weight = mark(_empty(self.local, dim, dtype=dtype, device=device), 0, unpadded=vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.local)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        y = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (S, B, H)
        return leave_tp_region(y, self.group, self.sequence_parallel)


# -- 3. the loss -------------------------------------------------------------------------------
def vocab_parallel_softmax(logits, target, group, start: int, vocab_size: int, ignore_index: int):
    """The fp32 softmax of vocab-split ``logits`` (``(..., V/tp)``) and the per-token loss of ``target``.

    All-reduce MAX of the row maxima, then one all-reduce SUM of [sum of exp, target logit] (the
    target lives on one rank, zeros elsewhere). Returns ``(softmax, loss, mine, idx, valid)``:
    ``mine`` marks the tokens whose target column is on this rank, at local column ``idx``.
    """
    local = logits.shape[-1]
    x = logits.float()  # (..., V/tp); the softmax is computed in fp32
    if start + local > vocab_size:  # padded vocab rows must not count
        x = x.clone() if x is logits else x
        x[..., max(vocab_size - start, 0):] = float("-inf")
    row_max = x.max(dim=-1).values
    C.all_reduce(row_max, group, op=torch.distributed.ReduceOp.MAX)
    x = x - row_max.unsqueeze(-1)
    valid = target != ignore_index
    mine = valid & (target >= start) & (target < start + local)
    idx = (target - start).masked_fill(~mine, 0)
    picked = x.gather(-1, idx.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
    x = x.exp_()
    sums = torch.stack([x.sum(dim=-1), picked])
    C.all_reduce(sums, group)
    sum_exp, target_logit = sums
    loss = (sum_exp.log() - target_logit).masked_fill(~valid, 0.0)
    x.div_(sum_exp.unsqueeze(-1))
    return x, loss, mine, idx, valid


def softmax_grad_(softmax, mine, idx, scale) -> torch.Tensor:
    """``(softmax - onehot(target)) * scale`` in place: the loss's gradient wrt the logits shard."""
    softmax.scatter_add_(-1, idx.unsqueeze(-1), -mine.unsqueeze(-1).to(softmax.dtype))
    return softmax.mul_(scale.unsqueeze(-1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy over vocab-split logits; the full logits never exist on one rank.

    forward: ``vocab_parallel_softmax`` (two all-reduces). backward: local only,
    ``softmax - onehot`` on this rank's columns.
    """

    @staticmethod
    def forward(ctx, logits, target, group, start, vocab_size, ignore_index):
        softmax, loss, mine, idx, valid = vocab_parallel_softmax(logits, target, group, start, vocab_size,
                                                                 ignore_index)
        ctx.save_for_backward(softmax, mine, idx, valid)  # softmax, kept for backward
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, idx, valid = ctx.saved_tensors
        g = softmax_grad_(softmax, mine, idx, grad * valid)  # reused in place: backward runs once
        return g.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None, *,
                                 vocab_size: int | None = None, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of ``target`` (``(...)``, global ids) under vocab-split ``logits`` (``(..., V/tp)``).

    Equals ``F.cross_entropy`` on the gathered (unpadded) logits; ``vocab_size`` is the real
    vocab (default: all columns). ``reduction``: "mean" over non-ignored tokens, "sum" or "none".
    """
    tp, local = C.size(group), logits.shape[-1]
    vocab_size = local * tp if vocab_size is None else vocab_size
    target = target.long()
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, C.rank(group) * local, vocab_size,
                                            ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    assert reduction == "mean", reduction
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)
