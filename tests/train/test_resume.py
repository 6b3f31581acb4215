"""Exact resume through the real launcher: optimizer state in the checkpoint, resharded across layouts and ZeRO
stages, a crash-safe series, and bad checkpoints refused in one line.

One 4-process job runs the uninterrupted run (TP2 x DP2, ZeRO-1, dropout 0.1, saving a series every 2 steps)
and then resumes its checkpoints at other layouts; every case keeps the global batch at 8 sequences. The same
job runs test_resume_compressed.py's cases (``resume_jobs`` in conftest.py): a launcher start costs more than
all of them.
"""

import glob
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from jobs import ds_config
from multiproc import THREADS, free_port
from paths import ROOT
from resume_cases import RESUME_STEPS as STEPS

from megakit.train.observe.metrics import read_metrics

TOL = 1e-5


@pytest.fixture(scope="module")
def resumed(resume_jobs):
    job = resume_jobs["test_resume"]
    return job["cases"], job["results"]


@pytest.mark.slow
def test_resume_at_the_same_layout_is_bitwise(resumed):
    _, results = resumed
    full, again = results[0]["loss"], results[1]["loss"]
    assert again == full[4:], (again, full)  # exact float equality: Adam's moments and step came back


@pytest.mark.slow
def test_resume_reshards_optimizer_state_across_layouts_and_zero_stages(resumed):
    """TP2xDP2 ZeRO-1 -> PP2xDP2 ZeRO-0, -> DP4 ZeRO-2, -> TP4 ZeRO-0: the uninterrupted losses within 1e-5."""
    _, results = resumed
    full = results[0]["loss"]
    for index, start in ((2, 2), (3, 4), (4, 6)):
        got = results[index]["loss"]
        assert len(got) == STEPS - start
        for step, (a, b) in enumerate(zip(got, full[start:]), start):
            assert abs(a - b) < TOL, (index, step, a, b)


@pytest.mark.slow
def test_packed_documents_resume_at_other_layouts(resumed):
    """Packed documents with masks (the document mask, restarted positions, no loss on the separator), saved at
    TP2 x DP2 and resumed at PP2 x DP2 and at DP4: the same batches, so the uninterrupted losses within 1e-5."""
    _, results = resumed
    full = results[5]["loss"]
    assert len(full) == STEPS and full != results[0]["loss"]
    for index in (6, 7):
        got = results[index]["loss"]
        assert len(got) == STEPS - 4
        for step, (a, b) in enumerate(zip(got, full[4:]), 4):
            assert abs(a - b) < TOL, (index, step, a, b)


@pytest.mark.slow
def test_a_ring_run_resumes_as_ulysses(resumed):
    """Saved at CP 2 as a ring, resumed at CP 2 as an all-to-all (--cp-mode a2a): the weights do not depend on how CP
    attends, so the run goes on within 1e-5 of the uninterrupted ring run."""
    _, results = resumed
    full, got = results[8]["loss"], results[9]["loss"]
    assert len(full) == STEPS and len(got) == STEPS - 4
    for step, (a, b) in enumerate(zip(got, full[4:]), 4):
        assert abs(a - b) < TOL, (step, a, b)


@pytest.mark.slow
def test_a_series_keeps_its_newest_and_falls_back_past_damage(resumed, tmp_path, capsys):
    cases, _ = resumed
    series = Path(cases[0]["save"])
    assert (series / "latest").read_text().strip() == "step-0000008"
    assert sorted(p.name for p in series.iterdir()) == ["latest"] + [f"step-000000{i}" for i in (2, 4, 6, 8)]
    manifest = json.loads((series / "step-0000008" / "manifest.json").read_text())
    assert any(name.startswith("state/exp_avg/") for name in manifest["params"])  # Adam moments are in it
    assert manifest["extra"]["optimizer_step"] == 8
    # damage the newest: the series resumes from the one before, saying why (at DP 2: the same 8 sequences a step,
    # and 2 processes start faster than the 4 that saved it)
    newest = next((series / "step-0000008").glob("*.safetensors"))
    newest.write_bytes(newest.read_bytes()[:-7])
    out = _train(tmp_path, "--load", str(series), "--steps", "7", nprocs=2)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert re.search(r"skipping damaged checkpoint .*step-0000008 \(.*fails its checksum", out.stdout), out.stdout
    assert "resuming from " + str(series / "step-0000006") in out.stdout
    # megakit convert takes a series as --load does: its newest intact checkpoint
    from megakit.commands.cli import main

    assert main(["convert", str(series), "--to-hf", str(tmp_path / "hf")]) == 0
    said = capsys.readouterr().out
    assert "converting " + str(series / "step-0000006") in said and "from step 6 of" in said, said


def _train(tmp_path, *args, nprocs=2, model="gpt-tiny", stage=1, steps=None):
    config = tmp_path / f"zero{stage}.json"
    config.write_text(json.dumps(ds_config(stage, micro=2, accumulation=2)))
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(nprocs),
        "--master_port",
        str(free_port()),
        "scripts/train.py",
        "--ds_config",
        str(config),
        "--model",
        model,
        "--seq-len",
        "32",
        "--no-progress",
        *args,
    ]
    return subprocess.run(
        cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS=THREADS), capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_bad_checkpoints_are_refused_in_one_line(resumed, tmp_path):
    cases, _ = resumed
    good = Path(cases[0]["save"]) / "step-0000004"
    tampered = tmp_path / "tampered"
    subprocess.run(["cp", "-r", str(good), str(tampered)], check=True)
    shard = next(tampered.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    before = {p.name: p.read_bytes() for p in tampered.iterdir()}
    out = _train(tmp_path, "--load", str(tampered), "--steps", "6", nprocs=2, model=cases[0]["model"])
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("train.py: error:")]
    assert out.returncode != 0 and len(lines) == 1 and "fails its checksum" in lines[0], out.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in tampered.iterdir()} == before  # nothing overwritten
    foreign = _train(tmp_path, "--load", str(good), "--steps", "6", nprocs=2, model="gpt-mini")  # another model
    lines = [line for line in (foreign.stdout + foreign.stderr).splitlines() if line.startswith("train.py: error:")]
    assert foreign.returncode != 0 and len(lines) == 1 and "different model" in lines[0], foreign.stderr[-2000:]
    other_seed = _train(tmp_path, "--load", str(good), "--steps", "6", "--seed", "3", nprocs=2, model=cases[0]["model"])
    assert other_seed.returncode == 2 and "resume with the same --seed" in other_seed.stderr, other_seed.stderr[-2000:]
    # another global batch (here 16 sequences against the checkpoint's 8): refused as the trainer resolves its run,
    # before any process group, in one line naming the fix
    from megakit.errors import UsageError
    from megakit.train.run import TrainConfig, resolve

    for world, micro, accumulation in ((4, 4, 2), (4, 2, 4), (2, 4, 4)):  # 4 ranks: TP 2 x DP 2; 2 ranks: DP 1
        wrong = TrainConfig(
            ds_config=ds_config(1, micro=micro, accumulation=accumulation),
            model=cases[0]["model"],
            seq_len=32,
            steps=6,
            tp=2,
            load=str(good),
        )
        with pytest.raises(UsageError) as refused:
            resolve(wrong, world, say=lambda *_: None)
        line = str(refused.value)
        assert "\n" not in line and "global_batch 8, this run has 16" in line and "same global batch" in line, line
    right = TrainConfig(
        ds_config=ds_config(1, micro=4, accumulation=1),
        model=cases[0]["model"],
        seq_len=32,
        steps=6,
        tp=2,
        load=str(good),
    )
    assert resolve(right, 4, say=lambda *_: None).start_step == 4  # the same 8 sequences in another split resume


def test_the_saved_step_count_is_fused_adams_too():
    """An Adam ds_config without ``torch_adam`` (the planner's) runs DeepSpeed's FusedAdam, which counts steps in the
    last parameter of each group only: the checkpoint's step count must be the steps taken, or a resume redoes
    Adam's bias correction from step 1 (fp32 ZeRO-0, where the optimizer sees every parameter)."""
    from types import SimpleNamespace

    import torch
    from deepspeed.ops.adam import FusedAdam

    from megakit.train.resilience.resume import optimizer_step_count

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    optimizer = FusedAdam([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=1e-3)
    for _ in range(3):
        for p in params:
            p.grad = torch.ones(3)
        optimizer.step()
    assert optimizer_step_count(SimpleNamespace(optimizer=optimizer)) == 3


@pytest.mark.slow
def test_a_job_killed_while_saving_resumes_on_the_uninterrupted_trajectory(tmp_path):
    """SIGKILL the whole job while a checkpoint is being written: the job is frozen (SIGSTOP) once a save's .tmp-
    directory exists, and killed only if it still does, so the kill lands mid-save. The unfinished save survives
    as .tmp- only, --keep 3 has kept exactly the three newest complete ones, the killed job left no DeepSpeed
    buffer in /dev/shm, and the series resumes from the newest complete one on the uninterrupted losses."""
    full = _train(tmp_path, "--steps", "40", "--metrics-out", str(tmp_path / "full.json"))
    assert full.returncode == 0, full.stderr[-3000:]
    series = tmp_path / "series"
    config = tmp_path / "zero1.json"
    log = open(tmp_path / "job.txt", "w")
    port = free_port()
    job = subprocess.Popen(
        [
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(port),
            "scripts/train.py",
            "--ds_config",
            str(config),
            "--model",
            "gpt-tiny",
            "--seq-len",
            "32",
            "--no-progress",
            "--steps",
            "400",
            "--save",
            str(series),
            "--save-every",
            "1",
            "--keep",
            "3",
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS=THREADS),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline, caught = time.time() + 240, []
        while time.time() < deadline and job.poll() is None and not caught:
            if any(int(p.name[5:12]) >= 5 for p in _unfinished(series)):  # --keep has pruned by then
                os.killpg(job.pid, signal.SIGSTOP)  # every process of the job stops where it stands
                caught = _unfinished(series)
                if not caught:  # the save finished in between: on to the next one
                    os.killpg(job.pid, signal.SIGCONT)
            time.sleep(0.002)
        assert job.poll() is None, (tmp_path / "job.txt").read_text()[-3000:]
        os.killpg(job.pid, signal.SIGKILL)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
        job.wait()
    assert caught, "no save was caught in progress"
    (unfinished,) = _unfinished(series)  # what the kill interrupted is still there, unpublished
    killed_at = int(unfinished.name[5:12])
    complete = sorted(p.name for p in series.glob("step-*") if "." not in p.name)
    assert complete == [f"step-{s:07d}" for s in range(killed_at - 3, killed_at)], (complete, killed_at)  # --keep 3
    assert (series / "latest").read_text().strip() == complete[-1]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")  # SIGKILL leaves no buffer behind
    resumed = _train(tmp_path, "--load", str(series), "--steps", "40", "--metrics-out", str(tmp_path / "res.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    start = int(re.search(r"resuming from .*step-(\d+)", resumed.stdout).group(1))
    assert start == killed_at - 1, (start, killed_at)
    want = [s["loss"] for s in read_metrics(tmp_path / "full.json")["steps"]][start:]
    got = [s["loss"] for s in read_metrics(tmp_path / "res.json")["steps"]]
    assert got == want and 0 < start < 40, (start, got, want)


def _unfinished(series: Path) -> list[Path]:
    return sorted(series.glob("step-*.tmp-*")) if series.exists() else []
