"""Benchmark: megakit checkpoint save and load against a bare safetensors file of the same tensors.

One process (TP = 1), a Llama-family model built from flags (default ~200 M parameters,
fp32), with Adam's two moments per parameter as a resumable checkpoint holds them (~2.4 GB
in all). The reference is the floor for the same bytes: ``safetensors.torch.save_file`` of
weights and moments and ``load_file`` + ``load_state_dict``, with no checksum, no fsync, no
rename. megakit adds sha256 (computed while writing and while reading, in a second thread),
fsync and the atomic rename. Rounds alternate so machine load hits both alike, each timed
phase starts after an ``os.sync()``, and the median round counts.

    python scripts/bench_checkpoint.py --dir /dev/shm        # megakit's own cost, in RAM
    python scripts/bench_checkpoint.py                       # on disk: adds its write-back (on a VM disk,
                                                             # erratic: bare saves took 1-5 s run to run)
    python scripts/bench_checkpoint.py --hidden 2048 --layers 4 --dir /fast/disk

Prints save and load times and GB/s for both, and ``ratio <megakit/reference>`` of save + load
time (above 1: megakit's integrity checks cost that factor).

``--async-save`` (``megakit.interop.checkpoint_async``): the time a training step is held by a save
is, for a synchronous save, the whole save; for an asynchronous one, the copy of weights and moments
to host memory (as the trainer makes it: ``optimizer_state`` copies the moments, ``snapshot`` the
weights) and the hand-over to the writer thread; the first save also allocates the host buffers the
later ones reuse, so it is printed apart and the figure is the median of the others. Each round also
waits for the background write (``async write``, the time until the checkpoint is published). Printed last:
``async stall ratio <held / synchronous save>`` (the target: at most 0.3).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args()
    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file

    from megakit.interop.checkpoint import load_checkpoint, load_state, save_checkpoint, stage_checkpoint
    from megakit.interop.checkpoint_async import AsyncWriter
    from megakit.nn.model import ModelConfig, Transformer

    config = ModelConfig(
        family="llama",
        vocab_size=args.vocab,
        max_seq_len=2048,
        hidden=args.hidden,
        layers=args.layers,
        heads=args.hidden // 64,
        kv_heads=args.hidden // 64,
        ffn=4 * args.hidden,
    )
    model, other = Transformer(config, seed=0), Transformer(config, seed=1)
    state = {
        name: {"exp_avg": torch.randn_like(p) * 1e-3, "exp_avg_sq": torch.rand_like(p) * 1e-6}
        for name, p in model.named_parameters()
    }
    flat = {**model.state_dict(), **{f"{k}/{n}": t for n, per in state.items() for k, t in per.items()}}
    nbytes = sum(t.numel() * t.element_size() for t in flat.values())
    root = tempfile.mkdtemp(dir=args.dir, prefix="bench_checkpoint-")
    times = {
        k: [] for k in ("megakit save", "megakit load", "reference save", "reference load", "async held", "async write")
    }
    writer = AsyncWriter(None)
    try:
        for r in range(args.rounds):
            os.sync()  # no phase pays for another's write-back (megakit's fsync would flush it)
            start = time.perf_counter()
            save_checkpoint(os.path.join(root, "mk"), model, step=r, config=config, state=state)
            times["megakit save"].append(time.perf_counter() - start)
            os.sync()  # no phase pays for another's write-back (megakit's fsync would flush it)
            start = time.perf_counter()
            load_checkpoint(os.path.join(root, "mk"), other)
            moments = load_state(os.path.join(root, "mk"), other)
            times["megakit load"].append(time.perf_counter() - start)
            assert torch.equal(moments["norm.weight"]["exp_avg"], state["norm.weight"]["exp_avg"])
            os.sync()  # no phase pays for another's write-back (megakit's fsync would flush it)
            start = time.perf_counter()
            save_file(flat, os.path.join(root, "ref.safetensors"))
            times["reference save"].append(time.perf_counter() - start)
            os.sync()  # no phase pays for another's write-back (megakit's fsync would flush it)
            start = time.perf_counter()
            loaded = load_file(os.path.join(root, "ref.safetensors"))
            other.load_state_dict({k: v for k, v in loaded.items() if "/" not in k})
            times["reference load"].append(time.perf_counter() - start)
            del loaded, moments  # not in memory while the next phase runs
            os.sync()  # no phase pays for another's write-back (megakit's fsync would flush it)
            start = time.perf_counter()
            copy = writer.buffers.copy  # as save_run copies: into host buffers kept from the last save
            copies = {n: {k: copy(f"{k}/{n}", t) for k, t in per.items()} for n, per in state.items()}
            writer.submit(
                stage_checkpoint(os.path.join(root, "mk-async"), model, step=r, config=config, state=copies, copy=copy)
            )
            held = time.perf_counter()
            times["async held"].append(held - start)
            del copies  # the writer holds them until it is done
            writer.wait()
            times["async write"].append(time.perf_counter() - held)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"model: {config.num_params() / 1e6:.0f} M parameters; weights + Adam moments {nbytes / 1e9:.2f} GB fp32; "
        f"median of {args.rounds} rounds"
    )
    median = {k: statistics.median(v) for k, v in times.items()}
    for name, seconds in median.items():
        print(f"{name:15s} {seconds:7.3f} s   {nbytes / seconds / 1e9:6.2f} GB/s")
    ours = median["megakit save"] + median["megakit load"]
    ref = median["reference save"] + median["reference load"]
    print(f"ratio {ours / ref:.2f}")
    rounds = times["async held"]
    held, sync = statistics.median(rounds[1:] or rounds), median["megakit save"]
    print(
        f"step held by a save: synchronous {sync:.3f} s, --async-save {held:.3f} s (median after the first save, "
        f"which allocates the host buffers and held it {rounds[0]:.3f} s; then written in "
        f"{median['async write']:.3f} s in the background; rounds: {', '.join(f'{t:.2f}' for t in rounds)} s)"
    )
    print(f"async stall ratio {held / sync:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
