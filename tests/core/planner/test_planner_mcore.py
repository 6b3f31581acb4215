"""``megakit plan --runtime megatron-core`` against Megatron-Core's own H100 BF16 runs: the Megatron-LM README's
weak-scaling table (Megatron-Core r0.8.0, GPT 1.7B-462B, TP + SP, PP up to 16, distributed optimizer, seq 4096,
``--tp-comm-overlap --overlap-grad-reduce --overlap-param-gather``; tests/data/megatron-core-runs.json). Each row
goes through the CLI in-process with what the table states pinned (TP, PP, DP, global batch); the micro-batch and
the interleaving, which it does not state, are the planner's own pick (the fastest that fits under the 80 % line),
and recompute is pinned selective.

Measured with one set of constants (``pytest -s`` prints the table): +4.7 %, +2.8 %, -1.0 %, -4.1 % (PP 1, micro-batch
4), -12.2 %, -6.8 %, -9.4 %, -12.6 %, -8.7 % (PP 2-16, interleaved over 4 virtual stages, micro-batch 1-2); mean |error|
6.9 %.

Reading the unstated knobs as micro-batch 1 and no interleaving instead leaves the TP 8 rows 15-38 % slow, and the
32B row shows that reading cannot be what ran (``test_micro_batch_one_cannot_be_what_ran``): one micro-batch of 4
per step gives Megatron's fp32 gradient reduce-scatter (4 bytes x 3.8B parameters per GPU, over one 400 Gb/s NIC:
48 replicas on 48 nodes) only the last of four backwards to hide behind, which alone exceeds the measured step
less its compute at the 7.1B row's efficiency."""

import json
from pathlib import Path

from paths import ROOT

from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import RUNTIMES, Plan

ALL_ROWS = json.loads((ROOT / "tests" / "data" / "megatron-core-runs.json").read_text())["rows"]
ROWS = [r for r in ALL_ROWS if "fp8" not in r["planner"]]  # the README's BF16 table, through the CLI
FP8_ROWS = [r for r in ALL_ROWS if "fp8" in r["planner"]]  # Megatron-Bridge's FP8 Llama rows, in-process
MODELS = ROOT / "models"
TOLERANCE = 0.15  # every row


def _argv(row, tmp_path, **override) -> list:
    """The row's GPT shape as a config.json and what it states pinned as tests/data says (``row["planner"]``;
    a null is left to the planner)."""
    config = tmp_path / f"{row['id']}.json"
    config.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": row["vocab"],
                "n_positions": row["seq_len"],
                "n_embd": row["hidden"],
                "n_layer": row["layers"],
                "n_head": row["heads"],
                "n_inner": row["ffn"],
                "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5,
                "resid_pdrop": 0.0,
                "embd_pdrop": 0.0,
                "attn_pdrop": 0.0,
                "tie_word_embeddings": True,
            }
        )
    )
    q = {**row["planner"], **override}
    flags = {
        "--gpu": "gpu",
        "--gpus": "gpus",
        "--tp": "tp",
        "--pp": "pp",
        "--cp": "cp",
        "--vpp": "vpp",
        "--zero": "zero",
        "--micro-batch": "micro_batch",
        "--global-batch": "global_batch",
        "--seq-len": "seq_len",
        "--recompute": "recompute",
        "--runtime": "runtime",
    }
    return ["--model", config] + [x for flag, key in flags.items() if q[key] is not None for x in (flag, q[key])]


def _error(got, row) -> float:
    return got["tokens_per_s"] / got["num_gpus"] / row["tokens_per_s_per_gpu"] - 1


def test_megatron_core_h100_rows_through_the_cli(plan_json, tmp_path):
    """Each published run keeps its layout, fits its GPU (it trained), and tokens/s/GPU lands within 15 %."""
    lines, errors = (
        [
            f"{'row':26s} {'tp':>2s} {'pp':>2s} {'mb':>2s} {'vpp':>3s} {'predicted':>9s} {'measured':>9s} "
            f"{'error':>7s} comm bubble"
        ],
        {},
    )
    for row in ROWS:
        got = plan_json(*_argv(row, tmp_path))
        assert (got["tp"], got["pp"], got["dp"]) == (row["tp"], row["pp"], row["dp"])
        assert got["global_batch"] == row["global_batch_seqs"]
        assert got["runtime"] == row["planner"]["runtime"]  # the JSON names the runtime that priced it
        assert got["peak_memory_gib"] <= got["gpu_memory_gib"], f"{row['id']} called out of memory"
        errors[row["id"]] = _error(got, row)
        lines.append(
            f"{row['id']:26s} {row['tp']:2d} {row['pp']:2d} {got['micro_batch']:2d} {got['vpp']:3d} "
            f"{got['tokens_per_s'] / got['num_gpus']:9.1f} {row['tokens_per_s_per_gpu']:9.1f} "
            f"{errors[row['id']]:+7.1%} {got['comm_fraction']:4.2f} {got['bubble_fraction']:6.2f}"
        )
    print("\n".join(lines))
    assert max(map(abs, errors.values())) <= TOLERANCE, errors


def test_micro_batch_one_cannot_be_what_ran(plan_json, tmp_path):
    """The 32B row (TP 8, DP 48 on 48 nodes, 4 sequences per replica) read as micro-batch 1: its data-parallel
    exchange alone, which the planner prices from bytes and link speed, leaves less of the measured step for compute
    than the 7.1B row's measured efficiency needs, so that reading is the planner's slow error, not the model's."""
    small, big = (next(r for r in ROWS if r["id"].endswith(size)) for size in ("7.1B", "32B"))
    one = plan_json(*_argv(big, tmp_path, micro_batch=1, vpp=1))
    chosen = plan_json(*_argv(big, tmp_path))
    measured_step = big["global_batch_seqs"] * big["seq_len"] / big["num_gpus"] / big["tokens_per_s_per_gpu"]
    exposed = one["comm_fraction"] * one["step_time_s"]  # TP and P2P are hidden or absent here: this is DP's
    compute_at_7b = measured_step * big["tflops_per_gpu"] / small["tflops_per_gpu"]  # the step at 7.1B's TFLOP/s
    assert measured_step - exposed < compute_at_7b, (measured_step, exposed, compute_at_7b)
    assert _error(one, big) < -TOLERANCE < _error(chosen, big)
    assert chosen["micro_batch"] > 1 and chosen["comm_fraction"] < one["comm_fraction"] / 4


def _fp8_case(row):
    """A Megatron-Bridge FP8 row pinned as its "planner" block says: the models/ preset it names or a Llama of its
    shape."""
    q = row["planner"]
    if q["model"].startswith("models/"):
        model = ModelSpec.from_config(str(MODELS / Path(q["model"]).name))
    else:
        model = ModelSpec(
            name=row["id"],
            family="llama",
            layers=row["layers"],
            hidden=row["hidden"],
            heads=row["heads"],
            kv_heads=row["kv_heads"],
            ffn=row["ffn"],
            vocab_size=row["vocab"],
            seq_len=row["seq_len"],
            max_seq_len=row["seq_len"],
            tie_embeddings=False,
            dropout=0.0,
        )
    model = model.with_overrides(seq_len=q["seq_len"])
    dp = q["gpus"] // (q["tp"] * q["pp"] * q["cp"])
    plan = Plan(
        tp=q["tp"],
        pp=q["pp"],
        cp=q["cp"],
        dp=dp,
        vpp=q["vpp"],
        zero_stage=q["zero"],
        micro_batch=q["micro_batch"],
        accumulation=q["global_batch"] // (dp * q["micro_batch"]),
        recompute=q["recompute"],
        sequence_parallel=q["tp"] > 1,
        fused_kernels=q["kernels"] == "compiled",
        fp8=q["fp8"],
        **RUNTIMES[q["runtime"]],
    )
    return model, Cluster(gpu=gpu_preset(q["gpu"]), num_gpus=q["gpus"]), plan


def test_megatron_bridge_fp8_rows_within_15_percent():
    """Megatron-Bridge's DGX-H100 FP8 rows (Llama 3 70B, Llama 3.1 405B at 8K tokens, Transformer Engine's current
    scaling): each layout as published, in-process (the memory model is not what these rows check), tokens/s/GPU within
    15 %. Torchao's per-micro-batch casts at 21 bytes an element priced the 405B rows 28-33 % slow; Transformer Engine
    casts in fused kernels and keeps each weight's FP8 copy for the whole step (``compute.FP8_CAST_BYTES_TE``)."""
    assert len(FP8_ROWS) >= 4
    lines, errors = [], {}
    for row in FP8_ROWS:
        model, cluster, plan = _fp8_case(row)
        got = estimate_cost(model, cluster, plan).tokens_per_s / plan.world
        errors[row["id"]] = got / row["tokens_per_s_per_gpu"] - 1
        lines.append(f"{row['id']:40s} {got:8.1f} {row['tokens_per_s_per_gpu']:8.1f} {errors[row['id']]:+7.1%}")
    print("\n".join(lines))
    assert max(map(abs, errors.values())) <= TOLERANCE, errors
