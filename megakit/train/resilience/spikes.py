"""The loss-spike guard (``--spike-guard Z``): roll back to the newest checkpoint and skip the batches that followed.

OPT-175B's and BLOOM's logbooks, and PaLM's report, describe the same cure for a loss that
jumps far above its trend: restart from a checkpoint before the spike and skip the data
batches around it. Here it runs without a person:

- The rule: a finite loss above the mean of the recent losses by more than Z of their
  standard deviations (population; floored at 0.1 % of the mean, so a flat curve does not
  fire on noise). "Recent" is the last ``WINDOW`` = 50 losses of the steps that count (a
  NaN-skipped step's is not one, nor a spike's); the rule arms once it has ``ARMED_AFTER`` = 8,
  enough for a standard deviation and early enough to protect a short run. Early in training
  the loss falls fast, so its spread is wide and the rule is lenient exactly where it should be.
  The loss is the one every rank agrees on (``StepGuard.check``'s all-reduce), so every rank
  takes the same decision.
- The cure (``roll_back``): the newest intact checkpoint of ``--save`` (an ``--async-save``
  in flight is finished first) goes back into the running engine -- the model's weights, the
  fp32 masters and Adam's moments, each DP rank's own state, the step count and the LR
  schedule, exactly what a resume restores -- and the run goes on from its step, reading the
  batches after the spike's. Weights and optimizer go back; the data does not.
- The skip is a data offset: step ``s`` reads the batch of step ``s + offset`` (``TokenBatches``
  is a function of the step, and so are the dropout masks, through the sample numbers). Every
  later checkpoint stores it (``extra["data"]["skipped_batches"]``) and a resume reads it back
  (``Run.data_offset``), with the guard's window (``extra["spike_guard"]``), so a resumed run
  makes the same decisions and reproduces the losses of the run that rolled back. A crash
  after a rollback and before the next save resumes from a checkpoint without the skip: the
  spike's batches are read again, and the guard rolls back again.
- A spike before any checkpoint exists is logged and the run goes on; ``MAX_ROLLBACKS`` = 3
  rollbacks to one checkpoint, and the next spike ends the run (``TrainingDiverged``).

ZeRO 3 is refused with the flag: its parameters are partitioned, and the weights load into a
model only before ``deepspeed.initialize`` (``megakit.interop.checkpoint``).
"""

from __future__ import annotations

import math
import statistics

from megakit.errors import UsageError
from megakit.interop.checkpoint import load_checkpoint
from megakit.interop.checkpoint_format import read_manifest
from megakit.train.engine.optim import start_schedule
from megakit.train.resilience.guards import TrainingDiverged
from megakit.train.resilience.resume import choose_checkpoint, per_rank_key, restore, restore_own_state

WINDOW = 50
ARMED_AFTER = 8
MAX_ROLLBACKS = 3
FLOOR = 1e-3  # of the mean: the smallest standard deviation the rule divides by


def data_offset(extra: dict) -> int:
    """The batches a checkpoint's run skipped (its step ``s`` read the batch of step ``s + offset``)."""
    return int(extra.get("data", {}).get("skipped_batches", 0))


class SpikeGuard:
    """The recent losses and the rule; ``check`` after every step, ``roll_back`` when it fires."""

    def __init__(self, z: float, *, saved: list | None = None) -> None:
        self.z = z
        self.recent = [(int(s), float(v)) for s, v in saved or []]  # (step, loss), oldest first
        self.rollbacks: dict[int, int] = {}  # checkpoint step -> rollbacks to it

    def state(self) -> list:
        """What a checkpoint keeps, for a resumed run to decide alike (JSON)."""
        return [[s, v] for s, v in self.recent]

    def check(self, step: int, loss: float) -> str | None:
        """Why ``loss`` at ``step`` is a spike; None, and it joins the window, if not (a NaN: the NaN guard's)."""
        if not math.isfinite(loss):
            return None
        values = [v for _, v in self.recent]
        if len(values) >= ARMED_AFTER:
            mean = statistics.fmean(values)
            spread = max(statistics.pstdev(values), FLOOR * abs(mean))
            if loss > mean + self.z * spread:
                return (
                    f"loss {loss:.4g} is {(loss - mean) / spread:.1f} standard deviations ({spread:.3g}) above the "
                    f"mean {mean:.4g} of the last {len(values)} steps (--spike-guard {self.z:g})"
                )
        self.recent = (self.recent + [(step, loss)])[-WINDOW:]
        return None

    def roll_back(self, why: str, *, step: int, offset: int, engine, topo, run, dp_sync, reporter):
        """Put the newest checkpoint back into the engine; ``((step, offset) to go on from, event)``, or
        ``(None, event)`` when there is no checkpoint yet. Collective: every rank, after the same ``check``."""
        say = print if topo.rank == 0 else (lambda *_: None)
        try:
            checkpoint = choose_checkpoint(
                run.cfg.save,
                doing="rolling back to",  # the event names the one chosen
                say=lambda text: "skipping damaged" in text and say(text),
            )
        except UsageError:
            text = f"loss spike at step {step}: {why}; no checkpoint in {run.cfg.save} yet to roll back to: going on"
            return None, reporter.event(step, "spike", text, spikes=1)
        manifest = read_manifest(checkpoint)
        back, extra = manifest["step"], manifest["extra"]
        self.rollbacks[back] = self.rollbacks.get(back, 0) + 1
        if self.rollbacks[back] > MAX_ROLLBACKS:
            raise TrainingDiverged(
                f"loss spike at step {step}: {why}; the run already rolled back to {checkpoint} "
                f"{MAX_ROLLBACKS} times; lower the learning rate, or resume from an earlier "
                "checkpoint with other data"
            )
        try:
            load_checkpoint(checkpoint, engine.module, topo)  # the weights the forward uses
            restore(engine, topo, checkpoint, back)  # fp32 masters, moments, the optimizer's step count
            restore_own_state(engine, topo, checkpoint, dp_sync, per_rank_key(run, topo), say=say)
        except UsageError as error:
            error.all_ranks = True  # load_checkpoint and load_state raise on every rank when any rank fails
            raise
        start_schedule(engine.lr_scheduler, back)
        first, last = back + data_offset(extra), step + offset  # the batches read since that checkpoint
        self.recent = [(int(s), float(v)) for s, v in extra.get("spike_guard", [])]
        text = (
            f"loss spike at step {step}: {why}; rolled back to {checkpoint} (step {back}), skipping the batches of "
            f"steps {first}-{last} ({last - first + 1}); step s now reads the batch of step s + {last + 1 - back}"
        )
        event = reporter.event(
            step, "rollback", text, rollback_to=back, skipped_batches=last - first + 1, data_offset=last + 1 - back
        )
        return (back, last + 1 - back), event
