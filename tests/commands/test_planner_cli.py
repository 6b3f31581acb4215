"""`megakit plan` end to end: the report, --json, --emit-config through DeepSpeed's own parser,
and bad input (one line, exit 2, nothing written)."""

import json
import re
import subprocess
import sys
import threading

import pytest
from multiproc import run_ranks

from megakit.commands import cli
from megakit.core.planner.memory import BACKWARD_ONLY, STEP_ONLY

PLAN_KEYS = {
    "tp",
    "pp",
    "dp",
    "vpp",
    "zero_stage",
    "micro_batch",
    "grad_accum",
    "global_batch",
    "recompute",
    "sequence_parallel",
    "peak_memory_gib",
    "gpu_memory_gib",
    "memory",
    "step_time_s",
    "tokens_per_s",
    "model_tflops_per_gpu",
    "hardware_tflops_per_gpu",
    "mfu",
    "comm_fraction",
    "bubble_fraction",
}


def plan(capsys, *argv):
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as stop:  # argparse's own refusals (a flag's type) exit, with status 2
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def test_console_script_plans_175b_from_a_fresh_shell():
    done = subprocess.run(
        [sys.executable, "-m", "megakit.commands.cli", "plan", "--params", "175B"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for needle in (
        "gpt3-175b shape",
        "smallest whole number of nodes",
        "TP x PP x DP",
        "80% line",
        "hardware TFLOP/s per GPU",
        "Top alternatives",
        "Rejected",
        "Tips",
        "deepspeed --num_nodes",
    ):
        assert needle in out, needle
    assert "torch" not in done.stderr


def test_json_report_has_the_issue_schema(capsys):
    code, out, _ = plan(capsys, "--params", "175B", "--gpus", "1024", "--tokens", "300B", "--json")
    assert code == 0
    report = json.loads(out)
    assert set(report) == {"plan", "alternatives", "rejected", "assumptions"}
    p = report["plan"]
    assert PLAN_KEYS <= set(p) and "train_days" in p
    assert p["tp"] * p["pp"] * p["dp"] == 1024 and p["micro_batch"] * p["grad_accum"] * p["dp"] == p["global_batch"]
    assert p["peak_memory_gib"] <= 0.8 * p["gpu_memory_gib"]
    m = p["memory"]  # the step's fp32 gradient copies come once the activations are freed: the larger phase counts
    step, backward = (sum(m.get(k, 0.0) for k in keys) for keys in (STEP_ONLY, BACKWARD_ONLY))
    assert sum(m.values()) - min(step, backward) == pytest.approx(p["peak_memory_gib"])
    assert 15 < p["train_days"] < 60
    assert report["alternatives"] and all(PLAN_KEYS <= set(a) for a in report["alternatives"])
    assert report["rejected"] and all({"plan", "reason"} <= set(r) for r in report["rejected"])
    assert report["assumptions"]["rule"]["branch"] == "model-parallel"


def test_every_json_entry_names_the_runtime_that_priced_it(capsys):
    """Layouts refused before any plan is built (ZeRO-2 under a pipeline, the memory floor) carry the run's runtime
    too, not megakit's default."""
    code, out, _ = plan(capsys, "--params", "70B", "--gpus", "16", "--runtime", "megatron-core", "--json")
    assert code == 0
    report = json.loads(out)
    kinds = {r["kind"] for r in report["rejected"]}
    assert kinds - {"memory"}, kinds  # a structural rejection is among them
    entries = [report["plan"], *report["alternatives"], *(r["plan"] for r in report["rejected"])]
    assert {e["runtime"] for e in entries} == {"megatron-core"}


def test_small_model_gets_pure_dp_and_a_tip_about_communication(capsys):
    code, out, _ = plan(capsys, "--params", "125M", "--gpus", "64", "--gpu", "a100-80gb", "--inter-bw", "1", "--json")
    report = json.loads(out)
    assert code == 0 and (report["plan"]["tp"], report["plan"]["pp"]) == (1, 1)
    assert report["plan"]["comm_fraction"] > 0.3
    code, out, _ = plan(capsys, "--params", "125M", "--gpus", "64", "--inter-bw", "1")
    assert "--compress" in out and "accumulation" in out


def _parse_with_deepspeed(rank, world, path, dp):
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group run_ranks started

    class PlannedDataParallel:  # the mpu protocol: the DP size the planned job will have
        def get_data_parallel_world_size(self):
            return dp

    config = DeepSpeedConfig(path, mpu=PlannedDataParallel())
    return (
        config.train_batch_size,
        config.train_micro_batch_size_per_gpu,
        config.gradient_accumulation_steps,
        config.zero_optimization_stage,
        config.gradient_clipping,
        config.scheduler_name,
        config.optimizer_name,
        config.bfloat16_config.enabled,
    )


def test_emitted_ds_config_is_accepted_by_deepspeed(tmp_path, capsys):
    target = tmp_path / "plan.json"
    code, out, _ = plan(capsys, "--params", "13B", "--gpus", "64", "--emit-config", str(target))
    assert code == 0 and f"--ds_config {target}" in out
    written = json.loads(target.read_text())
    code, out, _ = plan(capsys, "--params", "13B", "--gpus", "64", "--json")
    p = json.loads(out)["plan"]
    assert written["train_batch_size"] == p["micro_batch"] * p["grad_accum"] * p["dp"]
    parsed = run_ranks(_parse_with_deepspeed, 1, str(target), p["dp"])[0]
    assert parsed == (
        p["global_batch"],
        p["micro_batch"],
        p["grad_accum"],
        p["zero_stage"],
        1.0,
        "WarmupCosineLR",
        "adamw",
        True,
    )
    assert written["optimizer"]["params"]["lr"] == pytest.approx(p["lr"])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["plan.json", "plan.model.json"]  # no temporary file left


def test_a_small_model_gets_a_batch_its_token_budget_can_take(capsys):
    """GPT-3's 0.5M-token batch would train llama-tiny's Chinchilla budget (1.3M tokens) in 3 steps of 7,936
    sequences: the default batch is bounded to leave at least 500 steps, and the plan says so."""
    code, out, _ = plan(capsys, "--model", "models/llama-tiny.json", "--gpus", "4", "--json")
    report = json.loads(out)
    p, note = report["plan"], report["assumptions"]["global_batch_note"]
    assert code == 0 and p["total_steps"] >= 100 and p["global_batch"] <= 512, (p["total_steps"], p["global_batch"])
    assert p["global_batch"] % 4 == 0 and "lasts at least 500 steps" in note and "7,936 sequences" in note, note
    code, out, _ = plan(capsys, "--model", "models/llama-tiny.json", "--gpus", "4")
    assert "Global batch (no --global-batch given)" in out


BAD = [
    (["--params", "abc"], "not a size"),
    (["--params=-5B"], "positive"),
    (["--params", "0"], "positive"),
    (["--params", "175B", "--gpu", "a100"], "known GPUs: v100-32gb"),
    (["--model", "no/such/config.json"], "does not exist"),
    (["--model", "nosuchpreset"], "known presets"),
    (["--params", "175B", "--gpus", "64", "--tp", "3"], "--tp 3"),
    (["--params", "175B", "--tp", "3"], "GPUs per node"),
    (["--model", "llama-2-70b", "--nodes", "8", "--tp", "16"], "KV heads 8"),
    (["--params", "1.3B", "--gpus", "8", "--pp", "1", "--vpp", "2"], "--vpp 2"),
    (["--params", "1.3B", "--gpus", "1", "--zero", "1"], "DP=1 with 1 GPU(s); use --zero 0"),
    (
        ["--model", "gpt-tiny", "--gpus", "2", "--pp", "2", "--zero", "1", "--global-batch", "8"],
        "TP=1 x PP=2 leaves DP=1",
    ),
    (["--params", "-5B"], "--params '-5B' must be a positive size"),
    (["--params", "175B", "--gpus", "64", "--tp", "8", "--pp", "3"], "--pp 3"),
    (
        ["--params", "175B", "--gpus", "64", "--pp", "4", "--zero", "3", "--vpp", "2"],
        "--zero 3 with --pp 4 runs 1F1B with one model chunk per stage, not --vpp 2",
    ),
    (["--params", "175B", "--gpus", "64", "--pp", "4", "--zero", "2"], "--zero 2 cannot run with --pp 4"),
    (["--params", "175B", "--gpus", "8"], "needs at least"),
    (["--params", "175B", "--mem-threshold", "1.5"], "--mem-threshold"),
    (["--params", "1T", "--tokens", "-3"], "--tokens"),
    (["--params", "1.3B", "--gpus", "8", "--stage-layers", "12,12"], "needs the layout: pin --pp"),
    (
        ["--params", "1.3B", "--gpus", "8", "--pp", "2", "--vpp", "2", "--stage-layers", "12,12"],
        "--stage-layers 12,12 gives 2 layer counts for --pp 2 x --vpp 2 = 4 virtual stages",
    ),
    (
        ["--params", "1.3B", "--gpus", "8", "--pp", "2", "--stage-layers", "12,11"],
        "sums to 23 layers but the model has 24",
    ),
    (
        ["--params", "1.3B", "--gpus", "8", "--pp", "4", "--stage-layers", "12,0,6,6"],
        "has an entry below 1 in the middle",
    ),
    (["--params", "1.3B", "--gpus", "8", "--pp", "2", "--stage-layers", "12;12"], "is not a list of layer counts"),
    (
        ["--params", "7B", "--moe-routing", "balanced"],
        "--moe-routing balanced prices Mixture-of-Experts routing, and gpt3-6.7b is dense",
    ),  # refused as --ep 2 is, not ignored
    (["--params", "7B", "--moe-imbalance", "1.5"], "--moe-imbalance 1.5 prices Mixture-of-Experts routing"),
    (["--params", "7B", "--mem-threshold", "nan"], "--mem-threshold: nan is not a finite number"),
    (["--params", "7B", "--inter-bw", "inf"], "--inter-bw: inf is not a finite number"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_and_writes_nothing(argv, needle, tmp_path, capsys):
    target = tmp_path / "out.json"
    code, out, err = plan(capsys, *argv, "--emit-config", str(target))
    assert code == 2
    assert err.startswith("megakit plan: error: ") and err.count("\n") == 1 and needle in err, err
    assert "Traceback" not in err and not target.exists() and not list(tmp_path.iterdir())


def test_a_bad_launch_path_names_the_flag_given(tmp_path, capsys):
    """--params writes a model config beside the ds_config, which --emit-launch placed: the error names
    --emit-launch."""
    code, _, err = plan(capsys, "--params", "7B", "--emit-launch", "slurm", "/nonexistent/dir/job.sh")
    assert code == 2 and err.count("\n") == 1 and "--emit-launch folder /nonexistent/dir does not exist" in err, err
    assert "--emit-config" not in err


def test_malformed_and_unsupported_configs(tmp_path, capsys):
    broken = tmp_path / "config.json"
    broken.write_text('{"model_type": "llama", "hidden_size": ')
    code, _, err = plan(capsys, "--model", str(broken))
    assert code == 2 and "cannot read model config" in err and "Expecting value" in err
    broken.write_text('{"model_type": "llama", "hidden_size": 64}')
    code, _, err = plan(capsys, "--model", str(broken))
    assert code == 2 and "lacks the field" in err
    broken.write_text('{"model_type": "bert", "hidden_size": 64}')
    code, _, err = plan(capsys, "--model", str(broken))
    assert code == 2 and "model_type 'bert'; supported" in err
    # a config without hidden_size: one line naming the key, never a Python TypeError
    broken.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "vocab_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "intermediate_size": 64,
            }
        )
    )
    code, _, err = plan(capsys, "--model", str(broken))
    assert code == 2 and "lacks the field 'hidden_size'" in err and err.count("\n") == 1, err


def test_params_plan_writes_the_model_config_the_trainer_reads(tmp_path, capsys):
    from megakit.core.model_config import ModelConfig
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.train.trainer import load_ds_config

    target = tmp_path / "plan.json"
    code, out, _ = plan(capsys, "--params", "6.7B", "--gpus", "16", "--emit-config", str(target))
    model_file = tmp_path / "plan.model.json"
    assert code == 0 and f"--model {model_file}" in out
    assert ModelSpec.from_config(str(model_file)).params == ModelSpec.from_params("6.7B").params
    assert ModelConfig.load(str(model_file)).hidden == 4096
    code, out, _ = plan(capsys, "--params", "6.7B", "--gpus", "16", "--json")
    p = json.loads(out)["plan"]
    config = load_ds_config(str(target), dp=p["dp"], pp=p["pp"])  # the trainer's own checks
    assert config["train_batch_size"] == p["global_batch"]


def test_launch_command_carries_the_plans_recompute_sp_and_virtual_stages(capsys):
    code, out, _ = plan(
        capsys,
        "--params",
        "175B",
        "--gpus",
        "1024",
        "--tp",
        "8",
        "--pp",
        "16",
        "--vpp",
        "2",
        "--recompute",
        "full",
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    launch, p = report["assumptions"]["launch"], report["plan"]
    assert " --tp 8 --pp 16 " in launch and "--vpp 2" in launch and "--recompute full" in launch
    assert ("--sequence-parallel" in launch) == p["sequence_parallel"]
    assert report["assumptions"]["launch_note"] == ""


def _deepspeed_engine_from(rank, world, path, dp, pp):
    import deepspeed
    import torch

    from megakit.train.engine.ds_config import load_ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    config = load_ds_config(path, dp=dp, pp=pp)  # the trainer's reading: a pipeline steps once per flush
    model = torch.nn.Linear(4, 4)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return type(engine.optimizer).__name__, config["zero_optimization"]["overlap_comm"]


def test_emitted_pipeline_config_builds_a_deepspeed_engine(tmp_path, capsys):
    """DeepSpeed refuses overlap_comm with ZeRO-1 when each step is the accumulation boundary (PP > 1)."""
    target = tmp_path / "pp.json"
    code, out, err = plan(
        capsys,
        "--model",
        "gpt-tiny",
        "--gpus",
        "4",
        "--pp",
        "2",
        "--zero",
        "1",
        "--global-batch",
        "8",
        "--emit-config",
        str(target),
    )
    assert code == 0, err
    assert "--pp 2" in out
    # Two processes stand for one stage's two DP replicas (the engine's view of a PP=2 x DP=2 job).
    assert run_ranks(_deepspeed_engine_from, 2, str(target), 2, 2) == [("DeepSpeedZeroOptimizer", False)] * 2


def test_gpt3s_batch_is_one_number_for_the_default_batch_and_the_lr_scaled_to_it():
    """ "2M tokens" at 8192 tokens a sequence is GPT-3's batch rounded to 256 sequences for the default batch; the LR
    is GPT-3's at that same batch, not scaled by 256 / 244 as it was when the LR read 2e6 tokens as 244 sequences."""
    from megakit.core.planner import emit

    batch, note = emit.default_global_batch(8e9, 8192, tokens=15e12)
    lr, why = emit.scaled_lr(8e9, batch, 8192)
    assert batch == 256 and "2M tokens = 256 sequences of 8192" in note
    assert lr == 1.2e-4 and why == "0.00012 = GPT-3's 1.2e-04 at its 2M-token batch (256 sequences of 8192)", why
    lr, why = emit.scaled_lr(8e9, 512, 8192)  # twice the batch: twice the LR, from the same 256
    assert lr == 2.4e-4 and "x 512 / 256 sequences" in why


def test_a_measured_profile_prints_rounded_rates_and_a_tiny_models_count(tmp_path, capsys):
    """``--hardware``'s measured rates come out to four figures (11.77 GiB, not 11.770145416259766 or 11.7701), and a
    CPU-sized model's parameters as a count (842K), not 0.00B."""
    from megakit.commands import cli

    link = {"bytes": 2**24, "seconds": 0.0404, "bus_gbps": 0.4086099588212423}
    profile = {
        "profile": "megakit-probe",
        "version": 1,
        "device": "cpu",
        "dtype": "fp32",
        "backend": "gloo",
        "nproc": 2,
        "gpus_per_node": 2,
        "memory_gib": 11.770145416259766,
        "matmul_tflops": 0.032171739981735566,
        "copy_gbps": 3.5378572420870493,
        "attention_tflops": 0.010661163506496317,
        "links": {"all_reduce": link},
    }
    (tmp_path / "hw.json").write_text(json.dumps(profile))
    assert (
        cli.main(
            [
                "plan",
                "--model",
                "gpt-mini",
                "--hardware",
                str(tmp_path / "hw.json"),
                "--gpus",
                "2",
                "--global-batch",
                "8",
                "--seq-len",
                "128",
            ]
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())  # rich wraps lines
    assert "11.77 GiB, 0.03217 TFLOP/s peak" in out and "within 80% of 11.77 GiB" in out, out[:800]
    assert "0.454 GB/s per GPU" in out and ": 842K parameters" in out
    assert not re.search(r"\d\.\d{6,}", out), re.findall(r"\S*\d\.\d{6,}\S*", out)


def test_plan_shows_a_spinner_on_a_terminal_while_transformers_counts_the_model_and_nothing_in_a_pipe():
    """``--model`` spends seconds in transformers before the first line: a terminal sees what it waits for (a pipe
    sees nothing: ``_progress`` asks ``isatty``)."""
    import os
    import pty

    controller, terminal = pty.openpty()
    shown = bytearray()

    def drain() -> None:  # read while the child runs: a full pty buffer would block its spinner's writes
        while True:
            try:
                chunk = os.read(controller, 1 << 16)
            except OSError:  # EIO once the child and this test have closed the terminal side
                return
            if not chunk:
                return
            shown.extend(chunk)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    command = [sys.executable, "-m", "megakit.commands.cli", "plan", "--model", "llama-tiny", "--gpus", "2"]
    run = subprocess.run(command, stdout=subprocess.PIPE, stderr=terminal, timeout=300)
    os.close(terminal)
    reader.join(timeout=30)
    os.close(controller)
    assert run.returncode == 0 and b"Plan" in run.stdout
    assert b"megakit plan: reading llama-tiny (transformers counts its parameters)" in shown, bytes(shown[:400])
