"""How often to save: Young/Daly's interval from the plan's checkpoint size and the cluster's failure rate.

Saving too rarely loses hours of work to each failure; too often spends the run writing.
Young (1974) and Daly (2006) give the interval that minimises the two together to first
order: ``interval = sqrt(2 x write time x MTBF)``, where MTBF is the whole cluster's mean
time between failures (any GPU's failure stops a synchronous job).

- **Write time** = the checkpoint's bytes / the bandwidth its writers get. megakit writes
  the weights at the training precision plus, per parameter, the fp32 master copy and Adam's
  two moments (12 bytes more: 14 B/param in bf16; Muon's weights one momentum, 4 bytes less); only DP replica 0
  writes, so the writers
  are the TP x PP ranks of that replica and the nodes they sit on. The bandwidth is per
  writing node (``write_gbps``); the filesystem's aggregate is assumed not to bind.
  Default 1 GB/s per node: Llama 3's checkpoint storage (Tectonic) sustains 2 TB/s for
  16,384 GPUs, i.e. 2,048 nodes of 8 (Dubey et al. 2024, sec. 3.3.1).
- **MTBF** = one GPU's mean time between failures / GPUs. Default from Llama 3's 54-day
  pre-training snapshot on 16,384 H100s (Dubey et al. 2024, sec. 3.3.4, Table 5): 466 job
  interruptions, of which 47 were planned (firmware upgrades, operator-initiated updates)
  and 419 unexpected. Only the unexpected ones count: a planned stop is preceded by a save
  and loses no work, so it does not enter the trade-off. 16,384 x 54 x 24 / 419 = 50,677
  GPU-hours per failure (the job on 1,024 GPUs: one failure per 49.5 hours).

Pure arithmetic (no torch); ``megakit plan`` prints the result and puts ``--save-every`` in
the launch command.
"""

from __future__ import annotations

import dataclasses
import math

from megakit.core.planner.plan import Plan

# Llama 3 (Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4 and Table 5)
LLAMA3_UNEXPECTED_INTERRUPTIONS = 419
LLAMA3_GPUS = 16_384
LLAMA3_DAYS = 54
GPU_MTBF_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_UNEXPECTED_INTERRUPTIONS  # ~50,677 GPU-hours per failure
WRITE_GBPS_PER_NODE = 1.0  # Llama 3's Tectonic: 2 TB/s sustained / 2,048 nodes (sec. 3.3.1)
STATE_BYTES = 12  # per parameter beside the weights: fp32 master, Adam's m and v
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SaveAdvice:
    """The recommended ``--save-every`` and every input of the formula, for the report."""

    checkpoint_bytes: float
    bytes_per_param: float
    writer_nodes: int
    write_gbps_per_node: float
    write_s: float
    gpu_mtbf_hours: float
    gpus: int
    mtbf_s: float  # the cluster's: gpu_mtbf_hours x 3600 / gpus
    interval_s: float  # sqrt(2 x write_s x mtbf_s)
    step_time_s: float
    save_every: int  # interval_s / step_time_s, rounded, at least 1
    overhead: float  # expected share of the run lost to saves and to redone work: write/interval + interval/(2 MTBF)
    optimizer: str = "adamw"  # whose state the checkpoint holds


def checkpoint_bytes(params: float, precision: str) -> tuple[float, int]:
    """(bytes of one checkpoint, bytes per parameter): weights at ``precision`` + fp32 master + Adam's m, v."""
    per = WEIGHT_BYTES[precision] + STATE_BYTES
    return params * per, per


def writer_nodes(plan: Plan, gpus_per_node: int) -> int:
    """Nodes holding a writing rank: DP replica 0's (and CP rank 0's) TP x PP ranks, at
    ``rank = tp + T·(cp + C·(dp + D·pp))``."""
    ranks = (t + plan.tp * plan.cp * plan.dp * p for p in range(plan.pp) for t in range(plan.tp))
    return len({rank // gpus_per_node for rank in ranks})


def advise(
    plan: Plan,
    *,
    params: float,
    gpus_per_node: int,
    step_time_s: float,
    write_gbps: float = WRITE_GBPS_PER_NODE,
    gpu_mtbf_hours: float = GPU_MTBF_HOURS,
    momentum_params: float = 0.0,
) -> SaveAdvice:
    """Young/Daly's save interval for ``plan``, in seconds and in steps of ``step_time_s``. ``momentum_params``: of
    ``params``, those a Muon plan steps with one fp32 momentum where Adam keeps two moments."""
    assert write_gbps > 0 and gpu_mtbf_hours > 0 and step_time_s > 0
    size, whole = checkpoint_bytes(params, plan.precision)
    size -= 4 * momentum_params
    per: float = size / params if momentum_params else whole
    nodes = writer_nodes(plan, gpus_per_node)
    write_s = size / (nodes * write_gbps * 1e9)
    mtbf_s = gpu_mtbf_hours * 3600 / plan.world
    interval = math.sqrt(2 * write_s * mtbf_s)
    return SaveAdvice(
        checkpoint_bytes=size,
        bytes_per_param=per,
        writer_nodes=nodes,
        write_gbps_per_node=write_gbps,
        write_s=write_s,
        gpu_mtbf_hours=gpu_mtbf_hours,
        gpus=plan.world,
        mtbf_s=mtbf_s,
        interval_s=interval,
        step_time_s=step_time_s,
        save_every=max(1, round(interval / step_time_s)),
        overhead=write_s / interval + interval / (2 * mtbf_s),
        optimizer=plan.optimizer,
    )


def describe(a: SaveAdvice) -> str:
    """One paragraph with the formula's inputs, for the plan report."""
    states = "fp32 master + Adam m, v" + (" or Muon momentum" if a.optimizer == "muon" else "")
    return (
        f"Save every {a.save_every} steps (--save-every {a.save_every}): Young/Daly's interval "
        f"sqrt(2 x write {a.write_s:,.3g} s x MTBF {a.mtbf_s / 3600:,.1f} h) = {a.interval_s / 60:,.1f} min at "
        f"{a.step_time_s:.2f} s per step. Write: {_size(a.checkpoint_bytes)} ({a.bytes_per_param:.3g} B/param: "
        f"weights + {states}) over {a.writer_nodes} writing node(s) (DP replica 0's TP x PP ranks) "
        "at "
        f"{a.write_gbps_per_node:g} GB/s per node (--ckpt-write-gbps). MTBF: {a.gpu_mtbf_hours:,.0f} GPU-hours per "
        f"failure (--mtbf-gpu-hours; default: Llama 3's 419 unexpected interruptions in 54 days on 16,384 H100s) / "
        f"{a.gpus} GPUs. Expected cost of failures and saves together: {a.overhead:.1%} of the run."
    )


def _size(nbytes: float) -> str:
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if nbytes >= scale:
            return f"{nbytes / scale:,.3g} {unit}"
    return f"{nbytes:,.0f} B"
