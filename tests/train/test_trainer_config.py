"""ds_config checks and the script's bad-input handling (no process group needed)."""

import json
import os
import re
import subprocess
import sys

import pytest
from multiproc import THREADS
from paths import ROOT

from megakit.errors import UsageError
from megakit.train.engine.ds_config import load_ds_config, require_optimizer
from megakit.train.trainer import TrainConfig

PRESETS = sorted((ROOT / "ds_configs").glob("*.json"))


def test_presets_are_valid_json_and_documented():
    readme = (ROOT / "ds_configs" / "README.md").read_text()
    assert {p.stem for p in PRESETS} >= {"zero0", "zero1", "zero2", "zero3", "zero3_offload", "bf16", "fp16"}
    for path in PRESETS:
        json.loads(path.read_text())
        assert f"`{path.name}`" in readme, path.name


def test_batch_sizes_follow_the_layout():
    config = load_ds_config(str(ROOT / "ds_configs" / "zero1.json"), dp=4, pp=1)
    assert config["train_batch_size"] == 4 * 2 * 4  # micro x accumulation x DP
    derived = load_ds_config({"train_batch_size": 32, "gradient_accumulation_steps": 2}, dp=4, pp=1)
    assert derived["train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(UsageError, match="train_batch_size 30 != micro-batch"):
        load_ds_config({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, dp=4, pp=1)


def test_zero_2_and_offloaded_zero_3_are_refused_with_pipeline_parallelism():
    with pytest.raises(UsageError, match=r"ZeRO 2 with --pp 2: .* use ZeRO 1 or 3 .* with --pp > 1, or --pp 1"):
        load_ds_config(str(ROOT / "ds_configs" / "zero2.json"), dp=1, pp=2)
    assert load_ds_config(str(ROOT / "ds_configs" / "zero3.json"), dp=1, pp=2)["managed_gradient_accumulation"] is False
    with pytest.raises(UsageError, match=r"ZeRO 3 with zero_optimization.offload_optimizer and --pp 2: .* drop"):
        load_ds_config(str(ROOT / "ds_configs" / "zero3_offload.json"), dp=1, pp=2)
    piped = load_ds_config(str(ROOT / "ds_configs" / "zero1.json"), dp=1, pp=2)
    assert piped["managed_gradient_accumulation"] is False  # every engine.step() is the boundary
    overlapped = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1, "overlap_comm": True}}
    assert load_ds_config(overlapped, dp=1, pp=1)["zero_optimization"]["overlap_comm"]
    with pytest.raises(UsageError, match=r"overlap_comm with ZeRO-1 .*\(--pp 2\).* set overlap_comm to false"):
        load_ds_config(overlapped, dp=1, pp=2)  # DeepSpeed would assert mid-initialize


def test_unusable_presets_say_why():
    one_bit = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}}
    with pytest.raises(UsageError, match="no longer ships OneBitAdam.*--compress sign"):
        load_ds_config(one_bit, dp=1, pp=1)
    with pytest.raises(UsageError, match="fp16 training needs a GPU"):
        load_ds_config(str(ROOT / "ds_configs" / "fp16.json"), dp=1, pp=1)


def test_bad_files_and_flags(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_ds_config(str(tmp_path / "nope.json"), dp=1, pp=1)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UsageError, match="not valid JSON"):
        load_ds_config(str(tmp_path / "bad.json"), dp=1, pp=1)
    with pytest.raises(UsageError, match="--steps"):
        TrainConfig(ds_config={}, steps=0)


def test_script_reports_a_bad_data_path_in_one_line(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS=THREADS)
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--data", str(tmp_path / "missing"), "--steps", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("train.py: error: --data ")
    assert "Traceback" not in out.stderr


def test_non_finite_float_flags_are_one_line_and_exit_2():
    """--moe-aux-loss nan used to be accepted: every step was then skipped, and the run exited 0 having trained
    nothing."""
    env = dict(os.environ, OMP_NUM_THREADS=THREADS)
    for flag, value in (("--moe-aux-loss", "nan"), ("--moe-z-loss", "nan"), ("--spike-guard", "inf")):
        out = subprocess.run(
            [sys.executable, "scripts/train.py", "--model", "moe-tiny", flag, value, "--steps", "1"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert out.stderr.strip().splitlines() == [
            f"train.py: error: argument {flag}: {value} is not a finite number; give a finite value"
        ], out.stderr


def test_script_without_the_launcher_is_a_world_of_one(tmp_path):
    """`python scripts/train.py` (no RANK in the environment) runs as one process; a layout that needs more
    processes is one line, not torch's rendezvous traceback."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--tp", "2", "--steps", "1"],
        cwd=ROOT,
        env=dict(env, OMP_NUM_THREADS=THREADS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "train.py: error: world size 1 is not divisible by TP x PP = 2 x 1 = 2; "
        "launch a multiple of 2 processes or change --tp/--pp"
    )
    assert "Traceback" not in out.stderr


def test_recompute_and_save_flags_are_checked():
    with pytest.raises(UsageError, match="--recompute partial is not one of none, selective, full"):
        TrainConfig(ds_config={}, recompute="partial")
    assert TrainConfig(ds_config={}, recompute="selective").recompute == "selective"
    with pytest.raises(UsageError, match="--save-every 5 needs --save DIR"):
        TrainConfig(ds_config={}, save_every=5)


def test_launched_job_reports_a_user_mistake_once_and_every_rank_exits_2(tmp_path):
    """Sequence parallelism with a sequence TP does not divide: one line from rank 0, status 2, no traceback.
    Then a --load directory that holds no checkpoint, in one process."""
    from multiproc import free_port

    env = dict(os.environ, OMP_NUM_THREADS=THREADS)
    out = subprocess.run(
        [
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "scripts/train.py",
            "--model",
            "gpt-tiny",
            "--tp",
            "2",
            "--sequence-parallel",
            "--seq-len",
            "33",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert text.count("train.py: error:") == 1, text[-3000:]
    assert "sequence length 33 is not divisible by TP 2" in text and "Traceback" not in text
    (tmp_path / "ckpt").mkdir()
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--model", "gpt-tiny", "--load", str(tmp_path / "ckpt")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"train.py: error: {tmp_path / 'ckpt'} holds no manifest.json, so it "
        "is not a complete megakit checkpoint; give the directory a finished "
        "save wrote"
    ]


def test_mistakes_a_new_user_makes_get_one_line_before_any_process_starts():
    base = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cases = [
        (
            {"optimiser": base["optimizer"], "train_micro_batch_size_per_gpu": 2},
            "unknown key 'optimiser'; did you mean 'optimizer'?",
        ),
        (
            {**base, "train_micro_batch_size_per_gpu": "four"},
            "train_micro_batch_size_per_gpu must be a positive integer, got 'four'",
        ),
        (
            {**base, "zero_optimization": {"stage": 1, "overlap_com": True}},
            "unknown key 'zero_optimization.overlap_com'; did you mean 'overlap_comm'?",
        ),
        ({**base, "zero_optimization": {"stage": "two"}}, "zero_optimization.stage: input should be"),
        ({**base, "bf16": {"enabled": "yes"}}, "bf16.enabled must be true or false"),
        ({**base, "gradient_clipping": -1}, "gradient_clipping must be a number >= 0"),
        ({**base, "scheduler": "cosine"}, "scheduler must be a JSON object"),
    ]
    for config, message in cases:
        with pytest.raises(UsageError, match=re.escape(message)):
            load_ds_config(config, dp=1, pp=1)
    with pytest.raises(UsageError, match='no "optimizer" section'):
        require_optimizer(load_ds_config({"train_micro_batch_size_per_gpu": 2}, dp=1, pp=1))
    for path in PRESETS:  # every preset passes validation (those refused are refused for other reasons)
        if path.stem != "fp16":
            load_ds_config(str(path), dp=2, pp=1)


def test_zero_bubble_with_interleaving_is_one_line_before_any_process_group():
    with pytest.raises(UsageError, match="--schedule zb-h1 runs one model chunk per stage, got --vpp 2"):
        TrainConfig(ds_config={}, pp=2, vpp=2, schedule="zb-h1")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--pp", "2", "--vpp", "2", "--schedule", "zb-h1"],
        cwd=ROOT,
        env=dict(env, OMP_NUM_THREADS=THREADS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines() == [
        "train.py: error: --schedule zb-h1 runs one model chunk per stage, "
        "got --vpp 2; drop --vpp, or use --schedule interleaved"
    ]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--compress", "topk:0"], "--compress topk:0: the Top-K ratio must be above 0 and below 1"),
        (["--compress", "topk:2"], "--compress topk:2: the Top-K ratio must be above 0 and below 1"),
        (["--compress", "int9"], "--compress int9: not one of none, fp16, int8, sign, topk:RATIO"),
        (["--compress", "int8", "--ds_config", "ds_configs/zero3.json"], "--compress int8 needs ZeRO stage 0 or 1"),
        (["--compress", "topk:0.01", "--ds_config", "ds_configs/zero1.json"], "use ZeRO 0 (ds_configs/zero0.json)"),
        (["--local-sgd", "2", "--ds_config", "ds_configs/zero1.json"], "ZeRO 1 keeps each rank's optimizer step"),
        (["--local-sgd", "0"], "--local-sgd 0: the averaging period must be at least 1 step"),
        (["--local-sgd", "4", "--compress", "sign"], "choose one"),
    ],
)
def test_dp_sync_flags_are_refused_in_one_line_before_any_process_group(flags, message, capsys, monkeypatch):
    import importlib.util

    import torch.distributed as dist

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--model", "gpt-tiny", "--steps", "1", "--no-progress", *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: ") and message in err[0], err
    assert not dist.is_initialized()


def test_context_parallel_flags_are_checked_before_any_process_group():
    """--cp 3 on 4 processes, --cp 2 with a sequence that 2 x CP does not divide: one line each, from ``resolve``
    (no process group exists in this test process); and DeepSpeed is told the batch of DP x CP ranks."""
    from megakit.train.run import resolve

    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(UsageError, match=re.escape("world size 4 is not divisible by TP x PP x CP = 1 x 1 x 3 = 3")):
        resolve(TrainConfig(ds_config=ds, model="gpt-tiny", cp=3), 4)
    with pytest.raises(UsageError, match="sequence length 30 is not divisible by 2 x CP = 4"):
        resolve(TrainConfig(ds_config=ds, model="gpt-tiny", cp=2, seq_len=30), 4)
    run = resolve(TrainConfig(ds_config=ds, model="gpt-tiny", cp=2, seq_len=32), 4)
    assert (run.layout.cp, run.layout.dp, run.batch.global_batch, run.ds_config["train_batch_size"]) == (2, 2, 4, 8)
    with pytest.raises(
        UsageError,
        match=re.escape(
            "--cp-mode a2a splits each TP rank's 2 attention heads over CP 4, "
            "which does not divide them; use a --cp that divides 2, or "
            "--cp-mode ring"
        ),
    ):
        resolve(TrainConfig(ds_config=ds, model="gpt-tiny", tp=2, cp=4, cp_mode="a2a", seq_len=32), 8)
    with pytest.raises(UsageError, match="--cp-mode ulysses is not one of ring, a2a, hybrid"):
        TrainConfig(ds_config=ds, cp_mode="ulysses")
    # hybrid: an all-to-all degree above 1, below CP, dividing CP and the heads per TP rank (gpt-tiny: 4 heads)
    hybrid = dict(ds_config=ds, model="gpt-tiny", cp_mode="hybrid", seq_len=48)
    assert resolve(TrainConfig(**hybrid, cp=4), 4).layout.cp_a2a == 2  # the default: the largest such degree
    assert resolve(TrainConfig(**hybrid, cp=8), 8).layout.cp_a2a == 4
    assert resolve(TrainConfig(**hybrid, cp=6), 6).layout.cp_a2a == 2  # 3 does not divide 4 heads
    for bad in (dict(cp=2), dict(cp=4, cp_a2a=4), dict(cp=8, cp_a2a=3), dict(cp=4, tp=4)):
        with pytest.raises(UsageError, match="--cp-mode hybrid runs an all-to-all inside groups of --cp-a2a CP ranks"):
            resolve(TrainConfig(**{**hybrid, **bad}), bad["cp"] * bad.get("tp", 1))
    with pytest.raises(UsageError, match="--cp-a2a 2 sets the all-to-all degree of --cp-mode hybrid"):
        resolve(TrainConfig(ds_config=ds, model="gpt-tiny", cp=4, cp_a2a=2, seq_len=32), 4)
    assert resolve(TrainConfig(ds_config=ds, model="gpt-tiny", cp=4, cp_mode="a2a", seq_len=32), 4).layout.cp == 4
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--model", "gpt-tiny", "--cp", "2", "--seq-len", "30"],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS=THREADS),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "world size 1 is not divisible by TP x PP x CP" in out.stderr  # one process cannot hold CP 2


@pytest.mark.parametrize(
    "flags, world, message",
    [
        (["--model", "llama-tiny", "--tp", "8"], 8, "TP 8 does not divide KV heads 4; choose a TP that divides"),
        (
            ["--model", "gpt-tiny", "--pp", "8"],
            8,
            "4 layers cannot fill --pp 8 x --vpp 1 = 8 virtual stages, even with an "
            "embedding-only first and a loss-only last one; lower --pp/--vpp to at most 6 virtual stages in all",
        ),
        (
            ["--model", "gpt-tiny", "--pp", "2", "--vpp", "2", "--ds_config", "ACCUMULATION_3"],
            2,
            "but the ds_config's gradient_accumulation_steps is 3; set it to a multiple of 2 (e.g. 4)",
        ),
        (
            ["--model", "gpt-tiny", "--pp", "2", "--stage-layers", "1,1,2"],
            2,
            "--stage-layers 1,1,2 gives 3 layer counts for --pp 2 x --vpp 1 = 2 virtual stages; "
            "give one per virtual stage",
        ),
        (
            ["--model", "gpt-tiny", "--pp", "2", "--vpp", "2", "--stage-layers", "1,1,1,2"],
            2,
            "--stage-layers 1,1,1,2 sums to 5 layers but the model has 4; make the counts add up to 4",
        ),
        (
            ["--model", "gpt-tiny", "--pp", "2", "--vpp", "2", "--stage-layers", "2,0,1,1"],
            2,
            "--stage-layers 2,0,1,1 has an entry below 1 in the middle",
        ),
        (
            ["--model", "gpt-tiny", "--pp", "2", "--stage-layers", "2;2"],
            2,
            "--stage-layers '2;2' is not a list of layer",
        ),
        (
            ["--model", "gpt-tiny", "--pp", "2", "--vpp", "3", "--stage-layers", "0,1*5"],
            2,
            "--stage-layers 0,1,1,1,1,1 sums to 5 layers but the model has 4",
        ),
    ],
)
def test_layout_refusals_come_once_before_any_process_group(flags, world, message, capsys, monkeypatch, tmp_path):
    """What the model or the schedule refuses at this layout is said by rank 0 alone, in one line with status 2,
    before any process group exists (it used to come from every rank's model or schedule, after them). The
    interleaved schedule names the ds_config's setting: train.py has no --micro-batches."""
    import importlib.util

    import torch.distributed as dist

    config = json.loads((ROOT / "ds_configs" / "zero1.json").read_text()) | {"gradient_accumulation_steps": 3}
    (tmp_path / "ds.json").write_text(json.dumps(config))
    flags = [str(tmp_path / "ds.json") if f == "ACCUMULATION_3" else f for f in flags]
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for rank in (0, 1):  # as a launched job's ranks: the launcher's environment, one process standing in for each
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        assert script.main([*flags, "--steps", "1", "--no-progress"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        if rank == 0:
            assert len(err) == 1 and err[0].startswith("train.py: error: ") and message in err[0], err
            assert "--micro-batches" not in err[0]
        else:
            assert err == [], err
        assert not dist.is_initialized()
