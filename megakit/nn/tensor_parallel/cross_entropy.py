"""Megatron's vocab-parallel cross-entropy: the loss over vocab-split logits, which never gathers them.

Two all-reduces in forward (the row maxima, then the sums of exp and the target logits), none in backward
(``softmax - onehot`` on this rank's columns). ``chunked_loss`` runs the same over token chunks.
"""

from __future__ import annotations

import torch

from megakit.nn import comm as C


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
        x[..., max(vocab_size - start, 0) :] = float("-inf")
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
        softmax, loss, mine, idx, valid = vocab_parallel_softmax(logits, target, group, start, vocab_size, ignore_index)
        ctx.save_for_backward(softmax, mine, idx, valid)  # softmax, kept for backward
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, mine, idx, valid = ctx.saved_tensors
        g = softmax_grad_(softmax, mine, idx, grad * valid)  # reused in place: backward runs once
        return g.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    group=None,
    *,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of ``target`` (``(...)``, global ids) under vocab-split ``logits`` (``(..., V/tp)``).

    Equals ``F.cross_entropy`` on the gathered (unpadded) logits; ``vocab_size`` is the real
    vocab (default: all columns). ``reduction``: "mean" over non-ignored tokens, "sum" or "none".
    """
    tp, local = C.size(group), logits.shape[-1]
    vocab_size = local * tp if vocab_size is None else vocab_size
    target = target.long()
    loss = _VocabParallelCrossEntropy.apply(logits, target, group, C.rank(group) * local, vocab_size, ignore_index)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    assert reduction == "mean", reduction
    return loss.sum() / (target != ignore_index).sum().clamp(min=1)
