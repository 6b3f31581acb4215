"""What the plan turns into: a ds_config, the launch command, and tips tied to this plan.

The ds_config keeps to standard DeepSpeed keys (DeepSpeed's own parser must accept
it): batch sizes (``train_batch_size = micro × accumulation × DP``), bf16/fp16,
the ZeRO section, AdamW with a linearly scaled LR, a WarmupCosineLR schedule and
gradient clipping (FAQ row 4). TP and PP are not DeepSpeed keys: they go into
the printed launch command. A Muon plan (``Plan.optimizer``) has no optimizer
section (the trainer builds Muon + AdamW, ``check_muon``): its LR goes to the
launch command's ``--muon-lr``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path

from megakit.core.planner.memory import Buckets
from megakit.core.planner.plan import FP8_RECIPES, Plan
from megakit.errors import UsageError

# (parameters, learning rate, batch in tokens): GPT-3 (Brown et al. 2020, Table 2.1)
GPT3_LR = [
    (125e6, 6.0e-4, 0.5e6),
    (350e6, 3.0e-4, 0.5e6),
    (760e6, 2.5e-4, 0.5e6),
    (1.3e9, 2.0e-4, 1e6),
    (2.7e9, 1.6e-4, 1e6),
    (6.7e9, 1.2e-4, 2e6),
    (13e9, 1.0e-4, 2e6),
    (175e9, 0.6e-4, 3.2e6),
]
DEFAULT_BUCKETS = Buckets()  # DeepSpeed's own sizes (frozen, so one shared default is safe)
WARMUP_TOKENS = 375e6  # GPT-3's linear warm-up
CHINCHILLA_TOKENS_PER_PARAM = 20
GPT3_TOKENS = 300e9  # the yardstick for time-to-train when the cluster was auto-sized


MIN_STEPS = 500  # the fewest optimizer steps a default batch leaves the token budget: warm-up and decay need room


def gpt3_batch(params: float, seq_len: int) -> tuple[float, float, int]:
    """(LR, batch in tokens, batch in sequences) of GPT-3 for the nearest size: the tokens rounded to whole
    sequences, a multiple of 256 (a power of two below that). The one definition of "GPT-3's batch", so that the
    LR scaled to a plan's batch is GPT-3's own when the plan takes that batch (2M tokens at 8192 is 256
    sequences, not 244)."""
    _, lr, batch_tokens = min(GPT3_LR, key=lambda row: abs(math.log(row[0] / params)))
    seqs = batch_tokens / seq_len
    return (
        lr,
        batch_tokens,
        (max(1, int(round(seqs / 256)) * 256) if seqs >= 256 else max(1, 2 ** int(round(math.log2(seqs))))),
    )


def default_global_batch(params: float, seq_len: int, tokens: float | None = None) -> tuple[int, str]:
    """(sequences per step, what was assumed): GPT-3's batch for the nearest size (``gpt3_batch``), unless the
    token budget (``tokens``, else Chinchilla's 20 per parameter) would then last fewer than ``MIN_STEPS`` steps,
    as for a small model: then the largest power of two that leaves it ``MIN_STEPS`` steps (GPT-3's 0.5M-token
    batch would train a 66K-parameter model in 3 steps)."""
    _, batch_tokens, gpt3 = gpt3_batch(params, seq_len)
    budget = tokens or CHINCHILLA_TOKENS_PER_PARAM * params
    source = "--tokens" if tokens else f"{CHINCHILLA_TOKENS_PER_PARAM} per parameter, Chinchilla"
    gpt3_note = f"GPT-3's batch for this size ({batch_tokens / 1e6:g}M tokens = {gpt3:,} sequences of {seq_len})"
    if gpt3 * seq_len * MIN_STEPS <= budget:
        return gpt3, gpt3_note
    bounded = max(1, 2 ** int(math.floor(math.log2(max(budget / (MIN_STEPS * seq_len), 1)))))
    return bounded, (
        f"{bounded:,} sequences of {seq_len}, so that the token budget, {budget:,.0f} tokens ({source}), "
        f"lasts at least {MIN_STEPS} steps; {gpt3_note} would last "
        f"{math.ceil(budget / (gpt3 * seq_len))} steps"
    )


def scaled_lr(
    params: float, global_batch: int, seq_len: int, *, base_lr: float | None = None, base_batch: int | None = None
) -> tuple[float, str]:
    """Linear scaling (FAQ row 4: batch 64 / lr 0.1 -> batch 512 / lr 0.8) from a reference point:
    the user's ``base_lr`` at ``base_batch`` sequences, else GPT-3's LR and batch for the nearest size. Below
    GPT-3's batch (a small model's batch bounded by its token budget) the LR is not scaled down: 32 sequences
    against GPT-3's 7,936 would give 2.4e-6, which trains nothing in a few hundred Adam steps."""
    gpt3 = base_lr is None
    if base_lr is None:
        base_lr, tokens, base_batch_seqs = gpt3_batch(params, seq_len)
        source = (
            f"GPT-3's {base_lr:.1e} at its {tokens / 1e6:g}M-token batch ({base_batch_seqs:,} sequences of {seq_len})"
        )
    else:
        base_batch_seqs = base_batch or 256
        source = f"--base-lr {base_lr:g} at {base_batch_seqs:g} sequences"
    if gpt3 and global_batch < base_batch_seqs:
        return base_lr, (
            f"{base_lr:.3g} = {source}, not scaled down to {global_batch} sequences (linear scaling "
            f"would give {base_lr * global_batch / base_batch_seqs:.2g}, too small to train)"
        )
    if global_batch == base_batch_seqs:
        return base_lr, f"{base_lr:.3g} = {source}"
    lr = base_lr * global_batch / base_batch_seqs
    return lr, f"{lr:.3g} = {source} x {global_batch} / {base_batch_seqs:.0f} sequences (linear scaling)"


def ds_config(
    plan: Plan, *, lr: float, total_steps: int, warmup_steps: int, buckets: Buckets = DEFAULT_BUCKETS
) -> dict:
    """The DeepSpeed config the plan needs, so the emitted launch runs the plan that was priced."""
    zero: dict = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        # A pipeline steps once per flush (managed_gradient_accumulation off), and DeepSpeed then
        # allows overlap_comm only with ZeRO-2, which PP excludes: so overlap only without PP.
        zero.update(
            overlap_comm=plan.pp == 1,
            contiguous_gradients=True,
            reduce_scatter=True,
            reduce_bucket_size=buckets.reduce_bucket,
            allgather_bucket_size=buckets.allgather_bucket,
        )
    if plan.zero_stage == 3:
        zero.pop("allgather_bucket_size")
        zero.pop("reduce_scatter")
        zero.update(
            stage3_prefetch_bucket_size=buckets.stage3_prefetch,
            stage3_max_live_parameters=buckets.stage3_max_live,
            sub_group_size=buckets.stage3_sub_group,
        )
    if plan.offload in ("optimizer", "params"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if plan.offload == "params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    config = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_clipping": 1.0,
        "zero_optimization": zero,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": WEIGHT_DECAY},
        },
        "scheduler": {
            "type": "WarmupCosineLR",
            "params": {
                "total_num_steps": max(total_steps, warmup_steps + 1),
                "warmup_num_steps": warmup_steps,
                "warmup_min_ratio": 0.0,
                "cos_min_ratio": 0.1,
                "warmup_type": "linear",
            },
        },
        "steps_per_print": 10,
        "wall_clock_breakdown": False,
    }
    if plan.optimizer == "muon":  # the trainer builds Muon + AdamW at --muon-lr (train_flags) and refuses a section
        del config["optimizer"]
    if plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif plan.precision == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 16,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    return config


def schedule_steps(global_batch: int, seq_len: int, tokens: float | None, *, params: float) -> tuple[int, int]:
    """(total steps, warm-up steps) for ``tokens`` at this batch.

    Without ``--tokens`` the schedule spans 20 tokens per parameter (Chinchilla-optimal,
    Hoffmann et al. 2022), so a small model's emitted config does not warm up for longer
    than a sensible run lasts."""
    per_step = global_batch * seq_len
    total = max(1, math.ceil((tokens or CHINCHILLA_TOKENS_PER_PARAM * params) / per_step))
    warmup = max(1, min(math.ceil(WARMUP_TOKENS / per_step), total // 10 or 1))
    return total, warmup


KEEP = 3  # checkpoints the emitted launch keeps (--keep): the newest is the one --load auto takes
WEIGHT_DECAY = 0.1  # AdamW's in the ds_config, and --muon-weight-decay (both of Muon's halves) in a Muon launch


def train_flags(
    plan: Plan,
    *,
    config_path: str,
    model_arg: str,
    seq_len: int,
    save: str | None = None,
    save_every: int = 0,
    stage_layers: tuple[int, ...] | None = None,
    mtp: bool = False,
    objective: str = "lm",
    lr: float = 0.0,
) -> list[str]:
    """``scripts/train.py``'s flags for the plan's layout, recompute, sequence parallelism, virtual stages, a
    pinned ``stage_layers`` split (the default split is the trainer's own), ``--mtp``, a Muon plan's
    ``--optimizer muon`` at ``lr`` (the ds_config's would be AdamW's; Muon's ``match_rms_adamw`` takes the same), and
    with ``save`` a checkpoint series every ``save_every`` steps that the same command resumes (``--load auto``)."""
    parts = [
        "--ds_config",
        config_path,
        "--tp",
        str(plan.tp),
        "--pp",
        str(plan.pp),
        "--model",
        model_arg,
        "--seq-len",
        str(seq_len),
    ]
    if plan.cp > 1:
        parts += ["--cp", str(plan.cp)] + (["--cp-mode", plan.cp_mode] if plan.cp_mode != "ring" else [])
        parts += ["--cp-a2a", str(plan.cp_a2a)] if plan.cp_mode == "hybrid" else []
    if plan.ep > 1:
        parts += ["--ep", str(plan.ep)]
    if plan.vpp > 1:
        parts += ["--vpp", str(plan.vpp)]
    if stage_layers is not None:
        parts += ["--stage-layers", ",".join(map(str, stage_layers))]
    if plan.zero_bubble:
        parts += ["--schedule", "zb-h1"]
    if plan.sequence_parallel:
        parts.append("--sequence-parallel")
    if plan.recompute in ("selective", "full"):
        parts += ["--recompute", plan.recompute]
    if plan.compress != "none":
        parts += ["--compress", plan.compress]
    if not plan.fused_kernels:  # train.py compiles each block by default on a GPU (--kernels compiled)
        parts.append("--no-compile")
    if plan.fp8 in FP8_RECIPES[1:]:  # torchao's, which train.py runs (Transformer Engine's recipes it does not)
        parts += ["--fp8", plan.fp8]
    if plan.lora is not None:  # the adapters the plan priced (alpha and rslora cost nothing: the trainer's defaults)
        parts += ["--lora-rank", str(plan.lora.rank), "--lora-targets", ",".join(plan.lora.targets)]
        parts += ["--lora-dropout", f"{plan.lora.dropout:g}"] if plan.lora.dropout else []
    if mtp:  # the prediction modules the plan charged the last stage for (its split gives that stage fewer blocks)
        parts.append("--mtp")
    if objective != "lm":  # preference tuning on the pairs prepare-data wrote (the planner priced its reference)
        parts += ["--objective", objective]
    if plan.optimizer == "muon":
        parts += ["--optimizer", "muon", "--muon-lr", f"{lr:.3g}", "--muon-weight-decay", f"{WEIGHT_DECAY:g}"]
    if save:
        parts += ["--save", save, "--save-every", str(save_every), "--keep", str(KEEP), "--load", "auto"]
    return parts


def launch_command(
    plan: Plan,
    *,
    nodes: int,
    gpus_per_node: int,
    config_path: str,
    model_arg: str,
    seq_len: int,
    save: str | None = None,
    save_every: int = 0,
    stage_layers: tuple[int, ...] | None = None,
    hostfile: str | None = None,
    mtp: bool = False,
    objective: str = "lm",
    lr: float = 0.0,
) -> tuple[str, str]:
    """(the ``deepspeed`` command line for ``scripts/train.py`` with ``train_flags``; a note on what the plan
    assumes that train.py cannot do yet, '' if none)."""
    gpus = min(gpus_per_node, plan.world)
    parts = ["deepspeed"] + (["--hostfile", hostfile] if hostfile else [])
    if nodes > 1:
        parts += ["--num_nodes", str(nodes)]
    parts += ["--num_gpus", str(gpus), "scripts/train.py"]
    parts += train_flags(
        plan,
        config_path=config_path,
        model_arg=model_arg,
        seq_len=seq_len,
        save=save,
        save_every=save_every,
        stage_layers=stage_layers,
        mtp=mtp,
        objective=objective,
        lr=lr,
    )
    notes = []
    if plan.recompute not in ("none", "selective", "full"):
        notes.append(
            f"the plan also assumes {plan.recompute} activation recompute, which megakit's model does not do yet"
        )
    if plan.megatron or plan.zero3 != "deepspeed":
        notes.append(
            "the plan is priced as " + ("Megatron-LM" if plan.megatron else plan.zero3) + " runs it "
            "(--runtime); megakit's trainer differs in memory and overlap"
            + (
                f", and runs no {plan.fp8} FP8 (torchao's --fp8 tensorwise|rowwise only)"
                if plan.fp8 not in FP8_RECIPES
                else ""
            )
        )
    return " ".join(parts), "; ".join(notes)


def check_target(path: str, flag: str) -> None:
    """A file name in a folder that exists, or one clear line naming ``flag``: checked for every output before any is
    written, so a bad second path leaves no first file behind."""
    target = Path(path)
    if target.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name such as {path}/plan.json")
    folder = target.parent if str(target.parent) else Path(".")
    if not folder.is_dir():
        raise UsageError(f"{flag} folder {folder} does not exist; create it or pick another path")


def write_text_atomic(path: str, text: str, *, flag: str = "--emit-config", executable: bool = False) -> None:
    """Write to a temporary file in the same folder, then rename: never a half-written file."""
    check_target(path, flag)
    target = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent if str(target.parent) else ".")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o755 if executable else 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json_atomic(path: str, data: dict, *, flag: str = "--emit-config") -> None:
    """Writes JSON whole or not at all, so a failed write never leaves a half config for the launch."""
    write_text_atomic(path, json.dumps(data, indent=2) + "\n", flag=flag)


def tips(
    result, cost, plan: Plan, cluster, *, lr_note: str, warmup: int, total: int, auto_sized: bool = False
) -> list[str]:
    """FAQ advice (rows 1, 2, 4, 5) that applies to this plan, with its numbers."""
    out = []
    if cost.comm_fraction > 0.30:
        out.append(
            f"Communication is {cost.comm_fraction:.0%} of the step (> 30 %): raise gradient accumulation "
            "(communication happens only at the boundary), or use a bigger micro-batch."
        )
        if plan.dp > 1 and plan.tp * plan.dp > cluster.gpus_per_node and plan.compress == "none":
            out.append(
                f"DP traffic crosses nodes on {cluster.gpu.inter_link} ({cluster.gpu.inter_gbps:,.4g} GB/s per "
                "GPU): megakit's compression with error feedback (plan and train with --compress int8, "
                "with ZeRO 0 or 1, or sign or topk:0.01 with ZeRO 0) sends 4-50x fewer bytes; or, with ZeRO 0, "
                "--local-sgd H averages the weights only every H steps."
            )
    small_model = result.branch == "data-parallel" and plan.dp >= 8
    if small_model and cost.comm_fraction > 0.15:
        out.append(
            f"A small model on {plan.dp} GPUs is communication-bound: fewer GPUs or a bigger global batch "
            "would be nearly as fast per GPU-hour."
        )
    if cluster.gpu.inter_gbps < 12.5 and plan.world > cluster.gpus_per_node:
        out.append(
            f"The inter-node link is slow ({cluster.gpu.inter_gbps:,.4g} GB/s per GPU): prefer gradient "
            "accumulation, megakit's --compress (int8 with ZeRO 0 or 1; sign, topk:RATIO with ZeRO 0; "
            "all with error feedback) or, with ZeRO 0, --local-sgd H."
        )
    if plan.pp > 1 and cost.bubble_fraction > 0.10:
        out.append(
            f"The pipeline bubble is {cost.bubble_fraction:.0%}: more micro-batches per step or "
            "interleaving (--vpp) shrink it."
        )
    if auto_sized:
        days = GPT3_TOKENS / cost.tokens_per_s / 86400
        out.append(
            f"This is the fewest whole nodes that fit ({cluster.nodes}); 300B tokens would take {days:,.0f} "
            "days here: pass --nodes or --gpus to plan a bigger cluster."
        )
    out.append(
        f"LR {lr_note}; linear warm-up over {warmup} steps, cosine decay to 10 % over {total} steps, "
        "gradient clipping at 1.0 (all in the emitted ds_config)."
    )
    return out
