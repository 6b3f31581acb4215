"""Preference objectives on chosen/rejected pairs: DPO (Rafailov et al. 2023, sigmoid, with label smoothing as
conservative DPO), IPO (Azar et al. 2023) and SimPO (Meng et al. 2024, no reference).

Each works on per-sequence sums of the completion's token log-probabilities and their token counts, as TRL's
trainers do (``DPOTrainer``; ``CPOTrainer`` for SimPO), so the formulas are theirs and the tests compare with them.
The per-token log-probabilities are minus the vocab-parallel cross-entropy (``cross_entropy``), so the logits are
never gathered over TP. A packed window holds several sequences, each its own document: the pairs are the
documents in order, chosen then rejected (``prepare-data`` writes them so), and a document without a counted token
(the window's padding) belongs to no pair. With CP each rank sums its own rows and one all-reduce over CP gives the
sequence's whole sum (forward: all-reduce SUM; backward: the gradient times CP, since DeepSpeed averages the
gradients over DP x CP and every CP rank computes the same loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megakit.errors import UsageError
from megakit.nn import comm as C

OBJECTIVES = ("dpo", "ipo", "simpo")
STATS = ("pairs", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")
STATS += ("logps/chosen", "logps/rejected")


@dataclass(frozen=True, kw_only=True)
class Preference:
    """Which pair objective, and its constants: ``beta`` (DPO's and SimPO's temperature, IPO's tau),
    ``label_smoothing`` (DPO's: the chance a label is flipped) and ``gamma`` (SimPO's target margin)."""

    objective: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise UsageError(f"--objective {self.objective!r} is not one of {', '.join(OBJECTIVES)}")
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise UsageError(f"--dpo-beta must be a positive number (TRL's default is 0.1), got {self.beta}")
        if not 0.0 <= self.label_smoothing < 0.5:
            raise UsageError(f"--label-smoothing must lie in [0, 0.5), got {self.label_smoothing}")

    @property
    def needs_reference(self) -> bool:
        """DPO and IPO compare with the starting model; SimPO does not."""
        return self.objective != "simpo"


class _SumOverCP(torch.autograd.Function):
    """forward: all-reduce SUM over CP; backward: the gradient times CP (see the module's docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.cp = C.size(group)
        return C.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.cp, None


def sequence_logps(
    token_losses: torch.Tensor, target: torch.Tensor, documents: torch.Tensor, slots: int, cp_group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability and its counted tokens, ``(B, slots)`` each (fp32).

    ``token_losses`` ``(S, B)``: the per-token cross-entropy (0 where ignored); ``target`` ``(S, B)`` the labels
    (-100: not counted); ``documents`` ``(S, B)``: each token's document in its window; these are this rank's rows
    (its CP chunks), and ``cp_group`` sums them over the sequence. Documents at or past ``slots`` are left out."""
    valid = (target != -100) & (documents < slots)
    where = documents.clamp(max=slots - 1).t()  # (B, S)
    logps = torch.zeros(target.shape[1], slots, dtype=torch.float32, device=target.device)
    logps = logps.scatter_add(1, where, (-token_losses.float() * valid).t())
    counts = torch.zeros_like(logps).scatter_add_(1, where, valid.t().float())
    if C.size(cp_group) > 1:
        logps = _SumOverCP.apply(logps, cp_group)
        counts = C.all_reduce(counts, cp_group)
    return logps, counts


def count_pairs(labels: torch.Tensor, documents: torch.Tensor, slots: int) -> torch.Tensor:
    """The pairs ``(B, S)`` labels and documents hold: both sequences with a counted token (a 0-dim tensor)."""
    valid = (labels != -100) & (documents < slots)
    counts = torch.zeros(labels.shape[0], slots, device=labels.device)
    counts.scatter_add_(1, documents.clamp(max=slots - 1), valid.float())
    half = slots // 2 * 2
    return ((counts[:, 0:half:2] > 0) & (counts[:, 1:half:2] > 0)).sum()


def pair_losses(pref: Preference, logps, counts, reference=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(losses, stats, paired)`` of the pairs in ``logps``/``counts`` ``(B, 2P)`` (chosen at even slots): each
    pair's loss ``(B, P)`` (0 where there is no pair), the step statistics' sums (``STATS``, detached) and which
    slots hold a pair. ``reference`` ``(B, 2P)``: the starting model's sums (DPO, IPO)."""
    if pref.needs_reference and reference is None:
        raise UsageError(f"--objective {pref.objective} needs the reference log-probabilities of the data")
    pairs = logps.shape[1] // 2
    chosen, rejected = logps[:, 0 : 2 * pairs : 2], logps[:, 1 : 2 * pairs : 2]
    n_chosen, n_rejected = counts[:, 0 : 2 * pairs : 2], counts[:, 1 : 2 * pairs : 2]
    paired = (n_chosen > 0) & (n_rejected > 0)
    if pref.needs_reference:
        reference = reference.to(logps.dtype)
        chosen_ratio = chosen - reference[:, 0 : 2 * pairs : 2]
        rejected_ratio = rejected - reference[:, 1 : 2 * pairs : 2]
    if pref.objective == "dpo":
        margin = pref.beta * (chosen_ratio - rejected_ratio)
        eps = pref.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        rewards = pref.beta * chosen_ratio, pref.beta * rejected_ratio
    elif pref.objective == "ipo":  # TRL's IPO: the log-ratios per completion token
        per_token = chosen_ratio / n_chosen.clamp(min=1), rejected_ratio / n_rejected.clamp(min=1)
        losses = (per_token[0] - per_token[1] - 1 / (2 * pref.beta)) ** 2
        rewards = pref.beta * per_token[0], pref.beta * per_token[1]  # TRL's: its IPO's log-probs are per token
    else:  # SimPO: length-normalised, no reference, a target margin gamma
        average = chosen / n_chosen.clamp(min=1), rejected / n_rejected.clamp(min=1)
        margin = pref.beta * (average[0] - average[1]) - pref.gamma
        eps = pref.label_smoothing
        losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
        rewards = pref.beta * average[0], pref.beta * average[1]
    losses = torch.where(paired, losses, torch.zeros_like(losses))
    with torch.no_grad():
        good, bad = (r.detach() * paired for r in rewards)
        stats = torch.stack(
            [
                paired.sum(),
                good.sum(),
                bad.sum(),
                ((good > bad) & paired).sum(),
                (good - bad).sum(),
                (chosen.detach() * paired).sum(),
                (rejected.detach() * paired).sum(),
            ]
        ).double()
    return losses, stats, paired


def preference_loss(
    pref: Preference,
    token_losses: torch.Tensor,
    target: torch.Tensor,
    documents: torch.Tensor,
    *,
    reference: torch.Tensor | None = None,
    pairs: float | torch.Tensor | None = None,
    cp_group=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed pair losses over ``pairs`` (the trainer's share of the step's pairs; None: this batch's own
    count), the statistics' sums and the per-sequence log-probabilities ``(B, slots)``."""
    slots = reference.shape[1] if reference is not None else int(documents.max()) + 1
    slots += slots % 2  # whole pairs
    logps, counts = sequence_logps(token_losses, target, documents, slots, cp_group)
    if reference is not None and reference.shape[1] < slots:
        reference = F.pad(reference, (0, slots - reference.shape[1]))
    losses, stats, paired = pair_losses(pref, logps, counts, reference)
    divisor = pairs if pairs is not None else paired.sum().clamp(min=1)
    return losses.sum() / divisor, stats, logps
