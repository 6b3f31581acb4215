"""What preference tuning (``--objective dpo|ipo|simpo``) adds to a plan: the reference pass and what it keeps.

A pair's two sequences are documents in the planned windows (``prepare-data`` puts whole pairs in a window, chosen
first; ``--pad`` one pair a window, ``--pack`` as many as fit), so a training step over the same windows costs what
a language-model step costs: the plan's step prices it unchanged. What DPO and IPO add
(``megakit.train.observe.preference``):

- **the reference pass**: one forward pass of the frozen starting model over every training window, before the first
  step, in eval mode and without gradients. Its time is the forward's share of the plan's steps over those windows:
  a step's model FLOPs are forward 1x and backward 2x (and a full recompute's forward again), so the pass takes
  ``1 / (3 + recompute)`` of a step's time per global batch of windows. It runs once per run, not per epoch; a resume
  or a relaunch reads it back;
- **the stored log-probabilities**: one fp64 per sequence of each window (two per pair), kept in every rank's memory
  during the run and written beside ``--save``.

SimPO compares with no reference: it adds nothing.
"""

from __future__ import annotations

import dataclasses

OBJECTIVES = ("lm", "dpo", "ipo", "simpo")
NEEDS_REFERENCE = ("dpo", "ipo")
LOGP_BYTES = 8  # fp64: the trainer sums each sequence's token log-probabilities in double precision


@dataclasses.dataclass(frozen=True)
class PreferenceCost:
    """A preference run's additions: the reference pass's time on the plan's GPUs and the log-probabilities kept."""

    objective: str
    windows: int  # training windows the reference pass reads (one pass over the run's data)
    sequences_per_window: int  # two per pair
    reference_s: float  # 0 for SimPO
    stored_bytes: float  # 0 for SimPO

    def lines(self) -> list[str]:
        """The plan's section on it, for the table view."""
        head = f"Preference tuning (--objective {self.objective}): pairs fill the planned windows, so a step costs what"
        head += " the plan's step costs."
        if self.objective not in NEEDS_REFERENCE:
            return [head, "  SimPO has no reference model: no reference pass, nothing stored."]
        hours = self.reference_s / 3600
        return [
            head,
            f"  reference pass: one forward of the starting model over {self.windows:,} windows before step 1: "
            f"{hours:.2f} h on the plan's GPUs (a forward is 1/3 of a step's FLOPs; once per run, reused on resume)",
            f"  reference log-probabilities: {self.windows:,} windows x {self.sequences_per_window} sequences x "
            f"{LOGP_BYTES} B = {self.stored_bytes / 2**20:,.1f} MiB, in each rank's memory and beside --save",
        ]


def preference_cost(
    objective: str,
    *,
    windows: int,
    pairs_per_window: int,
    step_time_s: float,
    global_batch: int,
    recompute_fraction: float = 0.0,
) -> PreferenceCost:
    """The reference pass and the stored log-probabilities of ``windows`` training windows (``pairs_per_window``:
    1 with ``--pad``, more with ``--pack``) on a plan whose step over ``global_batch`` windows takes
    ``step_time_s``; ``recompute_fraction``: the share of the forward a full recompute runs again."""
    sequences = 2 * pairs_per_window
    if objective not in NEEDS_REFERENCE:
        return PreferenceCost(objective, windows, sequences, 0.0, 0.0)
    forward_share = 1.0 / (3.0 + recompute_fraction)
    reference_s = windows / global_batch * step_time_s * forward_share
    return PreferenceCost(objective, windows, sequences, reference_s, float(windows * sequences * LOGP_BYTES))
