"""Preference objectives (``megakit.nn.tensor_parallel.preference``) against TRL's own code, on the same logits.

TRL's ``CPOTrainer.get_batch_logps`` gives each padded sequence's summed (or averaged) completion log-probability,
and ``CPOTrainer.cpo_loss`` the sigmoid loss with label smoothing (conservative DPO when fed the log-ratios to the
reference; SimPO with its gamma when fed the averages) and IPO's square (fed TRL DPOTrainer's per-token log-ratios,
its IPO normalisation). megakit packs the same sequences into rows, two pairs and padding in one, and sums per
document. Both run the same formulas in fp32 and differ only in the order of their sums: over the vocabulary in the
softmax, over a sequence's tokens in its sum, so the per-sequence log-probabilities, the loss and the gradients
with respect to each sequence's logits agree within ``tolerance.fp32_bound`` of their magnitude over the vocabulary
(``assert_fp32_close``); a token off the mask, a pair mixed up or a wrong beta moves them by whole percents.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from tolerance import assert_fp32_close

from megakit.errors import UsageError
from megakit.nn.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megakit.nn.tensor_parallel.preference import Preference, preference_loss

cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")
V = 37
LENGTHS = [(3, 5), (2, 4), (4, 6), (3, 3), (5, 2), (2, 7)]  # (prompt, completion) of chosen, rejected, ...


def _sequences(seed: int = 0):
    """Per sequence: its logits (a leaf) and its targets, the prompt's ignored."""
    gen = torch.Generator().manual_seed(seed)
    seqs = []
    for prompt, completion in LENGTHS:
        n = prompt + completion
        logits = (2 * torch.randn(n, V, generator=gen)).requires_grad_()
        target = torch.randint(0, V, (n,), generator=gen)
        target[:prompt] = -100
        seqs.append((logits, target))
    return seqs


def _megakit(pref, seqs, reference):
    """Rows of packed documents: pairs 0 and 1 with padding in row 0, pair 2 in row 1."""
    rows = [[0, 1, 2, 3], [4, 5]]
    width = max(sum(len(seqs[i][1]) for i in row) for row in rows) + 2  # padding: one more document
    logits, targets, docs, refs = [], [], [], []
    for row in rows:
        used = sum(len(seqs[i][1]) for i in row)
        logits.append(torch.cat([seqs[i][0] for i in row] + [torch.zeros(width - used, V)]))
        targets.append(torch.cat([seqs[i][1] for i in row] + [torch.full((width - used,), -100)]))
        docs.append(
            torch.cat(
                [torch.full((len(seqs[i][1]),), d) for d, i in enumerate(row)] + [torch.full((width - used,), len(row))]
            )
        )
        refs.append(torch.tensor([reference[i] for i in row] + [0.0] * (4 - len(row))))
    logits, target, documents = torch.stack(logits, 1), torch.stack(targets, 1), torch.stack(docs, 1)  # (S, B, ...)
    token_losses = vocab_parallel_cross_entropy(logits, target, reduction="none")
    loss, stats, logps = preference_loss(pref, token_losses, target, documents, reference=torch.stack(refs))
    order = [logps[0, 0], logps[0, 1], logps[0, 2], logps[0, 3], logps[1, 0], logps[1, 1]]
    return loss, stats, torch.stack(order).detach()


def _trl(pref, seqs, reference):
    """TRL's functions on the padded batch [chosen..., rejected...] (its labels shifted by one, as it shifts)."""
    batch = [seqs[i] for i in (0, 2, 4, 1, 3, 5)]
    width = max(len(t) for _, t in batch) + 1
    logits = torch.stack([torch.cat([lg, torch.zeros(width - len(t), V)]) for lg, t in batch])
    labels = torch.stack(
        [torch.cat([torch.tensor([-100]), t, torch.full((width - 1 - len(t),), -100)]) for _, t in batch]
    )
    summed = cpo.CPOTrainer.get_batch_logps(logits, labels.clone())
    counts = (labels != -100).sum(1)
    ref = torch.tensor([reference[i] for i in (0, 2, 4, 1, 3, 5)])
    me = SimpleNamespace(
        alpha=0.0,
        beta=pref.beta,
        label_smoothing=pref.label_smoothing,
        simpo_gamma=pref.gamma,
        loss_type={"dpo": "sigmoid", "ipo": "ipo", "simpo": "simpo"}[pref.objective],
        accelerator=SimpleNamespace(device="cpu"),
    )
    if pref.objective == "dpo":
        fed = summed - ref
    elif pref.objective == "ipo":
        fed = (summed - ref) / counts  # DPOTrainer's IPO: the log-ratios per completion token
    else:
        fed = summed / counts
    losses, chosen_rewards, rejected_rewards = cpo.CPOTrainer.cpo_loss(me, fed[:3], fed[3:])
    rewards = torch.stack([chosen_rewards.sum(), rejected_rewards.sum()]).detach()
    return losses.mean(), summed[[0, 3, 1, 4, 2, 5]], rewards


@pytest.mark.parametrize(
    "pref",
    [
        Preference(objective="dpo", beta=0.1),
        Preference(objective="dpo", beta=0.5, label_smoothing=0.2),
        Preference(objective="ipo", beta=0.3),
        Preference(objective="simpo", beta=2.0, gamma=0.6),
    ],
    ids=["dpo", "cdpo", "ipo", "simpo"],
)
def test_loss_logps_and_gradients_equal_trl(pref):
    reference = [-30.0, -28.5, -31.0, -40.2, -25.0, -33.3]
    seqs = _sequences()
    loss, stats, logps = _megakit(pref, seqs, reference)
    loss.backward()
    ours = [lg.grad.clone() for lg, _ in seqs]
    for lg, _ in seqs:
        lg.grad = None
    want, want_logps, want_rewards = _trl(pref, seqs, reference)
    want.backward()
    assert_fp32_close(logps, want_logps.detach(), terms=V * 7, what="per-sequence log-probabilities")
    assert_fp32_close(
        loss.detach().item(),
        want.detach().item(),
        terms=V * 7,
        scale=float(want_logps.detach().abs().max()) * pref.beta,
        what="loss",
    )
    for (lg, _), g in zip(seqs, ours):
        assert_fp32_close(g, lg.grad, terms=V, what="gradient of the logits")
    assert stats[0].item() == 3  # three pairs; the padding document is none
    scale = float(want_logps.detach().abs().max()) * pref.beta
    assert_fp32_close(stats[1:3].float(), want_rewards.float(), terms=V * 7, scale=scale, what="rewards/*")


def test_the_first_step_of_dpo_is_ln2_and_its_metrics():
    """Policy = reference: every log-ratio 0, the loss ln 2, the rewards 0, no pair judged right."""
    seqs = _sequences(1)
    with torch.no_grad():
        _, _, logps = _megakit(Preference(), seqs, [0.0] * 6)
    loss, stats, _ = _megakit(Preference(), seqs, logps.tolist())
    assert abs(loss.item() - math.log(2)) < 1e-6
    assert stats[1:5].abs().max().item() < 1e-4
    assert stats[5].item() == pytest.approx(float(logps[0::2].sum()), rel=1e-5)  # logps/chosen: summed


def test_bad_settings_are_one_line():
    with pytest.raises(UsageError, match="--objective"):
        Preference(objective="kto")
    with pytest.raises(UsageError, match="--label-smoothing"):
        Preference(label_smoothing=0.5)
    with pytest.raises(UsageError, match="--dpo-beta"):
        Preference(beta=0.0)
