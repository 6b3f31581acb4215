"""``megakit plan``'s LoRA flags, as ``scripts/train.py``'s (``--lora-rank``, ``--lora-alpha``, ``--lora-dropout``,
``--lora-targets``, ``--lora-rslora``): the ``LoraSpec`` the planner prices (``megakit.core.planner.lora_cost``)."""

from __future__ import annotations

import argparse

from megakit.core.lora import LoraSpec, parse_targets
from megakit.core.planner import lora_cost
from megakit.core.planner.memory import GIB
from megakit.core.planner.model_spec import ModelSpec
from megakit.errors import UsageError, finite_float


def configure(parser: argparse.ArgumentParser) -> None:
    """The LoRA flag group (the trainer's names and defaults)."""
    g = parser.add_argument_group("LoRA", "price a LoRA fine-tune: the base frozen, adapters trained")
    g.add_argument(
        "--lora-rank",
        metavar="R",
        type=int,
        help="plan LoRA adapters of rank R on a frozen base (default: off, full fine-tuning)",
    )
    g.add_argument("--lora-alpha", type=finite_float, default=16.0, help="LoRA's alpha (default 16; no effect on cost)")
    g.add_argument("--lora-dropout", type=finite_float, default=0.0, help="dropout on the adapters' input (default 0)")
    g.add_argument(
        "--lora-targets",
        metavar="NAMES",
        default="all-linear",
        help="comma-separated module names that get adapters (q_proj, k_proj, v_proj, o_proj, gate_proj, "
        "up_proj, down_proj) or all-linear, every linear layer but the head (default)",
    )
    g.add_argument("--lora-rslora", action="store_true", help="rank-stabilised scaling (no effect on cost)")


def spec(args, model: ModelSpec, *, runtime: str) -> LoraSpec | None:
    """The flags' ``LoraSpec`` (None without --lora-rank), its targets checked against ``model``'s linears."""
    if args.lora_rank is None:
        defaults = {"lora_alpha": 16.0, "lora_dropout": 0.0, "lora_targets": "all-linear", "lora_rslora": False}
        given = [k for k, v in defaults.items() if getattr(args, k) != v]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} applies to LoRA; give --lora-rank R too")
        return None
    if runtime != "megakit":
        raise UsageError(f"LoRA is priced for megakit's trainer; drop --runtime {runtime} or --lora-rank")
    if getattr(args, "optimizer", "adamw") == "muon":  # as the trainer refuses it (train.run.resolve)
        raise UsageError("--optimizer muon does not train LoRA adapters; drop --lora-rank or use AdamW")
    if model.config.layer_pattern or model.config.linear is not None:  # lora_cost knows attention + MLP blocks
        raise UsageError(
            f"the planner prices LoRA on attention and MLP blocks, not yet on {model.config.hf_type or 'this'}'s "
            "linear-attention or Mamba-2 mixers; plan it without --lora-rank (the trainer runs it)"
        )
    lora = LoraSpec(
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        dropout=args.lora_dropout,
        targets=parse_targets(args.lora_targets),
        rslora=args.lora_rslora,
    )
    lora_cost.adapted(model, lora, 1)  # a target the model lacks: one line naming those it has
    return lora


def saved_params(model: ModelSpec, plan) -> float:
    """The parameters a checkpoint writes with its optimizer state: LoRA's checkpoints hold the adapters only."""
    return model.params if plan.lora is None else lora_cost.model_params(model, plan.lora)


def report(model: ModelSpec, plan, mem, cluster, *, threshold: float) -> dict:
    """``megakit plan``'s LoRA entry: the adapters, what the frozen base costs, the compute it saves, and the
    verdict's reason: whether a full fine-tune could fit this cluster at all (its model states fully sharded,
    ZeRO-3 over every GPU, no offload: 16 bytes a parameter in mixed precision over N)."""
    lora = plan.lora
    adapters = lora_cost.model_params(model, lora)
    line = threshold * cluster.gpu.mem_gib * GIB
    full_floor = 16 * model.params / cluster.num_gpus  # bf16/fp16: 2 + 2 + 4 + 8; fp32: 4 + 4 + 8 (no master)
    why = (
        f"LoRA is what lets it fit: a full fine-tune's model states alone, ZeRO-3 over all {cluster.num_gpus} GPUs "
        "without offload, "
        f"are {full_floor / GIB:,.1f} GiB per GPU, over the {line / GIB:,.1f} GiB line; LoRA keeps the frozen base "
        f"({mem.items['params'] / GIB:,.2f} GiB here) and the adapters' states only"
        if full_floor > line
        else f"a full fine-tune could fit too (its states fully sharded are {full_floor / GIB:,.1f} GiB per GPU); "
        "LoRA saves the base's gradients, fp32 master and Adam states"
    )
    return {
        "rank": lora.rank,
        "alpha": lora.alpha,
        "dropout": lora.dropout,
        "targets": list(lora.targets),
        "adapter_params": adapters,
        "adapter_share": adapters / model.params,
        "full_finetune_states_floor_gib": full_floor / GIB,
        "lets_it_fit": full_floor > line,
        "compute": "forward 1x and input gradients 1x of every base GEMM, no weight gradients for the base or head; "
        "the adapters' two rank-r GEMMs forward, input- and weight-gradient (about 2/3 of a full fine-tune)",
        "why": why,
    }
