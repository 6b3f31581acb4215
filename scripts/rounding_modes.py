"""Run numerical tests with their sums in other orders, as another machine would, to show that no tolerance leans
on this CPU's rounding.

    python scripts/rounding_modes.py                       # the numerical tests, in each mode
    python scripts/rounding_modes.py tests/nn/test_model.py --modes isa-default

Another x86 machine changes the order of fp32 reductions in three ways, each a mode here:

- ``threads-2``: two threads per process and per rank (``OMP_NUM_THREADS``, ``MEGAKIT_TEST_THREADS``), so
  ATen and MKL split every long reduction in two;
- ``isa-default``: ATen's scalar kernels (``ATEN_CPU_CAPABILITY=default``) and MKL's and oneDNN's SSE4 ones
  (``MKL_ENABLE_INSTRUCTIONS``, ``ONEDNN_MAX_CPU_ISA``), another vector width for every sum;
- ``mkl-avx2``: MKL's AVX2 GEMMs, the code path MKL takes on AMD EPYC processors.

Each mode runs pytest once; the table comes last: each mode's counts and time.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = {
    "threads-2": {"OMP_NUM_THREADS": "2", "MEGAKIT_TEST_THREADS": "2"},
    "isa-default": {
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
    },
    "mkl-avx2": {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}
NUMERICAL = [
    "nn/test_chunked_loss.py",
    "test_bench_gpu.py",
    "nn/test_compile.py",
    "nn/test_tensor_parallel.py",
    "nn/test_context_parallel.py",
    "nn/test_pipeline.py",
    "nn/test_recompute.py",
    "nn/test_model.py",
    "interop/test_hf_rope.py",
    "nn/test_moe.py",
    "interop/test_moe_hf.py",
    "nn/test_overlapped_linear.py",
    "nn/test_zero3_linear.py",
    "nn/test_dropout.py",
    "train/test_gpu_levers.py",
    "core/test_compression.py",
    "nn/test_documents.py",
    "train/test_token_weighting.py",
    "interop/test_packing.py",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tests", nargs="*", help="test files or node ids (default: the numerical tests)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--pytest-args", default="-q -x", help="passed to pytest (default: -q -x)")
    args = parser.parse_args()
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.exit(2, f"rounding_modes.py: error: unknown mode(s) {', '.join(unknown)}; pick of {', '.join(MODES)}\n")
    tests = args.tests or [f"tests/{name}" for name in NUMERICAL if (ROOT / "tests" / name).exists()]
    rows = []
    for mode in modes:
        env = {**os.environ, "OMP_NUM_THREADS": "1", **MODES[mode]}  # one thread, as CI, unless the mode says
        print(f"== {mode}: {' '.join(f'{k}={v}' for k, v in MODES[mode].items())}", flush=True)
        start = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "pytest", *args.pytest_args.split(), *tests],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - start
        sys.stdout.write(out.stdout[-4000:])
        summary = next(
            (line for line in reversed(out.stdout.splitlines()) if re.search(r"\d+ (passed|failed)", line)),
            f"pytest exited {out.returncode}",
        )
        rows.append((mode, out.returncode, summary.strip("= "), seconds))
    print(f"\n{'mode':<12} {'rc':>3} {'seconds':>8}  result")
    for mode, code, summary, seconds in rows:
        print(f"{mode:<12} {code:>3} {seconds:>8.0f}  {summary}")
    return max(code for _, code, _, _ in rows)


if __name__ == "__main__":
    sys.exit(main())
