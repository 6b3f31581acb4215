"""The one door for megakit's own communication: TP collectives, pipeline P2P, the trainer's reductions.

Every wrapper takes the process group explicitly and returns its input untouched
when the group has one member, so a TP = 1 model runs with no communication and
no initialised process group at all. ``group=None`` means "no parallelism here"
(size 1) -- unlike torch.distributed, where it would mean the world group; pass
``WORLD`` for the whole job.

Timing is an explicit hook, not a patch: ``with metered(meter):`` makes every call
through this module (and every wait on a handle it returned) add its wall time and
one call to ``meter``; nothing in torch is replaced. Collectives that ``--compile`` traces into a
block's graph (TP's ``f``/``g``) run as functional collectives and are not metered. torch 2.13 renamed the single-
tensor collectives (``all_gather_into_tensor`` -> ``all_gather_single``, ...); the
names are resolved once below, so the next rename is a one-line change. None of
these functions is differentiable: ``megakit.nn.tensor_parallel.layers`` wraps them in
autograd functions that say what runs in forward and in backward.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import threading
import time

import torch
import torch.distributed as dist

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _World:
    def __repr__(self) -> str:
        return "WORLD"


WORLD = _World()  # the whole job: torch's default group


def _pg(group):
    """torch's name for ``group`` (None is its default group, the world)."""
    return None if group is WORLD else group


# -- the timing hook ---------------------------------------------------------------------------
class Meter:
    """Seconds spent in, and number of, calls through this module while it is ``metered``.

    ``sync_cuda``: synchronise the device around each call, so asynchronous NCCL work is
    counted where it runs (costly: a trainer meters only sampled steps on GPU).
    """

    def __init__(self, *, sync_cuda: bool = False) -> None:
        self.seconds, self.calls, self.sync_cuda = 0.0, 0, sync_cuda
        self.all_to_all_bytes = 0  # what this rank's all-to-alls sent to other ranks (MoE token dispatch, Ulysses CP)
        self.p2p_sent: collections.Counter = collections.Counter()  # bytes of this rank's P2P sends, by global rank
        self.p2p_messages = 0  # how many P2P sends (ring attention's traffic, pipeline activations)

    def timed(self, fn, *args, **kwargs):
        """Call ``fn`` and add its wall time to the meter (after the GPU's queue drains, when asked to)."""
        if self.sync_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
            if self.sync_cuda:
                torch.cuda.synchronize()
            return out
        finally:
            self.seconds += time.perf_counter() - start

    def take(self) -> tuple[float, int]:
        """``(seconds, calls)`` since the last ``take``."""
        out = (self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return out


_meter: Meter | None = None  # set only inside ``metered``
_metered_thread: int | None = None  # the thread it counts (a checkpoint writer's calls are not the step's)


@contextlib.contextmanager
def metered(meter: Meter):
    """Count every call through this module from this thread, and every wait on its handles, into ``meter``."""
    global _meter, _metered_thread
    previous, _meter = (_meter, _metered_thread), meter
    _metered_thread = threading.get_ident()
    try:
        yield meter
    finally:
        _meter, _metered_thread = previous


def _call(fn, *args, **kwargs):
    if _meter is None or torch.compiler.is_compiling() or threading.get_ident() != _metered_thread:
        return fn(*args, **kwargs)
    _meter.calls += 1
    return _meter.timed(fn, *args, **kwargs)


class Handle:
    """An asynchronous operation this module started; waiting on it is communication time."""

    def __init__(self, work) -> None:
        self._work = work

    def wait(self) -> None:
        """Wait for the posted operation, timing the wait when a meter runs."""
        if self._work is None:
            return
        if _meter is None:
            self._work.wait()
        else:
            _meter.timed(self._work.wait)

    def is_completed(self) -> bool:
        """Done, without waiting (a send's buffer may be reused)."""
        return self._work is None or self._work.is_completed()


def _posted(fn, *args, **kwargs) -> Handle:
    if _meter is not None and not torch.compiler.is_compiling():
        _meter.calls += 1
    return Handle(fn(*args, **kwargs))


def side_group(timeout_s: float):
    """A second group over the whole job, on gloo, for collectives a background thread makes (an asynchronous
    checkpoint's write) while the main thread goes on with its own; None without a process group. Collective:
    every rank calls it, in the same order (``new_group``)."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def size(group) -> int:
    """Number of ranks in ``group``; 1 for ``None``."""
    return 1 if group is None else dist.get_world_size(_pg(group))


def rank(group) -> int:
    """This process's index in ``group``; 0 for ``None``."""
    return 0 if group is None else dist.get_rank(_pg(group))


def group_ranks(group) -> list[int]:
    """The global ranks of ``group``, in the group's order; ``[this rank]`` for ``None``."""
    if group is None:
        return [dist.get_rank()] if dist.is_initialized() else [0]
    return list(dist.get_process_group_ranks(_pg(group)))


# -- collectives -------------------------------------------------------------------------------
def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """Sum (or ``op``) of ``x`` over the group, in place; returns ``x``."""
    if size(group) > 1:
        _call(dist.all_reduce, x, op=op, group=_pg(group))
    return x


def broadcast(x: torch.Tensor, src: int, group) -> torch.Tensor:
    """``x`` from global rank ``src`` on every rank of the group, in place; returns ``x``."""
    if size(group) > 1:
        _call(dist.broadcast, x, src=src, group=_pg(group))
    return x


def all_gather_object(obj, group) -> list:
    """Every rank's picklable ``obj``, in rank order."""
    if size(group) == 1:
        return [obj]
    out: list = [None] * size(group)
    _call(dist.all_gather_object, out, obj, group=_pg(group))
    return out


def gather_object(obj, dst: int, group) -> list | None:
    """Every rank's picklable ``obj`` on global rank ``dst`` (in rank order), None elsewhere."""
    if size(group) == 1:
        return [obj]
    out = [None] * size(group) if dist.get_rank() == dst else None
    _call(dist.gather_object, obj, out, dst=dst, group=_pg(group))
    return out


def broadcast_object(obj, src: int, group):
    """Global rank ``src``'s picklable ``obj`` on every rank of the group."""
    if size(group) == 1:
        return obj
    box = [obj]
    _call(dist.broadcast_object_list, box, src=src, group=_pg(group))
    return box[0]


def barrier(group) -> None:
    """Wait for every rank of ``group``; free for a group of one."""
    if size(group) > 1:
        _call(dist.barrier, group=_pg(group))


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); a new tensor."""
    n = size(group)
    if n == 1:
        return x
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _call(_all_gather_single, out, x, group=_pg(group))
    if dim == 0:
        return out
    # Gathered along dim 0 (one contiguous block per rank): lay the blocks side by side.
    return torch.cat(out.chunk(n, dim=0), dim=dim)


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over the group and keep this rank's 1/n slice along ``dim``."""
    n = size(group)
    if n == 1:
        return x
    assert x.shape[dim] % n == 0, (x.shape, dim, n)
    if dim != 0:
        x = torch.cat(x.chunk(n, dim=dim), dim=0)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _call(_reduce_scatter_single, out, x, group=_pg(group))
    return out


def all_gather_async(x: torch.Tensor, group) -> tuple[torch.Tensor, Handle]:
    """Start ``all_gather(x, group, dim=0)``; the result is valid after ``wait()`` on the handle."""
    n = size(group)
    if n == 1:
        return x, Handle(None)
    x = x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, _posted(_all_gather_single, out, x, group=_pg(group), async_op=True)


def reduce_scatter_async(x: torch.Tensor, group) -> tuple[torch.Tensor, Handle]:
    """Start ``reduce_scatter(x, group, dim=0)``; the result is valid after ``wait()`` on the handle."""
    n = size(group)
    if n == 1:
        return x, Handle(None)
    assert x.shape[0] % n == 0, (x.shape, n)
    x = x.contiguous()
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return out, _posted(_reduce_scatter_single, out, x, group=_pg(group), async_op=True)


def all_reduce_async(x: torch.Tensor, group) -> Handle:
    """Start summing ``x`` over the group in place; ``x`` holds the sum after ``wait()``."""
    if size(group) == 1:
        return Handle(None)
    return _posted(dist.all_reduce, x, group=_pg(group), async_op=True)


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Block ``r`` of ``x`` (cut along dim 0 into n equal blocks) goes to rank ``r``; returns the blocks this rank
    received, in rank order (a new tensor)."""
    if size(group) == 1:
        return x
    out = torch.empty_like(x)
    _call(dist.all_to_all_single, out, x.contiguous(), group=_pg(group))
    return out


def all_to_all_single(x: torch.Tensor, group, *, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
    """Rows ``x[sum(send_splits[:r]) : ...]`` (``send_splits[r]`` of them) go to rank ``r``; returns the
    ``sum(recv_splits)`` rows received, in rank order (a new tensor). Splits may be zero, and so may
    every row this rank sends or receives (MoE token dispatch, ``megakit.nn.moe.dispatch``)."""
    if size(group) == 1:
        return x
    if _meter is not None:
        row = x[:1].numel() * x.element_size() if x.shape[0] else 0
        _meter.all_to_all_bytes += (sum(send_splits) - send_splits[rank(group)]) * row
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    _call(
        dist.all_to_all_single,
        out,
        x.contiguous(),
        output_split_sizes=list(recv_splits),
        input_split_sizes=list(send_splits),
        group=_pg(group),
    )
    return out


def split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """This rank's 1/n slice of ``x`` along ``dim`` (no communication)."""
    n = size(group)
    if n == 1:
        return x
    assert x.shape[dim] % n == 0, (x.shape, dim, n)
    return x.chunk(n, dim=dim)[rank(group)].contiguous()


# -- point to point (global ranks) --------------------------------------------------------------
def _count_sends(sends) -> None:
    """Add ``(tensor, peer, ...)`` sends to the meter's P2P messages and bytes by peer."""
    if _meter is None:
        return
    for t, peer, *_ in sends:
        _meter.p2p_messages += 1
        _meter.p2p_sent[peer] += t.numel() * t.element_size()


def isend(x: torch.Tensor, dst: int, tag: int = 0) -> Handle:
    """Post a send of ``x`` to global rank ``dst``; counted for the communication report."""
    _count_sends([(x, dst)])
    return _posted(dist.isend, x, dst=dst, tag=tag)


def irecv(x: torch.Tensor, src: int, tag: int = 0) -> Handle:
    """Post a receive into ``x`` from global rank ``src``."""
    return _posted(dist.irecv, x, src=src, tag=tag)


def recv(x: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
    """Receive into ``x`` from global rank ``src`` and return it."""
    _call(dist.recv, x, src=src, tag=tag)
    return x


def exchange(sends: list[tuple[torch.Tensor, int, int]], receives: list[tuple[torch.Tensor, int, int]]) -> Handle:
    """Post every ``(tensor, peer, tag)`` send and receive together (one ``batch_isend_irecv``) and
    return at once; ``wait()`` on the handle waits for all of them. Posted as one batch, two ranks
    exchanging with each other cannot block on each other's send (as separate NCCL calls could)."""
    _count_sends(sends)
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in receives]
    return _posted(lambda: _Works(dist.batch_isend_irecv(ops)) if ops else None)


class _Works:
    def __init__(self, works) -> None:
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


def send_and_receive(sends: list[tuple[torch.Tensor, int, int]], receives: list[tuple[torch.Tensor, int, int]]) -> None:
    """Post every ``(tensor, peer, tag)`` send and receive together and wait for all of them
    (one ``batch_isend_irecv``: NCCL runs them concurrently, so two stages sending to each
    other do not wait on each other)."""
    _count_sends(sends)
    ops = [dist.P2POp(dist.isend, t, peer, tag=tag) for t, peer, tag in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, tag=tag) for t, peer, tag in receives]
    if not ops:
        return
    _call(lambda: [work.wait() for work in dist.batch_isend_irecv(ops)])
