"""``megakit plan --kernels`` and ``--fp8`` through the CLI entry point: Narayanan et al. 2021's Tables 1-2
(Megatron-LM's fused kernels) with ``--kernels compiled``, megakit's eager H200 runs with ``--kernels eager``,
FP8 refused where the GPU has no FP8 tensor cores, and hardware FLOP/s under the matmul ceiling.

The CLI is run in-process (``megakit.commands.cli.main``) with each row's layout pinned. The exact parameter
count a ``--model`` config gets from transformers (11 s for the 1T row) is replaced by the analytic count: it
only names the model in the report, the cost model never reads it."""

import json
import sys

import pytest
from megatron_rows import ROWS as MEGATRON_ROWS
from megatron_rows import row_case
from paths import ROOT

import megakit.interop.hf as hf
from megakit.commands.cli import main
from megakit.core.planner.compute import IN_TRAINING
from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan

MEGAKIT = json.loads((ROOT / "tests" / "data" / "megakit-runs.json").read_text())["rows"]


def _megatron_argv(row, tmp_path) -> list:
    """The row's shape as a GPT-2 config.json, its layout pinned as ``test_planner_cost.row_case`` reads it."""
    model, plan, _ = row_case(row)
    config = tmp_path / f"{row['id']}.json"
    config.write_text(json.dumps(model.config.to_hf()))
    argv = [
        "--model",
        config,
        "--seq-len",
        row["seq_len"],
        "--gpu",
        "a100-80gb",
        "--gpus",
        plan.world,
        "--tp",
        plan.tp,
        "--pp",
        plan.pp,
        "--zero",
        plan.zero_stage,
        "--micro-batch",
        plan.micro_batch,
        "--global-batch",
        plan.global_batch,
        "--recompute",
        "full",
        "--precision",
        "fp16",
        "--attention",
        "standard",
        "--kernels",
        "compiled",
    ]  # megakit's own runtime: Megatron's TP linears
    if plan.vpp > 1:
        argv += ["--vpp", plan.vpp]
    if plan.zero_stage == 3:  # DeepSpeed's ZeRO-3 of 2021, as measured then
        argv += ["--runtime", "deepspeed-2021"]
    return argv


def test_megatron_2021_tables_1_and_2_through_the_cli_with_compiled_kernels(plan_json, tmp_path):
    """Every Table 1 and Table 2 row (and the GPT-3 estimate) within 15 % of the published TFLOP/s, which
    count the recomputed forward: the planner's hardware FLOPs with written-out attention."""
    errors = {}
    for row in MEGATRON_ROWS:
        got = plan_json(*_megatron_argv(row, tmp_path))
        assert got["kernels"] == "compiled" and got["recompute"] == "full"
        errors[row["id"]] = got["hardware_tflops_per_gpu"] / row["tflops_per_gpu"] - 1
    print("\n".join(f"{k:32s} {v:+.1%}" for k, v in errors.items()))
    assert max(map(abs, errors.values())) <= 0.15, errors


def test_eager_kernels_price_megatron_slower_than_fused(plan_json, tmp_path):
    """The same 1.7B row with one kernel per elementwise op: the eager trainer's model, clearly slower."""
    row = next(r for r in MEGATRON_ROWS if r["id"] == "nar21-t1-1.7B")
    argv = _megatron_argv(row, tmp_path)
    compiled = plan_json(*argv)["hardware_tflops_per_gpu"]
    eager = plan_json(*argv, "--kernels", "eager")["hardware_tflops_per_gpu"]
    assert eager < 0.85 * compiled


@pytest.mark.parametrize("row", MEGAKIT, ids=lambda r: r["id"])
def test_megakit_eager_h200_rows_through_the_cli(plan_json, row):
    """megakit's own eager trainer on one H200 (tests/data/megakit-runs.json) with ``--kernels eager``."""
    got = plan_json(
        "--model",
        row["model"],
        "--seq-len",
        row["seq_len"],
        "--gpu",
        row["gpu"],
        "--gpus",
        row["num_gpus"],
        "--tp",
        1,
        "--pp",
        1,
        "--zero",
        row["zero"],
        "--micro-batch",
        row["micro_batch"],
        "--global-batch",
        row["micro_batch"] * row["accumulation"],
        "--recompute",
        row["recompute"],
        "--kernels",
        "eager",
    )
    assert got["tokens_per_s"] == pytest.approx(row["tokens_per_s"], rel=0.15)


def test_the_default_is_compiled_and_fp8_speeds_up_large_gemms_on_hopper(plan_json):
    base = (
        "--model",
        "llama-3-8b",
        "--seq-len",
        8192,
        "--gpu",
        "h100-80gb",
        "--gpus",
        8,
        "--tp",
        1,
        "--pp",
        1,
        "--zero",
        2,
        "--micro-batch",
        1,
        "--global-batch",
        8,
        "--recompute",
        "full",
    )
    default, eager = plan_json(*base), plan_json(*base, "--kernels", "eager")
    tensorwise, rowwise = plan_json(*base, "--fp8", "tensorwise"), plan_json(*base, "--fp8", "rowwise")
    assert default["kernels"] == "compiled" and default["fp8"] == "none"
    # megakit's trainer compiles no block under DeepSpeed's ZeRO 3 (its hooks gather inside the block); FSDP does
    assert plan_json(*base, "--zero", 3)["kernels"] == "eager"
    assert plan_json(*base, "--zero", 3, "--runtime", "fsdp")["kernels"] == "compiled"
    assert eager["tokens_per_s"] < default["tokens_per_s"] < rowwise["tokens_per_s"] < tensorwise["tokens_per_s"]
    assert default["flops_conventions"]["hardware_tflops_per_gpu"].startswith("FLOPs the kernels execute")


def test_the_launch_command_runs_what_was_priced(monkeypatch, capsys):
    monkeypatch.setattr(hf, "exact_param_count", lambda raw: None)
    argv = [
        "plan",
        "--model",
        "llama-3-8b",
        "--gpu",
        "h100-80gb",
        "--gpus",
        "8",
        "--tp",
        "1",
        "--pp",
        "1",
        "--zero",
        "3",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
        "--global-batch",
        "8",
        "--json",
    ]
    assert main([*argv, "--kernels", "eager", "--fp8", "rowwise"]) == 0
    a = json.loads(capsys.readouterr().out)["assumptions"]
    assert "--no-compile" in a["launch"] and "--fp8 rowwise" in a["launch"] and a["launch_note"] == ""
    assert main([*argv, "--runtime", "fsdp"]) == 0
    a = json.loads(capsys.readouterr().out)["assumptions"]
    assert "--no-compile" not in a["launch"] and "--fp8" not in a["launch"] and "fsdp runs it" in a["launch_note"]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (("--gpu", "a100-80gb", "--fp8", "tensorwise"), "a100-80gb lacks"),
        (("--gpu", "v100-32gb", "--fp8", "rowwise"), "v100-32gb lacks"),
        (("--gpu", "h100-80gb", "--fp8", "rowwise", "--precision", "fp16"), "use --precision bf16"),
    ],
)
def test_fp8_refused_in_one_line_where_it_cannot_run(argv, needle, capsys):
    assert main(["plan", "--params", "7B", "--gpus", "8", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("gpu", ["a100-80gb", "h100-80gb", "h200-141gb", "mi300x-192gb"])
@pytest.mark.parametrize("seq_len", [2048, 32768, 131072])
def test_hardware_tflops_never_exceed_the_matmul_ceiling(gpu, seq_len):
    """Hardware FLOPs count what the kernels execute (causal flash attention skips the masked half), so they
    never outrun the best GEMM the planner prices (MAMF x IN_TRAINING); PaLM's MFU, counting the full S x S,
    may at long sequences, and the plan says which convention each figure uses."""
    model = ModelSpec.from_config("mistral-7b").with_overrides(seq_len=seq_len)
    g = gpu_preset(gpu)
    ceiling = g.peak_tflops * g.matmul_fraction * IN_TRAINING
    for plan in (
        Plan(dp=8, zero_stage=3, micro_batch=1, accumulation=1, recompute="full", fused_kernels=True),
        Plan(dp=8, zero_stage=3, micro_batch=1, accumulation=1, recompute="none", fused_kernels=True),
    ):
        cost = estimate_cost(model, Cluster(gpu=g, num_gpus=8), plan)
        assert cost.hardware_tflops_per_gpu <= ceiling


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-s"]))
