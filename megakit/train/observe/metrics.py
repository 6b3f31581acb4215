"""What one training step cost: throughput, FLOP/s, MFU and the share spent communicating.

Communication share is measured, with nothing patched: megakit's own calls (TP
collectives, pipeline P2P, MoE token all-to-alls, the trainer's loss and norm reductions) go
through ``megakit.nn.comm``, whose explicit ``Meter`` hook times each call and each wait on a
handle it returned; DeepSpeed's collectives (ZeRO's reductions and gathers) are timed by
DeepSpeed's own comms logger, switched on for measured steps. With gloo on CPU a
collective runs in the calling thread, so that is the time the step was blocked on
communication (including waiting for slower peers, as the FAQ's "communication share"
means). DeepSpeed's asynchronous ZeRO-3 gathers count their launch on CPU and the whole
operation on GPU, where its logger synchronises the device after each call; on GPU,
measuring synchronises, so a trainer measures sampled steps only. The door also counts the
bytes the all-to-alls (MoE token dispatch, Ulysses CP) send to other ranks (``all_to_all_bytes``), from the
tensors' shapes on the host; per-layer MoE figures come
from ``megakit.train.engine.moe_step``.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megakit.nn import comm


class StepCommunication:
    """``measure(True)`` around a step leaves ``(seconds, calls)`` of communication in ``result``."""

    def __init__(self, *, sync_cuda: bool = False) -> None:
        self.meter = comm.Meter(sync_cuda=sync_cuda)
        self.result: tuple[float, int] | None = None
        self.all_to_all_bytes = 0  # of the last measured step (MoE token dispatch, at megakit's door)

    @contextlib.contextmanager
    def measure(self, enabled: bool):
        """Time the enclosed work (a context manager); no cost when disabled."""
        if not enabled:
            self.result = None
            yield
            return
        import deepspeed.comm as ds_comm

        _deepspeed_totals()  # start from zero
        ds_comm.configure(enabled=True, prof_all=True, verbose=False, debug=False)
        try:
            with comm.metered(self.meter):
                yield
        finally:
            ds_comm.configure(enabled=False)
        seconds, calls = self.meter.take()
        self.all_to_all_bytes, self.meter.all_to_all_bytes = self.meter.all_to_all_bytes, 0
        ds_seconds, ds_calls = _deepspeed_totals()
        self.result = (seconds + ds_seconds, calls + ds_calls)


def _deepspeed_totals() -> tuple[float, int]:
    """Seconds and calls DeepSpeed's comms logger recorded since the last call, which resets it.

    DeepSpeed 0.19.8 records, for each call, the *running total* of its op's timer (the
    timer is never reset), so the total per op is its largest record; resetting the timers
    here keeps the totals per step and the logger's cost flat.
    """
    from deepspeed.comm.comm import comms_logger, timers

    data = comms_logger.get_raw_data()
    seconds = sum(max(record[1][-1] for record in sizes.values()) for sizes in data.values()) / 1e3
    calls = sum(record[0] for sizes in data.values() for record in sizes.values())
    comms_logger.reset_data()
    for name in data:
        timers(name).reset()
    return seconds, calls


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


def gpu_state() -> tuple[float | None, float | None]:
    """This process's GPU: (utilisation in %, peak memory allocated so far in GiB); None for what it cannot say.

    Utilisation is NVML's (``torch.cuda.utilization`` needs ``nvidia-ml-py``): the share of the last
    sample period in which a kernel ran (FAQ 7: keep it above 80 %). On CPU both are None: absent, not zero.
    """
    if not torch.cuda.is_available():
        return None, None
    try:
        util = float(torch.cuda.utilization())
    except Exception:  # no nvidia-ml-py, or NVML refused: leave it out rather than guess
        util = None
    return util, torch.cuda.max_memory_allocated() / 2**30


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
    comm_calls: int | None  # collective and P2P calls this rank made during the step, None when not sampled
    world_size: int
    peak_tflops: float | None  # per device
    dp_bytes: int | None = (
        None  # DP bytes this rank sent (when megakit, not DeepSpeed, syncs DP: --compress, --local-sgd)
    )
    dp_bytes_dense: int | None = None  # what the plain fp32 all-reduce of the same gradients would have sent
    data_seconds: float | None = None  # this rank's wait for its batch (the loader), before the step's clock
    skipped: bool = False  # a non-finite step the optimizer did not apply (megakit.train.resilience.guards)
    moe: dict | None = None  # MoE layer -> {max_tokens, mean_tokens, dropped, aux, ...} (engine.moe_step)
    mtp: list | None = None  # each MTP depth's loss L_k of the step (observe.mtp_losses), with --mtp
    all_to_all_bytes: int | None = None  # what this rank's all-to-alls sent (MoE, Ulysses CP; measured steps)
    compiling: bool = False  # the step's time includes torch.compile of the blocks (--compile's first step)
    gpu_util: float | None = None  # rank 0's GPU utilisation, % (gpu_state); None on CPU
    gpu_mem_gib: float | None = None  # rank 0's peak GPU memory allocated so far, GiB; None on CPU

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

    @property
    def data_share(self) -> float | None:
        """The loader's wait as a share of the step time (the wait included)."""
        return None if self.data_seconds is None else self.data_seconds / (self.seconds + self.data_seconds)

    @property
    def moe_imbalance(self) -> float | None:
        """The worst MoE layer's max/mean tokens per expert (1.0: perfectly balanced)."""
        if not self.moe:
            return None
        return max(m["max_tokens"] / m["mean_tokens"] for m in self.moe.values())

    def line(self) -> str:
        """The step's log line."""
        parts = [
            f"step {self.step:>5}"
            + (" (skipped)" if self.skipped else "")
            + (" (incl. compile)" if self.compiling else ""),
            f"loss {self.loss:.4f}",
            f"lr {self.lr:.2e}",
            f"grad-norm {self.grad_norm:.3f}",
            f"{self.samples_per_s:.1f} samples/s",
            f"{self.tokens_per_s:,.0f} tok/s",
            f"{self.tflops:.3f} TFLOP/s",
        ]
        if self.mfu is not None:
            parts.append(f"MFU {self.mfu:.1%}")
        if self.comm_share is not None:
            parts.append(f"comm {self.comm_share:.0%}")
        if self.dp_bytes is not None:
            parts.append(f"DP sent {self.dp_bytes / 1e6:.3g} MB of {self.dp_bytes_dense / 1e6:.3g}")
        if self.data_share is not None:
            parts.append(f"data {self.data_share:.2%}")
        if self.moe_imbalance is not None:
            parts.append(f"experts max/mean {self.moe_imbalance:.2f}")
        if self.mtp:
            parts.append("MTP loss " + "/".join(f"{x:.4f}" for x in self.mtp))
        if self.gpu_util is not None:
            parts.append(f"GPU util {self.gpu_util:.0f}%")
        if self.gpu_mem_gib is not None:
            parts.append(f"GPU mem {self.gpu_mem_gib:.1f} GiB")
        return " | ".join(parts)

    def scalars(self) -> dict[str, float]:
        """The step's values under TensorBoard's tag names."""
        out = {
            "train/loss": self.loss,
            "train/lr": self.lr,
            "train/grad_norm": self.grad_norm,
            "perf/samples_per_s": self.samples_per_s,
            "perf/tokens_per_s": self.tokens_per_s,
            "perf/tflops": self.tflops,
        }
        if self.mfu is not None:
            out["perf/mfu"] = self.mfu
        if self.comm_share is not None:
            out["perf/comm_share"] = self.comm_share
        if self.dp_bytes is not None:
            out["comm/dp_bytes"], out["comm/dp_bytes_dense"] = float(self.dp_bytes), float(self.dp_bytes_dense)
        if self.data_share is not None:
            out["perf/data_share"] = self.data_share
        if self.moe:
            out["moe/max_over_mean"] = self.moe_imbalance
            for layer, values in self.moe.items():
                out.update({f"moe/layer{layer}/{name}": value for name, value in values.items()})
        if self.all_to_all_bytes is not None:
            out["comm/all_to_all_bytes"] = float(self.all_to_all_bytes)
        for k, value in enumerate(self.mtp or [], start=1):
            out[f"train/mtp_{k}_loss"] = value
        if self.gpu_util is not None:
            out["perf/gpu_util"] = self.gpu_util
        if self.gpu_mem_gib is not None:
            out["perf/gpu_mem_gib"] = self.gpu_mem_gib
        return out

    def to_dict(self) -> dict:
        """The step's values for ``--metrics-out``."""
        return {
            "step": self.step,
            "loss": self.loss,
            "lr": self.lr,
            "grad_norm": self.grad_norm,
            "seconds": self.seconds,
            "samples_per_s": self.samples_per_s,
            "tokens_per_s": self.tokens_per_s,
            "tflops": self.tflops,
            "mfu": self.mfu,
            "comm_share": self.comm_share,
            "comm_calls": self.comm_calls,
            "data_share": self.data_share,
            "dp_bytes": self.dp_bytes,
            "dp_bytes_dense": self.dp_bytes_dense,
            "skipped": self.skipped,
            "all_to_all_bytes": self.all_to_all_bytes,
            "compiling": self.compiling,
            "gpu_util": self.gpu_util,
            "gpu_mem_gib": self.gpu_mem_gib,
            "moe": None if self.moe is None else {str(k): v for k, v in self.moe.items()},
            "mtp": self.mtp,
        }


def read_metrics(path: str | Path) -> dict:
    """A ``--metrics-out`` file (JSON Lines, ``reporting.MetricsFile``) as ``{"runs", "steps", "eval", "events",
    "memory"}``: every run's start and every event in order; the newest record of each step and of each evaluation,
    in step order (a resumed run, or one rolled back by --spike-guard, writes a step again); the last memory table
    (None without --verify-memory). A last line cut short by a kill is left out."""
    out: dict = {"runs": [], "steps": {}, "eval": {}, "events": [], "memory": None}
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(record, dict):  # not one of ours (an older, indented --metrics-out at the same path)
            continue
        kind = record.pop("type", None)
        if kind in ("step", "eval"):
            out["steps" if kind == "step" else "eval"][record["step"]] = record
        elif kind in ("run", "event"):
            out[f"{kind}s"].append(record)
        elif kind == "memory":
            out["memory"] = record["rows"]
    return {
        **out,
        "steps": [out["steps"][k] for k in sorted(out["steps"])],
        "eval": [out["eval"][k] for k in sorted(out["eval"])],
    }
