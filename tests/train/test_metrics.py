"""The communication door's meter on real gloo processes, and the step metrics' arithmetic."""

import time

import torch
import torch.distributed as dist
from multiproc import run_ranks

from megakit.nn import comm
from megakit.train.observe.metrics import StepMetrics


def _worker(rank, world_size):
    meter = comm.Meter()
    x = torch.ones(1000)
    comm.all_reduce(x, comm.WORLD)  # not metered: outside the hook
    assert meter.take() == (0.0, 0)
    with comm.metered(meter):
        comm.all_reduce(x, comm.WORLD)
        if rank == 0:
            time.sleep(0.3)  # rank 1 waits in the receive: that wait is communication time
            comm.isend(x, 1).wait()
        else:
            comm.irecv(x, 0).wait()
    seconds, calls = meter.take()
    # batched P2P (NCCL's default in the executor)
    sends, receives = ([(x, 1, 0)], []) if rank == 0 else ([], [(x, 0, 0)])
    comm.send_and_receive(sends, receives)
    return seconds, calls, float(x[0])


def test_the_door_meters_blocking_and_async_calls_without_touching_torch():
    originals = {name: getattr(dist, name) for name in ("all_reduce", "isend", "irecv", "batch_isend_irecv")}
    (s0, calls0, x0), (s1, calls1, x1) = run_ranks(_worker, 2)
    assert calls0 == calls1 == 2 and x0 == x1 == 4.0  # two all-reduces of ones over 2 ranks
    assert s1 >= 0.25 > s0 - 0.25  # the receiver was blocked while the sender slept
    assert all(getattr(dist, name) is fn for name, fn in originals.items())


def test_step_metrics_arithmetic():
    m = StepMetrics(
        step=3,
        loss=2.0,
        lr=1e-3,
        grad_norm=0.5,
        seconds=2.0,
        samples=64,
        tokens=64 * 128,
        flops=4e12,
        comm_seconds=0.5,
        comm_calls=3,
        world_size=4,
        peak_tflops=1.0,
    )
    assert m.samples_per_s == 32 and m.tokens_per_s == 4096 and m.tflops == 2.0
    assert m.mfu == 0.5 and m.comm_share == 0.25
    assert "MFU 50.0%" in m.line() and "comm 25%" in m.line()
    cpu = StepMetrics(
        step=0,
        loss=1.0,
        lr=0.0,
        grad_norm=1.0,
        seconds=1.0,
        samples=1,
        tokens=1,
        flops=1.0,
        comm_seconds=None,
        comm_calls=0,
        world_size=1,
        peak_tflops=None,
    )
    assert cpu.mfu is None and "MFU" not in cpu.line() and "comm" not in cpu.line()


def _all_to_all_worker(rank, world_size):
    """Rank r sends r + 1 rows of 4 fp32 values to each rank: the meter counts the bytes that leave the rank."""
    meter = comm.Meter()
    x = torch.full((world_size * (rank + 1), 4), float(rank))
    with comm.metered(meter):
        out = comm.all_to_all_single(
            x, comm.WORLD, send_splits=[rank + 1] * world_size, recv_splits=[r + 1 for r in range(world_size)]
        )
    return meter.all_to_all_bytes, meter.take()[1], out[:, 0].tolist()


def test_the_door_counts_all_to_all_bytes_sent_to_other_ranks():
    (b0, c0, out0), (b1, c1, _) = run_ranks(_all_to_all_worker, 2)
    assert (b0, b1) == (1 * 16, 2 * 16) and c0 == c1 == 1  # its own rows stay home
    assert out0 == [0.0, 1.0, 1.0]


def test_moe_metrics_in_the_line_and_the_logs():
    moe = {
        0: dict(max_tokens=96.0, mean_tokens=64.0, dropped=0.0, aux=1.1, seq_aux=1.2, z=3.0, bias_norm=0.0),
        2: dict(max_tokens=80.0, mean_tokens=64.0, dropped=0.1, aux=1.0, seq_aux=1.0, z=2.0, bias_norm=0.5),
    }
    m = StepMetrics(
        step=0,
        loss=1.0,
        lr=0.0,
        grad_norm=1.0,
        seconds=1.0,
        samples=1,
        tokens=1,
        flops=1.0,
        comm_seconds=None,
        comm_calls=0,
        world_size=1,
        peak_tflops=None,
        moe=moe,
        all_to_all_bytes=1024,
    )
    assert m.moe_imbalance == 1.5 and "experts max/mean 1.50" in m.line()
    scalars = m.scalars()
    assert scalars["moe/max_over_mean"] == 1.5 and scalars["moe/layer2/dropped"] == 0.1
    assert scalars["moe/layer0/bias_norm"] == 0.0 and scalars["comm/all_to_all_bytes"] == 1024.0
    assert m.to_dict()["moe"]["2"]["z"] == 2.0
