"""Benchmark: Muon (``--optimizer muon``) against AdamW on the same model, data and tokens, in one process.

Two parts, one run:

1. Step time at a few widths (a Llama-family model, byte tokens): the forward + backward time of a global batch
   (``--accumulation`` micro-batches) and the optimizer's time of each, and the optimizer's share of the step
   (median of a few steps). Newton-Schulz costs about ``30 m^2 n`` FLOPs per ``m x n`` matrix against ``6 T m n``
   for the step's ``T`` tokens, so its share falls with the tokens per step (~5 x width / T). Newton-Schulz runs in
   bf16, as torch.optim.Muon's does; on a CPU without bf16 GEMMs that share is far above a GPU's. The figure to
   read is the largest width's (the target: at most 10 %).
2. Training: both optimizers from the same initial weights over the same batches (byte tokens of the Python
   standard library) and the same warm-up + cosine schedule at the same lr (Muon's ``match_rms_adamw`` lets it
   reuse AdamW's lr and weight decay): the loss curve of each as a table and a PNG (matplotlib if installed), and
   the tokens each needs to reach AdamW's final loss (smoothed over a few steps).

    python scripts/bench_muon.py                      # a few minutes on a loaded 2-core CPU
    python scripts/bench_muon.py --steps 300 --widths 128 256 512 --png muon.png
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _model(width: int, layers: int, seq_len: int):
    from megakit.core.model_config import ModelConfig

    base = ModelConfig.load(os.path.join(os.path.dirname(__file__), "..", "models", "llama-tiny.json"))
    heads = max(width // 32, 1)
    return dataclasses.replace(
        base, hidden=width, ffn=int(width * 8 / 3) // 8 * 8, layers=layers, heads=heads, kv_heads=heads,
        head_dim=32, max_seq_len=seq_len,
    )  # fmt: skip


def _tokens(limit: int) -> torch.Tensor:
    """Byte tokens of the standard library's sources (vocabulary 256), as one long stream."""
    from megakit.train.data.batches import stdlib_files

    chunks, total = [], 0
    for path in stdlib_files():
        data = open(path, "rb").read()
        if not data:
            continue
        chunks.append(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        total += len(data)
        if total >= limit:
            break
    return torch.cat(chunks).long()[:limit]


def _optimizer(kind: str, net, *, lr: float, weight_decay: float):
    from megakit.train.engine.muon import ADAMW_BETAS, MuonWithAdamW, muon_groups
    from megakit.train.engine.optim import decay_groups

    if kind == "muon":
        return MuonWithAdamW(muon_groups(net, weight_decay=weight_decay), lr=lr, weight_decay=weight_decay)
    return torch.optim.AdamW(decay_groups(net), lr=lr, betas=ADAMW_BETAS, eps=1e-8, weight_decay=weight_decay)


def _batch(stream: torch.Tensor, step: int, batch: int, seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 100_003 + step)
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch,), generator=gen)
    rows = torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


def step_times(width: int, args, stream) -> dict[str, tuple[float, float]]:
    """Per optimizer: (median forward + backward seconds, median optimizer seconds) at ``width``."""
    from megakit.nn.model import Transformer

    config = _model(width, args.layers, args.seq_len)
    out = {}
    for kind in ("adamw", "muon"):
        net = Transformer(config, seed=args.seed)
        opt = _optimizer(kind, net, lr=args.lr, weight_decay=args.weight_decay)
        fb, op = [], []
        for step in range(args.timed_steps + 1):
            t0 = time.perf_counter()
            for micro in range(args.accumulation):  # one optimizer step per global batch, as in training
                x, y = _batch(stream, step * args.accumulation + micro, args.batch, args.seq_len, args.seed)
                net(x, y).backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if step:  # the first builds the state
                fb.append(t1 - t0)
                op.append(t2 - t1)
        out[kind] = (statistics.median(fb), statistics.median(op))
    return out


def _lr(step: int, steps: int, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def train(args, stream) -> dict[str, list[float]]:
    """Both optimizers' per-step losses, from the same weights over the same batches."""
    from megakit.nn.model import Transformer

    config = _model(args.train_width, args.layers, args.seq_len)
    start = Transformer(config, seed=args.seed)
    losses = {}
    for kind in ("adamw", "muon"):
        net = copy.deepcopy(start)
        opt = _optimizer(kind, net, lr=args.lr, weight_decay=args.weight_decay)
        curve = []
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = args.lr * _lr(step, args.steps, args.warmup)
            x, y = _batch(stream, step, args.batch, args.seq_len, args.seed)
            loss = net(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(float(loss.detach()))
        losses[kind] = curve
    return losses


def smooth(curve: list[float], window: int) -> list[float]:
    """The mean of the last ``window`` losses at each step (fewer at the start)."""
    return [statistics.fmean(curve[max(0, i - window + 1) : i + 1]) for i in range(len(curve))]


def tokens_to_reach(curve: list[float], target: float, tokens_per_step: int) -> int | None:
    """Tokens after which the smoothed ``curve`` first reaches ``target`` (None: never)."""
    for i, loss in enumerate(curve):
        if loss <= target:
            return (i + 1) * tokens_per_step
    return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--widths", type=int, nargs="+", default=[128, 256], help="hidden sizes timed (part 1)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--accumulation", type=int, default=8, help="micro-batches per timed optimizer step (part 1)")
    p.add_argument("--timed-steps", type=int, default=2)
    p.add_argument("--train-width", type=int, default=128, help="hidden size trained (part 2)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--smooth", type=int, default=10, help="steps the loss is averaged over to compare")
    p.add_argument("--png", default="bench_muon.png", help="where the loss plot goes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    stream = _tokens(4 << 20)
    tokens = args.accumulation * args.batch * args.seq_len
    print(
        f"step time, one process, {args.accumulation} micro-batches of {args.batch} x {args.seq_len} = "
        f"{tokens} tokens, "
    )
    print(f"{args.layers} layers (Newton-Schulz's FLOPs are about 5 x width / tokens of the step's):")
    print(
        f"{'width':>6} {'params':>8} | {'AdamW step':>10} {'opt':>7} {'share':>6} | "
        f"{'Muon step':>10} {'opt':>7} {'share':>6}"
    )
    for width in args.widths:
        times = step_times(width, args, stream)
        config = _model(width, args.layers, args.seq_len)
        cells = []
        for kind in ("adamw", "muon"):
            fb, op = times[kind]
            cells.append(f"{(fb + op) * 1e3:8.1f}ms {op * 1e3:6.1f}ms {100 * op / (fb + op):5.1f}%")
        print(f"{width:>6} {config.num_params() / 1e6:7.2f}M | {cells[0]} | {cells[1]}")
    losses = train(args, stream)
    per_step = args.batch * args.seq_len
    print(f"\nloss, width {args.train_width}, {args.steps} steps of {per_step} tokens, lr {args.lr:g} (both):")
    print(f"{'tokens':>8} {'AdamW':>8} {'Muon':>8}")
    for i in list(range(0, args.steps, max(args.steps // 10, 1))) + [args.steps - 1]:
        print(f"{(i + 1) * per_step:>8} {losses['adamw'][i]:8.4f} {losses['muon'][i]:8.4f}")
    smoothed = {k: smooth(v, args.smooth) for k, v in losses.items()}
    target = smoothed["adamw"][-1]
    print(f"\ntokens to reach AdamW's final loss {target:.4f} (mean of {args.smooth} steps):")
    for kind in ("adamw", "muon"):
        reached = tokens_to_reach(smoothed[kind], target, per_step)
        print(f"  {kind:<6} {reached if reached is not None else 'not reached':>8}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install matplotlib)")
        return 0
    tokens = [(i + 1) * per_step for i in range(args.steps)]
    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, label in (("adamw", "AdamW"), ("muon", "Muon + AdamW")):
        ax.plot(tokens, smoothed[kind], label=label)
    ax.set_xlabel("tokens")
    ax.set_ylabel(f"training loss (mean of {args.smooth} steps)")
    ax.set_title(f"width {args.train_width}, {args.layers} layers, lr {args.lr:g}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.png, dpi=120)
    print(f"plot: {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
