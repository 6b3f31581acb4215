"""Benchmark: one transformer block, forward + backward, TP = 2 on 2 CPU processes (gloo).

megakit's block (``megakit.nn.model.Block``: column/row-parallel layers, Megatron f/g)
against the same block written as plain PyTorch and sharded with PyTorch's DTensor
tensor parallelism (``ColwiseParallel`` for q/k/v/gate/up, ``RowwiseParallel`` for
o/down), on the same shapes and the same weights, in one run. The two are timed in
alternating rounds so machine load hits both alike; the median round counts.

    python scripts/bench_tp.py                      # llama block, hidden 512, seq 512
    python scripts/bench_tp.py --family gpt2 --hidden 768 --heads 12 --ffn 3072
    python scripts/bench_tp.py --dropout 0.1        # both in training mode with dropout

With ``--dropout`` the reference uses PyTorch's own dropout (``F.dropout`` on the residual
branches, ``dropout_p`` in SDPA), whose masks depend on each rank's generator; megakit
draws its layout-free masks (the same units drop at every TP/PP/DP layout), so the ratio
is what that guarantee costs.

Prints both times and, last, ``ratio <megakit/reference>`` (below 1: megakit is faster).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_workers import WorkerFailed, run_workers  # noqa: E402

from megakit.errors import UsageError, finite_float  # noqa: E402


class ReferenceBlock(nn.Module):
    """The block as single-device PyTorch (batch-first), for DTensor to shard."""

    def __init__(self, config) -> None:
        super().__init__()
        h, q, kv = config.hidden, config.heads * config.head_dim, config.kv_heads * config.head_dim
        self.config, self.llama = config, config.family == "llama"
        norm = (
            (lambda: nn.RMSNorm(h, eps=config.norm_eps))
            if self.llama
            else (lambda: nn.LayerNorm(h, eps=config.norm_eps))
        )
        self.attn_norm, self.mlp_norm = norm(), norm()
        self.q_proj = nn.Linear(h, q, bias=config.qkv_bias)
        self.k_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.v_proj = nn.Linear(h, kv, bias=config.qkv_bias)
        self.o_proj = nn.Linear(q, h, bias=config.out_bias)
        if self.llama:
            self.gate_proj = nn.Linear(h, config.ffn, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, config.ffn, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.ffn, h, bias=config.mlp_bias)

    def forward(self, x, rope):  # (B, S, H)
        from megakit.nn.model import apply_rope

        p = self.config.dropout if self.training else 0.0
        drop = (lambda t: F.dropout(t, p)) if p else (lambda t: t)
        b, s, _ = x.shape
        d = self.config.head_dim
        y = self.attn_norm(x)
        q = self.q_proj(y).view(b, s, -1, d).transpose(1, 2)  # (B, nh/tp, S, d): local heads
        k = self.k_proj(y).view(b, s, -1, d).transpose(1, 2)
        v = self.v_proj(y).view(b, s, -1, d).transpose(1, 2)
        if self.llama:
            q, k = apply_rope(q, rope[0][:s], rope[1][:s]), apply_rope(k, rope[0][:s], rope[1][:s])
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        x = x + drop(self.o_proj(a.transpose(1, 2).reshape(b, s, -1)))
        y = self.mlp_norm(x)
        h = F.silu(self.gate_proj(y)) * self.up_proj(y) if self.llama else F.gelu(self.up_proj(y), approximate="tanh")
        return x + drop(self.down_proj(h))


def _megakit_names(name: str) -> str:
    return (
        name.replace("q_proj", "attn.q_proj")
        .replace("k_proj", "attn.k_proj")
        .replace("v_proj", "attn.v_proj")
        .replace("o_proj", "attn.o_proj")
        .replace("gate_proj", "mlp.gate_proj")
        .replace("up_proj", "mlp.up_proj")
        .replace("down_proj", "mlp.down_proj")
    )


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from megakit.nn.dropout import DropoutKeys
    from megakit.nn.model import Block, ModelConfig, load_full_state_dict, rope_tables
    from megakit.nn.topology import Topology

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    config = ModelConfig(
        family=args.family,
        vocab_size=256,
        max_seq_len=args.seq,
        hidden=args.hidden,
        layers=1,
        heads=args.heads,
        kv_heads=args.kv_heads or args.heads,
        ffn=args.ffn,
        qkv_bias=args.family == "gpt2",
        out_bias=args.family == "gpt2",
        mlp_bias=args.family == "gpt2",
        dropout=args.dropout,
    )
    topo = Topology.from_world(tp=world)

    torch.manual_seed(0)  # same full weights on both ranks, then DTensor shards them
    ref = ReferenceBlock(config)
    full = {_megakit_names(k): v.detach().clone() for k, v in ref.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    plan = {n: ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj", "up_proj")}
    plan.update({n: RowwiseParallel() for n in ("o_proj", "down_proj")})
    if config.family == "llama":
        plan["gate_proj"] = ColwiseParallel()
    parallelize_module(ref, mesh, plan)

    ours = Block(config, index=0, group=topo.tp_group, sequence_parallel=False, dtype=torch.float32, device=None)
    load_full_state_dict(ours, full, topo)
    rope = rope_tables(config, None) if config.family == "llama" else None

    x = torch.randn(args.batch, args.seq, args.hidden, generator=torch.Generator().manual_seed(1))
    x_ref = x.clone().requires_grad_()
    x_ours = x.transpose(0, 1).contiguous().requires_grad_()  # megakit is sequence-first

    def step_ref():
        ref.zero_grad(set_to_none=True)
        ref(x_ref, rope).sum().backward()

    steps = iter(range(10**9))

    def step_ours():
        ours.zero_grad(set_to_none=True)
        n = next(steps)
        keys = DropoutKeys.of(0, range(n * args.batch, (n + 1) * args.batch))  # fresh masks every step
        ours(x_ours, rope, keys).sum().backward()

    ours.eval(), ref.eval()  # compare outputs without dropout, then time in training mode
    diff = (ours(x_ours, rope, None).transpose(0, 1) - ref(x_ref, rope)).abs().max().item()
    ours.train(), ref.train()
    for _ in range(args.warmup):
        step_ours()
        step_ref()
    times = {"megakit": [], "reference": []}
    for i in range(args.reps):
        order = [("megakit", step_ours), ("reference", step_ref)]
        for name, step in order if i % 2 == 0 else order[::-1]:
            dist.barrier()
            t0 = time.perf_counter()
            step()
            dist.barrier()
            times[name].append(time.perf_counter() - t0)
    w = ref.q_proj.weight
    layout = f"{type(w).__name__} {list(w.placements)} local {tuple(w.to_local().shape)}"
    if rank == 0:
        results.put((diff, times, layout))
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=["llama", "gpt2"], default="llama")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=0, help="default: as many as heads")
    parser.add_argument("--ffn", type=int, default=1536)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--dropout", type=finite_float, default=0.0, help="dropout probability (both blocks, training mode)"
    )
    args = parser.parse_args(argv)
    world = 2
    try:
        if min(args.hidden, args.heads, args.ffn, args.seq, args.batch, args.reps) < 1 or args.warmup < 0:
            raise UsageError("sizes and --reps must be positive and --warmup non-negative")
        if not 0.0 <= args.dropout < 1.0:
            raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
        from megakit.nn.model import ModelConfig

        ModelConfig(
            family=args.family,
            vocab_size=256,
            max_seq_len=args.seq,
            hidden=args.hidden,
            layers=1,
            heads=args.heads,
            kv_heads=args.kv_heads or args.heads,
            ffn=args.ffn,
        ).check_tp(world)
    except UsageError as exc:
        print(f"bench_tp.py: error: {exc}", file=sys.stderr)
        return 2

    try:
        ((diff, times, layout),) = run_workers(_worker, world, args)
    except WorkerFailed as exc:
        print(f"bench_tp.py: error: {exc}", file=sys.stderr)
        return 1
    kv = args.kv_heads or args.heads
    print(
        f"one {args.family} block, TP=2 on 2 CPU processes (gloo, 1 thread each): batch {args.batch}, "
        f"seq {args.seq}, hidden {args.hidden}, heads {args.heads}/{kv} kv, ffn {args.ffn}, dropout {args.dropout}"
    )
    print(f"forward+backward, median of {args.reps} alternating rounds after {args.warmup} warm-up")
    print(f"reference q_proj weight: {layout}; max |output difference| megakit vs reference: {diff:.2e}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, label in (("megakit", "megakit TP layers"), ("reference", "PyTorch DTensor Colwise/RowwiseParallel")):
        print(f"{label:42s} {med[name] * 1e3:9.2f} ms  (min {min(times[name]) * 1e3:.2f} ms)")
    print(f"ratio {med['megakit'] / med['reference']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
