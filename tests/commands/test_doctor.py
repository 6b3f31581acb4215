"""``megakit doctor`` on real jobs through the ``deepspeed`` launcher: every check passes on a healthy job and
fails on the fault it exists for.

Two launches (~30 s each on 2 idle cores): a healthy 2-process job (on packed documents with loss masks), and a
4-process job with one fault per check
planted by ``MEGAKIT_INJECT_FAULT`` (``megakit.train.doctor.fault_injection``), each on its own rank so that none hides
another: rank 1 runs another --seed and sleeps in every step, rank 3 reads DP rank 0's samples, rank 2 keeps half
its rows and gets a NaN gradient at step 3, and the ds_config scales the LR by 4 without a warm-up.
"""

import json
import os
import re
import subprocess
import sys

import pytest
from jobs import packed_documents
from multiproc import THREADS
from paths import ROOT

from megakit.commands import cli
from megakit.train.doctor.fault_injection import VARIABLE

DOCTOR = [
    sys.executable,
    "-m",
    "megakit.commands.cli",
    "doctor",
    "--steps",
    "5",
    "--base-lr",
    "1.5e-3",
    "--base-batch",
    "4",
    "--model",
    "gpt-tiny",
    "--seq-len",
    "32",
]


def _text(path) -> str:
    """A text of seeded random words: every sample window distinct, so the overlap counts are the fault's only
    (the repository's own files change, and their repeated lines make equal windows)."""
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    path.write_text(" ".join(rng.choice(words) for _ in range(8000)))
    return str(path)


FAULTS = "seed@1,sleep@1:0.5,overlap@3,unbalanced@2,nan@2:3"


def _ds_config(path, *, lr: float, warmup: int | None) -> str:
    config = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
    config.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    config["optimizer"]["params"]["lr"] = lr
    if warmup is None:
        del config["scheduler"]
    else:
        config["scheduler"]["params"].update(warmup_num_steps=warmup, total_num_steps=40)
    path.write_text(json.dumps(config))
    return str(path)


def _doctor(
    work, nproc: int, ds_config: str, faults: str = "", data: list[str] | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE} | {"OMP_NUM_THREADS": THREADS}
    if faults:
        env[VARIABLE] = faults
    report = work / "report.json"
    out = subprocess.run(
        [
            *DOCTOR,
            "--nproc",
            str(nproc),
            "--ds_config",
            ds_config,
            "--report-out",
            str(report),
            *(data or ["--data", _text(work / "text.txt")]),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert report.exists(), out.stdout[-3000:] + out.stderr[-3000:]
    return out, {check["name"]: check for check in json.loads(report.read_text())["checks"]}


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    work = tmp_path_factory.mktemp("healthy")  # global batch 8 = 2 x base batch 4: LR 2 x 1.5e-3, warmed up
    return _doctor(
        work,
        2,
        _ds_config(work / "ds.json", lr=3e-3, warmup=3),
        data=["--data", packed_documents(work), "--reset-attention-mask", "--reset-position-ids"],
    )


@pytest.fixture(scope="module")
def faulty(tmp_path_factory):
    work = tmp_path_factory.mktemp("faulty")  # global batch 16 = 4 x base batch 4: LR 4 x 1.5e-3, no warm-up
    return _doctor(work, 4, _ds_config(work / "ds.json", lr=6e-3, warmup=None), FAULTS)


@pytest.mark.slow
def test_a_healthy_job_passes_every_check(healthy):
    out, checks = healthy
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-3000:]
    assert [c["passed"] for c in checks.values()] == [True] * 7, checks
    assert "every check passed" in out.stdout and "FAQ 6" in out.stdout
    assert "seeds 0;" in checks["identical initial weights"]["numbers"]
    assert (
        "tokens per rank and step 128; no sample on two DP ranks; each step trained exactly the seed's global "
        "batch" in checks["data balance and no overlap"]["numbers"]
    )
    assert "steps 0-4" in checks["loss against a single process"]["numbers"]
    assert "x2 = 0.003 (peak is 1.00x that)" in checks["learning rate, scaling and warm-up"]["numbers"]
    assert "gloo on cpu; 2 ranks on 1 node(s)" in checks["backend and interconnect"]["numbers"]


@pytest.mark.slow
def test_each_check_fails_on_its_fault_and_names_the_rank(faulty):
    out, checks = faulty
    assert out.returncode == 1, out.stdout[-4000:] + out.stderr[-3000:]
    assert "failed: check 1, 2, 3, 4, 5, 7" in out.stdout  # the table's last line
    weights = checks["identical initial weights"]
    assert not weights["passed"] and "rank 1 (pp 0, dp 1, tp 0) differs from DP rank 0" in weights["numbers"]
    assert "rank 1 --seed 1" in weights["fix"]
    data = checks["data balance and no overlap"]
    assert not data["passed"]
    assert "dp 0 128, dp 1 128, dp 2 64, dp 3 128" in data["numbers"]  # rank 2's uneven shard
    # rank 3 read rank 0's; rank 1's other --seed draws another order, which may meet a rank's samples too
    assert re.search(r"\d+ samples trained by more than one DP rank \([^)]*dp 0 and 3", data["numbers"]), data
    grads = checks["finite, similar gradient norms"]
    assert not grads["passed"] and "step 3" in grads["numbers"]
    assert "non-finite on rank 2 (pp 0, dp 2, tp 0); finite on rank 0" in grads["numbers"]  # not on every rank
    loss = checks["loss against a single process"]
    assert not loss["passed"] and "steps 0-3" in loss["numbers"]  # the NaN came in backward, after the loss
    lr = checks["learning rate, scaling and warm-up"]
    assert not lr["passed"] and "no warm-up" in lr["numbers"] and "warmup_num_steps" in lr["fix"]
    assert checks["backend and interconnect"]["passed"]
    stragglers = checks["stragglers"]
    assert (
        not stragglers["passed"]
        and "rank 1 the slowest of its stage by more than 1.5x their median and 20% of the step in"
        in stragglers["numbers"]
    )


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--nproc", "1"], "", "--nproc 1: the doctor compares ranks"),
        (["--nproc", "2", "--tp", "4"], "", "world size 2 is not divisible by TP x PP"),
        (["--nproc", "2", "--base-lr", "1e-3"], "", "--base-lr and --base-batch go together"),
        (["--nproc", "2", "--doctor-out", "x.json"], "", "--doctor-out is the doctor's to set"),
        (["--nproc", "2"], "sleep@1", f"{VARIABLE}: cannot read 'sleep@1'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_process(argv, env, needle, monkeypatch, capsys):
    monkeypatch.setenv(VARIABLE, env)
    assert cli.main(["doctor", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("megakit doctor: error: ") and needle in err[-1], err


def test_the_backend_line_and_the_job_line_name_context_parallelism(capsys):
    """``megakit doctor --cp 2``: the grid is TP x CP x PP x DP (CP was left out); without CP it reads as before."""
    from megakit.commands.doctor_render import render
    from megakit.train.doctor.checks import check_backend

    ranks = [
        {"rank": r, "pp": 0, "dp": 0, "tp": 0, "backend": "gloo", "device": "cpu", "node": "node 0", "host": "h"}
        for r in range(2)
    ]
    config = {
        "model": "gpt-tiny",
        "world": 2,
        "tp": 1,
        "pp": 1,
        "dp": 1,
        "cp": 2,
        "zero_stage": 1,
        "precision": "fp32",
        "global_batch": 4,
        "seq_len": 32,
        "steps": 2,
        "start_step": 0,
    }
    verdict = check_backend({"ranks": ranks, "config": config})
    assert verdict.passed and "; TP 1 x CP 2 x PP 1 x DP 1;" in verdict.numbers, verdict
    render({"config": config, "steps": [{}, {}], "faults": ""}, [verdict])
    assert "TP 1 x CP 2 x PP 1 x DP 1, ZeRO 1" in capsys.readouterr().out
    without_cp = {k: v for k, v in config.items() if k != "cp"}  # facts a doctor of before CP wrote
    assert "; TP 1 x PP 1 x DP 1;" in check_backend({"ranks": ranks, "config": without_cp}).numbers
