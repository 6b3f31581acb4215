"""Run a function on N real processes joined by a gloo process group (no mocks).

    results = run_ranks(worker, 4, some_arg)   # worker(rank, world_size, some_arg) -> picklable
    a, b = run_many([(worker, (1,)), (other, ())], 2)   # several workers in one job: one start for all

The worker must be a module-level function. Each rank runs single-threaded (2-core
machine); an exception on any rank is re-raised here with that rank's traceback, and a
job that does not finish within ``timeout_s`` is killed and reported, never left hanging.
"""

from __future__ import annotations

import datetime
import os
import queue
import random
import socket
import traceback

import torch.multiprocessing as mp

# Threads per rank: 1 on this 2-core machine. ``scripts/rounding_modes.py`` sets 2, so that every reduction runs in
# another order (as on another machine) and the tests show that their tolerances do not lean on one order.
THREADS = os.environ.get("MEGAKIT_TEST_THREADS", "1")

ISSUED_PORTS: set[int] = set()  # every port handed out here; conftest.py looks for buffers named with them


def free_port() -> int:
    """A free port for a job's rendezvous, below the ephemeral range (32768-60999 on Linux by default).

    An OS-assigned port is ephemeral, and so are the ports gloo's own connections take: between this call and
    the job's bind, a job running on the other pytest-xdist worker could take it (EADDRINUSE, seen in CI-like
    runs). Below that range only explicit binds land; each xdist worker draws from its own block of 1000 and
    never hands out a port twice, so two workers cannot collide either."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    block = int(worker[2:]) + 1 if worker[:2] == "gw" and worker[2:].isdigit() else 0
    low = 20000 + 1000 * (block % 12)
    for port in random.Random(os.getpid()).sample(range(low, low + 1000), 1000):
        if port in ISSUED_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ISSUED_PORTS.add(port)
        return port
    with socket.socket() as s:  # the block is spent: an OS-assigned port, as before
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ISSUED_PORTS.add(port)
    return port


# Ranks fork from one server that has imported these once, instead of each importing them anew: torch, DeepSpeed,
# and the Muon optimizer (with torch's compiler) that DeepSpeed's ZeRO check imports when it builds an engine -- about
# 6 s of CPU a rank on this machine. The server only imports, so no thread or process group is forked.
PRELOAD = [
    "torch",
    "torch.distributed",
    "deepspeed",
    "deepspeed.runtime.zero.muon.muon_optimizer",
    "megakit.train.trainer",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def _entry(fn, rank, world_size, port, results, args, environ):
    os.environ.clear()
    os.environ.update(environ)  # the caller's now, not the server's from when it started
    os.environ.update(
        OMP_NUM_THREADS=THREADS,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(THREADS))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        out = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        results.put((rank, True, out))
    except BaseException:  # report every failure to the parent, with its traceback
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes; return results by rank."""
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args, dict(os.environ)), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=timeout_s)
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(out))
                raise TimeoutError(f"ranks {missing} did not finish in {timeout_s}s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def _each(rank, world_size, calls):
    return [fn(rank, world_size, *args) for fn, args in calls]


def run_many(calls: list[tuple], world_size: int, *, timeout_s: float = 240.0) -> list[list]:
    """Run ``fn(rank, world_size, *args)`` for each ``(fn, args)`` in turn in ONE job (starting processes costs
    more than most workers); return, per call, its results by rank."""
    by_rank = run_ranks(_each, world_size, calls, timeout_s=timeout_s)
    return [[by_rank[r][i] for r in range(world_size)] for i in range(len(calls))]
