"""The optimizer as practitioners set it (FAQ 4): which weights decay, and a warm-up whose first step moves them.

- Weight decay: matrices (linear and embedding weights) decay; biases (gpt-oss's stacked expert biases, 2-D,
  included) and every 1-D parameter (norm weights, gpt-oss's sinks) do not -- Megatron's convention
  (``no_weight_decay_cond``: a name ending in ``bias`` or one dimension), and transformers' for all but the sinks,
  which its name-matching ``Trainer.get_decay_parameter_names`` decays. Decaying a norm's gain pulls it towards 0,
  which only fights the normalisation; decaying a sink pulls its logit to 0.
- Warm-up: DeepSpeed's schedulers start at iteration -1 and give lr 0 there and, with a
  linear warm-up, at iteration 0 too: two wasted steps. megakit runs optimizer step t at
  iteration t + 1, so step 0 already trains at lr·1/warmup (nanoGPT's ``(it + 1) / warmup``).
  The reference run and a resumed run place the schedule the same way.
"""

from __future__ import annotations

import torch


def decay_groups(module: torch.nn.Module) -> list[dict]:
    """``module``'s trainable parameters as two optimizer groups: decayed, and not decayed (weight_decay 0).

    Named: DeepSpeed splits the experts (``megakit.train.engine.experts``) out of each group by its name."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    decayed = [p.ndim >= 2 and not n.endswith("bias") for n, p in named]
    groups = [
        {"name": "decay", "params": [p for (_, p), d in zip(named, decayed) if d]},
        {"name": "no_decay", "params": [p for (_, p), d in zip(named, decayed) if not d], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def start_schedule(scheduler, step: int) -> None:
    """Put a DeepSpeed LR scheduler where optimizer step ``step`` runs: iteration ``step + 1``."""
    if scheduler is not None and hasattr(scheduler, "last_batch_iteration"):
        scheduler.step(step + 1)
