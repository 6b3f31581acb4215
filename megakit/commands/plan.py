"""``megakit plan``: pick TP × PP × DP × ZeRO for a model and a cluster, and say why.

Reads the model (``--params`` or ``--model``) and the cluster (``--gpu``, ``--gpus`` or
``--nodes``), runs the search, and prints the plan, its memory against the
threshold line, its throughput, the best alternatives and rejections, and tips;
``--json`` prints the same as one JSON object, ``--emit-config`` writes the
ds_config and prints the launch command. Imports no torch.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import sys
from pathlib import Path

from megakit.commands import plan_lora, plan_report
from megakit.core.compression import parse_compression
from megakit.core.partition import parse_stage_layers
from megakit.core.planner import emit, launch_script, save_interval
from megakit.core.planner.activations import parse_loss_chunks
from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import (
    GPU,
    GPUS,
    Cluster,
    gpu_from_profile,
    gpu_preset,
)
from megakit.core.planner.memory import GIB, MEGATRON_RECOMPUTE
from megakit.core.planner.model_spec import ModelSpec, parse_count, preset_names
from megakit.core.planner.muon import muon_cost
from megakit.core.planner.pins import hybrid_degree
from megakit.core.planner.plan import FP8_RECIPES, FP8_TE_RECIPES, ROUTING, RUNTIMES, Plan
from megakit.core.planner.preference import OBJECTIVES, preference_cost
from megakit.core.planner.search import NoPlan, Pins, search, smallest_cluster
from megakit.core.planner.sharding import LINK_EFFICIENCY
from megakit.core.planner.stages import virtual_stage_ranges
from megakit.core.planner.verdict import headroom_note
from megakit.errors import UsageError, finite_float

# A value such as "-5B" or "-1.3e9" is a (wrong) size, not an option: argparse only treats plain
# negative numbers so, and would say "--params: expected one argument". No flag of this command looks
# like a number, so widening argparse's matcher (a private attribute, hence the hasattr) is safe; the
# value then reaches parse_count, which says why it is wrong.
_NEGATIVE_VALUE = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[+-]?\d+)?[kmbgt]?$", re.IGNORECASE)


def configure(parser: argparse.ArgumentParser) -> None:
    """``megakit plan``'s flags, one argument group (and one function) per topic, as ``--help`` shows them."""
    if hasattr(parser, "_negative_number_matcher"):
        parser._negative_number_matcher = _NEGATIVE_VALUE
    _model_flags(parser)
    _cluster_flags(parser)
    _training_flags(parser)
    _objective_flags(parser)
    plan_lora.configure(parser)
    _pin_flags(parser)
    _output_flags(parser)
    _checkpoint_flags(parser)


def _model_flags(parser: argparse.ArgumentParser) -> None:
    """The model: a size, a preset or a config.json, and its sequence."""
    model = parser.add_argument_group("model")
    model.add_argument("--params", help="model size: 125M, 1.3B, 70b, 175e9, 1T (nearest well-known shape)")
    model.add_argument("--model", help="preset name from models/ or a Hugging Face config.json path")
    model.add_argument("--seq-len", type=int, help="sequence length (default 2048, or the config's, up to 8192)")
    model.add_argument("--vocab", type=int, help="vocabulary size override")
    model.add_argument(
        "--mtp",
        action="store_true",
        help="train the config's Multi-Token Prediction modules (DeepSeek-V3's "
        "num_nextn_predict_layers) on the last stage, as train.py --mtp does",
    )


def _cluster_flags(parser: argparse.ArgumentParser) -> None:
    """The cluster: a GPU preset or a probed profile, how many, and overrides of its rates."""
    cluster = parser.add_argument_group("cluster")
    cluster.add_argument("--gpu", default="a100-80gb", help=f"GPU preset: {', '.join(GPUS)}")
    cluster.add_argument("--gpus", type=int, help="total GPUs (default: the fewest whole nodes that fit)")
    cluster.add_argument("--nodes", type=int, help="nodes (x --gpus-per-node)")
    cluster.add_argument("--gpus-per-node", type=int, help="default 8, or the probed machine's")
    cluster.add_argument(
        "--hardware",
        metavar="PROFILE.json",
        help="a profile written by megakit probe: its measured rates replace the --gpu preset",
    )
    cluster.add_argument("--gpu-mem", type=finite_float, help="GPU memory override, GiB")
    cluster.add_argument("--intra-bw", type=finite_float, help="intra-node link override, GB/s per GPU")
    cluster.add_argument("--inter-bw", type=finite_float, help="inter-node network override, GB/s per GPU")
    cluster.add_argument("--peak-tflops", type=finite_float, help="peak dense 16-bit TFLOP/s override")


def _objective_flags(parser: argparse.ArgumentParser) -> None:
    """What the run optimises: the next token, or a preference objective on pairs (its one-off reference pass)."""
    objective = parser.add_argument_group("objective")
    objective.add_argument(
        "--objective",
        choices=OBJECTIVES,
        default="lm",
        help="lm (default): the next-token loss; dpo, ipo, simpo: preference tuning on chosen/rejected pairs, which "
        "also prints the reference pass and the log-probabilities it keeps (none for simpo)",
    )
    objective.add_argument(
        "--pairs-per-window",
        type=int,
        default=1,
        metavar="K",
        help="with --objective: the pairs prepare-data puts in a window (1 with --pad, more with --pack; default 1)",
    )


def _training_flags(parser: argparse.ArgumentParser) -> None:
    """How the run trains: batch, tokens, precision, kernels, runtime and the memory levers."""
    train = parser.add_argument_group("training")
    train.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="adamw (default), or muon: plan train.py --optimizer muon (its moment, step buffers, Newton-Schulz, TP "
        "and DP exchanges priced in; ZeRO 1-2, or 0 in fp32), and print its cost line by line",
    )
    train.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: GPT-3's for the size)")
    train.add_argument("--tokens", help="training tokens, e.g. 300B: adds time-to-train")
    train.add_argument("--precision", choices=("bf16", "fp16", "fp32"), help="default bf16 (fp16 on V100)")
    train.add_argument(
        "--offload",
        choices=("none", "optimizer", "params"),
        default="none",
        help="ZeRO-Offload: the fp32 master and Adam states (optimizer), or the parameters too "
        "(params), in CPU memory (default none; tried by itself when nothing else fits)",
    )
    train.add_argument("--attention", choices=("flash", "standard"), help="default: flash where the GPU has it")
    train.add_argument(
        "--kernels",
        choices=("eager", "compiled"),
        default="compiled",
        help="elementwise work priced fused (compiled: train.py's default on a GPU, torch.compile of "
        "each block, as Megatron's fused kernels) or one kernel per op (eager: --no-compile)",
    )
    train.add_argument(
        "--fp8",
        choices=FP8_RECIPES + FP8_TE_RECIPES,
        default="none",
        help="the blocks' linears on FP8 tensor cores (torchao float8, as train.py --fp8; with --runtime "
        "megatron|megatron-core, Transformer Engine's recipes, blockwise and mxfp8 too); Hopper, "
        "Ada, Blackwell and MI300 have them, A100 and V100 do not",
    )
    train.add_argument(
        "--runtime",
        choices=tuple(RUNTIMES),
        default="megakit",
        help="whose trainer runs the plan: megakit (default; DeepSpeed), megatron (Megatron-LM: SP "
        "inputs re-gathered in backward, fp32 main grads under bf16), megatron-core (the same with "
        "Megatron-Core's TP and DP communication overlap), fsdp (ZeRO-3 "
        "prefetching whole blocks), deepspeed-2021 (ZeRO-3 as Narayanan et al. 2021 measured)",
    )
    train.add_argument(
        "--recompute-modules",
        metavar="M,M,...",
        help="--runtime megatron*, --recompute selective: Megatron-Core's --recompute-modules "
        f"({', '.join(MEGATRON_RECOMPUTE)}); default: core_attn, its own",
    )
    train.add_argument(
        "--main-grads",
        choices=("fp32", "bf16"),
        help="--runtime megatron*: the main-gradient buffers' dtype (default fp32, Megatron-LM's under "
        "bf16; bf16: --grad-reduce-in-bf16, as Megatron-Bridge's performance recipes run)",
    )
    train.add_argument(
        "--adam-moments",
        choices=("fp32", "bf16"),
        default="fp32",
        help="Adam's m and v dtype (bf16: Megatron's --use-precision-aware-optimizer --exp-avg-dtype "
        "bf16 --exp-avg-sq-dtype bf16) (default fp32)",
    )
    train.add_argument("--mem-threshold", type=finite_float, default=0.80, help="feasible if peak <= this x GPU memory")
    train.add_argument("--base-lr", type=finite_float, help="reference LR for linear scaling (with --base-batch)")
    train.add_argument("--base-batch", type=int, default=256, help="sequences at which --base-lr applies")
    train.add_argument(
        "--moe-routing",
        choices=tuple(ROUTING),
        help="MoE routing priced: real (dropless, the busiest expert rank gets "
        f"{ROUTING['real']:g}x its share; default) or balanced (forced, as most published runs)",
    )
    train.add_argument(
        "--moe-imbalance",
        type=finite_float,
        metavar="F",
        help="MoE: the busiest expert rank's tokens over the balanced share (overrides --moe-routing)",
    )
    train.add_argument(
        "--dp-shard",
        type=int,
        metavar="N",
        help="--runtime fsdp: shard the model states over groups of N data-parallel GPUs and replicate "
        "across groups (HSDP; torchtitan's data_parallel_shard_degree); default: all of DP",
    )
    train.add_argument(
        "--compress",
        default="none",
        metavar="CODEC",
        help="price DP traffic compressed as the trainer's --compress does (fp16, int8, sign, "
        "topk:RATIO; ZeRO 0 plans only)",
    )
    train.add_argument(
        "--loss-chunks",
        default="auto",
        metavar="K",
        help="the LM head and loss over K token chunks, as train.py --loss-chunks (default auto: "
        "one per 256 MiB of fp32 logits)",
    )


def _pin_flags(parser: argparse.ArgumentParser) -> None:
    """Dimensions to pin; the search fills in the rest around them."""
    pins = parser.add_argument_group("pin a dimension (the rest is searched)")
    pins.add_argument("--tp", type=int)
    pins.add_argument("--pp", type=int)
    pins.add_argument("--cp", type=int, help="context parallelism: each sequence split over CP GPUs (ring attention)")
    pins.add_argument(
        "--cp-mode",
        choices=("ring", "a2a", "hybrid"),
        help="how CP GPUs attend: ring (K/V blocks passed on), a2a (Ulysses: heads over CP) or hybrid "
        "(a2a inside groups of --cp-a2a GPUs, a ring across them); default: the fastest the heads "
        "allow",
    )
    pins.add_argument(
        "--cp-a2a",
        type=int,
        help="with --cp-mode hybrid: the all-to-all degree (default: the largest "
        "that divides CP and the heads per TP rank within a node)",
    )
    pins.add_argument(
        "--ep",
        type=int,
        help="expert parallelism (MoE models): experts sharded over EP of a stage's "
        "TP x CP x DP ranks (folded: consecutive, TP first)",
    )
    pins.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    pins.add_argument("--micro-batch", type=int)
    pins.add_argument("--recompute", choices=("none", "selective", "full"))
    pins.add_argument(
        "--vpp",
        type=int,
        help="virtual stages (interleaved chunks) per pipeline stage; they need not "
        "divide the layers, and PP x VPP may exceed them by 2 (an embedding-only "
        "first and a loss-only last virtual stage)",
    )
    pins.add_argument(
        "--stage-layers",
        metavar="N,N,...",
        help="layers per virtual stage, e.g. 3,4,4,3, N*K for K stages of N, e.g. 0,1*94,0 (chunk c of "
        "stage s is virtual stage c x PP + s; needs --pp; the first and last may be 0: embedding "
        "only, or final norm + head + loss only); default: balanced by parameters, embedding and "
        "head counted",
    )
    pins.add_argument(
        "--schedule",
        choices=("1f1b", "zb-h1"),
        help="pipeline schedule: zb-h1 (zero bubble, Qi et al. 2023) trades memory for bubble",
    )


def _output_flags(parser: argparse.ArgumentParser) -> None:
    """What to print or write: tables or JSON, a ds_config, a launch script."""
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    out.add_argument("--emit-config", metavar="PATH", help="write the plan's ds_config here")
    out.add_argument(
        "--emit-launch",
        nargs=2,
        metavar=("slurm|hostfile", "PATH"),
        help="write a Slurm batch script (torchrun per node, c10d, restarts) or a DeepSpeed hostfile "
        "(its deepspeed line on top) for this plan; the ds_config goes to --emit-config, else "
        "beside PATH as PATH's stem + .json",
    )
    out.add_argument("--top", type=int, default=5, help="alternatives and rejections to show")


def _checkpoint_flags(parser: argparse.ArgumentParser) -> None:
    """Checkpoint cadence: Young/Daly's interval from the write time and the cluster's MTBF."""
    ckpt = parser.add_argument_group("checkpoints (Young/Daly: save every sqrt(2 x write time x cluster MTBF))")
    ckpt.add_argument(
        "--save",
        metavar="DIR",
        default="checkpoints",
        help="where the launch command saves and resumes (--load auto) (default checkpoints)",
    )
    ckpt.add_argument("--save-every", type=int, metavar="N", help="steps between saves (default: Young/Daly's)")
    ckpt.add_argument(
        "--ckpt-write-gbps",
        type=finite_float,
        default=save_interval.WRITE_GBPS_PER_NODE,
        metavar="GB/S",
        help="checkpoint write bandwidth per writing node, GB/s (default 1: Llama 3's storage, "
        "2 TB/s over 2,048 nodes)",
    )
    ckpt.add_argument(
        "--mtbf-gpu-hours",
        type=finite_float,
        default=save_interval.GPU_MTBF_HOURS,
        metavar="H",
        help="one GPU's mean time between failures, hours (default 50677: Llama 3's 419 unexpected "
        "interruptions in 54 days on 16,384 GPUs); the cluster's is H / GPUs",
    )


def _cp_mode_note(model, cluster, plan, cost, pins) -> str:
    """Why the plan's CP ranks attend as they do: pinned, or its speed against each other mode, and why a mode the
    heads or the node rule out is not there."""
    what = {
        "ring": "K/V blocks passed around the CP group behind attention",
        "a2a": "all-to-alls of q, k, v and the output, each rank attending over the whole sequence of heads/CP",
        "hybrid": f"all-to-alls inside groups of {plan.cp_a2a} GPUs, a ring across them",
    }
    if pins.cp_mode is not None:
        return f"{plan.cp_mode}: pinned (--cp-mode)"
    heads, versus, ruled_out = model.heads // plan.tp, [], []
    a = hybrid_degree(model, cluster, plan.tp, plan.cp, pins.cp_a2a)
    for mode, cp_a2a in (("ring", 0), ("a2a", 0), ("hybrid", a)):
        if mode == plan.cp_mode:
            continue
        if mode == "a2a" and heads % plan.cp:
            ruled_out.append(
                f"a2a would split each TP rank's {heads} heads over CP {plan.cp}, which does not divide them"
            )
        elif mode == "hybrid" and not a:
            ruled_out.append(
                f"hybrid needs a degree above 1 and below CP {plan.cp} dividing it and the {heads} heads, within a node"
            )
        else:
            other = dataclasses.replace(plan, cp_mode=mode, cp_a2a=cp_a2a)
            alt = estimate_cost(model, cluster, other, seq_len=model.seq_len)
            versus.append(
                f"{cost.tokens_per_s / alt.tokens_per_s:.2f}x "
                + ("of " if versus else "the tokens/s of ")
                + other.cp_label
            )
    return f"{plan.cp_mode} ({what[plan.cp_mode]}): " + "; ".join([" and ".join(versus)] * bool(versus) + ruled_out)


def _check_moe_flags(args, model: ModelSpec) -> None:
    """Routing flags price experts: on a dense model they would change nothing, so they are refused as --ep is."""
    given = ([f"--moe-routing {args.moe_routing}"] if args.moe_routing else []) + (
        [f"--moe-imbalance {args.moe_imbalance:g}"] if args.moe_imbalance is not None else []
    )
    if model.moe is None and given:
        raise UsageError(
            f"{' and '.join(given)} {'price' if len(given) > 1 else 'prices'} Mixture-of-Experts routing, "
            f"and {model.name} is dense; drop {'them' if len(given) > 1 else 'it'} or plan an MoE config "
            "(e.g. --model mixtral-8x7b)"
        )


def _megatron_options(args) -> dict:
    """Plan fields of --recompute-modules, --main-grads and --adam-moments, checked against --runtime."""
    megatron = RUNTIMES[args.runtime].get("megatron", False)
    out = {"moments": args.adam_moments}
    if args.adam_moments != "fp32" and not megatron:
        raise UsageError(
            f"--adam-moments {args.adam_moments} is Megatron's precision-aware optimizer: add --runtime "
            "megatron or megatron-core, or drop it"
        )
    if args.main_grads:
        if not megatron:
            raise UsageError(
                f"--main-grads {args.main_grads} sets Megatron's main-gradient buffers: add --runtime "
                "megatron or megatron-core, or drop it"
            )
        out["reduce_precision"] = args.main_grads
    if args.recompute_modules:
        modules = tuple(m.strip() for m in args.recompute_modules.split(",") if m.strip())
        unknown = [m for m in modules if m not in MEGATRON_RECOMPUTE]
        if unknown or not modules:
            raise UsageError(
                f"--recompute-modules {args.recompute_modules}: {unknown[0] if unknown else 'empty'} is "
                f"not one of {', '.join(MEGATRON_RECOMPUTE)}"
            )
        if not megatron or args.recompute != "selective":
            raise UsageError(
                "--recompute-modules is Megatron-Core's selective recompute: add --runtime megatron-core "
                "(or megatron) and --recompute selective, or drop it"
            )
        out["recompute_modules"] = modules
    return out


def _positive(args, *names):
    for name in names:
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value}")


def _progress(message: str):
    """A spinner on stderr while a slow step runs, erased after it, on a terminal only: a log file or a pipe gets
    nothing, so stderr there still holds only an error line."""
    if not sys.stderr.isatty():
        return contextlib.nullcontext()
    from rich.console import Console

    return Console(stderr=True).status(message)


def load_model(args) -> ModelSpec:
    """The planned model: ``--params`` (a GPT of that size) or ``--model`` (a preset or a config.json)."""
    if bool(args.params) == bool(args.model):
        raise UsageError("give exactly one of --params SIZE (e.g. 175B) or --model NAME|config.json")
    if args.params:
        spec = ModelSpec.from_params(args.params, seq_len=args.seq_len or 2048)
    else:
        from megakit.interop.hf import (
            exact_param_count,  # transformers on the meta device
        )

        with _progress(f"megakit plan: reading {args.model} (transformers counts its parameters)"):
            spec = ModelSpec.from_config(args.model, count_params=exact_param_count)
    return spec.with_overrides(seq_len=args.seq_len, vocab_size=args.vocab, mtp=getattr(args, "mtp", False))


@dataclasses.dataclass(frozen=True)
class _Inputs:
    """What the search is asked: the model, the GPU, the run's precision and execution, and the pins."""

    gpu: GPU
    model: ModelSpec
    tokens: int | None
    precision: str
    flash: bool
    execution: dict
    global_batch: int
    batch_note: str
    imbalance: float
    pins: Pins

    def search_kwargs(self, args) -> dict:
        """The keyword arguments every search of this run shares."""
        return dict(
            pins=self.pins,
            threshold=args.mem_threshold,
            precision=self.precision,
            offload=args.offload,
            flash_attention=self.flash,
            seq_len=self.model.seq_len,
            moe_imbalance=self.imbalance,
            execution=self.execution,
        )


@dataclasses.dataclass(frozen=True)
class _Launch:
    """How to run the plan: learning rate and schedule, checkpoint interval, the files and the command."""

    lr: float
    lr_note: str
    total_steps: int
    warmup: int
    save_every: int
    advice: save_interval.SaveAdvice
    config_path: str
    model_file: object
    flags: dict
    command: str
    note: str


def run(args) -> int:
    """Plan the run: check the flags, search the layouts, and print (or write) the plan and how to launch it."""
    kind, launch_path = _check_args(args)
    inputs = _inputs(args)
    cluster, result, auto = _find_plan(args, inputs)
    plan, cost = result.best.plan, result.best.cost
    launch = _launch(args, inputs, cluster, plan, cost, kind=kind, launch_path=launch_path)
    report = _report(args, inputs, cluster, result, auto, launch)
    if args.emit_config or launch_path:
        _write_outputs(
            args,
            plan,
            cluster,
            inputs.model,
            launch.model_file,
            launch.config_path,
            launch.command,
            kind,
            launch_path,
            emit.ds_config(plan, lr=launch.lr, total_steps=launch.total_steps, warmup_steps=launch.warmup),
            emit.train_flags(plan, **launch.flags),
        )
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    _print_plan(args, report, result, inputs, cluster, launch, auto=auto, kind=kind, launch_path=launch_path)
    return 0


def _check_args(args) -> tuple[str | None, str | None]:
    """The flags that need no model: positive numbers, ``--emit-launch``'s kind, the routing and memory fractions."""
    _positive(
        args,
        "seq_len",
        "vocab",
        "gpus",
        "nodes",
        "gpus_per_node",
        "gpu_mem",
        "intra_bw",
        "inter_bw",
        "peak_tflops",
        "global_batch",
        "tp",
        "pp",
        "cp",
        "ep",
        "micro_batch",
        "vpp",
        "base_lr",
        "base_batch",
        "top",
        "save_every",
        "ckpt_write_gbps",
        "mtbf_gpu_hours",
        "pairs_per_window",
    )
    kind, launch_path = args.emit_launch or (None, None)
    if kind is not None and kind not in launch_script.KINDS:
        raise UsageError(
            f"--emit-launch {kind}: the kinds are slurm (an sbatch script) and hostfile (for deepspeed); "
            "e.g. --emit-launch slurm job.sh"
        )
    if args.moe_imbalance is not None and not args.moe_imbalance >= 1:
        raise UsageError(f"--moe-imbalance {args.moe_imbalance} must be at least 1 (1: perfectly balanced routing)")
    if not 0 < args.mem_threshold <= 1:
        raise UsageError(f"--mem-threshold {args.mem_threshold} must be in (0, 1], e.g. 0.8")
    return kind, launch_path


def _inputs(args) -> _Inputs:
    """Read the model and the GPU, and resolve precision, execution, the global batch and the pins."""
    megatron_options = _megatron_options(args)  # checked before the model is read (seconds in transformers)
    gpu, args.gpus_per_node = _hardware(args)
    model = load_model(args)
    _check_moe_flags(args, model)
    args.moe_routing = args.moe_routing or "real"  # no default in the parser, so that a given one can be refused
    tokens = parse_count(args.tokens, what="--tokens") if args.tokens else None
    precision = args.precision or (
        "fp16"
        if gpu.name.startswith("v100")
        else "fp32"
        if gpu.fp32_rate == 1.0 and gpu.name.startswith("probed:")
        else "bf16"
    )
    flash = gpu.flash_attention if args.attention is None else args.attention == "flash"
    _check_fp8(args, gpu, precision)
    _check_muon(args, precision)
    execution = dict(fused_kernels=args.kernels == "compiled", fp8=args.fp8, **RUNTIMES[args.runtime])
    execution |= megatron_options | ({"optimizer": args.optimizer} if args.optimizer != "adamw" else {})
    execution["lora"] = plan_lora.spec(args, model, runtime=args.runtime)
    if args.dp_shard is not None:
        if args.runtime != "fsdp":
            raise UsageError(
                f"--dp-shard {args.dp_shard} is HSDP, which PyTorch FSDP runs: add --runtime fsdp (megakit's "
                "trainer and DeepSpeed's ZeRO-3 shard over all of DP)"
            )
        if args.dp_shard < 1:
            raise UsageError(f"--dp-shard {args.dp_shard} must be at least 1, e.g. 8 (one node)")
        execution["dp_shard"] = args.dp_shard
    global_batch, batch_note = (
        (args.global_batch, "--global-batch")
        if args.global_batch
        else emit.default_global_batch(model.params, model.seq_len, tokens)
    )
    imbalance = args.moe_imbalance if args.moe_imbalance is not None else ROUTING[args.moe_routing]
    pins = Pins(
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        cp_mode=args.cp_mode,
        cp_a2a=args.cp_a2a,
        ep=args.ep,
        zero=args.zero,
        micro_batch=args.micro_batch,
        recompute=args.recompute,
        vpp=args.vpp,
        compress=str(parse_compression(args.compress)),
        schedule=args.schedule,
        stage_layers=parse_stage_layers(args.stage_layers),
        loss_chunks=parse_loss_chunks(args.loss_chunks),
    ).resolved()
    return _Inputs(gpu, model, tokens, precision, flash, execution, global_batch, batch_note, imbalance, pins)


def _cluster(args, gpu: GPU, *, nodes: int | None = None, gpus: int | None = None) -> Cluster:
    """``nodes`` whole nodes (or ``gpus`` GPUs) of ``gpu``, with the flags' overrides."""
    total = gpus if gpus is not None else nodes * args.gpus_per_node
    return Cluster(gpu=gpu, num_gpus=total, gpus_per_node=args.gpus_per_node).with_overrides(
        mem_gib=args.gpu_mem, intra_gbps=args.intra_bw, inter_gbps=args.inter_bw, peak_tflops=args.peak_tflops
    )


def _find_plan(args, inputs: _Inputs):
    """``(cluster, result, auto)``: the search on the given cluster, or on the fewest nodes that fit (``auto``).

    On a given cluster where nothing fits, the error says the closest layout's fix (and, with ``--json``, prints
    it as a 'no' verdict) or how many GPUs the model needs.
    """
    kwargs = inputs.search_kwargs(args)
    model, gpu, global_batch = inputs.model, inputs.gpu, inputs.global_batch
    auto = args.gpus is None and args.nodes is None
    if auto:
        _, result = smallest_cluster(model, lambda n: _cluster(args, gpu, nodes=n), global_batch=global_batch, **kwargs)
        return _cluster(args, gpu, gpus=result.best.plan.world), result, auto
    if args.gpus is not None and args.nodes is not None and args.gpus != args.nodes * args.gpus_per_node:
        raise UsageError(
            f"--gpus {args.gpus} disagrees with --nodes {args.nodes} x --gpus-per-node "
            f"{args.gpus_per_node}; give one of them"
        )
    cluster = _cluster(args, gpu, gpus=args.gpus) if args.gpus is not None else _cluster(args, gpu, nodes=args.nodes)
    try:
        return cluster, search(model, cluster, global_batch=global_batch, **kwargs), auto
    except NoPlan as error:
        if error.closest is not None:  # a judged layout over the GPU's memory: verdict 'no', the fix named
            if args.json:
                c = error.closest
                no = plan_report.plan_dict(c.plan, c.memory, c.cost, cluster, inputs.tokens, model.seq_len)
                json.dump(
                    {"plan": no | {"fits": "no", "mem_threshold": args.mem_threshold, "fix": error.fix}},
                    sys.stdout,
                    indent=2,
                )
                sys.stdout.write("\n")
            raise
        if not error.memory_bound:
            raise
        try:
            nodes, _ = smallest_cluster(
                model, lambda n: _cluster(args, gpu, nodes=n), global_batch=global_batch, **kwargs
            )
            need = f"; it needs at least {nodes * args.gpus_per_node} GPUs ({nodes} nodes)"
        except UsageError:
            need = ""
        raise UsageError(f"{error}{need}") from None


def _launch(args, inputs: _Inputs, cluster: Cluster, plan: Plan, cost, *, kind, launch_path) -> _Launch:
    """The learning rate and schedule, the checkpoint interval, and the launch command for ``plan``."""
    model = inputs.model
    lr, lr_note = emit.scaled_lr(
        model.params,
        plan.global_batch,
        model.seq_len,
        base_lr=args.base_lr,
        base_batch=args.base_batch if args.base_lr else None,
    )
    total_steps, warmup = emit.schedule_steps(plan.global_batch, model.seq_len, inputs.tokens, params=model.params)
    config_path = args.emit_config or (
        str(Path(launch_path).with_suffix(".json")) if launch_path else "ds_configs/plan.json"
    )
    model_arg, model_file = _model_arg(args, model, config_path)
    advice = save_interval.advise(
        plan,
        params=plan_lora.saved_params(model, plan),
        momentum_params=muon_cost(model.config).params if plan.optimizer == "muon" else 0.0,
        gpus_per_node=cluster.gpus_per_node,
        step_time_s=cost.step_time_s,
        write_gbps=args.ckpt_write_gbps,
        gpu_mtbf_hours=args.mtbf_gpu_hours,
    )
    save_every = args.save_every or min(advice.save_every, total_steps)  # a short run saves once, at its end
    flags = dict(
        config_path=config_path,
        model_arg=model_arg,
        seq_len=model.seq_len,
        save=args.save,
        save_every=save_every,
        stage_layers=inputs.pins.stage_layers,
        mtp=model.mtp > 0,
        objective=args.objective,
        lr=lr,
    )
    command, note = emit.launch_command(
        plan,
        nodes=cluster.nodes,
        gpus_per_node=cluster.gpus_per_node,
        hostfile=launch_path if kind == "hostfile" else None,
        **flags,
    )
    return _Launch(lr, lr_note, total_steps, warmup, save_every, advice, config_path, model_file, flags, command, note)


def _speedup(model: ModelSpec, cluster: Cluster, plan: Plan, cost) -> float:
    """The plan's tokens/s over one GPU's running the same global batch by accumulation alone."""
    single = estimate_cost(
        model,
        dataclasses.replace(cluster, num_gpus=1),
        dataclasses.replace(
            plan,
            tp=1,
            pp=1,
            dp=1,
            cp=1,
            ep=1,
            vpp=1,
            zero_stage=0,
            sequence_parallel=False,
            accumulation=plan.global_batch // plan.micro_batch,
        ),
        seq_len=model.seq_len,
    )
    return cost.tokens_per_s / single.tokens_per_s


def _report(args, inputs: _Inputs, cluster: Cluster, result, auto: bool, launch: _Launch) -> dict:
    """The plan as ``--json`` prints it (and the tables render): the plan, alternatives, rejections, assumptions."""
    model, tokens = inputs.model, inputs.tokens
    plan, cost, mem = result.best.plan, result.best.cost, result.best.memory
    speedup = _speedup(model, cluster, plan, cost)
    report = {
        "plan": plan_report.plan_dict(plan, mem, cost, cluster, tokens, model.seq_len)
        | {
            "fits": result.fits,
            "mem_threshold": result.threshold,
            "speedup_vs_one_gpu": speedup,
            "scaling_efficiency": speedup / plan.world,
            "lr": launch.lr,
            "warmup_steps": launch.warmup,
            "total_steps": launch.total_steps,
            "save_every": launch.save_every,
            "save_interval": dataclasses.asdict(launch.advice),
            "stage_layers": [
                len(r)
                for r in virtual_stage_ranges(
                    model.with_overrides(stage_layers=inputs.pins.stage_layers), plan.pp, plan.vpp
                )
            ],
        },
        "alternatives": [
            plan_report.plan_dict(c.plan, c.memory, c.cost, cluster, tokens, model.seq_len)
            for c in result.ranked[1 : 1 + args.top]
        ],
        "rejected": [
            {
                "plan": plan_report.plan_fields(r.plan) if r.plan else None,
                "reason": r.reason,
                "kind": r.kind,
                "tokens_per_s": r.tokens_per_s,
            }
            for r in plan_report.top_rejected(result.rejected, args.top)
        ],
        "assumptions": plan_report.assumptions(
            model,
            cluster,
            auto,
            result,
            inputs.precision,
            inputs.flash,
            args.mem_threshold,
            inputs.global_batch,
            tokens,
            launch.command,
            launch.note,
            inputs.batch_note,
        )
        | plan_report.moe_assumptions(model, args, inputs.imbalance),
    }
    _add_model_notes(report["plan"], args, inputs, cluster, result)
    return report


def _add_model_notes(entry: dict, args, inputs: _Inputs, cluster: Cluster, result) -> None:
    """The FLOPs per token (with and without windows, with MTP), the CP mode's reason and the headroom."""
    model, plan, cost, mem = inputs.model, result.best.plan, result.best.cost, result.best.memory
    entry["gflops_per_token"] = {  # causal, window-aware (Megatron-Bridge's convention), and without windows
        "causal": model.config.causal_flops_per_token(model.seq_len) / 1e9,
        "windows_ignored": model.config.causal_flops_per_token(model.seq_len, windows=False) / 1e9,
    }
    entry["mtp"] = model.mtp  # the MTP modules planned on the last stage (--mtp), in its memory and time
    if model.config.mtp_layers:  # DeepSeek-V3's prediction modules (counted in the plan's FLOPs with --mtp)
        entry["gflops_per_token"]["with_mtp"] = model.config.causal_flops_per_token(model.seq_len, mtp=True) / 1e9
    if plan.lora is not None:
        entry["lora"] = plan_lora.report(model, plan, mem, cluster, threshold=args.mem_threshold)
    if plan.cp > 1:
        entry["cp_mode_note"] = _cp_mode_note(model, cluster, plan, cost, inputs.pins)
    if args.optimizer == "muon":
        entry["muon"] = _muon(inputs, cluster, result)
    if args.objective != "lm":
        entry["preference"] = _preference(args, inputs, result)
    if result.fits == "above_threshold":
        entry["headroom"] = headroom_note(mem.total / GIB, gpu_gib=cluster.gpu.mem_gib, threshold=args.mem_threshold)


def _preference(args, inputs: _Inputs, result) -> dict:
    """``--objective dpo|ipo|simpo``: the reference pass over the run's windows and the log-probabilities it keeps
    (``megakit.core.planner.preference``); the windows are the run's tokens (``--tokens``, else the schedule's)."""
    plan, cost, model = result.best.plan, result.best.cost, inputs.model
    steps, _ = emit.schedule_steps(plan.global_batch, model.seq_len, inputs.tokens, params=model.params)
    windows = -(-int(inputs.tokens) // model.seq_len) if inputs.tokens else steps * plan.global_batch
    found = preference_cost(
        args.objective,
        windows=windows,
        pairs_per_window=args.pairs_per_window,
        step_time_s=cost.step_time_s,
        global_batch=plan.global_batch,
        recompute_fraction=plan.recompute_fraction if plan.recompute == "full" else 0.0,
    )
    return dataclasses.asdict(found) | {"lines": found.lines()}


def _muon(inputs: _Inputs, cluster: Cluster, result) -> dict:
    """``--optimizer muon``: Muon's cost on one GPU of the plan (``megakit.core.planner.muon``), which its memory and
    step time hold, with its lines."""
    from megakit.core.planner.cost import muon_plan_cost, muon_times
    from megakit.core.planner.muon import render

    plan, cost = result.best.plan, result.best.cost
    muon, times = muon_plan_cost(inputs.model, plan), muon_times(inputs.model, cluster, plan)
    lines = render(
        muon,
        zero_stage=plan.zero_stage,
        step_flops_per_gpu=cost.model_tflops_per_gpu * 1e12 * cost.step_time_s,
        times=times,
        step_s=cost.step_time_s,
    )
    return dataclasses.asdict(muon) | {"times_s": times, "lines": lines}


def _print_plan(args, report, result, inputs: _Inputs, cluster, launch: _Launch, *, auto, kind, launch_path) -> None:
    """The plan's tables (rich), with the tips: learning rate, warm-up, checkpoint interval, what was written."""
    from megakit.commands.plan_render import render  # rich, only for the tables

    advice, total_steps = launch.advice, launch.total_steps
    saving = save_interval.describe(advice) + (
        f" The launch command uses your --save-every {args.save_every}."
        if args.save_every
        else f" That is longer than the whole run ({total_steps} steps), so the launch saves at its end "
        f"(--save-every {total_steps})."
        if advice.save_every > total_steps
        else ""
    )
    plan, cost = result.best.plan, result.best.cost
    tips = emit.tips(
        result, cost, plan, cluster, lr_note=launch.lr_note, warmup=launch.warmup, total=total_steps, auto_sized=auto
    ) + [saving]
    written = (args.emit_config or (launch.config_path if launch_path else None), launch_path)
    emitted = ", ".join(p for p in written if p)
    render(
        report,
        result,
        inputs.model,
        cluster,
        tips=tips,
        emitted=emitted or None,
        launch=f"sbatch {launch_path}" if kind == "slurm" else launch.command,
        launch_note=launch.note,
    )
    for section in ("muon", "preference"):
        if section in report["plan"]:
            print("\n".join(report["plan"][section]["lines"]))


def _check_muon(args, precision: str) -> None:
    """What megakit's trainer runs --optimizer muon with (``megakit.train.engine.muon.check_muon``), said before the
    search: ZeRO 0-2 (0 in fp32 only), no offload, its own runtime."""
    if args.optimizer != "muon":
        return
    if args.zero == 3:
        raise UsageError(
            "--optimizer muon --zero 3: ZeRO 3 partitions each weight over DP, and Newton-Schulz needs whole "
            "matrices; use --zero 1 or 2 (or drop --zero)"
        )
    if args.zero == 0 and precision != "fp32":
        raise UsageError(
            f"--optimizer muon --zero 0 in {precision}: DeepSpeed's {precision} optimizer steps flat copies, not "
            "matrices; use --zero 1 or 2, or --precision fp32"
        )
    if args.offload != "none":
        raise UsageError(
            f"--optimizer muon --offload {args.offload}: Muon steps on the GPU (its exchanges run on the GPU's "
            "partitions); drop --offload"
        )
    if args.runtime != "megakit":
        raise UsageError(
            f"--optimizer muon prices megakit's trainer's Muon, not --runtime {args.runtime}'s; drop --runtime"
        )


def _check_fp8(args, gpu: GPU, precision: str) -> None:
    """FP8 needs FP8 tensor cores and a bf16 run to cast from."""
    if args.fp8 == "none":
        return
    if not gpu.fp8_tflops:
        raise UsageError(
            f"--fp8 {args.fp8} needs FP8 tensor cores, which {gpu.name} lacks (Hopper, Ada, Blackwell "
            "and MI300 have them); drop --fp8 or plan for e.g. --gpu h100-80gb"
        )
    if precision != "bf16":
        raise UsageError(f"--fp8 {args.fp8} casts from bf16, not --precision {precision}; use --precision bf16")
    if args.fp8 in FP8_TE_RECIPES and not RUNTIMES[args.runtime].get("megatron"):
        raise UsageError(
            f"--fp8 {args.fp8} is Transformer Engine's recipe, which Megatron runs: add --runtime "
            f"megatron-core, or use --fp8 tensorwise|rowwise (torchao, megakit's trainer)"
        )
    if args.fp8 == "mxfp8" and not gpu.mx_scaling:
        raise UsageError(
            f"--fp8 mxfp8 needs tensor cores that apply MX block scales, which {gpu.name} lacks "
            "(Blackwell has them); use --fp8 blockwise on Hopper, or plan for --gpu b200-180gb"
        )


def _write_outputs(
    args,
    plan: Plan,
    cluster: Cluster,
    model: ModelSpec,
    model_file,
    config_path,
    launch,
    kind,
    launch_path,
    config: dict,
    flags: list[str],
) -> None:
    """The model config (a --params shape), the ds_config and the launch file: every path checked first, each file
    written to a temporary name and renamed, so a bad path leaves nothing half-way."""
    config_flag = "--emit-config" if args.emit_config else "--emit-launch"  # the flag whose path placed the config
    targets = [(model_file, config_flag), (config_path, config_flag), (launch_path, "--emit-launch")]
    for path, flag in targets:
        if path:
            emit.check_target(path, flag)
    if launch_path and Path(launch_path).resolve() in {Path(p).resolve() for p in (config_path, model_file) if p}:
        raise UsageError(
            f"--emit-launch {launch_path} is also the ds_config's or model config's path; give the launch "
            "file another name (e.g. job.sh)"
        )
    per_node = min(cluster.gpus_per_node, plan.world)  # as the deepspeed line: a plan smaller than one node
    nodes = -(-plan.world // per_node)
    if model_file:  # a --params shape with no preset: the trainer gets its config.json too
        emit.write_json_atomic(model_file, model.to_hf_config(), flag=config_flag)
    emit.write_json_atomic(config_path, config, flag=config_flag)
    if launch_path:
        summary = f"{model.name}: {plan.describe()} on {nodes} node(s) x {per_node} {cluster.gpu.name}"
        text = (
            launch_script.slurm_script(nodes=nodes, gpus_per_node=per_node, train_flags=flags, summary=summary)
            if kind == "slurm"
            else launch_script.hostfile(nodes=nodes, gpus_per_node=per_node, command=launch, summary=summary)
        )
        emit.write_text_atomic(launch_path, text, flag="--emit-launch", executable=kind == "slurm")


def _hardware(args) -> tuple[GPU, int]:
    """The GPU and GPUs per node: a preset, or what ``megakit probe`` measured (``--hardware``)."""
    if not args.hardware:
        return gpu_preset(args.gpu), args.gpus_per_node or 8
    try:
        profile = json.loads(Path(args.hardware).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(
            f"cannot read --hardware {args.hardware}: {error}; write it with megakit probe --nproc N --out FILE"
        ) from None
    gpu, per_node = gpu_from_profile(profile, source=f"--hardware {args.hardware}", link_efficiency=LINK_EFFICIENCY)
    return gpu, args.gpus_per_node or per_node


def _model_arg(args, model: ModelSpec, config_path: str) -> tuple[str, str | None]:
    """What the launch command passes as --model, and the config.json to write for it (or None):
    the user's --model, a preset of that shape, or ``<ds_config stem>.model.json`` beside the ds_config."""
    if args.model:
        return args.model, None
    if model.name in preset_names() and args.vocab is None:
        return model.name, None
    stem = config_path[:-5] if config_path.endswith(".json") else config_path
    return f"{stem}.model.json", f"{stem}.model.json"
