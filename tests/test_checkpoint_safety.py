"""A checkpoint survives whatever kills its save, and only one run writes a ``--save`` directory.

- Publish points: a child process saves a real model and is SIGKILLed while paused at each point of the publish
  sequence (``megakit.train.resilience.save_dir``'s list), for a single checkpoint and a ``--keep`` series, new
  steps and re-saved ones. After each, ``--load auto`` and ``--load DIR`` take the newest complete checkpoint (its
  weights, not only its step), the start-up cleanup keeps it, and the next save leaves exactly what it should.
- A real trainer killed between ``_publish``'s two renames (issue 51): the next ``--load auto`` resumes from the
  moved-aside copy; while the killed one still ran, a second run on its ``--save`` was refused in one line naming
  its PID (exit 2); the lock it left is taken over and said; the lock is gone after a normal exit and after an
  error.
- One launcher job at 2 processes: another holder's lock, a full disk (a real tmpfs, skipped where mounting is not
  permitted) with and without ``--async-save``: one line on every rank, the last checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent

# -- the publish sequence, killed at each point -----------------------------------------------------------------
CHILD = r'''
import os, shutil, signal, sys, time
from pathlib import Path
import torch
import megakit.interop.checkpoint as ck
from megakit.nn.model import ModelConfig, Transformer
from megakit.train.resilience.resume import publish_in_series

torch.set_num_threads(1)
root, cases = Path(sys.argv[1]), sys.argv[2:]
config = ModelConfig.load("gpt-tiny")

def save(directory, step, seed, *, series):
    target = directory / f"step-{step:07d}" if series else directory
    ck.save_checkpoint(target, Transformer(config, seed=seed), step=step, config=config)
    if series:
        publish_in_series(directory, target, keep=2)

for kind in ("single", "series"):  # the checkpoints there before the save that is killed
    for step in (1, 2) if kind == "series" else (1,):
        save(root / f"template-{kind}" / "ck", step, step, series=kind == "series")

def pause(here):
    (here / "paused").touch()
    time.sleep(600)

def half_remove(path, here):  # a removal killed half-way: one file gone
    next(p for p in Path(path).iterdir() if p.is_file()).unlink()
    pause(here)

def hook(point, here):
    rename, replace, rmtree, fsync, visible = os.rename, os.replace, shutil.rmtree, ck.fsync, ck._check_visible
    if point == "tmp-written":  # every shard, no manifest
        ck._check_visible = lambda tmp, manifest: (visible(tmp, manifest), pause(here))
    elif point == "manifest-written":
        ck.fsync = lambda path: (fsync(path), path.name == "manifest.json" and pause(here))
    elif point == "moved-aside":
        os.rename = lambda a, b: (rename(a, b), ".old-" in str(b) and pause(here))
    elif point == "tmp-renamed":
        os.rename = lambda a, b: (rename(a, b), ".tmp-" in str(a) and pause(here))
    elif point == "old-removing":
        shutil.rmtree = lambda p, **k: (".old-" in str(p) and half_remove(p, here), rmtree(p, **k))
    elif point == "latest-written":
        os.replace = lambda a, b: (str(a).endswith("latest.tmp") and pause(here), replace(a, b))
    elif point == "pruning":
        shutil.rmtree = lambda p, **k: (Path(p).name == "step-0000001" and half_remove(p, here), rmtree(p, **k))

for case in cases:
    kind, point = case.split(":")
    here = root / case.replace(":", "-")
    shutil.copytree(root / f"template-{kind.split('-')[0]}", here)
    pid = os.fork()
    if pid == 0:
        try:
            hook(point, here)
            step, seed = {"single": (2, 2), "series-new": (3, 3), "series-resave": (2, 22)}[kind]
            save(here / "ck", step, seed, series=kind != "single")
        finally:
            os._exit(3)  # the save went through: the point was never reached
    while not (here / "paused").exists():
        if os.waitpid(pid, os.WNOHANG) != (0, 0):
            sys.exit(f"{case}: the save never reached its point")
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, (case, status)
    (here / "paused").unlink()
'''

# (kind, point): the step --load must take and the seed of its weights, and what it must say
EXPECTED = {
    ("single", "tmp-written"): (1, 1, "ignoring"),
    ("single", "manifest-written"): (1, 1, "ignoring"),
    ("single", "moved-aside"): (1, 1, "is missing: a save killed while replacing it moved its last complete"),
    ("single", "tmp-renamed"): (2, 2, None),
    ("single", "old-removing"): (2, 2, None),
    ("series-new", "tmp-written"): (2, 2, "ignoring"),
    ("series-new", "manifest-written"): (2, 2, "ignoring"),
    ("series-new", "tmp-renamed"): (2, 2, "latest names step-0000002, not the newer step-0000003: a save killed"),
    ("series-new", "latest-written"): (2, 2, "latest names step-0000002, not the newer step-0000003"),
    ("series-new", "pruning"): (3, 3, None),
    ("series-resave", "moved-aside"): (2, 2, "moved aside by a save killed while replacing it"),
    ("series-resave", "tmp-renamed"): (2, 22, None),
    ("series-resave", "old-removing"): (2, 22, None),
}


class Weights:
    """Whether a checkpoint holds the weights of gpt-tiny built from a seed (each model built once)."""

    def __init__(self) -> None:
        from megakit.nn.model import ModelConfig, Transformer

        self.config, self.models = ModelConfig.load("gpt-tiny"), {}
        self.loaded = Transformer(self.config, seed=99)

    def model(self, seed: int):
        from megakit.nn.model import Transformer

        return self.models.setdefault(seed, Transformer(self.config, seed=seed))

    def of(self, checkpoint: Path, seed: int) -> bool:
        from megakit.interop.checkpoint import load_checkpoint

        load_checkpoint(checkpoint, self.loaded)
        return all(torch.equal(a, b) for a, b in zip(self.loaded.parameters(), self.model(seed).parameters()))


def test_a_save_killed_at_each_point_of_its_publish_leaves_the_newest_complete_checkpoint(tmp_path):
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.train.resilience.restarts import auto_load
    from megakit.train.resilience.resume import check_checkpoint_flags, publish_in_series
    from megakit.train.resilience.save_dir import remove_leftovers

    cases = [f"{kind}:{point}" for kind, point in EXPECTED]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), *cases], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=240)
    assert child.returncode == 0, child.stdout[-3000:] + child.stderr[-3000:]
    weights = Weights()
    for (kind, point), (step, seed, note) in EXPECTED.items():
        ck, series, case = tmp_path / f"{kind}-{point}" / "ck", kind != "single", f"{kind} killed at {point}"
        assert auto_load(str(ck), "auto") == str(ck), case  # --load auto sees a checkpoint
        for save in (str(ck), None):  # --load auto (the --save directory), --load DIR
            said = []
            start, chosen = check_checkpoint_flags(save=save, load=str(ck), steps=10, series=series, say=said.append)
            assert start == step and weights.of(chosen, seed), (case, chosen, said)
            assert note is None or any(note in line for line in said), (case, said)
        remove_leftovers(ck, say=lambda *_: None)  # what the run's rank 0 does at start, under the lock
        assert check_checkpoint_flags(save=str(ck), load=str(ck), steps=10, series=series,
                                      say=lambda *_: None)[0] == step, case  # it kept the newest complete one
        # the resumed run's next save: then only complete checkpoints are left, --keep 2 of them in a series
        target = ck / "step-0000004" if series else ck
        save_checkpoint(target, weights.model(4), step=4, config=weights.config)
        if series:
            publish_in_series(ck, target, keep=2)
        remove_leftovers(ck, say=lambda *_: None)
        siblings = sorted(p.name for p in ck.parent.iterdir())
        assert siblings == ["ck"], (case, siblings)
        if series:
            names = sorted(p.name for p in ck.iterdir())
            assert len(names) == 3 and names[0] == "latest" and names[-1] == "step-0000004" and all(
                (ck / n / "manifest.json").is_file() for n in names[1:]), (case, names)
        assert check_checkpoint_flags(save=str(ck), load=str(ck), steps=10, series=series,
                                      say=lambda *_: None)[0] == 4, case
