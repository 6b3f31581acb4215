"""Train a megakit model with TP x PP x DeepSpeed ZeRO DP (x CP, x EP for experts), on CPU or GPU.

    deepspeed scripts/train.py --ds_config ds_configs/zero2.json
    deepspeed --num_gpus 4 scripts/train.py --ds_config ds_configs/zero1.json --tp 2 --pp 2
    deepspeed --num_gpus 4 scripts/train.py --model moe-tiny --ep 2 --tp 2

The launcher starts one process per GPU (per CPU process with --num_gpus on a CPU
machine); DP takes the processes that TP x PP leave.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from megakit.errors import finite_float

DEFAULT_DS_CONFIG = Path(__file__).resolve().parent.parent / "ds_configs" / "zero1.json"


def _rank0() -> bool:
    """Whether this process prints errors every rank makes alike (the launcher sets RANK)."""
    return os.environ.get("RANK", "0") == "0"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # every rank parses the same command line: rank 0 says it
        self.exit(2, f"train.py: error: {message}\n" if _rank0() else None)


class _Help(argparse.HelpFormatter):
    """--help gives each flag's default where its text does not say it already (an unset or off flag has none)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        said = re.search(r"\(default\b|\bdefault:|\bdefault [\w.]+[,;:)]", text)
        if (
            action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
            or said
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, its flags grouped by topic so that --help reads by topic."""
    p = _Parser(description=__doc__.splitlines()[0], formatter_class=_Help)
    _model_flags(p)
    _moe_flags(p)
    _parallel_flags(p)
    _data_flags(p)
    _optimisation_flags(p)
    _lora_flags(p)
    _objective_flags(p)
    _speed_flags(p)
    _checkpoint_flags(p)
    _report_flags(p)
    p.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # set by the launcher
    return p.parse_args(argv)


def _model_flags(p: argparse.ArgumentParser) -> None:
    """Which model trains, on what length of sequence, from which seed."""
    g = p.add_argument_group("model", "the model and its sequence")
    g.add_argument("--model", default="gpt-mini", help="preset in models/ or a path to a HF config.json")
    g.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default: the model's max)")
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="every random stream derives from it: weights, data order and dropout masks (the same at any "
        "TP/PP/DP layout), and each rank's default generators from it and the rank's grid place",
    )
    g.add_argument(
        "--mtp",
        action="store_true",
        help="train the model's Multi-Token Prediction modules (DeepSeek-V3's num_nextn_predict_layers; "
        "off by default, as for fine-tuning): loss = main + MTP_WEIGHT / D x sum of each depth's",
    )
    g.add_argument(
        "--mtp-weight",
        metavar="LAMBDA",
        type=finite_float,
        default=0.1,
        help="the MTP losses' weight (default 0.1, Megatron's; DeepSeek-V3 used 0.3, then 0.1)",
    )


def _moe_flags(p: argparse.ArgumentParser) -> None:
    """A MoE model's routing and balancing, overriding its config for one run."""
    g = p.add_argument_group("mixture of experts", "MoE models: routing and balancing (they override the model config)")
    g.add_argument(
        "--moe-aux-loss",
        metavar="COEFF",
        type=finite_float,
        default=None,
        help="load-balancing aux loss coefficient (overrides the model config; 0 turns it off)",
    )
    g.add_argument(
        "--moe-z-loss",
        metavar="COEFF",
        type=finite_float,
        default=None,
        help="router z-loss coefficient (overrides the model config)",
    )
    g.add_argument(
        "--moe-capacity-factor",
        metavar="CF",
        type=finite_float,
        default=None,
        help="cap each expert at CF x its even share of the tokens, dropping the rest (default: dropless)",
    )
    g.add_argument(
        "--moe-expert-bias",
        action="store_true",
        help="aux-loss-free load balancing (DeepSeek-V3): a per-expert routing bias updated once per "
        "optimizer step from the step's token counts",
    )
    g.add_argument(
        "--moe-force-balance",
        action="store_true",
        help="benchmarking aid (Megatron's --moe-router-force-load-balancing): route by random logits, "
        "so every expert gets its even share in expectation, as most published MoE throughput is "
        "measured; the router learns nothing and the run is not a model to keep",
    )


def _parallel_flags(p: argparse.ArgumentParser) -> None:
    """How the processes split the model, the sequence and the experts, and the pipeline schedule they run."""
    g = p.add_argument_group(
        "parallelism", "how the processes split the model and the batch: DP takes what TP x PP x CP leave"
    )
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel degree")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    g.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel degree: the sequence split over CP ranks (load-balanced causal halves), "
        "attention as ring attention; --seq-len must divide by 2 x CP",
    )
    g.add_argument(
        "--cp-mode",
        choices=("ring", "a2a", "hybrid"),
        default="ring",
        help="how CP ranks share attention: ring (K/V blocks passed around the CP group), a2a "
        "(DeepSpeed-Ulysses: an all-to-all gives each rank the whole sequence of heads/CP heads; "
        "needs the heads per TP rank to divide by CP) or hybrid (an all-to-all inside groups of "
        "--cp-a2a consecutive CP ranks, a ring across the groups: USP, Megatron's a2a+p2p)",
    )
    g.add_argument(
        "--cp-a2a",
        type=int,
        default=0,
        help="with --cp-mode hybrid: the all-to-all degree, dividing CP and the heads per TP rank; keep "
        "TP x it within a node (default: the largest such degree below CP)",
    )
    g.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel degree (MoE models): each MoE layer's experts split over EP ranks folded "
        "over TP x CP x DP (consecutive ranks, TP first), tokens exchanged by all-to-all; must divide "
        "the experts and TP x CP x DP",
    )
    g.add_argument(
        "--vpp",
        type=int,
        default=1,
        help="model chunks per pipeline stage (interleaved 1F1B); they need not divide the layers, and "
        "PP x VPP may exceed them by 2 (an embedding-only first and a loss-only last virtual stage)",
    )
    g.add_argument(
        "--stage-layers",
        metavar="N,N,...",
        default=None,
        help="layers per virtual stage, PP x VPP counts in pipeline order (chunk c of stage s is virtual "
        "stage c x PP + s), e.g. 3,2,2,3, N*K for K stages of N, e.g. 0,1*94,0; the first and last "
        "may be 0 (embedding only, or final norm + head + loss only); "
        "default: balanced by parameters, embedding and head counted",
    )
    g.add_argument(
        "--schedule",
        default=None,
        choices=["1f1b", "gpipe", "interleaved", "zb-h1"],
        help="pipeline schedule (PP > 1); default 1f1b, or interleaved with --vpp > 1; zb-h1 splits each "
        "backward into the input gradient and the deferred weight gradient (zero bubble, Qi et al. 2023)",
    )
    g.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="split norms, dropout and the residual stream over TP along the sequence (Megatron SP; "
        "--seq-len must divide by --tp); nothing to split at --tp 1, where it changes nothing",
    )
    g.add_argument(
        "--allow-cross-node-tp",
        action="store_true",
        help="run a TP group that spans nodes (refused by default: its per-layer all-reduce would "
        "cross the slow inter-node link)",
    )


def _data_flags(p: argparse.ArgumentParser) -> None:
    """Where the tokens come from and how packed documents are seen."""
    g = p.add_argument_group("data", "the corpus and how packed documents are read")
    g.add_argument(
        "--data",
        default=None,
        nargs="+",
        metavar="DIR",
        help="a directory `megakit prepare-data` wrote (token shards and their tokenizer), or a text file "
        "or directory trained on as bytes (default: the Python standard library's sources, as bytes); "
        "or a mixture of WEIGHT DIR pairs, e.g. --data 0.7 web/ 0.3 code/ (shares of the samples)",
    )
    g.add_argument(
        "--reset-attention-mask",
        action="store_true",
        help="packed documents: attention stays inside each document of a window (Llama 3's pretraining "
        "mask; needs --data DIR from prepare-data, which records where documents start)",
    )
    g.add_argument(
        "--reset-position-ids",
        action="store_true",
        help="packed documents: positions restart at each document (what transformers reads as packing)",
    )
    g.add_argument(
        "--eod-mask-loss",
        action="store_true",
        help="no loss where the input is the end-of-document token (it predicts the next document)",
    )


def _optimisation_flags(p: argparse.ArgumentParser) -> None:
    """The optimizer and its schedule (in the ds_config), how long, and how DP ranks exchange gradients."""
    g = p.add_argument_group("optimisation", "the optimizer (its ds_config), the steps and the DP exchange")
    g.add_argument(
        "--optimizer",
        choices=("adamw", "muon"),
        default="adamw",
        help="adamw (default): the ds_config's optimizer; muon: Muon (torch.optim.Muon's math, match_rms_adamw lr) "
        "for the hidden matrices and AdamW for embeddings, head, norms and biases, exact at any TP/PP/DP/CP/EP "
        "with ZeRO 0 in fp32 or ZeRO 1-2 in fp32/bf16/fp16 (not ZeRO 3); the ds_config must have no optimizer "
        "section (ds_configs/muon.json, ds_configs/muon_zero1.json)",
    )
    g.add_argument(
        "--muon-lr", type=finite_float, default=2e-3, help="--optimizer muon: the lr of both halves (default 2e-3)"
    )
    g.add_argument(
        "--muon-weight-decay",
        type=finite_float,
        default=0.1,
        help="--optimizer muon: the decoupled weight decay of both halves (default 0.1)",
    )
    g.add_argument(
        "--qk-clip",
        metavar="TAU",
        type=finite_float,
        default=0.0,
        help="--optimizer muon: MuonClip's QK-clip, scaling W_q and W_k of each head whose largest attention "
        "logit passed TAU back to TAU after each step (Kimi K2: 100; default 0: off)",
    )
    g.add_argument(
        "--ds_config",
        "--ds-config",
        default=str(DEFAULT_DS_CONFIG),
        help="DeepSpeed JSON config: ds_configs/*.json, or what `megakit plan --emit-config` wrote "
        "(default: ds_configs/zero1.json)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=None,
        help="optimizer steps in all, a --load checkpoint's included (default 200; 3 with --verify-memory)",
    )
    g.add_argument(
        "--compress",
        metavar="CODEC",
        default="none",
        help="compress the DP exchange, with error feedback: fp16 (2x fewer bytes) or int8 (~4x) "
        "gradients (ZeRO 0 or 1); sign (1-bit with a per-chunk scale, ~30x) or topk:RATIO (the largest "
        "RATIO of the elements as index/value pairs; topk:0.01 ~50x) of the optimizer's weight update "
        "(ZeRO 0, fp32). For "
        "links that cannot keep up with the step (FAQ 3/5); on NVLink/InfiniBand the default exact "
        "all-reduce is faster",
    )
    g.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="drop what --compress loses instead of sending it next step (to measure what feedback buys)",
    )
    g.add_argument(
        "--local-sgd",
        metavar="H",
        type=int,
        default=None,
        help="asynchronous-style DP (ZeRO 0, fp32): each rank steps on its own gradients and the weights "
        "are averaged every H steps (post-local SGD): ~H x fewer bytes, some loss per step. Prefer "
        "the default synchronous training unless the network is the bottleneck",
    )


def _lora_flags(p: argparse.ArgumentParser) -> None:
    """LoRA: adapters on a frozen base instead of every weight (megakit.core.lora, megakit.nn.lora)."""
    g = p.add_argument_group("LoRA", "train low-rank adapters on a frozen base (docs/training.md)")
    g.add_argument(
        "--lora-rank",
        metavar="R",
        type=int,
        default=None,
        help="train LoRA adapters of rank R on a frozen base instead of every weight (default: off, full "
        "fine-tuning); checkpoints then hold the adapters and their optimizer state only",
    )
    g.add_argument("--lora-alpha", type=finite_float, default=16.0, help="LoRA's alpha: adapters scaled by alpha / R")
    g.add_argument("--lora-dropout", type=finite_float, default=0.0, help="dropout on the adapters' input (0 only)")
    g.add_argument(
        "--lora-targets",
        metavar="NAMES",
        default="all-linear",
        help="comma-separated Hugging Face module names that get adapters (q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj, ...) or peft's all-linear: every linear layer but the head",
    )
    g.add_argument(
        "--lora-rslora", action="store_true", help="rank-stabilised scaling alpha / sqrt(R) (peft's use_rslora)"
    )
    g.add_argument(
        "--lora-base",
        metavar="CKPT",
        default=None,
        help="the base checkpoint whose frozen weights the adapters train on (megakit convert --from-hf makes "
        "one); --load CKPT of a checkpoint without adapters does the same (default: the seed's weights, or on "
        "--load of a LoRA checkpoint the base it names)",
    )


def _objective_flags(p: argparse.ArgumentParser) -> None:
    """What the loss is: the next token, or a preference objective on chosen/rejected pairs."""
    g = p.add_argument_group("objective", "the next-token loss, or preference tuning on pairs (DPO, IPO, SimPO)")
    g.add_argument(
        "--objective",
        choices=("lm", "dpo", "ipo", "simpo"),
        default="lm",
        help="lm: the token loss (default); dpo, ipo, simpo: preference tuning on the chosen/rejected pairs of "
        "prepare-data (docs/training.md); DPO and IPO compare with the starting model, once, before step 1",
    )
    g.add_argument(
        "--dpo-beta",
        metavar="BETA",
        type=finite_float,
        default=0.1,
        help="DPO's and SimPO's beta, IPO's tau (default 0.1, TRL's)",
    )
    g.add_argument(
        "--label-smoothing",
        metavar="EPS",
        type=finite_float,
        default=0.0,
        help="conservative DPO (and SimPO): the chance a preference label is flipped, in [0, 0.5) (default 0)",
    )
    g.add_argument(
        "--simpo-gamma",
        metavar="GAMMA",
        type=finite_float,
        default=None,
        help="SimPO's target reward margin (default 0.5, TRL's); only with --objective simpo",
    )


def _speed_flags(p: argparse.ArgumentParser) -> None:
    """Trade-offs of memory against compute, and the kernels a step runs; none changes what is learnt."""
    g = p.add_argument_group(
        "memory and speed", "recompute, chunked loss, float8, compiled blocks and the attention kernel"
    )
    g.add_argument(
        "--recompute",
        choices=["none", "selective", "full"],
        default="none",
        help="full: keep only each block's input and recompute the block in backward (~1/3 more "
        "compute, far less activation memory); selective: recompute only the attention core "
        "(Korthikanti et al. 2022), which saves its s x s scores when attention is written out, and the "
        "Gated DeltaNet / Mamba-2 mixers' cores (conv and chunked scan)",
    )
    g.add_argument(
        "--loss-chunks",
        metavar="K",
        default="auto",
        help="compute the LM head and loss over K chunks of the tokens, so the whole logits never exist "
        "(same loss and gradients); default auto: one chunk per 256 MiB of fp32 logits, 1 below",
    )
    g.add_argument(
        "--fp8",
        choices=["none", "tensorwise", "rowwise"],
        default="none",
        help="float8 GEMMs in the large TP linears through torchao (GPUs of compute capability 8.9+: "
        "Ada, Hopper, Blackwell); tensorwise is the faster recipe, rowwise the more accurate",
    )
    g.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile each transformer block (regional: one block's graph serves all layers; "
        "Inductor fuses its elementwise work). Default: on with CUDA, where it pays, off on CPU, "
        "where compiling would outlast a short run (MoE blocks included; off for --cp > 1, untested "
        "compiled); the first step's time includes compiling and is logged as such",
    )
    g.add_argument(
        "--attention-kernel",
        default="auto",
        choices=["auto", "flash", "cudnn", "efficient", "math"],
        help="pin the SDPA backend (flash, cudnn, efficient need CUDA); auto: cuDNN first on Hopper and "
        "newer (K/V heads expanded for GQA), torch's own choice elsewhere. --profile names the kernel "
        "that ran",
    )
    g.add_argument(
        "--linear-attention-kernels",
        default="auto",
        choices=["auto", "torch"],
        help="the Gated DeltaNet / Mamba-2 mixers' kernels (default: %(default)s): auto runs flash-linear-attention, "
        "causal-conv1d and mamba-ssm on a GPU where installed (pip install 'megakit[kernels]'), the torch chunked "
        "forms elsewhere; torch pins the torch forms",
    )


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    """Saving and resuming, and what a run survives: signals, NaN steps, loss spikes, dead peers."""
    g = p.add_argument_group("checkpoints and resilience", "saving, resuming and what a run survives")
    g.add_argument(
        "--save",
        metavar="DIR",
        default=None,
        help="write a checkpoint (weights, optimizer state, step) to DIR at the end; one run writes DIR "
        "at a time (rank 0 locks it), and a DIR holding another run's checkpoint is refused unless "
        "--load resumes from it",
    )
    g.add_argument(
        "--save-every",
        metavar="N",
        type=int,
        default=0,
        help="with --save: also every N steps (each save replaces DIR, or see --keep)",
    )
    g.add_argument(
        "--keep",
        metavar="K",
        type=int,
        default=0,
        help="with --save-every: keep the newest K checkpoints as DIR/step-N, DIR/latest written last; "
        "--load DIR then takes the newest intact one",
    )
    g.add_argument(
        "--async-save",
        action="store_true",
        help="with --save: the step waits only for the copy of the state to host memory; writing, fsync "
        "and the rename run in a background thread (one save at a time; a crash mid-write leaves "
        "the previous checkpoint as it was)",
    )
    g.add_argument(
        "--save-on-signal",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with --save: on SIGTERM or SIGUSR1 to any rank (a scheduler's notice, Slurm's --signal), "
        "or its launcher gone, finish the step, save it and exit with status 75, every rank at the "
        "same step; a second signal 2 s or more later stops at once (default: on; off, or without "
        "--save, the run stops there without saving, also with status 75; docs/clusters.md)",
    )
    g.add_argument(
        "--load",
        metavar="DIR",
        default=None,
        help="'auto': the --save DIR's newest intact checkpoint, or step 0 while it has none (the same "
        "command then restarts a run after a crash, e.g. under torchrun --max-restarts N); or "
        "resume from a checkpoint (or the newest intact one of a --keep series) saved at any "
        "TP/PP/DP layout and ZeRO stage: weights, fp32 master weights, Adam moments and step; data and "
        "LR schedule continue (same --seed and global batch); --steps counts the loaded steps too",
    )
    g.add_argument(
        "--init",
        metavar="DIR",
        default=None,
        help="the checkpoint to start from while --save holds none (a pretrained or imported model to "
        "fine-tune, as --load DIR would); implies --load auto, so the same command restarts the run "
        "from --save after a crash or a requeue (default: none; not with --load DIR)",
    )
    g.add_argument(
        "--max-skipped-steps",
        metavar="N",
        type=int,
        default=None,
        help="a step whose loss or gradient norm is NaN/inf is skipped (no update; its batch is spent); "
        "the run ends at the next one after N skipped in a row (default 10; 0: at the first)",
    )
    g.add_argument(
        "--spike-guard",
        metavar="Z",
        type=finite_float,
        default=None,
        help="a loss more than Z standard deviations above the mean of the last 50 steps (armed after 8) "
        "rolls back to the newest checkpoint of --save and skips the batches read since; needs --save "
        "DIR --save-every N (ZeRO 0-2); a resume keeps the skip",
    )
    g.add_argument(
        "--stall-timeout",
        type=finite_float,
        default=60.0,
        help="seconds without a heartbeat after which a peer counts as dead and the job ends",
    )


def _report_flags(p: argparse.ArgumentParser) -> None:
    """What the run evaluates, logs and writes for tools (TensorBoard, the profiler, megakit doctor), and --check."""
    g = p.add_argument_group("evaluation and logging", "what the run measures and writes, and checks before it starts")
    g.add_argument(
        "--eval-every",
        metavar="N",
        type=int,
        default=0,
        help="validation loss and perplexity every N steps and at the end (needs --data from prepare-data)",
    )
    g.add_argument(
        "--eval-batches",
        metavar="K",
        type=int,
        default=8,
        help="global batches of the validation split per evaluation (default 8)",
    )
    g.add_argument("--log-every", type=int, default=1, help="print a metrics line every N steps")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--log-heartbeat",
        metavar="SECONDS",
        type=finite_float,
        default=60.0,
        help="without a progress bar (a log file): a line every SECONDS while a step runs longer (0: off)",
    )
    g.add_argument(
        "--metrics-out",
        metavar="FILE",
        default=None,
        help="append one JSON line per step, evaluation and event to FILE as it happens (JSON Lines; rank "
        "0; default: none); a killed run keeps what it logged",
    )
    g.add_argument("--tensorboard", metavar="DIR", default=None, help="write TensorBoard event files to DIR")
    g.add_argument(
        "--profile",
        metavar="DIR",
        nargs="?",
        const="profile",
        default=None,
        help="write a PyTorch profiler trace per rank (steps 2-3) to DIR (default ./profile)",
    )
    g.add_argument(
        "--verify-memory",
        action="store_true",
        help="print each rank's measured memory next to the planner's prediction",
    )
    g.add_argument(
        "--deepspeed-logs",
        action="store_true",
        help="show DeepSpeed's own start-up and INFO lines in the workers (hidden by default: each rank "
        "repeats them, and megakit's banner says what they would; the launcher's own lines follow its "
        "--log_level)",
    )
    g.add_argument(
        "--doctor-out",
        metavar="FILE",
        default=None,
        help="write per-rank facts (weight hashes, samples, local gradient norms, step times) to FILE for "
        "`megakit doctor`, which starts the job with it",
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="check the flags, the ds_config, the model, the data and --load for $WORLD_SIZE processes "
        "(default 1) in this one process, say what would run and exit (2 on a mistake): what a "
        "cluster job runs before it starts its workers",
    )


def _leave() -> None:
    """Close the process group on a clean exit (NCCL warns of leaked resources otherwise); after a
    peer died it could hang, so the failure paths leave it to the process's end."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def config(args: argparse.Namespace):
    """The ``TrainConfig`` these flags ask for (``megakit doctor`` checks its trainer flags through it too).
    UsageError for a flag value no run can take."""
    from megakit.core.partition import parse_stage_layers
    from megakit.core.planner.activations import parse_loss_chunks
    from megakit.train.run import TrainConfig

    return TrainConfig(
        ds_config=args.ds_config,
        model=args.model,
        data=args.data[0] if args.data and len(args.data) == 1 else args.data,  # one data set, or a mixture
        steps=args.steps if args.steps is not None else 3 if args.verify_memory else 200,
        seed=args.seed,
        tp=args.tp,
        pp=args.pp,
        cp=args.cp,
        cp_mode=args.cp_mode,
        cp_a2a=args.cp_a2a,
        ep=args.ep,
        vpp=args.vpp,
        schedule=args.schedule,
        seq_len=args.seq_len,
        stage_layers=parse_stage_layers(args.stage_layers),
        tensorboard=args.tensorboard,
        profile=args.profile,
        verify_memory=args.verify_memory,
        metrics_out=args.metrics_out,
        log_every=args.log_every,
        progress=not args.no_progress,
        deepspeed_logs=args.deepspeed_logs,
        log_heartbeat_s=args.log_heartbeat,
        stall_timeout_s=args.stall_timeout,
        recompute=args.recompute,
        loss_chunks=parse_loss_chunks(args.loss_chunks),
        fp8=args.fp8,
        sequence_parallel=args.sequence_parallel,
        save=args.save,
        save_every=args.save_every,
        keep=args.keep,
        load=args.load,
        init=args.init,
        allow_cross_node_tp=args.allow_cross_node_tp,
        compress=args.compress,
        error_feedback=not args.no_error_feedback,
        local_sgd=args.local_sgd,
        doctor_out=args.doctor_out,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        moe_aux_loss=args.moe_aux_loss,
        moe_z_loss=args.moe_z_loss,
        moe_capacity_factor=args.moe_capacity_factor,
        moe_expert_bias=args.moe_expert_bias,
        moe_force_balance=args.moe_force_balance,
        compile=args.compile,
        attention_kernel=args.attention_kernel,
        linear_attention_kernels=args.linear_attention_kernels,
        spike_guard=args.spike_guard,
        async_save=args.async_save,
        reset_attention_mask=args.reset_attention_mask,
        save_on_signal=args.save_on_signal,
        reset_position_ids=args.reset_position_ids,
        eod_mask_loss=args.eod_mask_loss,
        mtp=args.mtp,
        mtp_weight=args.mtp_weight,
        optimizer=args.optimizer,
        muon_lr=args.muon_lr,
        muon_weight_decay=args.muon_weight_decay,
        qk_clip=args.qk_clip,
        lora=_lora(args),
        lora_base=args.lora_base,
        objective=args.objective,
        dpo_beta=args.dpo_beta,
        label_smoothing=args.label_smoothing,
        simpo_gamma=args.simpo_gamma,
        **({} if args.max_skipped_steps is None else {"max_skipped_steps": args.max_skipped_steps}),
    )


def _lora(args: argparse.Namespace):
    """The ``LoraSpec`` of the --lora-* flags (None without --lora-rank)."""
    from megakit.core.lora import LoraSpec, parse_targets
    from megakit.errors import UsageError

    if args.lora_rank is None:
        given = [flag for flag in ("lora_rslora", "lora_base") if getattr(args, flag)]
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')} applies to LoRA; give --lora-rank R too")
        return None
    return LoraSpec(
        rank=args.lora_rank,
        alpha=args.lora_alpha,
        dropout=args.lora_dropout,
        targets=parse_targets(args.lora_targets),
        rslora=args.lora_rslora,
    )


def _check(cfg) -> int:
    """``--check``: ``resolve`` the run (every check the workers make before any process group) and say what it is."""
    from megakit.errors import UsageError
    from megakit.train.data.corpus import verify_corpus
    from megakit.train.observe.reporting import layout_words
    from megakit.train.resilience.save_lock import holder, in_use
    from megakit.train.run import resolve

    world = int(os.environ.get("WORLD_SIZE", 1))
    try:
        run = resolve(cfg, world, say=lambda *_: None)
        verify_corpus(cfg.data)  # every shard's sha256: a shard damaged in place is named now, not at its step
        held = holder(cfg.save) if cfg.save else None
        if held:  # the run would stop at its start: another run still writes there
            raise UsageError(in_use(cfg.save, held))
    except UsageError as error:
        print(f"train.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    batch = run.batch
    start = f", resuming at step {run.start_step} from {run.checkpoint}" if run.checkpoint is not None else ""
    print(
        f"train.py: check passed: {cfg.model} on {world} process(es), {layout_words(run.layout, vpp=cfg.vpp)}, "
        f"{batch.global_batch} sequences of {batch.seq_len} per step, {cfg.steps} steps{start}",
        flush=True,
    )
    return 0


def _quiet_deepspeed(args: argparse.Namespace) -> None:
    """Before DeepSpeed is imported: on a machine without CUDA, name its accelerator, so that each rank does not
    warn that it "was unable to detect" a GPU (``--deepspeed-logs`` keeps the warning)."""
    if args.deepspeed_logs or "DS_ACCELERATOR" in os.environ:
        return
    import torch

    xpu = getattr(torch, "xpu", None)
    others = (xpu is not None and xpu.is_available()) or torch.backends.mps.is_available()  # DeepSpeed's to detect
    if not torch.cuda.is_available() and not others:
        os.environ["DS_ACCELERATOR"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _quiet_deepspeed(args)
    from megakit.errors import UsageError
    from megakit.train.trainer import TrainingDiverged, train

    try:
        cfg = config(args)
    except UsageError as error:  # the same flags on every rank
        if _rank0():
            print(f"train.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    if args.check:
        return _check(cfg)
    try:
        stopped = train(cfg, keep_steps=False).stopped  # each step's metrics: the log and --metrics-out
        _leave()
        if stopped:  # a signal or the launcher gone: stopped (and saved with --save) at a step every rank agreed on
            from megakit.train.resilience.preemption import EXIT_STOPPED

            return EXIT_STOPPED
    except UsageError as error:
        _leave()
        if _rank0() or not getattr(error, "all_ranks", False):  # a rank's own mistake: it says so itself
            print(f"train.py: error: {error}", file=sys.stderr, flush=True)
        return 2
    except TrainingDiverged as error:
        _leave()
        if _rank0():  # every rank learnt it from the same all-reduce
            print(f"train.py: {error}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as error:
        if "communication failed" not in str(error):
            raise
        print(f"train.py: {error}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
