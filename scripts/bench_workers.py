"""How the multi-process bench scripts start their workers: ``world`` fresh processes (spawned, so nothing is
inherited) meeting over gloo on a free loopback port, each called as ``worker(rank, world, port, *args, results)``.
What they put on ``results`` comes back. A worker that dies ends the bench at once instead of at the timeout."""

import queue
import socket
import time


class WorkerFailed(RuntimeError):
    """A worker exited with an error (its traceback is above) or none replied in time."""


def run_workers(worker, world: int, *args, replies: int = 1, timeout: float = 1800.0) -> list:
    """Start the workers, wait for ``replies`` items on the shared queue and for every worker to exit cleanly."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(rank, world, port, *args, results)) for rank in range(world)]
    for p in procs:
        p.start()
    got, deadline = [], time.monotonic() + timeout
    try:
        while len(got) < replies:
            try:
                got.append(results.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise WorkerFailed("a worker process failed (see above)") from None
                if time.monotonic() > deadline:
                    raise WorkerFailed(f"no result from the workers within {timeout:.0f} s") from None
        for p in procs:
            p.join()
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join()
    if any(p.exitcode for p in procs):
        raise WorkerFailed("a worker process failed (see above)")
    return got
