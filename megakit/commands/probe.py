"""``megakit probe``: measure this machine (matmul, memory, attention, collectives) into a profile that
``megakit plan --hardware PROFILE.json`` plans with instead of a GPU preset.

The measuring runs in ``megakit.train.cluster.probe`` (torch); this module parses, checks and writes.
"""

from __future__ import annotations

import argparse

from megakit.core.planner.emit import write_json_atomic
from megakit.errors import UsageError


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds ``megakit probe``'s flags (each command module owns its own, so ``cli`` stays a table)."""
    parser.add_argument("--nproc", type=int, default=1, help="processes to start, one per GPU (or CPU share)")
    parser.add_argument("--out", required=True, metavar="PROFILE.json", help="where to write the profile")
    parser.add_argument("--hidden", type=int, help="hidden size of the plan-like GEMMs (default 4096 GPU, 512 CPU)")
    parser.add_argument("--tokens", type=int, help="tokens per micro-batch of the GEMMs (default 8192 GPU, 1024 CPU)")
    parser.add_argument("--bytes", type=int, help="collective message size (default 256 MiB GPU, 16 MiB CPU)")
    parser.add_argument("--repeat", type=int, default=5, help="timed repetitions per measurement (median)")


def run(args) -> int:
    """Measures this machine's GEMM and collective speeds into a profile that ``megakit plan --hardware`` reads."""
    for name in ("nproc", "hidden", "tokens", "bytes", "repeat"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be a positive integer, got {value}")
    if not args.out.endswith(".json"):
        raise UsageError(f"--out {args.out} should name a .json file, e.g. --out hw.json")
    import torch

    from megakit.train.cluster import probe

    gpu = torch.cuda.is_available()
    if gpu and args.nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {args.nproc} exceeds the {torch.cuda.device_count()} GPUs here; use at most that")
    try:
        profile = probe.run(
            args.nproc,
            hidden=args.hidden or (4096 if gpu else 512),
            tokens=args.tokens or (8192 if gpu else 1024),
            nbytes=args.bytes or (256 if gpu else 16) * 2**20,
            repeat=args.repeat,
        )
    except RuntimeError as error:
        raise UsageError(f"the probe failed: {error}") from None
    write_json_atomic(args.out, profile)
    links = ", ".join(f"{k} {v['bus_gbps']:.2f}" for k, v in profile["links"].items()) or "none (one process)"
    print(
        f"{profile['device']} x {profile['nproc']} ({profile['backend']}, {profile['dtype']}): matmul "
        f"{profile['matmul_tflops']:.3g} TFLOP/s, copy {profile['copy_gbps']:.3g} GB/s, attention "
        f"{profile['attention_tflops']:.3g} TFLOP/s; bus bandwidth GB/s: {links}"
    )
    print(f"wrote {args.out}; plan with: megakit plan --hardware {args.out} ...")
    return 0
