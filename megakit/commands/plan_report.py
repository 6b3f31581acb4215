"""``megakit plan --json``: the plan as data -- its layout, memory and speed with the FLOPs convention each
figure counts, the rejected layouts worth showing, and what was assumed (model, cluster, MoE routing)."""

from __future__ import annotations

from megakit.core.planner.hardware import Cluster
from megakit.core.planner.memory import GIB
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import RUNTIMES, Plan


def _runtime_fields(plan: Plan) -> dict:
    """The ``RUNTIMES`` fields this plan differs in from megakit's trainer."""
    fields = sorted(set().union(*RUNTIMES.values()))  # megatron, comm_overlap (megatron-core), zero3
    return {k: getattr(plan, k) for k in fields if getattr(plan, k) != getattr(Plan(), k)}


def top_rejected(rejected, top):
    """The fastest plans that did not fit, then one example of each structural reason (for layouts
    that failed even at their smallest, the one closest to fitting)."""
    out = [r for r in rejected if r.kind == "memory"][:top]
    for kind in ("tp-node", "zero-pp", "rule", "vpp", "batch", "ep", "floor"):
        of_kind = [r for r in rejected if r.kind == kind]
        if of_kind:
            out.append(min(of_kind, key=lambda r: r.peak_gib or 0.0))
    return out


def moe_assumptions(model: ModelSpec, args, imbalance: float) -> dict:
    """The experts and the routing regime the plan is priced in (nothing for a dense model)."""
    if model.moe is None:
        return {}
    regime = "custom" if args.moe_imbalance is not None else args.moe_routing
    return {
        "moe": {
            "experts": model.moe.experts,
            "top_k": model.moe.top_k,
            "expert_ffn": model.moe.ffn,
            "shared_ffn": model.moe.shared_ffn,
            "moe_layers": model.config.moe_layers,
            "active_params": model.active_params(),
            "routing": regime,
            "imbalance": imbalance,
            "capacity_factor": model.moe.capacity_factor,
            "routing_note": (
                "forced-balanced routing, as most published MoE throughput is measured"
                if imbalance == 1.0
                else f"the busiest expert rank gets {imbalance:g}x its "
                "balanced share of tokens (dropless routing with a balancing loss); "
                "--moe-routing balanced prices forced balance"
            ),
        }
    }


def plan_fields(plan: Plan) -> dict:
    """The plan's shape as JSON fields, shared by the chosen plan and the rejected ones so they read alike."""
    return {
        "tp": plan.tp,
        "pp": plan.pp,
        "dp": plan.dp,
        "cp": plan.cp,
        "cp_mode": plan.cp_mode,
        "cp_a2a": plan.a2a_degree,
        "ep": plan.ep,
        "edp": plan.edp,
        "vpp": plan.vpp,
        "zero_stage": plan.zero_stage,
        "zero3_shard_group": plan.shard_group * plan.cp if plan.zero_stage == 3 else None,
        "schedule": "zb-h1" if plan.zero_bubble else "interleaved" if plan.vpp > 1 else "1f1b",
        "micro_batch": plan.micro_batch,
        "grad_accum": plan.accumulation,
        "global_batch": plan.global_batch,
        "recompute": plan.recompute,
        "recompute_modules": list(plan.recompute_modules),
        "main_grads": plan.grad_reduce_precision if plan.megatron else None,
        "adam_moments": plan.moments,
        "sequence_parallel": plan.sequence_parallel,
        "precision": plan.precision,
        "offload": plan.offload,
        "flash_attention": plan.flash_attention,
        "kernels": "compiled" if plan.fused else "eager",
        "fp8": plan.fp8,
        "runtime": next(k for k, v in RUNTIMES.items() if v == _runtime_fields(plan)),
    }


# Which FLOPs each throughput figure counts (the JSON carries this; the tables say it in their labels).
FLOPS_CONVENTIONS = {
    "model_tflops_per_gpu": "model FLOPs: 6N-style, attention's full S x S (PaLM's and Megatron's MFU convention), "
    "no recompute",
    "mfu": "model FLOPs / (GPUs x dense 16-bit peak)",
    "hardware_tflops_per_gpu": "FLOPs the kernels execute: recompute included, causal flash attention's masked half "
    "skipped",
}


def plan_dict(plan: Plan, mem, cost, cluster: Cluster, tokens, seq_len: int) -> dict:
    """The chosen plan with its memory and cost, as JSON for ``megakit plan --json`` and the tests."""
    out = plan_fields(plan) | {
        "peak_memory_gib": mem.total / GIB,
        "gpu_memory_gib": cluster.gpu.mem_gib,
        "memory": mem.gib(),
        "peak_stage": mem.stage,
        "memory_breakdown": {
            item: {line: v / GIB for line, v in lines.items()}  # lines inside an item
            for item, lines in mem.breakdown.items()
        },
        "step_time_s": cost.step_time_s,
        "tokens_per_s": cost.tokens_per_s,
        "model_tflops_per_gpu": cost.model_tflops_per_gpu,
        "hardware_tflops_per_gpu": cost.hardware_tflops_per_gpu,
        "mfu": cost.mfu,
        "flops_conventions": FLOPS_CONVENTIONS,
        "comm_fraction": cost.comm_fraction,
        "bubble_fraction": cost.bubble_fraction,
        "all_to_all_s": cost.a2a_s,
        "all_to_all_fraction": cost.a2a_s / cost.step_time_s,
        "num_gpus": plan.world,
    }
    if plan.ep > 1:
        out["ep_group"] = ep_group_span(plan, cluster)
    if tokens:
        out["train_days"] = tokens / cost.tokens_per_s / 86400
    return out


def ep_group_span(plan: Plan, cluster: Cluster) -> dict:
    """Where one EP group's all-to-all runs: EP consecutive ranks of a stage (TP first, then CP, then DP:
    ``megakit.core.layout``), so over how many TP groups and nodes it reaches."""
    node = cluster.gpus_per_node
    nodes = -(-plan.ep // node)
    return {
        "ranks": plan.ep,
        "consecutive": True,
        "tp_groups": -(-plan.ep // plan.tp),
        "nodes": nodes,
        "link": "intra-node"
        if nodes == 1
        else f"{nodes} nodes ({(plan.ep - min(plan.ep, node)) / plan.ep:.0%} of each rank's tokens leave its node)",
        "edp_stride": plan.ep,
    }


def assumptions(
    model: ModelSpec,
    cluster: Cluster,
    auto: bool,
    result,
    precision,
    flash,
    threshold,
    global_batch,
    tokens,
    launch,
    launch_note,
    batch_note: str = "",
) -> dict:
    """What the planner assumed (model, hardware, batch, launch), printed so the user can check the inputs."""
    gpu = cluster.gpu
    return {
        "model": {
            "name": model.name,
            "source": model.assumed,
            "family": model.family,
            "params": model.params,
            "layers": model.layers,
            "hidden": model.hidden,
            "heads": model.heads,
            "kv_heads": model.kv_heads,
            "ffn": model.ffn,
            "vocab": model.vocab_size,
            "seq_len": model.seq_len,
            "active_params": model.active_params(),
            "tie_embeddings": model.tie_embeddings,
        },
        "cluster": {
            "gpu": gpu.name,
            "num_gpus": cluster.num_gpus,
            "nodes": cluster.nodes,
            "gpus_per_node": cluster.gpus_per_node,
            "gpu_memory_gib": gpu.mem_gib,
            "peak_tflops": gpu.peak_tflops,
            "hbm_gbps": gpu.hbm_gbps,
            "intra_node": f"{gpu.intra_link}, {gpu.intra_gbps:,.4g} GB/s per GPU",
            "inter_node": f"{gpu.inter_link}, {gpu.inter_gbps:,.4g} GB/s per GPU",
            "auto_sized": auto,
        },
        "rule": {"branch": result.branch, "why": result.branch_why},
        "mem_threshold": threshold,
        "precision": precision,
        "attention": "flash" if flash else "standard",
        "global_batch": global_batch,
        "global_batch_note": batch_note,
        "tokens": tokens,
        "layouts_evaluated": result.evaluated,
        "launch": launch,
        "launch_note": launch_note,
    }
