"""``scripts/bench_gpu.py --dry-run``: the whole GPU script on CPU with tiny shapes, so a typo never costs GPU time."""

import json
import os
import subprocess
import sys
from pathlib import Path

from multiproc import THREADS
from tolerance import fp32_bound

ROOT = Path(__file__).resolve().parent.parent
BF16_ROUNDOFF = 2.0**-9  # bf16 keeps 8 significant bits: a value is rounded to within 2^-9 of itself


def test_bench_gpu_dry_run_measures_every_variant_and_prints_the_table_last(tmp_path):
    out = subprocess.run(
        [sys.executable, "scripts/bench_gpu.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS=THREADS, MEGAKIT_FP8_EMULATE="1"),
    )  # fp8 emulated on CPU
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert {"torch", "deepspeed", "torchao", "cudnn"} <= set(results["environment"])
    assert results["ceilings"]["bf16_tflops"] > 0 and "6N + 12 L q S" in results["mfu_formula"]
    rows = {row["variant"]: row for row in results["shapes"]["tiny-64"]["variants"]}
    assert list(rows) == ["A", "B", "C", "D", "E", "F-tw", "F-rw", "A2"]
    for name in ("A", "B", "C", "D", "E", "F-tw", "F-rw", "A2"):  # every lever ran, the planner beside it
        assert rows[name]["step_s"] > 0 and rows[name]["planner"]["step_s"] > 0, rows[name]
    assert rows["B"]["micro"] > rows["A"]["micro"] and rows["C"]["settings"]["compile"]
    assert rows["A"]["loss"] == rows["A2"]["loss"]  # the same run twice: only its time may differ
    # Chunking the loss reorders the sum over the tokens, nothing else: before any update the two losses agree to
    # fp32 rounding over those tokens. After the updates they agree to bf16 rounding only: the chunked head rounds
    # its fp32 weight gradient to bf16 once, the unchunked one in its bf16 GEMM, and Adam turns a rounding in a
    # near-zero gradient element into a whole step of the other sign. A chunk left out or scaled wrongly moves the
    # loss by an eighth (one of 8 chunks), far past both bounds.
    e, d, tokens = rows["E"], rows["D"], rows["D"]["micro"] * 64  # tiny-64: sequences of 64 tokens
    assert abs(e["first_loss"] - d["first_loss"]) <= fp32_bound(d["first_loss"], tokens), (e, d)
    assert abs(e["loss"] - d["loss"]) <= BF16_ROUNDOFF * d["loss"], (e["loss"], d["loss"])
    assert rows["F-tw"]["loss"] != rows["E"]["loss"] and abs(rows["F-tw"]["loss"] - rows["E"]["loss"]) < 0.01
    attention = {row["choice"]: row for row in results["shapes"]["tiny-64"]["attention"]}
    assert any("math" in k for k in attention["math"]["kernels"]) and "needs a CUDA GPU" in attention["cudnn"]["error"]
    flex = attention["documents flex"]  # FlexAttention's block mask against SDPA's boolean mask, forward on CPU
    assert flex["max_gap"] <= fp32_bound(1.0, 64) and 0 < flex["kept_pairs"] < 1, flex
    ring = results["ring"]  # the CP ring's block loop: fused pairs against explicit blocks (256, 512 tokens here)
    assert [(r["choice"], r["local_tokens"]) for r in ring] == [
        (f"ring {n}", t) for t in (256, 512) for n in ("fused", "explicit")
    ], ring
    for fused in ring[::2]:  # fp32 on CPU: the gap is rounding over the row's keys
        assert fused["max_gap_out"] <= fp32_bound(1.0, fused["local_tokens"]), fused
        assert fused["max_gap_dq"] <= fp32_bound(1.0, fused["local_tokens"]), fused
    assert results["shapes"]["tiny-w2L-32"]["variants"][0]["step_s"] > 0  # a derived (fewer layers) shape
    moe = {row["family"]: row for row in results["moe"]}  # one MoE layer per family: looped, grouped, compiled
    assert list(moe) == ["moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny"], results["moe"]
    for row in moe.values():
        assert min(row["loop_ms"], row["grouped_ms"], row["compiled_ms"]) > 0
        assert (row["graphs"], row["breaks"]) == (1, 0)
        assert row["max_gap"] <= fp32_bound(1.0, row["tokens"]), row
    linear = {row["mixer"]: row for row in results["linear_attention"]}  # CPU: the torch forms both ways, exactly
    assert list(linear) == ["gdn", "mamba2"] and all(r["max_gap_out"] == r["max_gap_dx"] == 0 for r in linear.values())
    parity = results["fp8_parity"]
    assert parity["fp8_gap"] < parity["bf16_spread"] and not parity["nan"], parity
    table = out.stdout.rstrip().splitlines()
    assert table[-1].startswith("tiny-w2L-32") and any(line.startswith("shape ") for line in table[-12:])
