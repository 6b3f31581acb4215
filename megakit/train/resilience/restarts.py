"""``--load auto``: one command that a scheduler (torchrun's agent, Slurm's requeue) can run again after a crash.

``--save DIR --load auto`` starts from DIR's newest intact checkpoint (a ``--keep`` series
already falls back past a damaged one; a checkpoint a killed save moved aside counts), or from
``--init`` (a model to fine-tune) or step 0 while DIR holds none (unfinished saves do not count). It is a value
of ``--load`` and not the default because a default would quietly continue an old run in a
reused ``--save`` directory; the same command that starts the run also restarts it.

Rank 0 keeps a record of the run's attempts beside DIR, in ``.DIR.attempts.json`` (beside,
not inside: a single checkpoint at DIR is replaced whole on each save), read only once it holds
DIR's lock (``save_lock``), so never by a second run while the first still runs: where each attempt
started and the last step it finished. A restarted attempt says which restart it is and
how many steps it redoes (those its predecessor finished after its last checkpoint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from megakit.errors import UsageError
from megakit.train.resilience.save_dir import holds_checkpoint

AUTO = "auto"


def auto_load(save: str | None, load: str | None, *, init: str | None = None, say=print) -> str | None:
    """What ``--load`` means: ``auto`` (implied by ``--init``) is ``--save`` DIR when it holds a checkpoint, else
    ``--init`` (a pretrained or imported model to fine-tune: Megatron's ``--pretrained-checkpoint``, torchtitan's
    ``initial_load_path``), else nothing (step 0)."""
    if init is not None and load is None:
        load = AUTO
    if load != AUTO:
        return load
    if not save:
        raise UsageError(
            f"--load auto{' (implied by --init)' if init else ''} resumes from the --save directory's "
            "newest checkpoint; pass --save DIR (with --save-every N) as well"
        )
    if holds_checkpoint(save):  # in place, in its series, or moved aside by a save killed while replacing it
        return save
    if init is not None:
        say(f"megakit: --load auto: no checkpoint in {save} yet; starting from --init {init}")
        return init
    say(f"megakit: --load auto: no checkpoint in {save} yet; starting at step 0")
    return None


def restarts_from_save(load: str | None, init: str | None) -> bool:
    """Whether the run's command restarts it from --save (``--load auto``, or ``--init``, which implies it)."""
    return load == AUTO or init is not None


def attempts_path(save: str) -> Path:
    """Where a ``--save`` directory's attempt history is kept (beside it, hidden)."""
    path = Path(save)
    return path.with_name(f".{path.name}.attempts.json")


class Attempts:
    """Rank 0's record of this run's attempts; ``finished(step)`` after every step."""

    def __init__(self, save: str | None, *, start: int, active: bool, say=print) -> None:
        self.path = attempts_path(save) if save and active else None
        self.history: list[dict] = []
        if self.path is None:
            return
        if self.path.is_file():
            self.history = json.loads(self.path.read_text()).get("attempts", [])
        if self.history:
            last = self.history[-1]
            redo = max(0, last["reached"] - start)
            total = sum(max(0, a["reached"] - b["started"]) for a, b in zip(self.history, self.history[1:])) + redo
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
            agent = f" (torchrun restart {restart})" if restart not in (None, "0") else ""
            say(
                f"megakit: restart {len(self.history)} of this run{agent}: the last attempt finished step "
                f"{last['reached'] - 1}, resuming at step {start} redoes {redo} step(s) ({total} in all)"
            )
        self.history.append({"started": start, "reached": start})
        self._write()

    @property
    def restarts(self) -> int:
        return max(0, len(self.history) - 1)

    def finished(self, step: int) -> None:
        """Record the step the current attempt reached."""
        if self.path is not None:
            self.history[-1]["reached"] = step + 1
            self._write()

    def _write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"attempts": self.history}))
        os.replace(tmp, self.path)
