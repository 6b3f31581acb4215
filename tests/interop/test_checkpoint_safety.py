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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from paths import ROOT

# -- the publish sequence, killed at each point -----------------------------------------------------------------
CHILD = r"""
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
"""

# (kind, point): the step --load must take and the seed of its weights, and what it must say (an unfinished save is
# "not (yet) complete": before the lock is held it may be another run's save still in progress)
IGNORING = "not (yet) complete (a save killed before it finished, or one still in progress"
EXPECTED = {
    ("single", "tmp-written"): (1, 1, IGNORING),
    ("single", "manifest-written"): (1, 1, IGNORING),
    ("single", "moved-aside"): (1, 1, "is missing: a save killed while replacing it moved its last complete"),
    ("single", "tmp-renamed"): (2, 2, None),
    ("single", "old-removing"): (2, 2, None),
    ("series-new", "tmp-written"): (2, 2, IGNORING),
    ("series-new", "manifest-written"): (2, 2, IGNORING),
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
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path), *cases],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
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
        assert (
            check_checkpoint_flags(save=str(ck), load=str(ck), steps=10, series=series, say=lambda *_: None)[0] == step
        ), case  # it kept the newest complete one
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
            assert (
                len(names) == 3
                and names[0] == "latest"
                and names[-1] == "step-0000004"
                and all((ck / n / "manifest.json").is_file() for n in names[1:])
            ), (case, names)
        assert (
            check_checkpoint_flags(save=str(ck), load=str(ck), steps=10, series=series, say=lambda *_: None)[0] == 4
        ), case


# -- one writer, a writable directory, the right kind of directory ----------------------------------------------
def test_one_run_holds_a_save_directory_and_a_dead_runs_lock_is_taken_over(tmp_path):
    import socket

    from megakit.errors import UsageError
    from megakit.train.resilience.save_lock import SaveLock, lock_path

    save = tmp_path / "ck"
    lock_path(save).write_text(json.dumps({"host": "gone-node", "pid": 4242, "started": "yesterday"}))  # not locked
    said = []
    lock = SaveLock.acquire(save, say=said.append)
    assert said == [
        f"megakit: took over the lock on --save {save} from a run that is gone (host gone-node, "
        "PID 4242, started yesterday)"
    ]
    with pytest.raises(UsageError) as refused:  # another open of it, even in this process, is another run
        SaveLock.acquire(save)
    line = str(refused.value)
    assert (
        line.startswith(
            f"--save {save} is in use by another run (host {socket.gethostname()}, PID {os.getpid()}, started "
        )
        and "choose another --save" in line
        and "\n" not in line
    ), line
    lock.release()
    lock.release()  # idempotent
    assert os.listdir(tmp_path) == []  # the lock file goes with the lock
    SaveLock.acquire(save, say=said.append).release()  # free again, and nothing to take over
    assert len(said) == 1 and os.listdir(tmp_path) == []


def _train_script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        return (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True, timeout=30
            ).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


def _unmount(path: Path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, timeout=30)


def test_an_unwritable_or_foreign_save_directory_is_refused_before_any_step(tmp_path, capsys, monkeypatch):
    """A path under a regular file, a read-only mount (a real one, where this machine lets the test mount), a
    directory holding another run's checkpoint, a series beside a single checkpoint: one line each, exit 2, from
    --check and from the trainer alike, with --load auto too, before any process group."""
    import torch.distributed as dist

    from megakit.errors import UsageError
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.resilience.resume import check_checkpoint_flags

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    script = _train_script()
    (tmp_path / "file").write_text("not a directory")
    read_only = tmp_path / "ro"
    mounted = _mount_tmpfs(read_only, "ro,size=64k")
    try:
        refusals = [(tmp_path / "file" / "ck", "file is a file, not a directory")]
        refusals += [(read_only / "ck", f"cannot write in {read_only} (Read-only file system)")] if mounted else []
        for save, message in refusals:
            for extra in (["--check"], ["--load", "auto"], ["--check", "--load", "auto"]):
                assert (
                    script.main(["--model", "gpt-tiny", "--steps", "1", "--no-progress", "--save", str(save), *extra])
                    == 2
                )
                err = capsys.readouterr().err.strip().splitlines()
                assert len(err) == 1 and err[0].startswith("train.py: error: --save ") and message in err[0], err
    finally:
        if mounted:
            _unmount(read_only)
    assert not dist.is_initialized() and sorted(os.listdir(tmp_path)) == ["file", "ro"]  # nothing written
    from megakit.train.resilience.save_lock import SaveLock

    lock = SaveLock.acquire(tmp_path / "held")  # --check says a job would be refused: another run holds --save
    try:
        assert script.main(["--model", "gpt-tiny", "--steps", "1", "--save", str(tmp_path / "held"), "--check"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is in use by another run (host " in err[0] and f"PID {os.getpid()}" in err[0], err
    finally:
        lock.release()

    config = ModelConfig.load("gpt-tiny")
    single, series = tmp_path / "single", tmp_path / "series"
    save_checkpoint(single, Transformer(config), step=3, config=config)
    save_checkpoint(series / "step-0000003", Transformer(config), step=3, config=config)
    flags = dict(steps=9, say=lambda *_: None)
    for save, load, series_flag, message in [
        (single, None, False, "already holds a checkpoint of another run, which this run \\(from scratch\\) would"),
        (single, str(series), False, "already holds a checkpoint of another run"),
        (single, str(single), True, "holds a single checkpoint, and --keep would write a series"),
        (series, str(series), False, "holds a --keep series; add --save-every N --keep K"),
        (series, None, True, "already holds a checkpoint of another run"),
    ]:
        with pytest.raises(UsageError, match=message):
            check_checkpoint_flags(save=str(save), load=load, series=series_flag, **flags)
    # resuming the directory's own run: from it, a step of its series, or (the same) --load auto
    assert check_checkpoint_flags(save=str(single), load=str(single), **flags)[0] == 3
    assert check_checkpoint_flags(save=str(series), load=str(series / "step-0000003"), series=True, **flags)[0] == 3
    assert check_checkpoint_flags(save=str(tmp_path / "new"), load=str(single), **flags)[0] == 3
    # what is loaded is said in one line: path, step, model (an imported checkpoint's source too)
    save_checkpoint(
        tmp_path / "imported", Transformer(config), step=0, config=config, extra={"imported_from": "hf/my-model"}
    )
    said = []
    check_checkpoint_flags(save=None, load=str(tmp_path / "imported"), steps=9, say=said.append)
    assert said == [
        f"megakit: starting from {tmp_path / 'imported'} (step 0, imported from hf/my-model, gpt2, 4 "
        "layers, hidden 32, 0.06 M parameters)"
    ], said


def test_a_full_disk_is_one_line_with_the_bytes_and_the_intact_checkpoint(tmp_path):
    """A real tmpfs too small for a second copy: the check before writing refuses, naming the directory, the bytes
    needed and free, and the step still intact; where the check is passed (space taken meanwhile), the real
    ENOSPC of the write gives the same line, and nothing of the save is left."""
    from megakit.errors import UsageError
    from megakit.interop import checkpoint
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer

    config = ModelConfig.load("gpt-tiny")
    model = Transformer(config)
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "size=400k"):
        pytest.skip("mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN)")
    try:
        save_checkpoint(disk / "ck", model, step=5, config=config)  # ~250 KB: fits once, not twice
        with pytest.raises(UsageError) as full:
            save_checkpoint(disk / "ck", model, step=6, config=config)
        line = str(full.value)
        assert line.startswith(f"no space for the checkpoint of step 6 in {disk}: it needs ") and "bytes" in line
        assert f"the last complete checkpoint (step 5, {disk / 'ck'}) is intact" in line and "\n" not in line, line
        real_check = checkpoint.StagedCheckpoint._check_space
        checkpoint.StagedCheckpoint._check_space = lambda self, group: (1, 2)  # as if another writer took the space
        try:
            with pytest.raises(
                UsageError,
                match=r"no space for the checkpoint of step 6 in .*the last complete "
                r"checkpoint \(step 5",
            ):
                save_checkpoint(disk / "ck", model, step=6, config=config)
        finally:
            checkpoint.StagedCheckpoint._check_space = real_check
        assert os.listdir(disk) == ["ck"] and json.loads((disk / "ck" / "manifest.json").read_text())["step"] == 5
    finally:
        _unmount(disk)


# -- a real trainer killed between the two renames, and the lock on its directory --------------------------------
PAUSED_TRAINER = r"""
import os, runpy, sys, time
from pathlib import Path

rename, marker = os.rename, Path(sys.argv[1])

def paused(a, b):  # the trainer's save of step 4 stops right after moving the step-2 checkpoint aside
    rename(a, b)
    if ".old-" in str(b):
        marker.touch()
        time.sleep(600)

os.rename = paused
sys.argv = ["scripts/train.py", *sys.argv[2:]]
runpy.run_path("scripts/train.py", run_name="__main__")
"""
TRAIN = ["--model", "gpt-tiny", "--seq-len", "32", "--no-progress", "--save-every", "2"]


def _run(*args: str, save: Path, env: dict, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/train.py", *TRAIN, "--save", str(save), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        **kwargs,
    )


@pytest.mark.slow
def test_a_trainer_killed_between_the_renames_resumes_and_one_run_holds_the_directory(tmp_path):
    from megakit.train.doctor.fault_injection import VARIABLE
    from megakit.train.observe.metrics import read_metrics

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop(VARIABLE, None)
    save, paused = tmp_path / "ck", tmp_path / "paused"
    killed = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PAUSED_TRAINER,
            str(paused),
            *TRAIN,
            "--save",
            str(save),
            "--steps",
            "4",
            "--load",
            "auto",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not paused.exists():
            assert killed.poll() is None and time.monotonic() < deadline, "the trainer never paused in its save"
            time.sleep(0.05)
        # a second run on the same --save while the first still runs: refused in one line, before any step
        second = _run("--steps", "4", "--load", "auto", save=save, env=env)
        err = second.stderr.strip().splitlines()
        assert second.returncode == 2 and err[-1].startswith(
            f"train.py: error: --save {save} is in use by another run (host "
        ), second.stderr[-3000:]
        assert f"PID {killed.pid}, started" in err[-1] and "step " not in second.stdout.replace("(step", ""), err
        assert "restart" not in second.stdout, second.stdout  # the first run's attempts record is not read
        os.kill(killed.pid, signal.SIGKILL)
        first_log = killed.communicate(timeout=60)[0]
    finally:
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    assert not save.exists() and len(list(tmp_path.glob("ck.old-*"))) == 1  # killed between the two renames
    (old,) = tmp_path.glob("ck.old-*")
    (unfinished,) = tmp_path.glob("ck.tmp-*")  # the step-4 checkpoint, complete but never published
    logged = {
        int(line.split()[1]): line.split("| loss ")[1].split()[0]
        for line in first_log.splitlines()
        if line.startswith("step ")
    }
    # --load auto resumes from the moved-aside copy (not from step 0), takes over the dead run's lock, removes
    # what the killed save left, and says each in one line
    metrics = tmp_path / "m.json"
    resumed = _run("--steps", "6", "--load", "auto", "--metrics-out", str(metrics), save=save, env=env)
    out = resumed.stdout
    assert resumed.returncode == 0, out[-3000:] + resumed.stderr[-3000:]
    for line in (
        f"megakit: {save} is missing: a save killed while replacing it moved its last complete checkpoint "
        f"aside to {old}",
        f"megakit: resuming from {old} (step 2, gpt2, 4 layers",
        f"megakit: took over the lock on --save {save} from a run that is gone (host ",
        f"megakit: removed what saves killed mid-way left in {save}: {unfinished.name}",
        f"megakit: saved step 4 to {save} (",
        f"megakit: saved step 6 to {save} (",
        f"megakit: removed what saves killed mid-way left in {save}: {old.name}",
        "megakit: restart 1 of this run: the last attempt finished step 3, resuming at step 2 redoes 2",
    ):
        assert line in out, (line, out[-3000:])
    steps = {m["step"]: m["loss"] for m in read_metrics(metrics)["steps"]}
    assert sorted(steps) == [2, 3, 4, 5] and all(f"{steps[s]:.4f}" == logged[s] for s in (2, 3)), (steps, logged)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.attempts.json", "ck", "m.json", "paused"]
    assert json.loads((save / "manifest.json").read_text())["step"] == 6  # and no lock left after a normal end
    # an error after the lock was taken (a NaN loss with --max-skipped-steps 0) releases it too
    diverged = _run(
        "--steps",
        "8",
        "--load",
        "auto",
        "--max-skipped-steps",
        "0",
        save=save,
        env=dict(env, **{VARIABLE: "nanloss@0:6"}),
    )
    assert diverged.returncode == 1, diverged.stdout[-2000:] + diverged.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".ck.attempts.json", "ck", "m.json", "paused"]


# -- at 2 processes: another run's lock, a full disk with and without --async-save ---------------------------------
JOB = r"""
import json, os, sys
import torch.distributed as dist
from megakit.errors import UsageError
from megakit.train.trainer import TrainConfig, train

cases_path, out = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
cases, said = json.load(open(cases_path)), []
for case in cases:
    try:
        train(TrainConfig(progress=False, **case))
        said.append(None)
    except UsageError as error:  # what scripts/train.py prints (on rank 0 alone when every rank raised it)
        said.append([str(error), getattr(error, "all_ranks", False)])
json.dump(said, open(f"{out}.{os.environ['RANK']}", "w"))
if dist.is_initialized():
    dist.destroy_process_group()
"""


@pytest.mark.slow
def test_at_two_processes_a_held_directory_and_a_full_disk_are_one_line_on_every_rank(tmp_path):
    """One launcher job: --save held by another process (this test's); then --save-every 1 onto a real tmpfs with
    room for one checkpoint, synchronously and with --async-save: the second save is refused before writing, on
    every rank alike, naming the directory, the bytes and the step still intact, and the run keeps that step."""
    from multiproc import THREADS, free_port

    from megakit.train.resilience.save_lock import SaveLock

    disks = [tmp_path / "sync", tmp_path / "async"]
    if not all(_mount_tmpfs(disk, "size=1600k") for disk in disks):  # one ~1.1 MB checkpoint fits, not two
        for disk in disks:
            _unmount(disk)
        pytest.skip("mounting a tmpfs is not permitted here (needs root or CAP_SYS_ADMIN)")
    (tmp_path / "job.py").write_text(JOB)
    base = dict(ds_config=str(ROOT / "ds_configs" / "zero1.json"), model="gpt-tiny", seq_len=32, steps=2)
    cases = [
        dict(base, save=str(tmp_path / "held")),
        dict(base, save=str(disks[0] / "ck"), save_every=1),
        dict(base, save=str(disks[1] / "ck"), save_every=1, async_save=True),
    ]
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    lock = SaveLock.acquire(tmp_path / "held")
    try:
        job = subprocess.run(
            [
                "deepspeed",
                "--num_gpus",
                "2",
                "--master_port",
                str(free_port()),
                str(tmp_path / "job.py"),
                str(tmp_path / "cases.json"),
                str(tmp_path / "said"),
            ],
            cwd=ROOT,
            env=dict(os.environ, OMP_NUM_THREADS=THREADS, PYTHONPATH=str(ROOT)),
            capture_output=True,
            text=True,
            timeout=400,
        )
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        ranks = [json.loads((tmp_path / f"said.{rank}").read_text()) for rank in (0, 1)]
        assert ranks[0] == ranks[1] and all(all_ranks for _, all_ranks in ranks[0]), ranks  # printed once
        held, *full = [line for line, _ in ranks[0]]
        assert held.startswith(f"--save {tmp_path / 'held'} is in use by another run (host ") and (
            f"PID {os.getpid()}, started" in held
        ), held
        for disk, line in zip(disks, full):
            assert line.startswith(f"no space for the checkpoint of step 2 in {disk}: it needs "), line
            assert f"the last complete checkpoint (step 1, {disk / 'ck'}) is intact" in line, line
            needed, free = (int(line.split(word)[0].split()[-1].replace(",", "")) for word in (" bytes (", " are free"))
            assert needed > free > 0, line
            assert os.listdir(disk) == ["ck"] and json.loads((disk / "ck" / "manifest.json").read_text())["step"] == 1
        assert "saved step 1 to " + str(disks[1] / "ck") in job.stdout and "written in the background" in job.stdout
    finally:
        lock.release()
        for disk in disks:
            _unmount(disk)


def test_cleanup_keeps_a_moved_aside_copy_of_a_later_step_than_the_one_in_place(tmp_path):
    """A moved-aside copy is stale only when the checkpoint in place is at least as new (the kill was after the
    second rename); one of a later step (a checkpoint since written into the empty place) is kept."""
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.resilience.save_dir import remove_leftovers

    config = ModelConfig.load("gpt-tiny")
    model = Transformer(config)
    save_checkpoint(tmp_path / "ck", model, step=5, config=config)
    (tmp_path / "ck").rename(tmp_path / "ck.old-dead")
    save_checkpoint(tmp_path / "ck", model, step=0, config=config)  # e.g. convert --from-hf into the empty place
    assert remove_leftovers(tmp_path / "ck", say=lambda *_: None) == []
    assert sorted(os.listdir(tmp_path)) == ["ck", "ck.old-dead"]


@pytest.fixture
def world_of_one():
    """A real one-process gloo group (hold_save_dir broadcasts its verdict over the world)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_the_cleanup_at_start_keeps_the_moved_aside_copy_the_run_loads(tmp_path, world_of_one):
    """``--load DIR.old-X`` (or ``DIR/step-N.old-X``) where DIR holds the same step again: the copy is stale to the
    cleanup, but it is what this run loads, so taking the lock must not remove it."""
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.resilience.resume import check_checkpoint_flags
    from megakit.train.resilience.save_lock import hold_save_dir

    config = ModelConfig.load("gpt-tiny")
    model = Transformer(config)
    single, series = tmp_path / "single", tmp_path / "series"
    for step in (3, 5):
        save_checkpoint(single if step == 5 else tmp_path / "single.old-dead", model, step=step, config=config)
    save_checkpoint(series / "step-0000004.old-dead", model, step=4, config=config)
    save_checkpoint(series / "step-0000004", model, step=4, config=config)
    for save, load, series_flag in (
        (single, tmp_path / "single.old-dead", False),
        (series, series / "step-0000004.old-dead", True),
    ):
        start, chosen = check_checkpoint_flags(
            save=str(save), load=str(load), steps=9, series=series_flag, say=lambda *_: None
        )
        assert chosen == load
        hold_save_dir(str(save), rank=0, checkpoint=chosen, start=start, say=lambda *_: None).release()
        assert (load / "manifest.json").is_file(), f"{load} was removed before the run loaded it"


def test_taking_the_lock_refuses_a_directory_changed_since_the_load_was_chosen_or_unlockable(tmp_path, world_of_one):
    """A requeue race: the run the requeue replaced publishes its stop-save between the new run's choice of what to
    load and its lock. Taking the lock re-reads the choice and refuses in one line; so is a lock path that cannot
    be opened (a directory there), never an OSError that would leave the other ranks waiting in the broadcast."""
    from megakit.errors import UsageError
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.resilience.save_lock import hold_save_dir, lock_path

    config = ModelConfig.load("gpt-tiny")
    model, save, quiet = Transformer(config), tmp_path / "ck", (lambda *_: None)
    save_checkpoint(save, model, step=3, config=config)
    hold_save_dir(str(save), rank=0, checkpoint=save, start=3, say=quiet).release()  # unchanged: taken
    for checkpoint, start, now in (
        (save, 2, "is at step 3 now"),
        (None, 0, "holds one now"),
        (tmp_path / "gone", 1, "is gone now"),
    ):
        with pytest.raises(UsageError) as refused:
            hold_save_dir(str(save), rank=0, checkpoint=checkpoint, start=start, say=quiet)
        line = str(refused.value)
        assert line.startswith(f"--save {save} changed while this run started: ") and now in line, line
        assert line.endswith("start the run again") and "\n" not in line and not lock_path(save).exists(), line
    lock_path(tmp_path / "other").mkdir()
    with pytest.raises(UsageError, match=r"^--save \S+other: cannot lock \S+\.other\.lock \(Is a directory\); "):
        hold_save_dir(str(tmp_path / "other"), rank=0, say=quiet)


def test_a_free_space_check_that_fails_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    """statvfs failing where the save goes (a stale NFS handle, a permission) is the verdict rank 0 sends to every
    rank, not an OSError raised on rank 0 alone while the others wait for the verdict."""
    import shutil

    from megakit.errors import UsageError
    from megakit.interop import checkpoint
    from megakit.nn.model import ModelConfig, Transformer

    def stale(path):
        raise OSError(116, "Stale file handle")

    config = ModelConfig.load("gpt-tiny")
    monkeypatch.setattr(shutil, "disk_usage", stale)
    with pytest.raises(UsageError, match=r"^cannot check the free space for the checkpoint of step 1 in .* \(Stale "):
        checkpoint.save_checkpoint(tmp_path / "ck", Transformer(config), step=1, config=config)
    assert os.listdir(tmp_path) == []


def test_a_start_that_fails_after_the_lock_releases_it_in_a_long_lived_process(tmp_path, monkeypatch):
    """The trainer in this process (as tests/helpers/launch_sweep.py runs case after case): its start failing after the
    --save lock was taken (here the watchdog's store, as a connect_store timeout would) must not keep the flock for
    the process's life, which would refuse every later case on that --save."""
    import torch.distributed as dist
    from multiproc import free_port

    from megakit.train import trainer
    from megakit.train.resilience.save_lock import SaveLock

    def store_timed_out(*args):
        raise RuntimeError("connect_store: timed out after 30 s")

    monkeypatch.chdir(ROOT)
    for name, value in dict(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())
    ).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(trainer, "_start_watchdog", store_timed_out)
    save = tmp_path / "ck"
    try:
        with pytest.raises(RuntimeError, match="timed out"):
            trainer.train(
                trainer.TrainConfig(
                    ds_config=str(ROOT / "ds_configs" / "zero1.json"),
                    model="gpt-tiny",
                    seq_len=32,
                    steps=1,
                    progress=False,
                    save=str(save),
                )
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    SaveLock.acquire(save).release()  # free again in this very process


def test_init_starts_a_fine_tune_from_a_model_and_the_same_command_restarts_it_from_save(tmp_path, monkeypatch):
    """``--save run --init pretrained`` (``--load auto`` implied): the first attempt starts from the pretrained
    model; once --save holds a checkpoint, the same command (a torchrun restart, a Slurm requeue) resumes from it.
    ``--init`` with ``--load X`` is refused, and ``--load X`` into a --save that holds checkpoints names the fix."""
    from megakit.errors import UsageError
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.run import TrainConfig, resolve

    monkeypatch.chdir(ROOT)
    config = ModelConfig.load("gpt-tiny")
    pretrained, save = tmp_path / "pretrained", tmp_path / "run"
    save_checkpoint(pretrained, Transformer(config), step=0, config=config, extra={"imported_from": "hf/base"})
    flags = dict(
        ds_config=str(ROOT / "ds_configs" / "zero1.json"),
        model="gpt-tiny",
        seq_len=32,
        steps=6,
        save=str(save),
        save_every=2,
    )
    said = []
    for load in (None, "auto"):
        run = resolve(TrainConfig(**flags, load=load, init=str(pretrained)), 1, say=said.append)
        assert (run.checkpoint, run.start_step) == (pretrained, 0)
    assert f"megakit: --load auto: no checkpoint in {save} yet; starting from --init {pretrained}" in said
    save_checkpoint(save, Transformer(config), step=2, config=config)  # the first attempt's save
    run = resolve(TrainConfig(**flags, init=str(pretrained)), 1, say=said.append)
    assert (run.checkpoint, run.start_step) == (save, 2)
    with pytest.raises(
        UsageError,
        match=f"^--init {pretrained} is what --load auto starts from .* use --load auto "
        f"--init {pretrained} for a run that restarts from --save, or --load ",
    ):
        TrainConfig(**flags, load=str(save), init=str(pretrained))
    with pytest.raises(
        UsageError,
        match=f"already holds a checkpoint of another run, which this run \\(from "
        f"{pretrained}\\) would replace; resume that run with --load auto --init "
        f"{pretrained} ",
    ):
        resolve(TrainConfig(**flags, load=str(pretrained)), 1, say=said.append)


def test_what_a_failed_save_calls_intact_is_what_load_takes(tmp_path):
    """``latest`` names a step a killed re-save moved aside, beside a newer complete step (a run resumed from an
    earlier one): --load takes the moved-aside copy, and a failed save's line must name that one, not the newest."""
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.resilience import resume

    config = ModelConfig.load("gpt-tiny")
    model, series = Transformer(config), tmp_path / "series"
    for name, step in (("step-0000002", 2), ("step-0000003.old-dead", 3), ("step-0000004", 4)):
        save_checkpoint(series / name, model, step=step, config=config)
    (series / "latest").write_text("step-0000003\n")
    chosen = resume.choose_checkpoint(str(series), say=lambda *_: None)
    assert chosen == series / "step-0000003.old-dead"
    assert resume._last_complete(series) == f"the last complete checkpoint (step 3, {chosen}) is intact"
    tensors = sum(p.stat().st_size for p in chosen.glob("*.safetensors"))
    assert resume._size(chosen) == tensors > 0  # from the manifest, not a walk of the directory
