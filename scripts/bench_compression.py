"""DP gradient compression and local SGD against exact synchronous training, in one run.

Trains the same model, data and seed through the deepspeed launcher on ``--nproc`` CPU
processes (ZeRO 0, fp32; one int8 run at ZeRO 1, inside DeepSpeed's buckets) once per method, and prints,
per method, the DP bytes each rank
sent over the run against the dense fp32 all-reduce of the same gradients, and the final
loss (mean of the last 10 steps) against the uncompressed run's. Top-K is also run without
error feedback, to show what feedback buys. Last line:
``topk_bytes_saved <fraction> loss_gap <fraction>`` (Top-K with feedback).

    python scripts/bench_compression.py --steps 150
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from megakit.train.observe.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
METHODS = [  # (label, flags, goal: (least bytes saved, largest loss gap)) -- issue 9's targets
    ("none", [], None),
    ("fp16", ["--compress", "fp16"], (0.45, 0.01)),
    ("int8", ["--compress", "int8"], (0.70, 0.01)),
    ("int8, ZeRO 1", ["--compress", "int8", "--ds_config", str(ROOT / "ds_configs" / "zero1.json")], (0.70, 0.01)),
    ("sign", ["--compress", "sign"], (0.95, 0.05)),
    ("topk:0.01", ["--compress", "topk:0.01"], (0.90, 0.03)),
    ("topk:0.01 no-EF", ["--compress", "topk:0.01", "--no-error-feedback"], None),
    ("local-sgd 4", ["--local-sgd", "4"], (0.50, 0.05)),
]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(flags: list[str], *, nproc: int, steps: int, model: str, out: Path) -> dict:
    """One launcher run; its per-step metrics (rank 0)."""
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(nproc),
        "--master_port",
        str(_port()),
        str(ROOT / "scripts" / "train.py"),
        "--ds_config",
        str(ROOT / "ds_configs" / "zero0.json"),
        "--model",
        model,
        "--steps",
        str(steps),
        "--no-progress",
        "--log-every",
        str(10**6),
        "--metrics-out",
        str(out),
        *flags,
    ]
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_compression: {' '.join(flags) or 'baseline'} failed:\n{done.stderr[-2000:]}")
    return read_metrics(out)["steps"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="DP processes (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per run (default 150)")
    parser.add_argument("--model", default="gpt-mini")
    args = parser.parse_args(argv)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, flags, _) in enumerate(METHODS):
            print(f"[{i + 1}/{len(METHODS)}] {label} ...", file=sys.stderr, flush=True)
            rows[label] = run(flags, nproc=args.nproc, steps=args.steps, model=args.model, out=Path(tmp) / f"{i}.jsonl")
    final = {label: statistics.mean(s["loss"] for s in steps[-10:]) for label, steps in rows.items()}
    dense = sum(s["dp_bytes_dense"] or 0 for s in rows["fp16"])  # DeepSpeed's all-reduce is not counted by megakit
    print(
        f"{args.model}, {args.steps} steps, DP {args.nproc} (ZeRO 0 unless named, fp32), final loss = mean of the "
        "last 10 steps"
    )
    print(f"{'method':<18}{'MB sent/rank':>14}{'of dense':>10}{'saved':>8}{'final loss':>12}{'gap':>9}  goal")
    summary = {}
    for label, _flags, goal in METHODS:
        sent = dense if label == "none" else sum(s["dp_bytes"] for s in rows[label])
        saved, gap = 1 - sent / dense, (final[label] - final["none"]) / final["none"]
        summary[label] = (saved, gap)
        target = (
            ""
            if goal is None
            else (
                f">= {goal[0]:.0%} saved, gap <= {goal[1]:.0%}: "
                + ("met" if saved >= goal[0] and gap <= goal[1] else "MISSED")
            )
        )
        print(
            f"{label:<18}{sent / 1e6:>14.2f}{dense / 1e6:>10.2f}{saved:>8.1%}{final[label]:>12.4f}{gap:>+9.2%}  "
            f"{target}"
        )
    saved, gap = summary["topk:0.01"]
    print(f"topk_bytes_saved {saved:.4f} loss_gap {gap:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
