"""``megakit plan`` against measured per-GPU peak memory of pipelines, 1F1B and interleaved 1F1B (1F1B-I) of the
same Megatron-LM runs (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", Tables 4, 6, 11 and 12; A100 80GB,
GPT 1.5B-28.3B, PP 8-32, TP 1, DP 1, fp16, written-out attention, no recompute: tests/data/pipeline-memory-runs.json).

Each row goes through the CLI in-process (``--runtime megatron``, ``--zero 0``) with its layout pinned: PP, micro-batch,
micro-batches, and the split as run (``--stage-layers``): in the plain runs the first and last stage hold one layer
fewer; the interleaved runs put one layer in each chunk and leave the first chunk of stage 0 and the last chunk of
the last stage with the embedding or the head only (Megatron's layer padding), which ``--stage-layers`` pins as 0.

Measured with one set of constants (``pytest -s`` prints the table), the published GB read as GiB (Megatron prints MB
of 2^20 bytes): plain 1F1B -8.2 % to +2.2 % over 20 rows (low by 2-8 % once micro-batches are large); 1F1B-I -6.8 % to
-4.8 %; what interleaving adds over 1F1B, which is the in-flight
difference times one layer's activations (8, 9, 16 and 31 layer-micro-batches), predicted 9.2, 7.8, 5.8, 13.4 GiB
against 10, 9, 7, 15 measured: 8-17 % short. Tolerances: 15 % on peaks, where the figures are whole GB and the one
configuration measured twice (28.3B, PP 32, micro-batch 2: 72 and 69 GB) differs by 4 %; 20 % on the increase, where
the rounding of two whole-GB figures alone is up to 1 GB of a 7-15 GB difference.
Read as 10^9 bytes (the paper does not say), the figures are 7 % lower: peaks -1.5 % to +9.6 %, the increase -1 %
to -11 %, inside the same tolerances."""

import json
from pathlib import Path

import pytest
from paths import ROOT

DATA = json.loads((ROOT / "tests" / "data" / "pipeline-memory-runs.json").read_text())
ROWS = DATA["rows"]
PLAIN = [r for r in ROWS if r["schedule"] == "1f1b"]
INTERLEAVED = [r for r in ROWS if r["schedule"] == "interleaved"]
TOLERANCE = 0.15  # peaks
INCREASE_TOLERANCE = 0.20  # interleaved minus plain


def _config(row, tmp_path, layers: int) -> Path:
    """The row's GPT shape as a GPT-2 config.json: Megatron's defaults of the time (learned positions up to 2048,
    tied embedding, dropout 0.1)."""
    path = tmp_path / f"{row['model'].split()[-1]}-{layers}.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": row["vocab"],
                "n_positions": 2048,
                "n_embd": row["hidden"],
                "n_layer": layers,
                "n_head": row["heads"],
                "n_inner": row["ffn"],
                "activation_function": "gelu_new",
                "layer_norm_epsilon": 1e-5,
                "resid_pdrop": 0.1,
                "embd_pdrop": 0.1,
                "attn_pdrop": 0.1,
                "tie_word_embeddings": True,
            }
        )
    )
    return path


def _cli(plan_json, row, tmp_path) -> dict:
    """The row through ``megakit plan``, its split as run."""
    split = row["stage_layers"]
    got = plan_json(
        "--model",
        _config(row, tmp_path, row["layers"]),
        "--seq-len",
        row["seq_len"],
        "--gpu",
        "a100-80gb",
        "--gpus",
        row["num_gpus"],
        "--tp",
        row["tp"],
        "--pp",
        row["pp"],
        "--vpp",
        row["vpp"],
        "--zero",
        0,
        "--micro-batch",
        row["micro_batch"],
        "--global-batch",
        row["micro_batch"] * row["micro_batches"],
        "--recompute",
        "none",
        "--attention",
        "standard",
        "--precision",
        "fp16",
        "--runtime",
        "megatron",
        "--stage-layers",
        ",".join(map(str, split)),
    )
    assert (got["tp"], got["pp"], got["dp"], got["vpp"], got["micro_batch"], got["grad_accum"]) == (
        row["tp"],
        row["pp"],
        row["dp"],
        row["vpp"],
        row["micro_batch"],
        row["micro_batches"],
    )
    assert got["runtime"] == "megatron" and not got["flash_attention"] and got["precision"] == "fp16"
    return got


def _error(predicted_gib, row) -> float:
    return predicted_gib / row["measured_gb"] - 1


def test_plain_1f1b_rows_through_the_cli(plan_json, tmp_path):
    """Every 1F1B row within 15 %, none called out of memory."""
    lines = [f"{'1F1B row':34s} {'mb':>3s} {'m':>4s} {'stage':>5s} {'predicted':>9s} {'measured':>8s} {'error':>7s}"]
    errors = {}
    for row in PLAIN:
        got = _cli(plan_json, row, tmp_path)
        assert got["fits"] != "no" and got["peak_memory_gib"] <= got["gpu_memory_gib"], f"{row['id']} out of memory"
        errors[row["id"]] = _error(got["peak_memory_gib"], row)
        lines.append(
            f"{row['id']:34s} {row['micro_batch']:3d} {row['micro_batches']:4d} {got['peak_stage']:5d} "
            f"{got['peak_memory_gib']:9.1f} {row['measured_gb']:8d} {errors[row['id']]:+7.1%}"
        )
    print("\n" + "\n".join(lines))
    assert max(map(abs, errors.values())) <= TOLERANCE, errors


def test_interleaved_rows_and_what_interleaving_adds(plan_json, tmp_path):
    """Each 1F1B-I row within 15 % with its split as run (embedding-only and head-only end chunks), none called out of
    memory, its peak on a middle stage (one layer in each chunk), and the increase over the same model's 1F1B row
    measured in the same table positive and within 20 %."""
    lines, errors = (
        [
            f"{'1F1B-I row':38s} {'vpp':>3s} {'stage':>5s} {'predicted':>9s} {'measured':>8s} {'error':>7s} "
            f"{'+pred':>6s} {'+meas':>5s} {'error':>7s}"
        ],
        {},
    )
    for row in INTERLEAVED:
        plain = next(r for r in PLAIN if r["source"] == row["source"] and r["model"] == row["model"])
        got = _cli(plan_json, row, tmp_path)
        assert got["fits"] != "no" and got["peak_memory_gib"] <= got["gpu_memory_gib"], f"{row['id']} out of memory"
        assert 0 < got["peak_stage"] < row["pp"] - 1
        peak = got["peak_memory_gib"]
        added = peak - _cli(plan_json, plain, tmp_path)["peak_memory_gib"]
        measured_added = row["measured_gb"] - plain["measured_gb"]
        errors[row["id"]] = (_error(peak, row), added / measured_added - 1)
        lines.append(
            f"{row['id']:38s} {row['vpp']:3d} {got['peak_stage']:5d} {peak:9.1f} {row['measured_gb']:8d} "
            f"{errors[row['id']][0]:+7.1%} {added:6.1f} {measured_added:5d} {errors[row['id']][1]:+7.1%}"
        )
        assert added > 0
    print("\n" + "\n".join(lines))
    assert all(abs(peak) <= TOLERANCE for peak, _ in errors.values()), errors
    assert all(abs(increase) <= INCREASE_TOLERANCE for _, increase in errors.values()), errors


def test_megatron_keeps_fp16_gradients_under_fp16(plan_json, tmp_path):
    """Megatron-LM accumulates gradients in fp32 under bf16 only (its arguments.py forces it there): under fp16 its
    buffers hold fp16 gradients, copied to fp32 at the step. Priced as fp32 buffers, the 14.6B row with 4 micro-batches
    (measured 19 GB) would hold 2 bytes x 0.94B parameters more through the backward: +11 % instead of +2 %."""
    row = next(r for r in PLAIN if r["id"] == "zb24-t12-14.6B-p16-b1-m4-1f1b")
    got = _cli(plan_json, row, tmp_path)
    items = got["memory"]
    assert items["grads"] == pytest.approx(items["params"]) and items["fp32_step_grads"] == pytest.approx(
        2 * items["grads"]
    )
    assert abs(_error(got["peak_memory_gib"], row)) < 0.05
