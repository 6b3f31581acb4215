"""The MoE router: which experts each token goes to, with what weight, and the balancing losses.

Everything here runs in fp32 whatever the model's dtype (fp64 when the model is fp64): the
anchors agree that routing decisions in bf16 flip on ties and rounding. Routing follows
``megakit.core.moe_config``: scores are softmax or sigmoid of the logits; the expert bias
(DeepSeek-V3's aux-loss-free balancing) and the group limit only *choose* the top-k, the
weights are the unbiased scores of the chosen experts, renormalised when ``normalize_top_k``,
times ``route_scale``.

Losses, over *the tokens of one micro-batch of one data-parallel replica* (all its sequences,
all their positions), whichever ranks hold them -- with sequence or context parallelism a
sequence's positions are spread over the TP and CP ranks, so the per-expert sums are summed
over those groups first (``_SequenceSum``). With ``T`` such tokens, ``S`` positions per sequence,
``c_e`` the top-k assignments to expert ``e``, ``p_te`` the token's scores (sigmoid scores
normalised to sum to one, as DeepSeek-V3 does):

- ``aux``: Switch/GShard, ``E / (k T^2) * sum_e c_e * sum_t p_te`` (1.0 when perfectly balanced;
  Hugging Face's ``load_balancing_loss_func`` is ``k`` times this, pooled over layers);
- ``seq_aux``: the same per sequence (``T -> S``), then the mean over the sequences (DeepSeek-V3);
  linear in the sequences, so its gradient does not depend on how they are cut into micro-batches;
- ``z``: ST-MoE's router z-loss, the mean over the ``T`` tokens of ``logsumexp(logits)^2``.

Only the scores carry gradient (the counts are constants, as in every anchor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megakit.core.moe_config import MoEConfig
from megakit.nn import comm as C


def route(
    logits: torch.Tensor, config: MoEConfig, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(experts (N, k), weights (N, k), scores (N, E))`` from fp32 router ``logits`` ``(N, E)``."""
    scores = logits.softmax(-1) if config.score == "softmax" else logits.sigmoid()
    choice = scores.detach() if bias is None else scores.detach() + bias.to(scores.dtype)
    if config.groups > 1:  # DeepSeek-V3 noaux_tc: a group's score is the sum of its best two
        n, e = choice.shape
        grouped = choice.view(n, config.groups, e // config.groups)
        group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (N, G)
        best = group_score.topk(config.group_top_k, dim=-1).indices
        allowed = torch.zeros_like(group_score, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~allowed.repeat_interleave(e // config.groups, dim=1), float("-inf"))
    experts = choice.topk(config.top_k, dim=-1).indices  # (N, k), sorted: best first
    weights = scores.gather(1, experts)
    if config.normalize_top_k:  # top-1 too: Mixtral's weight is then 1
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    if config.route_scale != 1.0:
        weights = weights * config.route_scale
    return experts, weights, scores


def capacity_keep(
    experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity_factor: float
) -> torch.Tensor:
    """Which assignments an expert keeps under a capacity: ``(N, k)`` bool.

    Policy: each expert takes at most ``ceil(capacity_factor * N * k / E)`` of the assignments made
    on *this rank* (its tokens of the micro-batch, after the TP/CP split, before the EP dispatch),
    those with the highest router weight, ties by token order. The drop decisions therefore
    depend on how the micro-batch is split over TP/SP/CP ranks (unlike dropless routing, which is
    exact at every layout). A dropped assignment adds nothing: the token keeps its residual (and
    shared expert) path and its other experts.
    """
    n, k = experts.shape
    capacity = math.ceil(capacity_factor * n * k / num_experts)
    flat_e, flat_w = experts.reshape(-1), weights.detach().reshape(-1)
    by_weight = torch.argsort(-flat_w, stable=True)
    order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # by expert, then weight descending
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_e.device).scatter_add(
        0, flat_e, torch.ones_like(flat_e)
    )  # not bincount, whose length is data: --compile keeps one graph
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.arange(order.numel(), device=experts.device) - starts[flat_e[order]]
    keep = torch.empty_like(flat_e, dtype=torch.bool)
    keep[order] = rank_in_expert < capacity  # a permutation: every slot written once
    return keep.view(n, k)


class _SequenceSum(torch.autograd.Function):
    """forward: all-reduce (sum) over the TP group (when it splits the tokens) and the CP group;
    backward: ``grad x CP``. Each rank's loss copy then gives its own share of the gradient
    (TP shares are summed by the parameters' TP all-reduce, ``tensor_parallel.replicated``) times
    CP, which DeepSpeed's average over DP x CP divides back out -- megakit's CP convention
    (``megakit.nn.sequence.sequence_mean``)."""

    @staticmethod
    def forward(ctx, x, tp_group, cp_group):
        ctx.cp = C.size(cp_group)
        out = C.all_reduce(x.clone(), tp_group)
        return C.all_reduce(out, cp_group)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp, None, None


@dataclass
class Losses:
    """The router's auxiliary losses of one micro-batch, kept apart so each is logged and weighted on its own."""

    aux: torch.Tensor  # scalars, fp32, the same on every rank of the TP x CP group
    seq_aux: torch.Tensor
    z: torch.Tensor
    tokens: int  # T: the micro-batch's tokens over the TP x CP group


def balance_losses(
    logits: torch.Tensor,
    scores: torch.Tensor,
    experts: torch.Tensor,
    *,
    batch: int,
    config: MoEConfig,
    tp_group=None,
    cp_group=None,
) -> Losses:
    """The three losses of the module docstring. Tokens are ordered ``(S_local, B)`` (sequence-first):
    token ``i`` belongs to sequence ``i % batch``. ``tp_group``: the group splitting the tokens
    (None when it does not); ``cp_group``: context parallelism."""
    n, e = scores.shape
    k = experts.shape[1]
    probs = scores if config.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
    counts = F.one_hot(experts, e).sum(1).to(scores.dtype).view(-1, batch, e).sum(0)  # (B, E), no grad
    mass = probs.view(-1, batch, e).sum(0)  # (B, E)
    zsum = logits.logsumexp(-1).square().sum().view(1)
    packed = torch.cat([counts.reshape(-1), mass.reshape(-1), zsum])
    if C.size(tp_group) * C.size(cp_group) > 1:
        packed = _SequenceSum.apply(packed, tp_group, cp_group)
    counts, mass, zsum = (
        packed[: batch * e].view(batch, e),
        packed[batch * e : 2 * batch * e].view(batch, e),
        packed[-1],
    )
    per_seq = n // batch * C.size(tp_group) * C.size(cp_group)  # S
    tokens = per_seq * batch  # T
    aux = e / (k * tokens * tokens) * (counts.sum(0) * mass.sum(0)).sum()
    seq_aux = (e / (k * per_seq * per_seq) * (counts * mass).sum(1)).mean()
    return Losses(aux=aux, seq_aux=seq_aux, z=zsum / tokens, tokens=tokens)
