"""``megakit probe``: measure the machine the job will run on, for ``megakit plan --hardware``.

``nproc`` processes start the way a DP job does (torch.multiprocessing, one per GPU, or per share
of the CPU cores; NCCL on GPUs, gloo on CPUs) and measure side by side, so each sees the share of
the machine a training rank gets:

- matrix multiplies at the shapes a plan runs (tokens × hidden × hidden, × 4 hidden, head_dim
  attention panels), best TFLOP/s per shape; the device's HBM (or DRAM) copy bandwidth; fused
  attention (``scaled_dot_product_attention``) forward + backward;
- all-reduce, all-gather and reduce-scatter over all ``nproc`` ranks, and P2P between neighbours,
  as bus bandwidth (nccl-tests' convention: all-reduce moves ``2(n-1)/n`` of the data per rank,
  gather and scatter ``(n-1)/n``, P2P all of it), every collective through ``megakit.nn.comm``.

Rank 0 writes one JSON profile (each figure the slowest rank's; the matmul rate the median over the
shapes); ``megakit.core.planner.hardware.gpu_from_profile`` reads it.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import statistics
import time

import torch
import torch.nn.functional as F

from megakit.nn import comm

PROFILE_VERSION = 1


def _timed(fn, *, repeat: int, sync) -> float:
    """Median seconds of ``fn()`` after one warm-up call."""
    fn()
    sync()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _device_sync(device):
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def measure_compute(device, dtype, *, hidden: int, tokens: int, repeat: int) -> dict:
    """Matmul TFLOP/s at plan-like shapes, copy bandwidth (GB/s) and attention TFLOP/s on this device."""
    sync = _device_sync(device)
    shapes = [
        (tokens, hidden, hidden),
        (tokens, hidden, 4 * hidden),
        (tokens, 4 * hidden, hidden),
        (2 * tokens, 2 * hidden, 2 * hidden),
    ]
    operands = [
        (
            torch.randn(m, k, device=device, dtype=dtype),
            torch.randn(k, n, device=device, dtype=dtype),
            torch.empty(m, n, device=device, dtype=dtype),
        )
        for m, k, n in shapes
    ]
    for a, b, c in operands:  # warm up every shape first: clocks, thread pools, allocator
        _timed(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), repeat=2, sync=sync)
    matmul = []
    for (m, k, n), (a, b, c) in zip(shapes, operands):
        seconds = _timed(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c), repeat=repeat, sync=sync)
        matmul.append({"m": m, "k": k, "n": n, "tflops": 2 * m * k * n / seconds / 1e12})
    mib = 1024 if device.type == "cuda" else 64  # large enough to stream past the caches
    big = torch.empty(mib * 2**20 // torch.finfo(dtype).bits * 8, device=device, dtype=dtype)
    dst = torch.empty_like(big)
    copy_s = _timed(lambda: dst.copy_(big), repeat=repeat, sync=sync)
    heads, head_dim, seq = max(hidden // 64, 1), 64, max(tokens // 2, 64)
    q, k, v = (torch.randn(2, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def attention():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    attn_s = _timed(attention, repeat=repeat, sync=sync)
    attn_flops = 3.5 * 4 * 2 * heads * seq * seq * head_dim / 2  # forward + backward, causal (as cost.py counts)
    return {
        "matmul": matmul,
        "copy_gbps": 2 * big.numel() * big.element_size() / copy_s / 1e9,
        "attention_tflops": attn_flops / attn_s / 1e12,
        "attention_shape": [2, heads, seq, head_dim],
    }


def measure_links(device, dtype, *, nbytes: int, repeat: int) -> dict:
    """Bus bandwidth (GB/s) of the collectives over the world and of P2P between neighbour ranks."""
    n, me = comm.size(comm.WORLD), comm.rank(comm.WORLD)
    sync = _device_sync(device)
    elems = max(nbytes // torch.finfo(dtype).bits * 8 // n * n, n)
    x = torch.ones(elems, device=device, dtype=dtype)
    size = x.numel() * x.element_size()
    out = {}

    def timed(fn):
        comm.barrier(comm.WORLD)
        return _timed(fn, repeat=repeat, sync=sync)

    for kind, fn, factor in (
        ("all_reduce", lambda: comm.all_reduce(x, comm.WORLD), 2 * (n - 1) / n),
        ("all_gather", lambda: comm.all_gather(x[: elems // n], comm.WORLD), (n - 1) / n),
        ("reduce_scatter", lambda: comm.reduce_scatter(x, comm.WORLD), (n - 1) / n),
    ):
        seconds = timed(fn)
        out[kind] = {"bytes": size, "seconds": seconds, "bus_gbps": factor * size / seconds / 1e9}
    peer_next, peer_prev = (me + 1) % n, (me - 1) % n
    recv = torch.empty_like(x)

    def p2p():
        comm.send_and_receive([(x, peer_next, 7)], [(recv, peer_prev, 7)])

    seconds = timed(p2p)
    out["p2p"] = {"bytes": size, "seconds": seconds, "bus_gbps": size / seconds / 1e9}
    return out


def _worker(rank: int, nproc: int, port: int, settings: dict, results) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank)
    )
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))  # each rank its share of the cores
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            rank=rank,
            world_size=nproc,
            timeout=datetime.timedelta(seconds=settings["timeout_s"]),
        )
        comm.barrier(comm.WORLD)  # every rank measures at once, sharing the machine as training ranks do
        compute = measure_compute(
            device, dtype, hidden=settings["hidden"], tokens=settings["tokens"], repeat=settings["repeat"]
        )
        links = measure_links(device, dtype, nbytes=settings["bytes"], repeat=settings["repeat"]) if nproc > 1 else {}
        rows = comm.gather_object({"compute": compute, "links": links}, 0, comm.WORLD)
        dist.destroy_process_group()
        if rank == 0:
            results.put(("ok", _profile(rows, device, dtype, nproc, settings)))
    except BaseException as error:  # the parent turns it into one line
        results.put(("error", f"rank {rank}: {type(error).__name__}: {error}"))


def _profile(rows: list[dict], device, dtype, nproc: int, settings: dict) -> dict:
    """Rank 0's JSON: every rank's numbers reduced to the slowest rank (the one a step waits for)."""
    matmul = [
        {**shape, "tflops": min(r["compute"]["matmul"][i]["tflops"] for r in rows)}
        for i, shape in enumerate(rows[0]["compute"]["matmul"])
    ]
    links = {
        kind: {**rows[0]["links"][kind], "bus_gbps": min(r["links"][kind]["bus_gbps"] for r in rows)}
        for kind in rows[0]["links"]
    }
    if device.type == "cuda":
        name, mem = torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory
    else:
        name, mem = (
            f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads/rank)",
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / nproc,
        )
    return {
        "profile": "megakit-probe",
        "version": PROFILE_VERSION,
        "host": socket.gethostname(),
        "device": name,
        "device_type": device.type,
        "dtype": {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype],
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "nproc": nproc,
        "gpus_per_node": nproc,
        "memory_gib": mem / 2**30,
        "matmul": matmul,
        "matmul_tflops": statistics.median(m["tflops"] for m in matmul),
        "copy_gbps": min(r["compute"]["copy_gbps"] for r in rows),
        "attention_tflops": min(r["compute"]["attention_tflops"] for r in rows),
        "links": links,
        "settings": settings,
        "measured": datetime.datetime.now(datetime.timezone.utc).isoformat(),
    }


def run(nproc: int, *, hidden: int, tokens: int, nbytes: int, repeat: int = 5, timeout_s: float = 300.0) -> dict:
    """Start ``nproc`` processes, measure, and return rank 0's profile (raises RuntimeError on failure)."""
    import queue

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    settings = {"hidden": hidden, "tokens": tokens, "bytes": nbytes, "repeat": repeat, "timeout_s": timeout_s}
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, settings, results), daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    try:
        status, value = results.get(timeout=timeout_s)
    except queue.Empty:
        status, value = "error", f"no result within {timeout_s:.0f} s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    if status != "ok":
        raise RuntimeError(value)
    return value
