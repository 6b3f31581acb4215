"""``megakit plan`` at 32K-700K tokens per sequence against published long-sequence runs of 7-8B Llama models on 8
GPUs (tests/data/long-sequence-runs.json): EasyContext's Llama-2-7B on 8 A100 (DeepSpeed ZeRO-3 with offload, data
parallel at 64K, zigzag ring attention to 700K) and torchtitan's Llama 3.1 8B on 8 H100 (FSDP2 + CP, float8), each
pinned through the CLI as its "planner" block says, and FlashAttention-2's own forward + backward benchmark, which
``compute.attention_time`` prices.

Measured with one set of constants (``pytest -s`` prints the table): EasyContext 64K data parallel +8.1 %, 512K and 700K
ring +6.2 % and +6.1 %; torchtitan 32K (FSDP 8) +10.0 %, 64K (FSDP 4, CP 2) +7.3 %. Outside 15 %, reported and not
fitted: EasyContext's 64K and 128K ring rows (+29 %, +65 %), which sit off the line their own table's other rows draw,
and torchtitan's CP 4 and CP 8 rows (+49 %, +59 %), whose attention would have to run at half FlashAttention-2's H100
rate."""

import json
from pathlib import Path

import pytest
from paths import ROOT

from megakit.core.planner.compute import attention_time
from megakit.core.planner.hardware import gpu_preset
from megakit.core.planner.model_spec import ModelSpec

DATA = json.loads((ROOT / "tests" / "data" / "long-sequence-runs.json").read_text())
ROWS = DATA["rows"]
MODELS = ROOT / "models"
TOLERANCE = 0.15  # every row held to it ("within": true)
KERNEL_TOLERANCE = 0.05  # FlashAttention-2's published bars; measured max 3.0 %


def _argv(row, tmp_path) -> list:
    """The row pinned as its "planner" block says: a Llama config.json from the shape fields, or a models/ preset."""
    q = row["planner"]
    if q["model"].startswith("models/"):
        model = MODELS / Path(q["model"].split()[0]).name
    else:
        model = tmp_path / f"{row['id']}.json"
        model.write_text(
            json.dumps(
                {
                    "model_type": "llama",
                    "architectures": ["LlamaForCausalLM"],
                    "vocab_size": row["vocab"],
                    "hidden_size": row["hidden"],
                    "intermediate_size": row["ffn"],
                    "num_hidden_layers": row["layers"],
                    "num_attention_heads": row["heads"],
                    "num_key_value_heads": row["kv_heads"],
                    "hidden_act": "silu",
                    "max_position_embeddings": 4096,
                    "rms_norm_eps": 1e-5,
                    "tie_word_embeddings": False,
                }
            )
        )
    flags = (
        "gpu",
        "gpus",
        "tp",
        "pp",
        "cp",
        "zero",
        "micro_batch",
        "global_batch",
        "seq_len",
        "recompute",
        "offload",
        "runtime",
        "kernels",
        "fp8",
    )
    return ["--model", model] + [x for key in flags for x in (f"--{key.replace('_', '-')}", q[key])]


def test_long_sequence_rows_through_the_cli(plan_json, tmp_path):
    """Each run keeps its layout and fits its GPU (it trained); the rows held to 15 % land there, and the two pairs
    reported outside it are ones the planner finds faster than measured (nothing fitted to pull them in)."""
    lines, errors = (
        [
            f"{'row':34s} {'cp':>2s} {'predicted':>9s} {'measured':>9s} {'error':>7s} {'hw TF/s':>7s} "
            f"{'mem GiB':>7s}  held"
        ],
        {},
    )
    for row in ROWS:
        got = plan_json(*_argv(row, tmp_path))
        assert (got["tp"], got["pp"], got["cp"], got["dp"]) == (row["tp"], row["pp"], row["cp"], row["dp"])
        assert got["peak_memory_gib"] <= got["gpu_memory_gib"], f"{row['id']} called out of memory"
        errors[row["id"]] = got["tokens_per_s"] / got["num_gpus"] / row["tokens_per_s_per_gpu"] - 1
        lines.append(
            f"{row['id']:34s} {row['cp']:2d} {got['tokens_per_s'] / got['num_gpus']:9.1f} "
            f"{row['tokens_per_s_per_gpu']:9.1f} {errors[row['id']]:+7.1%} "
            f"{got['hardware_tflops_per_gpu']:7.1f} {got['peak_memory_gib']:7.1f}  "
            f"{'15 %' if row['planner']['within'] else 'outside'}"
        )
    print("\n".join(lines))
    held = {k: e for k, e in errors.items() if next(r for r in ROWS if r["id"] == k)["planner"]["within"]}
    assert len(held) >= 5 and max(map(abs, held.values())) <= TOLERANCE, held
    assert all(errors[k] > TOLERANCE for k in errors.keys() - held.keys()), errors


def test_flash_attention_follows_its_own_benchmark():
    """FlashAttention-2's forward + backward, causal, head dim 128, at 512-16k tokens on A100 and H100 (its published
    figures, as its benchmark script counts FLOPs) is what ``attention_time`` prices, within 5 % at every length."""
    k = DATA["kernel"]
    errors = {}
    for point in k["rows"]:
        s, gpu = point["seq_len"], gpu_preset(point["gpu"])
        model = ModelSpec(
            name="fa2-bench",
            family="llama",
            layers=1,
            hidden=k["heads"] * k["head_dim"],
            heads=k["heads"],
            kv_heads=k["heads"],
            ffn=4 * k["heads"] * k["head_dim"],
            vocab_size=32000,
            seq_len=s,
            max_seq_len=s,
            tie_embeddings=False,
            dropout=0.0,
        )
        batch = k["tokens"] // s
        fwd, bwd = attention_time(
            model, gpu, tp=1, seq_len=s, micro_batch=batch, flash=True, peak=gpu.peak_tflops * 1e12, nbytes=2
        )
        flops = 3.5 * 4 * batch * s * s * k["head_dim"] * k["heads"] / 2
        errors[(point["gpu"], s)] = flops / (fwd + bwd) / 1e12 / point["tflops"] - 1
    print("\n".join(f"{g:10s} {s:6d} {e:+6.1%}" for (g, s), e in errors.items()))
    assert max(map(abs, errors.values())) <= KERNEL_TOLERANCE, errors


def test_easycontext_rows_that_miss_are_off_their_own_table_line():
    """Per-token time is linear in s (the weights' work per token is fixed, causal attention's grows with s), so the
    table's 512K and 700K ring rows fix a line. Its 64K data-parallel row lies on it (within 3 %); its 64K and 128K ring
    rows are 20 %+ slower than the line -- an excess no attention rate gives, which is why the planner is not fitted to
    them."""
    ec = {r["id"]: r for r in ROWS if r["id"].startswith("ec-")}
    (s1, t1), (s2, t2) = (
        (r["seq_len"], 1 / r["tokens_per_s_per_gpu"])
        for r in (ec["ec-a100x8-llama2-7b-s512k-ring8"], ec["ec-a100x8-llama2-7b-s700k-ring8"])
    )
    slope = (t2 - t1) / (s2 - s1)

    def line(s):
        return 1 / (t1 + slope * (s - s1))

    dp = ec["ec-a100x8-llama2-7b-s64k-dp"]
    assert line(dp["seq_len"]) == pytest.approx(dp["tokens_per_s_per_gpu"], rel=0.03)
    for name in ("ec-a100x8-llama2-7b-s64k-ring8", "ec-a100x8-llama2-7b-s128k-ring8"):
        assert line(ec[name]["seq_len"]) > 1.2 * ec[name]["tokens_per_s_per_gpu"], name
        assert not ec[name]["planner"]["within"]
