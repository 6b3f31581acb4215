"""``scripts/bench_gpu.py --dry-run``: the whole GPU script on CPU with tiny shapes, so a typo never costs GPU time."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_gpu_dry_run_measures_every_variant_and_prints_the_table_last(tmp_path):
    out = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, OMP_NUM_THREADS="1", MEGAKIT_FP8_EMULATE="1"))  # fp8 emulated on CPU
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
    assert abs(rows["E"]["loss"] - rows["D"]["loss"]) < 1e-5  # chunking the loss changes no number
    assert rows["F-tw"]["loss"] != rows["E"]["loss"] and abs(rows["F-tw"]["loss"] - rows["E"]["loss"]) < 0.01
    attention = {row["choice"]: row for row in results["shapes"]["tiny-64"]["attention"]}
    assert any("math" in k for k in attention["math"]["kernels"]) and "needs a CUDA GPU" in attention["cudnn"]["error"]
    assert results["shapes"]["tiny-w2L-32"]["variants"][0]["step_s"] > 0  # a derived (fewer layers) shape
    parity = results["fp8_parity"]
    assert parity["fp8_gap"] < parity["bf16_spread"] and not parity["nan"], parity
    table = out.stdout.rstrip().splitlines()
    assert table[-1].startswith("tiny-w2L-32") and any(line.startswith("shape ") for line in table[-12:])
