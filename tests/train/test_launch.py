"""The trainer launched as a user launches it: the same command twice, and a job spread over two "nodes".

Two launcher invocations on the loopback address (``torchrun --nnodes 2 --node_rank N``)
are two nodes to torch.distributed, as two machines would be.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
from jobs import LOSS_TOL, deepspeed, dropout_model
from multiproc import THREADS, free_port
from paths import ROOT

from megakit.train.observe.metrics import read_metrics

TRAIN = ["scripts/train.py", "--ds_config", "ds_configs/zero1.json", "--seq-len", "32", "--no-progress"]


def _losses(path: Path) -> list[float]:
    return [step["loss"] for step in read_metrics(path)["steps"]]


@pytest.mark.slow
def test_the_same_command_twice_gives_identical_losses(tmp_path):
    """TP 2 with dropout 0.1: bit-identical losses run to run; another --seed gives other losses.

    The first run keeps the progress bar on, as a cluster job would: its output is a pipe, so the
    log has no carriage return and one line per logged step (0, 2, 4 and the last, 5)."""
    model = dropout_model(tmp_path)
    runs = {}
    for name, seed in (("first", "0"), ("second", "0"), ("other seed", "1")):
        flags = [f for f in TRAIN if f != "--no-progress"] + ["--log-every", "2"] if name == "first" else TRAIN
        out = deepspeed(
            2,
            *flags,
            "--model",
            model,
            "--tp",
            "2",
            "--steps",
            "6",
            "--seed",
            seed,
            "--metrics-out",
            str(tmp_path / f"{name}.json"),
        )
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        runs[name] = _losses(tmp_path / f"{name}.json")
        if name == "first":
            log = out.stdout + out.stderr
            assert "\r" not in log, log[-3000:]
            steps = [line.split()[1] for line in log.splitlines() if line.startswith("step ") and " | loss " in line]
            assert steps == ["0", "2", "4", "5"], log[-3000:]
    assert runs["first"] == runs["second"], runs  # exact float equality
    assert all(a != b for a, b in zip(runs["first"], runs["other seed"])), runs


def _two_nodes(*args: str, timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """Run ``scripts/train.py ARGS`` as 2 nodes x 2 processes: two torchrun invocations on loopback."""
    port = str(free_port())
    env = dict(os.environ, OMP_NUM_THREADS=THREADS)
    jobs = [
        subprocess.Popen(
            [
                "torchrun",
                "--nnodes",
                "2",
                "--node_rank",
                str(node),
                "--nproc_per_node",
                "2",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                *TRAIN,
                "--model",
                "gpt-tiny",
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (0, 1)
    ]
    try:
        outs = [job.communicate(timeout=timeout) for job in jobs]
    finally:
        for job in jobs:
            if job.poll() is None:
                job.kill()
    return [subprocess.CompletedProcess(job.args, job.returncode, o, e) for job, (o, e) in zip(jobs, outs)]


@pytest.mark.slow
def test_a_tp_group_across_nodes_is_refused_and_tp_inside_nodes_trains(tmp_path):
    refused = _two_nodes("--tp", "4", "--steps", "2")
    text = "".join(r.stdout + r.stderr for r in refused)
    assert all(r.returncode != 0 for r in refused), text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("train.py: error:")]
    assert lines == [
        "train.py: error: TP group of ranks 0-3 spans 2 nodes (node 0, node 1), so its all-reduce in "
        "every layer would cross the slow link between them; use a --tp that divides the 2 processes "
        "per node (e.g. --tp 2) and the rest as --pp, or pass --allow-cross-node-tp to run it anyway"
    ], text[-3000:]
    assert "exitcode  : 2" in text  # each worker ended with the usage status, not a crash

    trained = _two_nodes("--tp", "2", "--pp", "2", "--steps", "2", "--metrics-out", str(tmp_path / "m.json"))
    assert all(r.returncode == 0 for r in trained), "".join(r.stdout + r.stderr for r in trained)[-3000:]
    from megakit.train.doctor.reference import reference_run

    single = reference_run(
        json.loads((ROOT / "ds_configs" / "zero1.json").read_text()), model="gpt-tiny", steps=2, seq_len=32
    )["loss"]  # what one process trains on the same batches
    got = _losses(tmp_path / "m.json")
    assert len(got) == 2 and all(abs(a - b) < LOSS_TOL for a, b in zip(got, single)), (got, single)

    allowed = _two_nodes("--tp", "4", "--steps", "1", "--allow-cross-node-tp")
    text = "".join(r.stdout + r.stderr for r in allowed)
    assert all(r.returncode == 0 for r in allowed), text[-3000:]
    assert "warning: TP group of ranks 0-3 spans 2 nodes" in text and "--allow-cross-node-tp" in text
