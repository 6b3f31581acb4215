"""Context parallelism's split of the sequence: which tokens a CP rank holds, and the collectives over them.

The load-balanced causal split (Megatron-Core's, Liu et al. 2023 "Ring Attention" with the zig-zag order of
Brandon et al. 2023): the sequence is cut into ``2 x CP`` equal chunks and CP rank ``i`` holds chunks ``i`` and
``2 CP - 1 - i``, side by side, so under a causal mask every rank has the same amount of attention work. Everything
in a block except attention is per token and runs on the rank's own rows, at their global positions (RoPE, learned
position embeddings, dropout masks: ``positions``); attention gets the other ranks' keys and values
(``megakit.nn.attention.ring``, ``megakit.nn.attention.ulysses``). The loss is the sum over the whole sequence's
valid tokens over their count, or over the trainer's token count (``sequence_mean``).
"""

from __future__ import annotations

import torch

from megakit.nn import comm as C


def positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global token positions CP rank ``cp_rank`` holds, in its order: chunk ``cp_rank``, then
    chunk ``2 cp - 1 - cp_rank`` (each ``seq_len / (2 cp)`` long). ``(seq_len / cp,)`` int64."""
    assert seq_len % (2 * cp) == 0, (seq_len, cp)
    n = seq_len // (2 * cp)
    first, second = cp_rank * n, (2 * cp - 1 - cp_rank) * n
    return torch.cat([torch.arange(first, first + n, device=device), torch.arange(second, second + n, device=device)])


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, *, dim: int) -> torch.Tensor:
    """This rank's rows of ``x`` along its sequence dimension ``dim`` (no communication)."""
    if cp == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp, cp_rank, device=x.device))


@torch.no_grad()
def gather_sequence(x: torch.Tensor, group, *, dim: int) -> torch.Tensor:
    """Inverse of ``split_sequence`` over the CP group: every rank's rows, in sequence order.

    forward only (a collective: every CP rank calls it); for logits and tests, not training.
    """
    cp = C.size(group)
    if cp == 1:
        return x
    parts = C.all_gather(x.movedim(dim, 0).contiguous(), group, dim=0).chunk(cp, dim=0)
    seq_len = x.shape[dim] * cp
    order = torch.cat([positions(seq_len, cp, r, device=x.device) for r in range(cp)])
    out = torch.empty_like(torch.cat(parts, dim=0))
    out[order] = torch.cat(parts, dim=0)
    return out.movedim(0, dim)


class _SequenceMean(torch.autograd.Function):
    """forward: all-reduce (sum) of [loss sum, token count] over CP, then the sum over ``tokens`` (or over
    the count): the same on every CP rank. backward: ``grad x CP / tokens`` on each rank, the adjoint of
    the all-reduce when every rank's copy of the loss is counted: DeepSpeed averages gradients over
    DP x CP, which divides the CP back out."""

    @staticmethod
    def forward(ctx, local_sum, local_count, group, tokens):
        totals = C.all_reduce(torch.stack([local_sum.detach().float(), local_count.float()]), group)
        divisor = totals[1].clamp(min=1) if tokens is None else tokens  # a tensor or a float: no device sync
        ctx.scale = C.size(group) / divisor
        ctx.dtype = local_sum.dtype
        return (totals[0] / divisor).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.scale).to(ctx.dtype), None, None, None


def sequence_mean(token_losses: torch.Tensor, valid: torch.Tensor, group, tokens: float | None = None) -> torch.Tensor:
    """The sum of ``token_losses`` over the valid tokens of the whole sequence (every CP rank's rows), divided by
    ``tokens`` (the trainer's share of the step's token count, ``Transformer.loss_tokens``) or else by their count:
    the sequence's mean."""
    return _SequenceMean.apply(token_losses.sum(), valid.sum(), group, tokens)
