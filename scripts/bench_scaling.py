"""Data-parallel scaling on this machine, measured and predicted: one training step of a small GPT (fp32,
megakit's model, gradients all-reduced through megakit.nn.comm, AdamW) on 1, 2 and 4 processes, samples/s
and the efficiency against linear, beside the step time ``megakit plan --hardware`` predicts for the same
layout from a probe of the same process count. Last lines: ``ratio <predicted/measured step time>`` at the
largest size and ``efficiency <measured> predicted <planner>`` (target: within 25 % of each other)."""

import argparse
import json
import os
import statistics
import sys
import time

from bench_workers import run_workers

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ, MICRO = 512, 4, 8, 2048, 1024, 256, 4


def _config():
    from megakit.core.model_config import ModelConfig

    return ModelConfig(
        family="gpt2",
        vocab_size=VOCAB,
        max_seq_len=SEQ,
        hidden=HIDDEN,
        layers=LAYERS,
        heads=HEADS,
        kv_heads=HEADS,
        ffn=FFN,
        tie_embeddings=True,
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
    )


def _worker(rank, nproc, port, steps, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from megakit.nn import comm
    from megakit.nn.model import Transformer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    dist.init_process_group("gloo", rank=rank, world_size=nproc)
    model = Transformer(_config(), seed=0).train()
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    gen = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps + 2):
        ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=gen)
        comm.barrier(comm.WORLD)
        start = time.perf_counter()
        model(ids, ids).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        comm.all_reduce(flat, comm.WORLD)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p)).div_(nproc)
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    results.put((rank, statistics.median(times[2:])))


def measure(nproc: int, steps: int) -> float:
    """The slowest rank's median step time."""
    return max(step for _, step in run_workers(_worker, nproc, steps, replies=nproc, timeout=600))


def predict(profile: dict, nproc: int) -> float:
    from megakit.core.planner.cost import estimate_cost
    from megakit.core.planner.hardware import Cluster, gpu_from_profile
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.core.planner.plan import Plan
    from megakit.core.planner.sharding import LINK_EFFICIENCY

    gpu, per_node = gpu_from_profile(profile, link_efficiency=LINK_EFFICIENCY)
    spec = ModelSpec(config=_config(), name="bench-scaling", seq_len=SEQ)
    plan = Plan(dp=nproc, zero_stage=0, micro_batch=MICRO, accumulation=1, precision="fp32")
    return estimate_cost(spec, Cluster(gpu=gpu, num_gpus=nproc, gpus_per_node=per_node), plan).step_time_s


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", default="1,2,4", help="DP sizes to measure, the first the baseline (default 1,2,4)")
    parser.add_argument(
        "--hardware",
        help="a megakit probe profile for every size (default: probe each size now, "
        "since processes sharing the cores change the per-process rates)",
    )
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.nprocs.split(",")]
    fixed = json.loads(open(args.hardware).read()) if args.hardware else None
    print(
        f"model gpt2 {LAYERS}x{HIDDEN} (FFN {FFN}, vocab {VOCAB}), micro-batch {MICRO} x {SEQ} tokens per process, "
        "fp32, DP all-reduce through megakit.nn.comm"
    )
    print(
        f"{'DP':>3}{'samples/s':>11}{'step s':>9}{'predicted s':>13}{'ratio':>7}{'eff.':>7}{'pred. eff.':>12}   probe"
    )
    rows = []
    for n in sizes:
        if fixed is None:
            from megakit.train.cluster import probe

            profile = probe.run(n, hidden=HIDDEN, tokens=MICRO * SEQ, nbytes=16 * 2**20)
        else:
            profile = fixed
        predicted, measured = predict(profile, n), measure(n, args.steps)
        rows.append((n, measured, predicted))
        _, base_m, base_p = rows[0]  # weak scaling (the same batch per process): efficiency = base step / step
        eff, pred_eff = base_m / measured, base_p / predicted
        print(
            f"{n:>3}{n * MICRO / measured:>11.2f}{measured:>9.3f}{predicted:>13.3f}{predicted / measured:>7.2f}"
            f"{eff:>7.2f}{pred_eff:>12.2f}   matmul {profile['matmul_tflops']:.3g} TFLOP/s, all-reduce "
            f"{profile['links'].get('all_reduce', {}).get('bus_gbps', float('nan')):.3g} GB/s",
            flush=True,
        )
    print(
        f"(the planner's prediction is `megakit plan --hardware PROFILE` for the same layout: the profile's "
        f"rates replace --peak-tflops and --intra-bw; efficiency = samples/s against {sizes[0]} process(es) "
        "scaled linearly)"
    )
    print(f"ratio {rows[-1][2] / rows[-1][1]:.3f}")
    print(f"efficiency {eff:.3f} predicted {pred_eff:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
