"""The planner with a probed profile against this machine: one data-parallel training step of a small GPT
(fp32, megakit's model, gradients all-reduced through megakit.nn.comm, AdamW) measured on ``--nproc``
processes, and the step time ``megakit plan --hardware`` predicts for the same layout. Without
``--hardware`` it probes first. Last line: ``ratio <predicted/measured>`` (target: within 0.75-1.25)."""

import argparse
import json
import os
import socket
import statistics
import sys
import time

HIDDEN, LAYERS, HEADS, FFN, VOCAB, SEQ, MICRO = 512, 4, 8, 2048, 1024, 256, 4


def _config():
    from megakit.core.model_config import ModelConfig

    return ModelConfig(family="gpt2", vocab_size=VOCAB, max_seq_len=SEQ, hidden=HIDDEN, layers=LAYERS, heads=HEADS,
                       kv_heads=HEADS, ffn=FFN, tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True)


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
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p)).div_(nproc)
            offset += p.numel()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    results.put((rank, statistics.median(times[2:])))


def measure(nproc: int, steps: int) -> float:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, steps, results)) for r in range(nproc)]
    for p in procs:
        p.start()
    step = max(results.get(timeout=600)[1] for _ in range(nproc))
    for p in procs:
        p.join()
    return step


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
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--hardware", help="a megakit probe profile (default: probe now)")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args(argv)
    if args.hardware:
        profile = json.loads(open(args.hardware).read())
    else:
        from megakit.train import probe

        profile = probe.run(args.nproc, hidden=HIDDEN, tokens=MICRO * SEQ, nbytes=16 * 2**20)
    predicted = predict(profile, args.nproc)
    measured = measure(args.nproc, args.steps)
    print(f"model gpt2 {LAYERS}x{HIDDEN} (FFN {FFN}, vocab {VOCAB}), micro-batch {MICRO} x {SEQ} tokens, "
          f"DP={args.nproc}, fp32, on {profile['device']}")
    print(f"probe: matmul {profile['matmul_tflops']:.3g} TFLOP/s, copy {profile['copy_gbps']:.3g} GB/s, all-reduce "
          f"{profile['links'].get('all_reduce', {}).get('bus_gbps', float('nan')):.3g} GB/s")
    print(f"step time: measured {measured:.3f} s, predicted {predicted:.3f} s")
    print(f"ratio {predicted / measured:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
