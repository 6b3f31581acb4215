"""Faults planted in a real job on purpose, to test that ``megakit doctor`` catches each one. For testing only.

The doctor's checks must fail on the faults they exist for, through the real launcher and
the real trainer, not on made-up numbers. ``MEGAKIT_INJECT_FAULT`` (read here and nowhere
else, and only when the trainer runs with ``--doctor-out``) lists them, comma-separated,
by global rank:

    seed@R          rank R runs with --seed + 1 (its weights, data order and dropout masks)
    overlap@R       rank R reads the next DP rank's samples (every rank reading one shard)
    unbalanced@R    rank R keeps half the rows of each micro-batch (an uneven shard)
    nan@R[:STEP]    a NaN in one of rank R's gradients from step STEP on (default 1)
    sleep@R:SECONDS rank R sleeps that long inside every step (a straggler)

Two more test the trainer's own guards and restarts, in any run (not only the doctor's):

    nanloss@R:STEP  rank R's forward output (the loss, on the last stage) is NaN at step STEP only
    kill@R:STEP     rank R kills itself (SIGKILL) at the start of step STEP, on a job's first attempt
                    only (torchrun's TORCHELASTIC_RESTART_COUNT 0), so the restarted job gets past it
    spike@STEP      every rank's loss is multiplied by 1000 on the batch of step STEP (its data position: after
                    the spike guard's rollback skips that batch, the run does not read it again); the loss only,
                    so every rank sees the same spike and the spike guard fires alike everywhere

A job with faults says so on rank 0 before it starts.
"""

from __future__ import annotations

import dataclasses
import os
import signal
from dataclasses import dataclass

from megakit.errors import UsageError

VARIABLE = "MEGAKIT_INJECT_FAULT"
KINDS = ("seed", "overlap", "unbalanced", "nan", "sleep", "nanloss", "kill", "spike")
EVERY_RANK = -1  # the rank of a fault every rank plays (spike)
SPIKE_FACTOR = 1000.0


@dataclass(frozen=True)
class Faults:
    """The faults one rank plays (all off by default)."""

    seed: bool = False
    overlap: bool = False
    unbalanced: bool = False
    nan_from_step: int | None = None
    sleep_s: float = 0.0
    nan_loss_step: int | None = None
    kill_step: int | None = None
    spike_step: int | None = None

    @property
    def any(self) -> bool:
        return self != Faults()


def parse(spec: str) -> dict[int, Faults]:
    """``{rank: Faults}`` of a ``MEGAKIT_INJECT_FAULT`` value; UsageError naming the bad item."""
    out: dict[int, dict] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        kind, _, where = item.partition("@")
        if kind == "spike":  # every rank: spike@STEP
            where = f"{EVERY_RANK}:{where}" if where.isdigit() else "x"
        rank_text, _, value = where.partition(":")
        try:
            rank = int(rank_text)
            number = float(value) if value else None
        except ValueError:
            rank = number = -1
        # a number: required (True), optional (None) or refused (False)
        takes_number = {"sleep": True, "nan": None, "nanloss": True, "kill": True, "spike": True}.get(kind, False)
        ok = (
            kind in KINDS and (rank == EVERY_RANK if kind == "spike" else rank >= 0) and (number is None or number >= 0)
        )
        if not ok or (takes_number is not None and takes_number != (number is not None)):
            raise UsageError(
                f"{VARIABLE}: cannot read '{item}'; use KIND@RANK with KIND one of {', '.join(KINDS)} "
                "(nan@RANK:STEP, nanloss@RANK:STEP, kill@RANK:STEP and sleep@RANK:SECONDS take a number; "
                "spike@STEP plays on every rank)"
            )
        field = {
            "seed": ("seed", True),
            "overlap": ("overlap", True),
            "unbalanced": ("unbalanced", True),
            "nan": ("nan_from_step", int(number) if number is not None else 1),
            "sleep": ("sleep_s", number),
            "nanloss": ("nan_loss_step", int(number or 0)),
            "kill": ("kill_step", int(number or 0)),
            "spike": ("spike_step", int(number or 0)),
        }[kind]
        out.setdefault(rank, {})[field[0]] = field[1]
    return {rank: Faults(**fields) for rank, fields in out.items()}


def injected(rank: int, environ=os.environ) -> Faults:
    """This rank's faults from the environment (none when the variable is unset), those of every rank included."""
    faults = parse(environ.get(VARIABLE, ""))
    every = {k: v for k, v in dataclasses.asdict(faults.get(EVERY_RANK, Faults())).items() if v != getattr(Faults(), k)}
    return dataclasses.replace(faults.get(rank, Faults()), **every)


def with_seed_fault(cfg, rank: int):
    """``cfg`` as rank ``rank`` runs it: ``seed + 1`` under ``seed@rank`` in a doctor's job (``cfg.doctor_out``)."""
    return dataclasses.replace(cfg, seed=cfg.seed + 1) if cfg.doctor_out and injected(rank).seed else cfg


class TrainingFaults:
    """Rank ``rank``'s ``nanloss``, ``kill`` and ``spike`` faults, played by the trainer: ``at_step(step)`` before
    each step, ``spiked(data_step, loss)`` on its loss."""

    def __init__(self, rank: int, chunks, environ=os.environ) -> None:
        faults = injected(rank, environ)
        self.nan_step, self.step, self.spike_step = faults.nan_loss_step, -1, faults.spike_step
        first_attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.kill_step = faults.kill_step if first_attempt else None
        if self.nan_step is not None:
            for chunk in chunks:
                chunk.register_forward_hook(self._poison)

    def _poison(self, module, args, output):
        return output * float("nan") if self.step == self.nan_step else output

    def spiked(self, data_step: int, loss):
        """The loss, multiplied at the planted spike's step."""
        return loss * SPIKE_FACTOR if data_step == self.spike_step else loss

    def at_step(self, step: int) -> None:
        """Note the step; kill this process at the planted step."""
        self.step = step
        if step == self.kill_step:
            os.kill(os.getpid(), signal.SIGKILL)


class FaultyBatches:
    """A ``TokenBatches`` whose rank reads another DP rank's samples (overlap) or half its rows (unbalanced)."""

    def __init__(self, batches, faults: Faults) -> None:
        self.batches, self.faults = batches, faults

    def __getattr__(self, name):
        return getattr(self.batches, name)

    def _source(self, dp_rank: int) -> int:
        return (dp_rank + 1) % self.batches.plan.dp if self.faults.overlap else dp_rank

    def _keep(self, rows: int) -> int:
        return max(1, rows // 2) if self.faults.unbalanced else rows

    def micro_batches(self, step: int, dp_rank: int):
        """The wrapped batches, cut short where a fault plants a short batch."""
        return [
            (x[: self._keep(len(x))], y[: self._keep(len(y))])
            for x, y in self.batches.micro_batches(step, self._source(dp_rank))
        ]

    def sample_numbers(self, step: int, dp_rank: int) -> list[range]:
        """The wrapped sample numbers, cut like the batches."""
        return [rows[: self._keep(len(rows))] for rows in self.batches.sample_numbers(step, self._source(dp_rank))]

    def forward_extras(self, step: int, dp_rank: int) -> list[dict]:
        """The wrapped extras (document ids, weights), cut like the batches."""
        return [
            {k: t[: self._keep(len(t))] for k, t in extras.items()}
            for extras in self.batches.forward_extras(step, self._source(dp_rank))
        ]
