"""Benchmark: one MoE layer, forward + backward, EP = 2 on 2 CPU processes (gloo), against DeepSpeed's MoE.

megakit's block (``megakit.nn.moe.layer.MoE``: fp32 router, sort-based all-to-all dispatch with variable
splits, stacked SwiGLU experts) against ``deepspeed.moe.layer.MoE`` (GShard top-2 gate, einsum
dispatch into an ``(E, capacity, H)`` buffer, equal-split all-to-all) with the same experts, the same
weights and the same tokens, in one run. DeepSpeed runs at capacity factor ``E / k``, so its capacity
is every token and it drops none (megakit is dropless); both route the same way (softmax, top-2,
renormalised), which the printed output difference confirms. The two are timed in alternating
rounds so machine load hits both alike; the median round counts. Each rank also times megakit at
EP = 1 against transformers' ``MixtralSparseMoeBlock`` on its own tokens (rank 0's figures shown), and
megakit's EP 2 folded over a TP pair (each TP rank routing its rows of the replicated input, the output
gathered back) against DeepSpeed's layer given those rows.

    python scripts/bench_moe.py                       # hidden 256, ffn 512, 8 experts, top-2, 1024 tokens/rank
    python scripts/bench_moe.py --experts 16 --tokens 2048

Prints the times and, last, ``ratio <megakit/DeepSpeed>`` (below 1: megakit is faster).
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

from megakit.errors import UsageError  # noqa: E402


class SwiGLU(nn.Module):
    """One expert as DeepSpeed takes it (a module it copies E/EP times)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


def _timed(steps: dict, reps: int, barrier) -> dict:
    times = {name: [] for name in steps}
    order = list(steps.items())
    for i in range(reps):
        for name, step in order if i % 2 == 0 else order[::-1]:
            barrier()
            t0 = time.perf_counter()
            step()
            barrier()
            times[name].append(time.perf_counter() - t0)
    return times


def _worker(rank: int, world: int, port: int, args, results) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.layer import MoE as DeepSpeedMoE
    from deepspeed.utils import groups
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    from megakit.core.layout import Layout
    from megakit.core.moe_config import MoEConfig
    from megakit.nn.moe.layer import MoE
    from megakit.nn.topology import Topology

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=600),
    )
    deepspeed.init_distributed(dist_backend="gloo")
    h, f, e, k = args.hidden, args.ffn, args.experts, 2
    config = MoEConfig(experts=e, top_k=k, ffn=f)
    torch.manual_seed(0)  # the same full weights on both ranks
    router = torch.randn(e, h) * 0.5
    gate_up, down = torch.randn(e, 2 * f, h) * h**-0.5, torch.randn(e, h, f) * f**-0.5

    def load(moe, ep_rank, local):
        with torch.no_grad():
            moe.gate.weight.copy_(router)
            moe.experts.gate_up_proj.copy_(gate_up[ep_rank * local : (ep_rank + 1) * local])
            moe.experts.down_proj.copy_(down[ep_rank * local : (ep_rank + 1) * local])
        return moe

    topo = Topology(Layout(dp=world, ep=world))
    ours = load(MoE(config, h, ep_group=topo.ep_group), topo.ep_rank, e // world)
    groups._create_expert_and_data_parallel(world)
    theirs = DeepSpeedMoE(
        h,
        SwiGLU(h, f),
        num_experts=e,
        ep_size=world,
        k=k,
        capacity_factor=e / k,
        eval_capacity_factor=e / k,
        min_capacity=0,
        drop_tokens=True,
        use_rts=False,
        top2_2nd_expert_sampling=False,
    )
    theirs.set_deepspeed_parallelism()
    with torch.no_grad():
        theirs.deepspeed_moe.gate.wg.weight.copy_(router)
        for i, expert in enumerate(theirs.deepspeed_moe.experts.deepspeed_experts):
            expert.gate_up.weight.copy_(gate_up[rank * (e // world) + i])
            expert.down.weight.copy_(down[rank * (e // world) + i])

    x = torch.randn(args.batch, args.tokens // args.batch, h, generator=torch.Generator().manual_seed(1 + rank))
    x_ours = x.transpose(0, 1).contiguous().requires_grad_()  # megakit is sequence-first
    x_theirs = x.clone().requires_grad_()
    with torch.no_grad():
        diff = (ours(x_ours).transpose(0, 1) - theirs(x_theirs)[0]).abs().max().item()

    def step(model, inp, out=lambda y: y):
        def run():
            model.zero_grad(set_to_none=True)
            out(model(inp)).sum().backward()

        return run

    for _ in range(args.warmup):
        step(ours, x_ours)()
        step(theirs, x_theirs, lambda y: y[0])()
    ep2 = _timed(
        {"megakit": step(ours, x_ours), "deepspeed": step(theirs, x_theirs, lambda y: y[0])}, args.reps, dist.barrier
    )

    # EP 2 folded over TP 2 (DP 1): both ranks hold the TP group's whole (S, B, H) input, each routes its S/TP rows
    # and the output is gathered back; DeepSpeed's layer gets the same rows of each rank to route (what it would
    # route with its duplicate tokens dropped), so both do the work of the ep2 row plus, for megakit, the gather.
    folded = Topology(Layout(tp=world, ep=world))
    ours_tp = load(MoE(config, h, group=folded.tp_group, ep_group=folded.ep_group), folded.ep_rank, e // world)
    rows = args.tokens // args.batch
    x_group = torch.randn(world * rows, args.batch, h, generator=torch.Generator().manual_seed(7))  # same on both
    x_tp = x_group.clone().requires_grad_()
    x_half = x_group[rank * rows : (rank + 1) * rows].transpose(0, 1).contiguous().requires_grad_()
    with torch.no_grad():
        diff_tp = (
            (ours_tp(x_tp)[rank * rows : (rank + 1) * rows].transpose(0, 1) - theirs(x_half)[0]).abs().max().item()
        )
    for _ in range(args.warmup):
        step(ours_tp, x_tp)()
        step(theirs, x_half, lambda y: y[0])()
    tp2 = _timed(
        {"megakit": step(ours_tp, x_tp), "deepspeed": step(theirs, x_half, lambda y: y[0])}, args.reps, dist.barrier
    )

    # EP = 1 against transformers' block, on this rank's tokens alone.
    single = load(MoE(config, h), 0, e)
    hf = MixtralSparseMoeBlock(
        MixtralConfig(hidden_size=h, intermediate_size=f, num_local_experts=e, num_experts_per_tok=k)
    )
    with torch.no_grad():
        hf.gate.weight.copy_(router)
        hf.experts.gate_up_proj.copy_(gate_up)
        hf.experts.down_proj.copy_(down)
        diff1 = (single(x_ours).transpose(0, 1) - hf(x_theirs)).abs().max().item()
    for _ in range(args.warmup):
        step(single, x_ours)()
        step(hf, x_theirs)()
    ep1 = _timed({"megakit": step(single, x_ours), "transformers": step(hf, x_theirs)}, args.reps, lambda: None)
    if rank == 0:
        results.put((diff, ep2, diff1, ep1, diff_tp, tp2))
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per rank (batch x sequence)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    world = 2
    try:
        if min(args.hidden, args.ffn, args.experts, args.tokens, args.batch, args.reps) < 1 or args.warmup < 0:
            raise UsageError("sizes and --reps must be positive and --warmup non-negative")
        if args.experts % world or args.tokens % args.batch:
            raise UsageError(f"--experts must be divisible by EP {world} and --tokens by --batch")
    except UsageError as exc:
        print(f"bench_moe.py: error: {exc}", file=sys.stderr)
        return 2

    try:
        ((diff, ep2, diff1, ep1, diff_tp, tp2),) = run_workers(_worker, world, args)
    except WorkerFailed as exc:
        print(f"bench_moe.py: error: {exc}", file=sys.stderr)
        return 1
    print(
        f"one MoE layer (SwiGLU experts), {args.experts} experts, top-2, hidden {args.hidden}, ffn {args.ffn}, "
        f"{args.tokens} tokens per rank; forward+backward, median of {args.reps} alternating rounds after "
        f"{args.warmup} warm-up; gloo, 1 thread per process"
    )
    med2 = {k: statistics.median(v) for k, v in ep2.items()}
    med1 = {k: statistics.median(v) for k, v in ep1.items()}
    print(f"EP 1, one process: max |output difference| vs transformers {diff1:.2e}")
    print(f"  megakit MoE (EP 1)                          {med1['megakit'] * 1e3:9.2f} ms")
    print(
        f"  transformers MixtralSparseMoeBlock          {med1['transformers'] * 1e3:9.2f} ms   "
        f"ratio {med1['megakit'] / med1['transformers']:.3f}"
    )
    print(f"EP 2, two processes: max |output difference| vs DeepSpeed {diff:.2e} (DeepSpeed drops no token)")
    print(f"  megakit MoE (all-to-all, variable splits)   {med2['megakit'] * 1e3:9.2f} ms")
    print(f"  deepspeed.moe.layer.MoE (capacity E/k)      {med2['deepspeed'] * 1e3:9.2f} ms")
    medtp = {k: statistics.median(v) for k, v in tp2.items()}
    print(f"EP 2 folded over TP 2 (DP 1): max |output difference| vs DeepSpeed {diff_tp:.2e}")
    print(f"  megakit MoE (EP over the TP pair, S/TP rows each, output gathered) {medtp['megakit'] * 1e3:9.2f} ms")
    print(
        f"  deepspeed.moe.layer.MoE (EP 2, the same rows per rank)             {medtp['deepspeed'] * 1e3:9.2f} ms   "
        f"ratio {medtp['megakit'] / medtp['deepspeed']:.3f}"
    )
    print(f"ratio {med2['megakit'] / med2['deepspeed']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
