"""A run that survives a killed worker: torchrun's agent restarts every worker and ``--load auto`` resumes.

TP 2 with dropout 0.1 on 2 processes, ``--save-every 3 --keep 2 --load auto``; rank 1 kills itself
(SIGKILL) at the start of step 7 on the first attempt. The agent (``--max-restarts 1``) restarts
both workers with the same command; they resume from the step-6 checkpoint and end at step 9 with
the uninterrupted run's losses, bit for bit.
"""

import json
import os
import subprocess

import pytest
from jobs import dropout_model
from multiproc import THREADS
from paths import ROOT

from megakit.train.doctor.fault_injection import VARIABLE
from megakit.train.observe.metrics import read_metrics

TRAIN = [
    "scripts/train.py",
    "--ds_config",
    "ds_configs/zero1.json",
    "--seq-len",
    "32",
    "--no-progress",
    "--tp",
    "2",
    "--steps",
    "9",
]


def _torchrun(*args: str, fault: str = "") -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=THREADS, **{VARIABLE: fault})
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "2", "--max-restarts", "1", *TRAIN, *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_killed_worker_is_restarted_and_the_run_resumes_bitwise(tmp_path):
    model = dropout_model(tmp_path)
    full = _torchrun("--model", model, "--metrics-out", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
    save = tmp_path / "ckpt"
    out = _torchrun(
        "--model",
        model,
        "--metrics-out",
        str(tmp_path / "restarted.json"),
        "--save",
        str(save),
        "--save-every",
        "3",
        "--keep",
        "2",
        "--load",
        "auto",
        fault="kill@1:7",
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "megakit: --load auto: no checkpoint in" in log  # the first attempt started at step 0
    assert (
        "megakit: restart 1 of this run (torchrun restart 1): the last attempt finished step 6, resuming at "
        "step 6 redoes 1 step(s) (1 in all)"
    ) in log, log[-4000:]
    losses = {m["step"]: m["loss"] for m in read_metrics(tmp_path / "full.json")["steps"]}
    restarted = read_metrics(tmp_path / "restarted.json")  # both attempts appended: steps 0-6, then 6-8
    assert [run["start_step"] for run in restarted["runs"]] == [0, 6], restarted["runs"]
    resumed = {m["step"]: m["loss"] for m in restarted["steps"]}  # step 6: the restarted attempt's, the newest
    assert sorted(resumed) == list(range(9)), resumed
    assert all(resumed[s] == losses[s] for s in resumed), (resumed, losses)  # bitwise
    assert sorted(p.name for p in save.iterdir()) == ["latest", "step-0000006", "step-0000009"]
    attempts = json.loads((tmp_path / ".ckpt.attempts.json").read_text())["attempts"]
    assert attempts == [{"started": 0, "reached": 7}, {"started": 6, "reached": 9}], attempts


def test_load_auto_is_the_save_directory_once_it_holds_a_checkpoint(tmp_path):
    from megakit.errors import UsageError
    from megakit.train.resilience.restarts import auto_load

    said = []
    assert auto_load(str(tmp_path / "new"), "auto", say=said.append) is None  # nothing yet: step 0, said once
    assert said == [f"megakit: --load auto: no checkpoint in {tmp_path / 'new'} yet; starting at step 0"]
    (tmp_path / "series" / "step-0000003").mkdir(parents=True)
    assert auto_load(str(tmp_path / "series"), "auto") == str(tmp_path / "series")
    assert auto_load(None, "some/dir") == "some/dir"  # any other --load is itself
    with pytest.raises(UsageError, match="--load auto resumes from the --save directory"):
        auto_load(None, "auto")


def test_attempts_count_restarts_and_the_steps_they_redo(tmp_path):
    from megakit.train.resilience.restarts import Attempts

    said = []
    first = Attempts(str(tmp_path / "ckpt"), start=0, active=True, say=said.append)
    for step in range(8):  # killed after finishing step 7
        first.finished(step)
    second = Attempts(str(tmp_path / "ckpt"), start=6, active=True, say=said.append)  # resumed from step 6
    second.finished(6)  # killed again after step 6
    third = Attempts(str(tmp_path / "ckpt"), start=3, active=True, say=said.append)  # the step-6 one was damaged
    assert said == [
        "megakit: restart 1 of this run: the last attempt finished step 7, resuming at step 6 redoes "
        "2 step(s) (2 in all)",
        "megakit: restart 2 of this run: the last attempt finished step 6, resuming at step 3 redoes "
        "4 step(s) (6 in all)",
    ]
    assert third.restarts == 2
    assert not Attempts(str(tmp_path / "other"), start=0, active=False).restarts  # only rank 0 keeps the record
    assert not (tmp_path / ".other.attempts.json").exists()
