"""What one training step cost: throughput, FLOP/s, MFU and the share spent communicating.

Communication share is measured, not modelled: ``CommTimer`` wraps torch.distributed's
collective and point-to-point functions (DeepSpeed's ZeRO reductions, megakit's TP
collectives and pipeline sends all call them through the module, so nothing escapes)
and adds up the wall time spent inside them. With gloo on CPU a collective runs in
the calling thread, so that is the time the step was blocked on communication
(including waiting for slower peers, as the FAQ's "communication share" means). On
GPU, NCCL calls return at once, so a sampled step synchronises the device around
each call; unsampled steps run undisturbed and report no share.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

_WRAPPED = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
            "all_gather_single", "reduce_scatter_single", "broadcast", "reduce", "all_to_all", "all_to_all_single",
            "send", "recv", "isend", "irecv", "batch_isend_irecv", "barrier", "all_gather_object")
_ASYNC = ("isend", "irecv")
# P2POp checks ``op is isend`` against distributed_c10d's own names: patch them there too
_ALSO_IN_C10D = ("isend", "irecv")


class _TimedWork:
    """An async handle whose ``wait()`` counts as communication time (the rest is delegated)."""

    def __init__(self, work, timer: "CommTimer") -> None:
        self._work, self._timer = work, timer

    def wait(self, *args, **kwargs):
        return self._timer.timed(self._work.wait, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommTimer:
    """Adds up seconds spent inside torch.distributed calls while ``measuring`` (context manager installs it).

    Forward and backward are untouched: the wrapped functions are called unchanged,
    the timer only reads the clock around them (and, on GPU, synchronises first).
    """

    def __init__(self, *, sync_cuda: bool = False) -> None:
        self.seconds = 0.0
        self.calls = 0  # collective/P2P calls since the last take(): shows where communication happens
        self.last_calls = 0
        self.measuring = True
        self.sync_cuda = sync_cuda
        self._originals: dict = {}
        self._depth = 0

    def timed(self, fn, *args, **kwargs):
        """Call ``fn`` and add its wall time (nested calls, e.g. all_gather_object -> all_gather, count once)."""
        if not self.measuring or self._depth:
            return fn(*args, **kwargs)
        self._depth += 1
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
            self._depth -= 1

    def _wrap(self, name, fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if not self._depth:
                self.calls += 1
            if name == "batch_isend_irecv":
                return [_TimedWork(work, self) for work in fn(*args, **kwargs)]
            if name in _ASYNC or kwargs.get("async_op"):  # time the wait, not the posting
                work = fn(*args, **kwargs)
                return None if work is None else _TimedWork(work, self)
            return self.timed(fn, *args, **kwargs)

        wrapper._megakit_timer = self
        return wrapper

    def take(self) -> float:
        """Seconds since the last ``take`` (the call count goes to ``last_calls``)."""
        seconds, self.seconds = self.seconds, 0.0
        self.last_calls, self.calls = self.calls, 0
        return seconds

    @classmethod
    def shared(cls, *, sync_cuda: bool = False) -> "CommTimer":
        """The timer installed for this process, installing one on first use (and never removing it).

        One per process because libraries keep the functions they looked up: DeepSpeed's
        comm backend holds on to the wrapped all-gather after the first run, so a second
        run in the same process must keep feeding the same timer.
        """
        timer = getattr(dist.all_reduce, "_megakit_timer", None)
        if timer is None:
            timer = cls(sync_cuda=sync_cuda).__enter__()
        timer.sync_cuda = sync_cuda
        return timer

    def __enter__(self) -> "CommTimer":
        from torch.distributed import distributed_c10d

        for name in _WRAPPED:
            fn = getattr(dist, name, None)
            if fn is not None:
                self._originals[name] = fn
                wrapped = self._wrap(name, fn)
                setattr(dist, name, wrapped)
                if name in _ALSO_IN_C10D:
                    setattr(distributed_c10d, name, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import distributed_c10d

        for name, fn in self._originals.items():
            setattr(dist, name, fn)
            if name in _ALSO_IN_C10D:
                setattr(distributed_c10d, name, fn)
        self._originals.clear()


def gpu_peak_tflops() -> float | None:
    """Dense bf16 peak of this process's GPU, from the planner's presets; None on CPU or an unknown GPU."""
    if not torch.cuda.is_available():
        return None
    from megakit.core.planner.hardware import GPUS

    name = torch.cuda.get_device_name().lower()
    for preset in GPUS.values():
        family = preset.name.split("-")[0]
        if family in name.replace(" ", "").replace("-", ""):
            return preset.peak_tflops
    return None


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """One optimizer step, as logged (whole-job throughput; MFU per GPU)."""

    step: int
    loss: float
    lr: float
    grad_norm: float
    seconds: float
    samples: int
    tokens: int
    flops: float  # model FLOPs of the step, all ranks together
    comm_seconds: float | None  # this rank's time in communication, None when not sampled
    comm_calls: int  # torch.distributed calls this rank made during the step
    world_size: int
    peak_tflops: float | None  # per device

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def tflops(self) -> float:
        """Achieved model TFLOP/s of the whole job."""
        return self.flops / self.seconds / 1e12

    @property
    def mfu(self) -> float | None:
        if self.peak_tflops is None:
            return None
        return self.tflops / (self.world_size * self.peak_tflops)

    @property
    def comm_share(self) -> float | None:
        return None if self.comm_seconds is None else min(1.0, self.comm_seconds / self.seconds)

    def line(self) -> str:
        parts = [f"step {self.step:>5}", f"loss {self.loss:.4f}", f"lr {self.lr:.2e}", f"grad-norm {self.grad_norm:.3f}",
                 f"{self.samples_per_s:.1f} samples/s", f"{self.tokens_per_s:,.0f} tok/s", f"{self.tflops:.3f} TFLOP/s"]
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        if self.comm_share is not None:
            parts.append(f"comm {self.comm_share:.0%}")
        return " | ".join(parts)

    def scalars(self) -> dict[str, float]:
        out = {"train/loss": self.loss, "train/lr": self.lr, "train/grad_norm": self.grad_norm,
               "perf/samples_per_s": self.samples_per_s, "perf/tokens_per_s": self.tokens_per_s,
               "perf/tflops": self.tflops}
        if self.mfu is not None:
            out["perf/mfu"] = self.mfu
        if self.comm_share is not None:
            out["perf/comm_share"] = self.comm_share
        return out

    def to_dict(self) -> dict:
        return {"step": self.step, "loss": self.loss, "lr": self.lr, "grad_norm": self.grad_norm,
                "seconds": self.seconds, "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
                "tflops": self.tflops, "mfu": self.mfu, "comm_share": self.comm_share,
                "comm_calls": self.comm_calls}
