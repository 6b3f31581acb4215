"""Benchmark megakit's 1F1B and zero-bubble ZB-H1 executors against DeepSpeed's PipelineEngine on 2 CPU processes.

    python scripts/bench_pipeline.py [--model gpt-mini --micro-batches 8 --micro-batch-size 4 --seq-len 128]

Both run the same model (megakit ``Transformer`` stages, identical weights), the same
2-stage split and the same micro-batches, one optimizer step (SGD) per batch:
megakit's ``PipelineExecutor.step`` with the 1F1B schedule and with ZB-H1 (each backward
split into the input gradient B and the deferred weight gradient W), and DeepSpeed's
``PipelineEngine.train_batch`` (its ``TrainSchedule`` is the same 1F1B order). Embeddings
are untied for both, so neither does tied-weight communication the other does not,
and the last stage computes logits then ``F.cross_entropy`` in both, so only the
executors differ.
The three alternate step by step (so a change in the machine's load hits all alike).
Prints each one's median step time, megakit's measured bubbles next to the simulator's
predictions from the measured per-stage costs, and, last, ``ratio <megakit 1F1B/DeepSpeed>``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from torch import nn  # noqa: E402

from megakit.errors import UsageError  # noqa: E402


class _Stage(nn.Module):
    """A DeepSpeed pipeline layer: a megakit ``Transformer`` stage (the last one returns logits)."""

    def __init__(self, config, layers, pre, post, seed):  # built by LayerSpec on its own stage only
        super().__init__()
        from megakit.nn.model import Transformer

        self.stage = Transformer(config, layers=layers, pre=pre, post=post, seed=seed)

    def forward(self, x):
        return self.stage(x)


class _LogitsLoss(nn.Module):
    """megakit's last stage computing its loss exactly as the DeepSpeed run's ``loss_fn`` does."""

    def __init__(self, stage):
        super().__init__()
        self.stage = stage

    def forward(self, x, labels=None):
        return _logits_loss(self.stage(x), labels)


def _logits_loss(logits, labels):
    import torch.nn.functional as F

    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def _timed(run_step) -> float:
    """Wall time of one step, ended when its slowest rank ends it (ranks start together)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    run_step()
    took = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def _worker(rank: int, args, port: int, queue) -> None:
    os.environ.update(
        OMP_NUM_THREADS="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_SIZE="2",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        queue.put((rank, _bench(rank, args)))
    except BaseException as error:  # the parent reports it
        import traceback

        queue.put((rank, error if isinstance(error, UsageError) else RuntimeError(traceback.format_exc())))


def _bench(rank: int, args) -> dict:
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    from megakit.core.layout import Layout
    from megakit.core.partition import partition_layers
    from megakit.core.schedules import build_schedule, schedule_1f1b
    from megakit.core.simulator import Costs, simulate
    from megakit.nn.model import ModelConfig, build_stage_chunks
    from megakit.nn.pipeline.executor import PipelineExecutor
    from megakit.nn.topology import Topology
    from megakit.train.engine.deepspeed_shm import unlink_shared_memory

    config = ModelConfig.load(args.model).replace(tie_embeddings=False)
    m, b, s = args.micro_batches, args.micro_batch_size, args.seq_len
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, config.vocab_size, (m, b, s + 1), generator=g)
    ids, labels = [x[:, :-1].contiguous() for x in data], [x[:, 1:].contiguous() for x in data]

    # -- megakit 1F1B ----------------------------------------------------------------------------
    topo = Topology(Layout(pp=2))
    chunks = build_stage_chunks(config, topo, seed=0)
    opt = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=1e-3)

    def step_and_zero():
        opt.step()
        opt.zero_grad(set_to_none=True)

    if topo.is_last_stage:  # same loss computation as DeepSpeed's loss_fn: only the executors differ
        chunks = [_LogitsLoss(chunks[0])]
    executor = PipelineExecutor(
        chunks, topo, schedule=schedule_1f1b(2, m), activation_shape=(s, b, config.hidden), optimizer_step=step_and_zero
    )
    zero_bubble = PipelineExecutor(
        chunks,
        topo,
        schedule=build_schedule("zb-h1", 2, m),
        activation_shape=(s, b, config.hidden),
        optimizer_step=step_and_zero,
    )
    stage_times, zb_times = [], []

    def megakit_step():
        executor.step(ids if topo.is_first_stage else None, labels if topo.is_last_stage else None)
        stage_times.append(executor.last_times)

    def zb_step():
        zero_bubble.step(ids if topo.is_first_stage else None, labels if topo.is_last_stage else None)
        zb_times.append(zero_bubble.last_times)

    # -- DeepSpeed PipelineEngine ---------------------------------------------------------------
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the process group already set up
    ranges = partition_layers(config, 2)
    specs = [LayerSpec(_Stage, config, ranges[0], True, False, 0), LayerSpec(_Stage, config, ranges[1], False, True, 0)]
    module = PipelineModule(layers=specs, num_stages=2, loss_fn=_logits_loss, partition_method="uniform")
    ds_config = {
        "train_micro_batch_size_per_gpu": b,
        "gradient_accumulation_steps": m,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0},
    }
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.SGD(module.parameters(), lr=1e-3), config=ds_config
    )
    unlink_shared_memory()  # DeepSpeed's CPU all-reduce buffers: leave none behind in /dev/shm

    def ds_step():
        engine.train_batch(iter(list(zip(ids, labels))))

    # rotate the three, step by step, so that a change in the machine's load hits all alike
    runs, times = (megakit_step, zb_step, ds_step), ([], [], [])
    for i in range(args.warmup + args.steps):
        took = {}
        for k in range(3):
            j = (i + k) % 3
            took[j] = _timed(runs[j])
        if i >= args.warmup:
            for j in range(3):
                times[j].append(took[j])
    ours, zb, theirs = times
    mine = stage_times[args.warmup :]
    fwd = statistics.median(t.forward for t in mine) / m
    bwd = statistics.median(t.backward for t in mine) / m
    bubble = statistics.mean(t.bubble for t in mine)
    zb_mine = zb_times[args.warmup :]
    zb_bubble, zb_bwd = statistics.mean(t.bubble for t in zb_mine), statistics.median(t.backward for t in zb_mine) / m
    costs = [torch.tensor([fwd, bwd, bubble, zb_bubble, zb_bwd]) for _ in range(2)]
    torch.distributed.all_gather(costs, torch.tensor([fwd, bwd, bubble, zb_bubble, zb_bwd]))
    forward, backward = tuple(float(c[0]) for c in costs), tuple(float(c[1]) for c in costs)
    sim = simulate(schedule_1f1b(2, m), Costs(forward=forward, backward=backward))
    sim_zb = simulate(build_schedule("zb-h1", 2, m), Costs(forward=forward, backward=backward, weight=0.5))

    return dict(
        ours=statistics.median(ours),
        zb=statistics.median(zb),
        theirs=statistics.median(theirs),
        bubble=[float(c[2]) for c in costs],
        sim_bubble=list(sim.bubble_per_stage),
        sim_step=sim.step_time,
        zb_bubble=[float(c[3]) for c in costs],
        sim_zb_bubble=list(sim_zb.bubble_per_stage),
        sim_zb_step=sim_zb.step_time,
        zb_backward=[float(c[4]) for c in costs],
        costs=[(float(c[0]), float(c[1])) for c in costs],
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt-mini")
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        from megakit.nn.model import ModelConfig

        config = ModelConfig.load(args.model)
        for flag in ("micro_batches", "micro_batch_size", "seq_len", "steps"):
            if getattr(args, flag) < 1:
                raise UsageError(f"--{flag.replace('_', '-')} must be a positive integer, got {getattr(args, flag)}")
        if args.seq_len > config.max_seq_len:
            raise UsageError(
                f"--seq-len {args.seq_len} exceeds {args.model}'s max_seq_len {config.max_seq_len}; lower it"
            )
        if config.layers < 2:
            raise UsageError(f"{args.model} has {config.layers} layer; a 2-stage split needs at least 2")

        import torch.multiprocessing as mp

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, args, port, queue), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        results = dict(queue.get(timeout=900) for _ in procs)
        for p in procs:
            p.join(timeout=30)
        for value in results.values():
            if isinstance(value, BaseException):
                raise value
    except UsageError as error:
        print(f"bench_pipeline: error: {error}", file=sys.stderr)
        return 2
    r = results[0]
    print(
        f"model {args.model} (untied), 2 stages, {args.micro_batches} micro-batches of {args.micro_batch_size} x "
        f"{args.seq_len} tokens, 2 CPU processes, median of {args.steps} steps"
    )
    print(
        f"per-micro-batch costs (forward, backward) s: stage 0 {r['costs'][0][0]:.4f}, {r['costs'][0][1]:.4f}; "
        f"stage 1 {r['costs'][1][0]:.4f}, {r['costs'][1][1]:.4f}"
    )
    print(f"megakit 1F1B step:              {r['ours'] * 1e3:8.1f} ms")
    print(f"megakit ZB-H1 step:             {r['zb'] * 1e3:8.1f} ms")
    print(f"DeepSpeed PipelineEngine step:  {r['theirs'] * 1e3:8.1f} ms")
    print(
        f"bubble per stage, measured (megakit): {r['bubble'][0]:.1%}, {r['bubble'][1]:.1%}; "
        f"simulator with the measured costs: {r['sim_bubble'][0]:.1%}, {r['sim_bubble'][1]:.1%} "
        f"(step {r['sim_step'] * 1e3:.1f} ms); formula at equal stages (p-1)/(m+p-1): "
        f"{1 / (args.micro_batches + 1):.1%}"
    )
    print(
        f"ZB-H1: B + W per micro-batch s: stage 0 {r['zb_backward'][0]:.4f}, stage 1 {r['zb_backward'][1]:.4f} "
        f"(1F1B's whole backward above); bubble measured {r['zb_bubble'][0]:.1%}, {r['zb_bubble'][1]:.1%}; "
        f"simulator with the measured costs, W = half the backward: {r['sim_zb_bubble'][0]:.1%}, "
        f"{r['sim_zb_bubble'][1]:.1%} (step {r['sim_zb_step'] * 1e3:.1f} ms)"
    )
    print(f"ratio ZB-H1/1F1B {r['zb'] / r['ours']:.3f}, ZB-H1/DeepSpeed {r['zb'] / r['theirs']:.3f}")
    print(f"ratio {r['ours'] / r['theirs']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
