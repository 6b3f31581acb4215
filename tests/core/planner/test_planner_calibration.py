"""The cost model against every calibration row, with one set of constants: 26 published FSDP / FSDP2 /
HSDP / ZeRO-3 runs (tests/data/sharded-dp.json, a copy of ../shared/calibration with how the planner reads
each row), Narayanan et al. 2021 Tables 1-2 (tests/data/megatron-2021.json) and megakit's own trainer on
an H200 (tests/data/megakit-runs.json), torchao/torchtitan float8 runs (tests/data/fp8-runs.json). Each layout is pinned
as published; the per-row errors are printed (``pytest -s``). The bounds sit just above what is measured (sharded-dp:
mean 6.6 %, max 14.5 %), and docs/planning.md states the measured figures.

The other public rows, one file each (in this folder), through ``megakit plan``: Megatron-Core's H100 weak-scaling
table, TP up to 8 and PP up to 16 (test_planner_mcore.py, every row within 15 %); measured peak memory of 1F1B and
interleaved 1F1B pipelines (test_planner_pipeline_memory.py, from the Zero Bubble paper); 32K-700K-token runs
(test_planner_long_sequence.py); Narayanan et al. 2021 with compiled kernels (test_planner_kernels.py)."""

import json
import re
import statistics

import pytest
from megatron_rows import ROWS as MEGATRON_ROWS
from megatron_rows import row_case
from paths import ROOT

from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import GIB, peak_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan
from megakit.core.planner.search import OVERHEAD_BYTES

DATA = ROOT / "tests" / "data"
SHARDED = json.loads((DATA / "sharded-dp.json").read_text())
MEGAKIT = json.loads((DATA / "megakit-runs.json").read_text())["rows"]
FP8 = json.loads((DATA / "fp8-runs.json").read_text())["rows"]
TOLERANCE = 0.15  # per row; measured max 14.5 %
MEAN_TOLERANCE = 0.075  # sharded-dp mean; measured 6.6 %
GUIDE = ROOT / "docs" / "planning.md"  # the planner's guide, which states the errors


def sharded_case(row) -> tuple[ModelSpec, Cluster, Plan]:
    """A sharded-dp.json row as the planner reads it: the shape, the cluster, the pinned plan."""
    q = row["planner"]
    model = ModelSpec(
        name=row["id"],
        family=q.get("family", "llama"),
        layers=row["layers"],
        hidden=row["hidden"],
        heads=row["heads"],
        kv_heads=row["kv_heads"] or row["heads"],
        ffn=row["ffn"],
        vocab_size=row["vocab"] or q["vocab"],
        seq_len=row["seq_len"],
        max_seq_len=max(row["seq_len"], 2048),
        tie_embeddings=False,
        dropout=0.0,
    )
    tp, dp, mb = row["tp"] or 1, row["dp"] or q["dp"], row["micro_batch"] or q["micro_batch"]
    cluster = Cluster(gpu=gpu_preset(q["gpu"]), num_gpus=tp * dp, gpus_per_node=row["gpus_per_node"] or 8)
    cluster = cluster.with_overrides(inter_gbps=q.get("inter_gbps"))
    plan = Plan(
        tp=tp,
        dp=dp,
        zero_stage=3,
        micro_batch=mb,
        accumulation=1,
        recompute=q["recompute"],
        sequence_parallel=bool(row["sp"]),
        precision="bf16",
        flash_attention=True,
        recompute_fraction=q.get("recompute_fraction", 1.0),
        fused_kernels=q.get("fused_kernels", False),
        dp_shard=q.get("dp_shard", 0),
        reduce_precision=q.get("reduce_precision", ""),
        offload=q.get("offload", "none"),
        zero3=q["zero3"],
        fp8=row.get("fp8", "none"),
    )
    return model, cluster, plan


def megakit_case(row) -> tuple[ModelSpec, Cluster, Plan]:
    model = ModelSpec.from_config(row["model"]).with_overrides(seq_len=row["seq_len"])
    cluster = Cluster(gpu=gpu_preset(row["gpu"]), num_gpus=row["num_gpus"])
    plan = Plan(
        dp=row["num_gpus"],
        zero_stage=row["zero"],
        micro_batch=row["micro_batch"],
        accumulation=row["accumulation"],
        recompute=row["recompute"],
    )
    return model, cluster, plan


def all_errors() -> dict:
    """id -> (predicted, measured, unit) for every row of the three files."""
    out = {}
    for row in SHARDED["rows"]:
        model, cluster, plan = sharded_case(row)
        out[row["id"]] = (
            estimate_cost(model, cluster, plan).tokens_per_s / plan.world,
            row["tokens_per_s_per_gpu"],
            "tok/s/GPU",
        )
    for row in FP8:  # torchao float8 and its bf16 twins (megakit plan --fp8)
        model, cluster, plan = sharded_case(row)
        out[row["id"]] = (
            estimate_cost(model, cluster, plan).tokens_per_s / plan.world,
            row["tokens_per_s_per_gpu"],
            "tok/s/GPU",
        )
    for row in MEGATRON_ROWS:
        _, _, cost = row_case(row)
        out[row["id"]] = (cost.hardware_tflops_per_gpu, row["tflops_per_gpu"], "TFLOP/s")
    for row in MEGAKIT:
        model, cluster, plan = megakit_case(row)
        out[row["id"]] = (estimate_cost(model, cluster, plan).tokens_per_s, row["tokens_per_s"], "tok/s")
    return out


ERRORS = all_errors()


def test_every_row_within_15_percent_printing_the_table():
    lines = [f"{'row':44s} {'predicted':>10s} {'measured':>10s} {'error':>7s}"]
    for name, (pred, meas, unit) in ERRORS.items():
        lines.append(f"{name:44s} {pred:10.1f} {meas:10.1f} {pred / meas - 1:+7.1%}  {unit}")
    sharded = [abs(ERRORS[r["id"]][0] / ERRORS[r["id"]][1] - 1) for r in SHARDED["rows"]]
    every = [abs(p / m - 1) for p, m, _ in ERRORS.values()]
    lines.append(
        f"sharded-dp: mean {statistics.mean(sharded):.1%}, max {max(sharded):.1%} over {len(sharded)} rows; "
        f"all: mean {statistics.mean(every):.1%}, max {max(every):.1%} over {len(every)} rows"
    )
    for dropped in SHARDED["dropped"]:
        lines.append(f"dropped {dropped['id']}: {dropped['reason'][:100]}...")
    print("\n".join(lines))
    outside = [line for line, (p, m, _) in zip(lines[1:], ERRORS.values()) if abs(p / m - 1) > TOLERANCE]
    assert not outside, "\n".join(outside)
    assert statistics.mean(sharded) <= MEAN_TOLERANCE


def test_the_planning_guide_states_the_measured_errors():
    """docs/planning.md's "mean error X %, max Y %" for the published sharded runs is what this table measures."""
    sharded = [abs(ERRORS[r["id"]][0] / ERRORS[r["id"]][1] - 1) for r in SHARDED["rows"]]
    stated = re.search(
        r"(\d+) published FSDP/FSDP2/HSDP/ZeRO-3 runs\s+\(mean error ([\d.]+) %, max ([\d.]+) %\)", GUIDE.read_text()
    )
    assert stated, "docs/planning.md no longer states the calibration error"
    assert int(stated.group(1)) == len(sharded)
    assert (float(stated.group(2)), float(stated.group(3))) == (
        round(100 * statistics.mean(sharded), 1),
        round(100 * max(sharded), 1),
    )


@pytest.mark.parametrize("row", SHARDED["rows"], ids=lambda r: r["id"])
def test_published_sharded_layouts_are_not_called_out_of_memory(row):
    """Each run trained: pinned as published, the layout's predicted peak fits the GPU it ran on."""
    model, cluster, plan = sharded_case(row)
    peak = peak_memory(model, seq_len=model.seq_len, overhead_bytes=OVERHEAD_BYTES, **plan.memory_kwargs()).total
    assert peak <= cluster.gpu.mem_gib * GIB, f"{peak / GIB:.1f} GiB > {cluster.gpu.mem_gib} GiB"


def test_every_row_says_how_the_planner_reads_it_and_dropped_rows_say_why():
    shared = ROOT.parent / "shared" / "calibration" / "sharded-dp.json"
    ours = {r["id"] for r in SHARDED["rows"]} | {d["id"] for d in SHARDED["dropped"]}
    if shared.is_file():  # the copy holds every row of the shared file
        assert ours == {r["id"] for r in json.loads(shared.read_text())["rows"]}
    assert all(r["planner"]["zero3"] in ("fsdp", "deepspeed") for r in SHARDED["rows"])
    assert all(len(d["reason"]) > 80 for d in SHARDED["dropped"]) and len(SHARDED["dropped"]) <= 3


def test_gemm_efficiency_follows_the_gpu_generation():
    """The same small model on 8 GPUs: an H100 needs bigger GEMMs than an A100 to approach its peak, so
    its MFU is lower at the same shapes, and grows faster with the micro-batch."""
    model = ModelSpec.from_params("1.3B", seq_len=2048)
    mfu = {}
    for gpu in ("a100-80gb", "h100-80gb"):
        cluster = Cluster(gpu=gpu_preset(gpu), num_gpus=8)
        mfu[gpu] = [estimate_cost(model, cluster, Plan(dp=8, micro_batch=b, accumulation=1)).mfu for b in (1, 8)]
    assert mfu["h100-80gb"][0] < mfu["a100-80gb"][0]
    assert mfu["h100-80gb"][1] / mfu["h100-80gb"][0] > mfu["a100-80gb"][1] / mfu["a100-80gb"][0]


def test_fsdp_overlap_hides_what_deepspeed_2021_exposed():
    """ZeRO-3 of a 70B on 64 A100s: today's prefetch hides most gathers; DeepSpeed of 2021 did not."""
    model = ModelSpec.from_config("llama-2-70b").with_overrides(seq_len=4096)
    cluster = Cluster(gpu=gpu_preset("a100-80gb"), num_gpus=64)
    base = dict(dp=64, zero_stage=3, micro_batch=1, accumulation=1, recompute="full")
    fsdp = estimate_cost(model, cluster, Plan(**base, zero3="fsdp"))
    old = estimate_cost(model, cluster, Plan(**base, zero3="deepspeed-2021"))
    assert fsdp.dp_comm_s < 0.1 * fsdp.step_time_s < old.dp_comm_s
    slow = cluster.with_overrides(inter_gbps=2.0)  # a network slow enough to show what crosses it
    full = estimate_cost(model, slow, Plan(**base, zero3="fsdp"))
    hsdp = estimate_cost(model, slow, Plan(**base, zero3="fsdp", dp_shard=8))
    assert hsdp.dp_comm_s < full.dp_comm_s  # gathers on NVLink, only the gradient shard crosses nodes


def test_fp8_speed_ups_follow_the_recipe():
    """torchao's Llama-3-8B table: tensorwise gains more than rowwise over bf16, as measured (+25 % / +10 %),
    each predicted gain within 10 points of the published one."""
    got = {r["fp8"]: ERRORS[r["id"]] for r in FP8 if r["id"].startswith("torchao")}
    for recipe in ("tensorwise", "rowwise"):
        predicted, measured = got[recipe][0] / got["none"][0], got[recipe][1] / got["none"][1]
        assert predicted == pytest.approx(measured, abs=0.10), recipe
    assert got["tensorwise"][0] > got["rowwise"][0] > got["none"][0]


@pytest.mark.parametrize("row", FP8, ids=lambda r: r["id"])
def test_fp8_runs_are_not_called_out_of_memory(row):
    model, cluster, plan = sharded_case(row)
    peak = peak_memory(model, seq_len=model.seq_len, overhead_bytes=OVERHEAD_BYTES, **plan.memory_kwargs()).total
    assert peak <= cluster.gpu.mem_gib * GIB, f"{peak / GIB:.1f} GiB > {cluster.gpu.mem_gib} GiB"


def test_hsdp_rows_through_the_cli_with_dp_shard(plan_json, tmp_path, capsys):
    """IBM's HSDP runs (shard inside each 8-GPU node, replicate across) through ``megakit plan --runtime fsdp
    --dp-shard 8``: the CLI prices what the row's in-process plan prices; sharding over all 128 GPUs (FSDP) holds
    a sixteenth of the states per GPU instead. --dp-shard without --runtime fsdp, or one that does not divide DP,
    is one line."""
    from megakit.commands.cli import main

    row = next(r for r in SHARDED["rows"] if r["id"] == "fms-a100x128-llama2-7b-hsdp")
    model, cluster, plan = sharded_case(row)
    config = tmp_path / "llama2-7b.json"
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
        "--inter-bw",
        cluster.gpu.inter_gbps,
        "--tp",
        1,
        "--pp",
        1,
        "--zero",
        3,
        "--micro-batch",
        plan.micro_batch,
        "--global-batch",
        plan.global_batch,
        "--recompute",
        "none",
        "--kernels",
        "eager",
        "--runtime",
        "fsdp",
    ]
    hsdp = plan_json(*argv, "--dp-shard", 8)
    assert hsdp["tokens_per_s"] / plan.world == pytest.approx(ERRORS[row["id"]][0], rel=1e-6)
    fsdp = plan_json(*argv)
    assert fsdp["peak_memory_gib"] < hsdp["peak_memory_gib"] - 5  # 7B: 16 B/param over 8 GPUs, not 128
    for extra, needle in (
        (["--dp-shard", 8], "add --runtime fsdp"),
        (["--runtime", "fsdp", "--dp-shard", 48], "does not divide DP"),
    ):
        args = [a for a in argv if a not in ("--runtime", "fsdp")] + extra
        capsys.readouterr()
        assert main(["plan", *map(str, args)]) == 2
        assert needle in capsys.readouterr().err
