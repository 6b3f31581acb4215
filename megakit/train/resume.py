"""A training run's checkpoints: ``--save``, ``--save-every`` and ``--load`` around ``megakit.interop.checkpoint``.

What a checkpoint carries is the checkpoint module's scope: the weights (at any TP x PP
layout), the step and a little metadata. A resumed run continues the data stream and
the LR schedule from the saved step (both are functions of the step), but its Adam
moments start from zero: optimizer state is not in megakit checkpoints. Weights are
loaded into the stage model *before* ``deepspeed.initialize``, which copies its master
weights from the model there (and partitions it under ZeRO-3).
"""

from __future__ import annotations

import warnings
from pathlib import Path

from megakit.errors import UsageError
from megakit.interop.checkpoint import save_checkpoint
from megakit.interop.checkpoint_format import MANIFEST, read_manifest


def check_checkpoint_flags(*, save: str | None, load: str | None, steps: int) -> int:
    """The step a run starts from (0, or the loaded checkpoint's); UsageError for what would fail later.

    Runs before any process group exists, so a mistake is found before training, not at its end.
    ``steps`` counts every step, loaded ones included (Megatron's ``--train-iters``), so the LR
    schedule in the ds_config means the same thing in a resumed run.
    """
    if save:
        target = Path(save)
        if target.exists() and not (target / MANIFEST).is_file() and (not target.is_dir() or any(target.iterdir())):
            raise UsageError(f"--save {target} exists and is not a megakit checkpoint; choose another directory "
                             "or remove it")
    if not load:
        return 0
    start = read_manifest(load)["step"]
    if start >= steps:
        raise UsageError(f"checkpoint {load} is at step {start} and --steps counts all steps, loaded ones "
                         f"included; pass --steps larger than {start}")
    return start


def resume_schedule(engine, start: int) -> None:
    """Move the engine's LR schedule to step ``start``: one scheduler step per optimizer step, as a run from 0."""
    if engine.lr_scheduler is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch schedulers warn when stepped before the optimizer
            for _ in range(start):
                engine.lr_scheduler.step()


def save_weights(directory: str, engine, topo, config, *, step: int, extra: dict) -> None:
    """Every rank writes its shard of ``engine.module`` (one stage, or an interleaved stage's chunks).

    Collective over the world (see ``save_checkpoint``); an error on any rank raises on every rank.
    Under ZeRO-3 the checkpoint module gathers each parameter over DP; under bf16 the weights
    saved are the engine's bf16 ones (the fp32 master copy is optimizer state).
    """
    save_checkpoint(directory, engine.module, topo, step=step, config=config,
                    extra={**extra, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp})
