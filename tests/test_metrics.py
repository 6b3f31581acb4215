"""CommTimer on real gloo processes, and the step metrics' arithmetic."""

import time

import torch
import torch.distributed as dist
from multiproc import run_ranks

from megakit.train.metrics import CommTimer, StepMetrics


def _worker(rank, world_size):
    timer = CommTimer.shared()
    assert CommTimer.shared() is timer  # one per process, even across runs
    timer.take()
    x = torch.ones(1000)
    dist.all_reduce(x)
    if rank == 0:
        time.sleep(0.3)  # rank 1 waits in the receive: that wait is communication time
        dist.isend(x, dst=1).wait()
    else:
        dist.irecv(x, src=0).wait()
    seconds = timer.take()
    calls = timer.last_calls
    # batched P2P (NCCL's default in the executor): P2POp must accept the wrapped isend/irecv
    op = dist.P2POp(dist.isend, x, 1) if rank == 0 else dist.P2POp(dist.irecv, x, 0)
    for work in dist.batch_isend_irecv([op]):
        work.wait()
    return seconds, calls, float(x[0])


def test_comm_timer_counts_blocking_and_async_calls():
    (s0, calls0, x0), (s1, calls1, x1) = run_ranks(_worker, 2)
    assert calls0 == calls1 == 2 and x0 == x1 == 2.0
    assert s1 >= 0.25 > s0 - 0.25  # the receiver was blocked while the sender slept


def test_step_metrics_arithmetic():
    m = StepMetrics(step=3, loss=2.0, lr=1e-3, grad_norm=0.5, seconds=2.0, samples=64, tokens=64 * 128,
                    flops=4e12, comm_seconds=0.5, comm_calls=3, world_size=4, peak_tflops=1.0)
    assert m.samples_per_s == 32 and m.tokens_per_s == 4096 and m.tflops == 2.0
    assert m.mfu == 0.5 and m.comm_share == 0.25
    assert "MFU 50.0%" in m.line() and "comm 25%" in m.line()
    cpu = StepMetrics(step=0, loss=1.0, lr=0.0, grad_norm=1.0, seconds=1.0, samples=1, tokens=1, flops=1.0,
                      comm_seconds=None, comm_calls=0, world_size=1, peak_tflops=None)
    assert cpu.mfu is None and "MFU" not in cpu.line() and "comm" not in cpu.line()
