"""``scripts/bench_gpu.py --dry-run``: the whole GPU script on CPU with tiny shapes, so a typo never costs GPU time."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_bench_gpu_dry_run_measures_every_variant_and_prints_the_table_last(tmp_path):
    out = subprocess.run([sys.executable, "scripts/bench_gpu.py", "--dry-run", "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    results = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert {"torch", "deepspeed", "torchao", "cudnn"} <= set(results["environment"])
    assert results["ceilings"]["bf16_tflops"] > 0 and "6N + 12 L q S" in results["mfu_formula"]
    rows = {row["variant"]: row for row in results["shapes"]["tiny-64"]["variants"]}
    assert list(rows) == ["A", "B", "C", "D", "E", "F-tw", "F-rw", "A2"]
    for name in ("A", "B", "C", "D", "A2"):  # the levers of this branch ran, with the planner beside them
        assert rows[name]["step_s"] > 0 and rows[name]["planner"]["step_s"] > 0, rows[name]
    assert rows["B"]["micro"] > rows["A"]["micro"] and rows["C"]["settings"]["compile"]
    assert rows["A"]["loss"] == rows["A2"]["loss"]  # the same run twice: only its time may differ
    for name in ("E", "F-tw", "F-rw"):  # measured, or skipped in one line (another branch's flag; fp8 on CPU)
        assert "step_s" in rows[name] or rows[name]["skipped"].startswith(("not available", "refused")), rows[name]
    attention = {row["choice"]: row for row in results["shapes"]["tiny-64"]["attention"]}
    assert any("math" in k for k in attention["math"]["kernels"]) and "needs a CUDA GPU" in attention["cudnn"]["error"]
    assert results["shapes"]["tiny-w2L-32"]["variants"][0]["step_s"] > 0  # a derived (fewer layers) shape
    assert "fp8_parity" in results
    table = out.stdout.rstrip().splitlines()
    assert table[-1].startswith("tiny-w2L-32") and any(line.startswith("shape ") for line in table[-12:])
