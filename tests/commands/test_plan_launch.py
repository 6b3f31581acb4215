"""What ``megakit plan`` hands to a cluster: a --save-every from Young/Daly, and a launch file.

The Slurm script runs here as Slurm would run it on two nodes: ``srun`` is a stand-in that starts
its command once per node of the allocation (``SLURM_NNODES`` copies, each with its
``SLURM_NODEID``), so the two ``torchrun`` agents meet at the script's c10d rendezvous on the
loopback address, as two machines would.
"""

import json
import math
import os
import subprocess

import pytest
from corpora import five_large_files
from jobs import LOSS_TOL, dropout_model
from multiproc import THREADS, free_port
from paths import ROOT

from megakit.commands import cli
from megakit.train.observe.metrics import read_metrics


def _plan(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_175b_on_1024_gpus_saves_every_young_daly_interval(capsys):
    """--save-every = sqrt(2 x write time x cluster MTBF) / step time, from the plan's own numbers."""
    code, text, _ = _plan(capsys, "--params", "175B", "--gpus", "1024")
    assert code == 0
    code, out, _ = _plan(capsys, "--params", "175B", "--gpus", "1024", "--json")
    report = json.loads(out)
    p, launch = report["plan"], report["assumptions"]["launch"]
    params, gpn = report["assumptions"]["model"]["params"], report["assumptions"]["cluster"]["gpus_per_node"]
    # the formula, from its definition: 14 B/param (bf16 weights + fp32 master + Adam m, v); only DP replica 0's
    # TP x PP ranks write, 1 GB/s per node; Llama 3: 419 unexpected interruptions in 54 days on 16,384 GPUs
    assert p["precision"] == "bf16" and p["cp"] == 1
    writers = {(t + p["tp"] * p["dp"] * s) // gpn for s in range(p["pp"]) for t in range(p["tp"])}
    write_s = params * 14 / (len(writers) * 1e9)
    mtbf_s = 16_384 * 54 * 24 / 419 / 1024 * 3600
    want = round(math.sqrt(2 * write_s * mtbf_s) / p["step_time_s"])
    assert p["save_every"] == want and 10 < want < 10_000, (p["save_every"], want)
    assert f"--save checkpoints --save-every {want} --keep 3 --load auto" in launch
    flat = " ".join(text.split())  # rich wraps the report at the terminal's width
    assert f"Save every {want} steps (--save-every {want})" in flat and f"--save-every {want}" in flat
    a = p["save_interval"]
    for shown in (
        f"write {a['write_s']:,.3g} s",
        f"MTBF {a['mtbf_s'] / 3600:,.1f} h",
        "14 B/param",
        f"over {len(writers)} writing node(s)",
        "1 GB/s per node",
        "50,677 GPU-hours per failure",
        "419 unexpected interruptions in 54 days on 16,384 H100s",
        "/ 1024 GPUs",
        f"at {p['step_time_s']:.2f} s per step",
    ):
        assert shown in flat, shown
    code, out, _ = _plan(
        capsys, "--params", "175B", "--gpus", "1024", "--json", "--mtbf-gpu-hours", "5000", "--ckpt-write-gbps", "4"
    )  # the user's failure rate and bandwidth
    assert json.loads(out)["plan"]["save_every"] == round(
        math.sqrt(2 * write_s / 4 * 5000 / 1024 * 3600) / p["step_time_s"]
    )


def test_emit_launch_writes_a_slurm_script_bash_parses_and_a_hostfile(tmp_path, capsys):
    common = ["--params", "13B", "--gpus", "64", "--tp", "8"]
    code, out, _ = _plan(capsys, *common, "--emit-launch", "slurm", str(tmp_path / "job.sh"))
    assert code == 0 and f"sbatch {tmp_path / 'job.sh'}" in out
    script = (tmp_path / "job.sh").read_text()
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], capture_output=True).returncode == 0
    assert os.access(tmp_path / "job.sh", os.X_OK) and "#SBATCH --nodes=8" in script
    assert "#SBATCH --gpus-per-node=8" in script and "--nproc-per-node=8 --max-restarts=3" in script
    assert "--rdzv-backend=c10d" in script and 'srun --nodes="$SLURM_NNODES" --ntasks-per-node=1' in script
    assert f"--ds_config {tmp_path / 'job.json'} --tp 8 " in script and '--load auto "$@"' in script
    assert json.loads((tmp_path / "job.json").read_text())["train_batch_size"] > 0  # the ds_config beside it

    code, out, _ = _plan(
        capsys,
        *common,
        "--emit-launch",
        "hostfile",
        str(tmp_path / "hosts"),
        "--emit-config",
        str(tmp_path / "plan.json"),
        "--save-every",
        "50",
    )
    hosts = (tmp_path / "hosts").read_text().splitlines()
    assert code == 0 and [h for h in hosts if not h.startswith("#")] == [f"node{i} slots=8" for i in range(1, 9)]
    command = f"deepspeed --hostfile {tmp_path / 'hosts'} --num_nodes 8 --num_gpus 8 scripts/train.py"
    assert any(h.startswith(f"#   {command}") and "--save-every 50 " in h for h in hosts), hosts
    assert command in " ".join(out.split())

    before = sorted(os.listdir(tmp_path))
    for argv, needle in (
        (["--emit-launch", "pbs", str(tmp_path / "x.sh")], "--emit-launch pbs: the kinds are"),
        (
            ["--emit-launch", "slurm", str(tmp_path / "no" / "x.sh"), "--emit-config", str(tmp_path / "y.json")],
            "--emit-launch folder",
        ),
        (
            ["--emit-launch", "hostfile", str(tmp_path / "y.json"), "--emit-config", str(tmp_path / "y.json")],
            "is also the ds_config's",
        ),
    ):
        code, out, err = _plan(capsys, *common, *argv)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
        assert sorted(os.listdir(tmp_path)) == before  # nothing written


SRUN = """#!/bin/bash
# srun's stand-in: its command once per node of the allocation (SLURM_NNODES), all on this machine
while [[ "$1" == --* ]]; do shift; done
echo "srun: starting $SLURM_NNODES node(s)" >&2
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@pytest.mark.slow
def test_the_slurm_script_trains_on_two_loopback_nodes_and_survives_a_killed_worker(tmp_path, capsys):
    """The plan's TP 2 x PP 2 on 2 nodes x 2 processes, dropout 0.1, through the emitted script with the variables a
    two-node allocation sets. Rank 1 is killed (SIGKILL) at the start of step 7: the torchrun agents restart every
    worker on both nodes (the script's --max-restarts), ``--load auto`` resumes from the step-6 checkpoint and the
    run ends at step 12. It validates on prepared data, keeps 2 checkpoints (arguments to the script override the
    plan's --save-every), and its losses are the single process's. (That a resume is bitwise the uninterrupted run
    at the same layout is test_restart's.) Before it, the script given a flag no worker can run stops at its
    ``train.py --check`` in one line, exit 2, without starting torchrun (which would retry it 3 times)."""
    from megakit.interop.prepare_data import PrepareConfig, prepare
    from megakit.train.doctor.fault_injection import VARIABLE
    from megakit.train.doctor.reference import reference_run

    data, model = str(tmp_path / "tokens"), dropout_model(tmp_path)
    config = json.loads(open(model).read()) | {"vocab_size": 300}  # the tokenizer's below
    open(model, "w").write(json.dumps(config))
    prepare(
        PrepareConfig(
            inputs=[str(five_large_files(tmp_path / "plays", words_per_file=10_000))],
            out=data,
            vocab_size=300,
            workers=1,
            progress=False,
        ),
        say=lambda *_: None,
    )
    job, config = tmp_path / "job.sh", tmp_path / "job.json"
    code, _, err = _plan(
        capsys,
        "--model",
        model,
        "--gpus",
        "4",
        "--gpus-per-node",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--vpp",
        "1",
        "--precision",
        "fp32",
        "--global-batch",
        "4",
        "--micro-batch",
        "1",
        "--seq-len",
        "32",
        "--tokens",
        "5120",
        "--base-lr",
        "1e-3",
        "--base-batch",
        "4",
        "--emit-launch",
        "slurm",
        str(job),
        "--save",
        str(tmp_path / "ckpt"),
    )
    assert code == 0, err
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "srun").write_text(SRUN)
    (tmp_path / "bin" / "srun").chmod(0o755)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=THREADS,
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        SLURM_NNODES="2",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="node[1-2]",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        **{VARIABLE: "kill@1:7"},
    )
    mistake = subprocess.run(
        ["bash", str(job), "--cp", "3"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )  # a flag no worker could run: the script's --check ends the job first
    errors = [line for line in mistake.stderr.splitlines() if line.startswith("train.py")]
    assert mistake.returncode == 2 and len(errors) == 1 and "--cp" in errors[0], mistake.stderr[-2000:]
    assert "srun: starting" not in mistake.stderr and not (tmp_path / "ckpt").exists()
    out = subprocess.run(
        [
            "bash",
            str(job),
            "--steps",
            "12",
            "--data",
            data,
            "--eval-every",
            "4",
            "--eval-batches",
            "1",
            "--save-every",
            "3",
            "--keep",
            "2",
            "--metrics-out",
            str(tmp_path / "m.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = out.stdout + out.stderr
    assert out.returncode == 0, "\n".join(line for line in log.splitlines() if "error" in line)[-4000:]
    assert "train.py: check passed: " in log and "on 4 process(es), TP 2 x PP 2 x DP 1" in log
    assert "--load auto: no checkpoint in" in log and "TP 2 x PP 2 x DP 1" in log and "\r" not in log, log[-3000:]
    assert "the last attempt finished step 6, resuming at step 6 redoes 1 step(s)" in log, log[-4000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["latest", "step-0000009", "step-0000012"]
    got = read_metrics(tmp_path / "m.json")  # both attempts appended: steps 0-6 (eval at 4), then 6-11
    assert [run["start_step"] for run in got["runs"]] == [0, 6], got["runs"]
    want = reference_run(
        json.loads(config.read_text()), model=model, steps=12, seq_len=32, data=data, eval_every=4, eval_batches=1
    )
    losses = {s["step"]: s["loss"] for s in got["steps"]}
    assert sorted(losses) == list(range(12)), losses
    assert all(abs(losses[s] - want["loss"][s]) < LOSS_TOL for s in losses), (losses, want["loss"])
    assert [e["step"] for e in got["eval"]] == [4, 8, 12]
    assert all(abs(a["loss"] - b["loss"]) < LOSS_TOL for a, b in zip(got["eval"], want["evals"], strict=True)), (
        got,
        want,
    )
