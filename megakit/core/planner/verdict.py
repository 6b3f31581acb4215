"""A pinned layout's verdict: does it fit, and if not, the one change that makes it fit.

The 80 % line (``--mem-threshold``) is the rule for what the search *chooses*: it leaves room for
what the memory model does not itemise. It is the wrong answer to "will my layout fit?", which is
asked when every dimension that decides memory is pinned (TP, PP, ZeRO, micro-batch, recompute).
Such a layout is judged against the GPU's whole memory instead:

* ``yes``: the predicted peak is under the line;
* ``above_threshold``: over the line but within the GPU's memory; it runs, with less headroom
  for allocator fragmentation, NCCL's buffers and transient spikes than the search would leave;
* ``no``: over the GPU's memory; ``suggest_fix`` names the smallest single change that fits.
"""

from __future__ import annotations

import dataclasses
import itertools

from megakit.core.planner.memory import GIB, peak_memory
from megakit.core.planner.plan import Plan, optimizer_runs_zero, pipeline_runs_zero

VERDICTS = ("yes", "above_threshold", "no")


def verdict(peak_bytes: float, *, threshold_bytes: float, gpu_bytes: float) -> str:
    """Whether the peak fits: ``yes``, ``above_threshold`` (fits, past the safety margin) or ``no``."""
    if peak_bytes <= threshold_bytes:
        return "yes"
    return "above_threshold" if peak_bytes <= gpu_bytes else "no"


def headroom_note(peak_gib: float, *, gpu_gib: float, threshold: float) -> str:
    """What running above the line means, in this plan's numbers."""
    return (
        f"above the {threshold:.0%} line ({threshold * gpu_gib:.1f} GiB) but within the GPU's {gpu_gib:,.4g} GiB: "
        f"{gpu_gib - peak_gib:.1f} GiB remain for allocator fragmentation, NCCL buffers and transient spikes "
        "that the estimate does not itemise; it should run, but the search would not choose it "
        "(watch torch.cuda.max_memory_reserved on the first steps)"
    )


def _pipeline_runs(plan: Plan, *, zero: int, pp: int) -> bool:
    return pipeline_runs_zero(zero, pp=pp, vpp=plan.vpp, zero_bubble=plan.zero_bubble, offload=plan.offload)


def _changes(plan: Plan, *, world: int, gpus_per_node: int, model) -> list[tuple[str, dict]]:
    """Single changes that only lower memory, cheapest in speed first."""
    out: list[tuple[str, dict]] = []
    per_rank = plan.micro_batch * plan.accumulation
    for mb in sorted((b for b in range(1, plan.micro_batch) if per_rank % b == 0), reverse=True):
        out.append((f"--micro-batch {mb}", dict(micro_batch=mb, accumulation=per_rank // mb)))
    out += _module_changes(plan, model)
    if plan.recompute != "full":
        out.append(("--recompute full", dict(recompute="full")))
    runs = [z for z in range(4) if optimizer_runs_zero(z, optimizer=plan.optimizer, precision=plan.precision)]
    for zero in range(plan.zero_stage + 1, 4):
        if plan.dp > 1 and _pipeline_runs(plan, zero=zero, pp=plan.pp) and zero in runs:
            out.append((f"--zero {zero}", dict(zero_stage=zero)))
    if plan.tp > 1 and not plan.sequence_parallel:
        out.append(("sequence parallelism", dict(sequence_parallel=True)))
    for tp in (2 * plan.tp, 4 * plan.tp, 8 * plan.tp):
        if tp <= gpus_per_node and gpus_per_node % tp == 0 and model.tp_ok(tp) and plan.dp * plan.tp % tp == 0:
            out.append((f"--tp {tp}", dict(tp=tp, sequence_parallel=True, **_fewer_replicas(plan, tp // plan.tp))))
    for pp in () if model.stage_layers else (2 * plan.pp, 4 * plan.pp, 8 * plan.pp):  # a pinned split fixes PP
        if pp <= model.layers and plan.dp * plan.pp % pp == 0 and _pipeline_runs(plan, zero=plan.zero_stage, pp=pp):
            out.append((f"--pp {pp}", dict(pp=pp, **_fewer_replicas(plan, pp // plan.pp))))
    offload = optimizer_runs_zero(plan.zero_stage, optimizer=plan.optimizer, precision=plan.precision, offload="cpu")
    if plan.offload == "none" and plan.zero_stage >= 1 and (plan.zero_stage < 3 or plan.pp == 1) and offload:
        out.append(("--offload optimizer", dict(offload="optimizer")))
    return [(text, change) for text, change in out if _divides(plan, change, world)]


LIGHT_MODULES = ("layernorm", "moe_act", "mla_up_proj")  # Megatron-Core's cheap recomputes: norms, activations, up-proj
HEAVY_MODULES = ("mlp", "shared_experts", "moe")  # whole MLPs: their GEMMs again


def _module_changes(plan: Plan, model) -> list[tuple[str, dict]]:
    """Under Megatron's runtimes, selective recompute with other ``--recompute-modules`` (up to three of those that
    apply to the model), fewest heavy modules first, then fewest modules: each costs far less time than
    ``--recompute full``, and Megatron-Bridge's recipes train this way (DeepSeek-V3: ``mla_up_proj,mlp``)."""
    if not plan.megatron or plan.recompute == "full":
        return []
    c = model.config
    applies = {
        "layernorm": True,
        "mla_up_proj": c.mla is not None,
        "moe_act": c.moe is not None,
        "mlp": c.moe is None or c.moe_layers < c.layers,
        "shared_experts": c.moe is not None and bool(c.moe.shared_ffn),
        "moe": c.moe is not None,
    }
    names = [m for m in LIGHT_MODULES + HEAVY_MODULES if applies[m]]
    sets = [s for k in (1, 2, 3) for s in itertools.combinations(names, k)]
    sets.sort(key=lambda s: (sum(m in HEAVY_MODULES for m in s), len(s)))
    flag = "--recompute selective " if plan.recompute != "selective" else ""
    return [
        (f"{flag}--recompute-modules {','.join(s)}", dict(recompute="selective", recompute_modules=s))
        for s in sets
        if s != plan.recompute_modules
    ]


def _fewer_replicas(plan: Plan, factor: int) -> dict:
    """DP divided by ``factor`` and each replica's accumulation multiplied by it: the same global batch."""
    return dict(dp=plan.dp // factor, accumulation=plan.accumulation * factor)


def _divides(plan: Plan, change: dict, world: int) -> bool:
    new = dataclasses.replace(plan, **change)
    return new.world == world and new.global_batch == plan.global_batch and (new.dp * new.cp) % new.ep == 0


def suggest_fix(
    model,
    plan: Plan,
    *,
    seq_len: int,
    world: int,
    gpus_per_node: int,
    threshold_bytes: float,
    gpu_bytes: float,
    overhead_bytes: float,
) -> str:
    """The first single change (``_changes``' order) that brings the peak under the line, else under
    the GPU's memory, with the peak it gives; or what to do when no single change is enough."""
    within = None
    for text, change in _changes(plan, world=world, gpus_per_node=gpus_per_node, model=model):
        new = dataclasses.replace(plan, **change)
        peak = peak_memory(model, seq_len=seq_len, overhead_bytes=overhead_bytes, **new.memory_kwargs()).total
        if peak <= threshold_bytes:
            return f"{text} (peak {peak / GIB:.1f} GiB, under the line)"
        if within is None and peak <= gpu_bytes:
            within = f"{text} (peak {peak / GIB:.1f} GiB, above the line but within memory)"
    if within:
        return within
    return "no single change is enough: drop the pins and let the planner search, or use more or bigger GPUs"
