"""Benchmark: context parallelism's attention, the fused ring against the explicit one, and the ring against Ulysses.

1. One rank's block loop (its own block, the diagonal one every rank computes): the ring on the fused kernel
   (``megakit.nn.attention.blocks._FusedBlockAttention``: chunk pairs, the masked ones skipped, each pair one
   LSE-returning flash call) against the explicit blocks (``_BlockAttention``: a (S/cp)^2 fp32 score matrix and its
   ``exp``), forward + backward. Each variant runs in a fresh process, so its peak resident memory over the
   inputs (``ru_maxrss``) is its own.
2. CP 2 over two processes (gloo): the ring against ``--cp-mode a2a`` (``megakit.nn.attention.ulysses``) on the same
   shapes, forward + backward, alternating rounds, the median counted.

    python scripts/bench_cp.py                          # 4k and 8k local tokens, 8 heads of 64, fp32
    python scripts/bench_cp.py --local-tokens 2048 --reps 2

Prints the figures per shape and, last, the ratios (``memory old/new``, ``speed new/old``, ``a2a/ring`` time).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_workers import WorkerFailed, run_workers  # noqa: E402


def _one_block(fused: bool, tokens: int, heads: int, dim: int, reps: int) -> dict:
    """In this process: the ring's own block, fused or explicit, ``reps`` timed fwd+bwd; peak RSS over the inputs."""
    import torch

    from megakit.nn.attention.ring import ring_attention

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, dim, generator=gen).requires_grad_() for _ in range(3))
    grad = torch.randn(1, heads, tokens, dim, generator=gen)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = []
    for _ in range(reps + 1):  # the first one warms up
        t0 = time.perf_counter()
        (ring_attention(q, k, v, None, fused=fused) * grad).sum().backward()
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base  # KiB on Linux
    return {"seconds": statistics.median(times[1:]), "peak_mib": peak / 1024}


def _ring_or_a2a(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from megakit.core.layout import Layout
    from megakit.nn.attention.ring import ring_attention
    from megakit.nn.attention.ulysses import ulysses_attention
    from megakit.nn.topology import Topology

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    topo = Topology(Layout(cp=world))
    tokens = args.local_tokens[0]
    gen = torch.Generator().manual_seed(1 + rank)
    q, k, v = (torch.randn(1, args.heads, tokens, args.dim, generator=gen).requires_grad_() for _ in range(3))

    def whole(a, b, c):
        return torch.nn.functional.scaled_dot_product_attention(a, b, c, is_causal=True)

    steps = {
        "ring": lambda: ring_attention(q, k, v, topo.cp_group).sum().backward(),
        "a2a": lambda: ulysses_attention(q, k, v, topo.cp_group, whole).sum().backward(),
    }
    times = {name: [] for name in steps}
    for i in range(args.reps + 1):
        for name, step in steps.items() if i % 2 == 0 else reversed(steps.items()):
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - t0)
    if rank == 0:
        results.put({name: statistics.median(t) for name, t in times.items()})
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--local-tokens",
        type=int,
        nargs="+",
        default=[4096, 8192],
        help="tokens a CP rank holds (each even); the CP 2 comparison uses the first",
    )
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block", choices=("fused", "explicit"), help=argparse.SUPPRESS)  # a child's one variant
    args = parser.parse_args(argv)
    if args.block:
        print(json.dumps(_one_block(args.block == "fused", args.local_tokens[0], args.heads, args.dim, args.reps)))
        return 0
    if (
        min(args.local_tokens + [args.heads, args.dim, args.reps]) < 1
        or any(t % 2 for t in args.local_tokens)
        or args.heads % 2
    ):
        print(
            "bench_cp.py: error: --local-tokens must be even and positive, --heads even (CP 2 splits them)",
            file=sys.stderr,
        )
        return 2
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    print(
        f"one CP rank's own block, {args.heads} heads of {args.dim}, fp32, forward + backward, median of "
        f"{args.reps}; each variant in a fresh process (peak resident memory over its inputs)"
    )
    ratios = []
    for tokens in args.local_tokens:
        row = {}
        for block in ("explicit", "fused"):
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--block",
                    block,
                    "--local-tokens",
                    str(tokens),
                    "--heads",
                    str(args.heads),
                    "--dim",
                    str(args.dim),
                    "--reps",
                    str(args.reps),
                ],
                capture_output=True,
                text=True,
                env=env,
                timeout=1800,
            )
            if out.returncode:
                print(out.stderr[-2000:], file=sys.stderr)
                return 1
            row[block] = json.loads(out.stdout.strip().splitlines()[-1])
        old, new = row["explicit"], row["fused"]
        print(
            f"  {tokens:6d} tokens: explicit {old['seconds'] * 1e3:8.1f} ms {old['peak_mib']:8.1f} MiB | "
            f"fused {new['seconds'] * 1e3:8.1f} ms {new['peak_mib']:8.1f} MiB"
        )
        ratios.append((tokens, old["peak_mib"] / max(new["peak_mib"], 1e-3), old["seconds"] / new["seconds"]))
    try:
        (cp2,) = run_workers(_ring_or_a2a, 2, args)
    except WorkerFailed as error:
        print(f"bench_cp.py: error: {error}", file=sys.stderr)
        return 1
    print(
        f"CP 2 over two processes (gloo, 1 thread each), {args.local_tokens[0]} tokens per rank: ring "
        f"{cp2['ring'] * 1e3:.1f} ms, a2a {cp2['a2a'] * 1e3:.1f} ms"
    )
    for tokens, memory, speed in ratios:
        print(f"ratio {tokens} tokens: memory old/new {memory:.1f}x, speed new/old {speed:.2f}x")
    print(f"ratio a2a/ring time {cp2['a2a'] / cp2['ring']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
