"""One training run, resolved once: ``TrainConfig`` is what the user asked for, ``Run`` what it means.

``resolve`` turns the flags and the job's size into every derived setting -- the layout,
the validated ds_config as DeepSpeed gets it, the model description, the batch plan,
the precision, the effective sequence parallelism and pipeline schedule, the step to
start from -- and checks them all before any process group exists, alike on every rank.
Everything below ``train`` reads the ``Run`` instead of working the same things out again.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch

from megakit.core.compression import Compression, parse_compression
from megakit.core.layout import Layout, check_ep_fold, hybrid_degrees
from megakit.core.lora import LoraSpec
from megakit.core.model_config import ModelConfig, check_seq_len
from megakit.core.partition import partition_layers
from megakit.core.planner.activations import loss_chunks_of
from megakit.core.schedules import build_schedule
from megakit.errors import UsageError
from megakit.interop.checkpoint_format import read_manifest, state_keys
from megakit.nn.attention.core import CP_MODES
from megakit.nn.attention.kernels import KernelChoice, device_kernel
from megakit.nn.compile import default_compile
from megakit.nn.linear_attention.kernels import check_kernels
from megakit.nn.model import trained_mtp_depth
from megakit.nn.tensor_parallel.fp8 import check_fp8
from megakit.train.data.batches import DEFAULT_MAX_BYTES, BatchPlan
from megakit.train.data.corpus import Corpus, ValidationBatches, model_for_corpus, open_corpus
from megakit.train.engine import lora as lora_run
from megakit.train.engine.ds_config import load_ds_config, require_optimizer, schedule_over_steps
from megakit.train.engine.muon import OPTIMIZERS, check_muon, check_qk_clip
from megakit.train.observe.preference import check_pairs
from megakit.train.resilience.guards import DEFAULT_MAX_SKIPPED
from megakit.train.resilience.restarts import AUTO, auto_load
from megakit.train.resilience.resume import check_checkpoint_flags, check_same_run
from megakit.train.resilience.spikes import data_offset

RECOMPUTE = ("none", "selective", "full")


MOE_FLAGS = {
    "moe_aux_loss": "aux_loss_coeff",
    "moe_z_loss": "z_loss_coeff",  # TrainConfig's --moe-* fields
    "moe_capacity_factor": "capacity_factor",
    "moe_expert_bias": "expert_bias",  # -> the MoEConfig
    "moe_force_balance": "force_balance",
}  # fields they override
DOCUMENT_FLAGS = ("reset_attention_mask", "reset_position_ids", "eod_mask_loss")  # its packed-document fields


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. ``ds_config``: a path or an already-loaded dict."""

    ds_config: str | dict
    model: str = "gpt-mini"
    data: str | list | None = None  # a directory or text, or a mixture: [weight, dir, weight, dir, ...]
    steps: int = 200
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallelism: the sequence split over CP ranks, attention as ring attention
    cp_mode: str = "ring"  # with CP: "ring" (K/V blocks passed around), "a2a" (Ulysses: heads over CP, all-to-all)
    # or "hybrid" (all-to-all inside groups of cp_a2a CP ranks, a ring across them)
    cp_a2a: int = 0  # hybrid's all-to-all degree (0: the largest proper divisor of CP that divides the heads)
    ep: int = 1  # expert parallelism: each MoE layer's experts split over EP ranks folded over TP x CP x DP
    moe_aux_loss: float | None = None  # overrides of the model's MoEConfig (None: the config's own)
    moe_z_loss: float | None = None
    moe_capacity_factor: float | None = None
    moe_expert_bias: bool = False  # aux-loss-free balancing (DeepSeek-V3's expert bias)
    moe_force_balance: bool = False  # benchmarking aid: random routing, balanced in expectation (Megatron's flag)
    seq_len: int | None = None
    seed: int = 0
    vpp: int = 1
    stage_layers: tuple[int, ...] | None = None  # blocks per virtual stage (chunk c of stage s is c * pp + s)
    schedule: str | None = None  # default: "interleaved" with vpp > 1, else "1f1b"
    tensorboard: str | None = None
    profile: str | None = None
    verify_memory: bool = False
    metrics_out: str | None = None
    log_every: int = 1
    progress: bool = True
    deepspeed_logs: bool = False  # DeepSpeed's own INFO lines and start-up messages (hidden: they repeat per rank)
    log_heartbeat_s: float = 60.0  # without a bar: a line every this many seconds while a step runs longer; 0: never
    stall_timeout_s: float = 60.0
    collective_timeout_s: float = 300.0
    max_bytes: int = DEFAULT_MAX_BYTES
    recompute: str = "none"  # "full": keep each block's input only; "selective": recompute the attention core
    sequence_parallel: bool = False  # split norms/dropout/residual over TP along the sequence (no-op at TP 1)
    loss_chunks: int = 0  # the LM head and loss over K token chunks (tensor_parallel.chunked_loss); 0: auto_loss_chunks
    fp8: str = "none"  # float8 GEMMs in the large TP linears (nn.tensor_parallel.fp8): none | tensorwise | rowwise
    save: str | None = None  # checkpoint directory, written at the end (and every save_every steps)
    save_every: int = 0
    keep: int = 0  # with --save-every: keep the newest K checkpoints as DIR/step-N with DIR/latest (0: one, replaced)
    load: str | None = None  # checkpoint to start from: weights and step count (not the optimizer state)
    init: str | None = None  # with --load auto (implied): the checkpoint to start from while --save holds none
    allow_cross_node_tp: bool = False  # run a TP group that spans nodes (with a warning) instead of refusing it
    compress: str = "none"  # DP gradient compression: none | fp16 | int8 | sign | topk:RATIO (megakit.core.compression)
    error_feedback: bool = True  # carry what compression dropped into the next step (off only to compare)
    local_sgd: int | None = None  # average the weights over DP every H steps instead of the gradients every step
    doctor_out: str | None = None  # megakit doctor: gather per-rank facts to this JSON file (train.doctor.diagnostics)
    eval_every: int = 0  # validation loss every N steps (and at the end); 0: never
    eval_batches: int = 8  # global batches of the validation split per evaluation
    max_skipped_steps: int = DEFAULT_MAX_SKIPPED  # non-finite steps skipped in a row before the run ends (guards)
    compile: bool | None = None  # torch.compile each block (megakit.nn.compile); None: on with CUDA, off on CPU
    compile_backend: str = "inductor"  # torch.compile's backend; the CPU tests use "aot_eager" (no C++ build)
    attention_kernel: str = "auto"  # SDPA backend: auto | flash | cudnn | efficient | math (nn.attention.kernels)
    linear_attention_kernels: str = "auto"  # auto: fla / causal-conv1d / mamba-ssm on CUDA where installed; torch
    spike_guard: float | None = None  # Z: a loss Z recent standard deviations above the recent mean rolls back (spikes)
    async_save: bool = False  # checkpoints written in a background thread; the step waits for the host copy only
    save_on_signal: bool = True  # with save: SIGTERM/SIGUSR1 (or the launcher gone) save after the step, then stop
    # packed documents (Megatron's names; off by default: Llama 3 found the mask of "limited impact" in standard
    # pretraining, and it matters for long sequences and for packed fine-tuning examples)
    reset_attention_mask: bool = False  # attention stays inside each document of a window
    reset_position_ids: bool = False  # positions restart at each document (learned embeddings; transformers' packing)
    eod_mask_loss: bool = False  # no loss where the input is the end-of-document token
    mtp: bool = False  # train the config's Multi-Token Prediction modules (DeepSeek-V3's num_nextn_predict_layers)
    mtp_weight: float = 0.1  # lambda of L_main + lambda / D x sum(L_k) (Megatron's default; DeepSeek-V3: 0.3, then 0.1)
    optimizer: str = "adamw"  # "adamw": the ds_config's; "muon": megakit's Muon + AdamW (megakit.train.engine.muon)
    muon_lr: float = 2e-3  # --optimizer muon: the lr of both halves (Muon's scaled by match_rms_adamw)
    muon_weight_decay: float = 0.1  # --optimizer muon: decoupled weight decay of both halves
    qk_clip: float = 0.0  # --optimizer muon: MuonClip's QK-clip, the largest attention logit kept (0: off)
    lora: LoraSpec | dict | None = None  # train LoRA adapters on a frozen base (megakit.core.lora; a dict from JSON)
    lora_base: str | None = None  # the base checkpoint a LoRA fine-tune starts from (train.engine.lora)
    # preference tuning on chosen/rejected pairs (megakit.nn.tensor_parallel.preference); lm: the token loss
    objective: str = "lm"  # lm | dpo | ipo | simpo
    dpo_beta: float = 0.1  # DPO's and SimPO's beta, IPO's tau (TRL's default 0.1)
    label_smoothing: float = 0.0  # conservative DPO (and SimPO): the chance a preference label is flipped
    simpo_gamma: float | None = None  # SimPO's target margin (None: 0.5, TRL's default); only with simpo

    def __post_init__(self) -> None:
        if isinstance(self.lora, dict):
            object.__setattr__(self, "lora", LoraSpec(**self.lora))
        if self.stage_layers is not None:  # a list (JSON of tests/helpers/launch_sweep.py) or a tuple (--stage-layers)
            object.__setattr__(self, "stage_layers", tuple(self.stage_layers))
        if self.recompute not in RECOMPUTE:
            raise UsageError(
                f"--recompute {self.recompute} is not one of {', '.join(RECOMPUTE)}; megakit recomputes "
                "whole blocks (full), the attention core (selective) or nothing (none)"
            )
        check_kernels(self.linear_attention_kernels)
        if self.save_every < 0 or (self.save_every and not self.save):
            raise UsageError(f"--save-every {self.save_every} needs --save DIR and a count of at least 1")
        if self.keep < 0 or (self.keep and not self.save_every):
            raise UsageError(
                f"--keep {self.keep} keeps the newest of the checkpoints --save-every writes; "
                "pass --save DIR --save-every N with it, and a count of at least 1"
            )
        if self.steps < 1:
            raise UsageError(f"--steps must be at least 1, got {self.steps}")
        if self.max_skipped_steps < 0:
            raise UsageError(
                f"--max-skipped-steps must be 0 (end at the first non-finite step) or more, "
                f"got {self.max_skipped_steps}"
            )
        if not self.log_heartbeat_s >= 0:
            raise UsageError(f"--log-heartbeat must be 0 (off) or a number of seconds, got {self.log_heartbeat_s}")
        if self.spike_guard is not None and (self.spike_guard <= 0 or not self.save_every):
            raise UsageError(
                f"--spike-guard {self.spike_guard:g} rolls back to the newest checkpoint of --save DIR; "
                "pass --save DIR --save-every N with it, and a Z above 0 (e.g. 4)"
            )
        if self.init is not None and self.load not in (None, AUTO):
            raise UsageError(
                f"--init {self.init} is what --load auto starts from while --save holds no checkpoint, "
                f"and --load {self.load} names another: use --load auto --init {self.init} for a run "
                f"that restarts from --save, or --load {self.load} alone"
            )
        if self.async_save and not self.save:
            raise UsageError(
                "--async-save writes the checkpoints of --save DIR in the background; pass --save DIR "
                "(with --save-every N) with it, or drop it"
            )
        if self.log_every < 1:
            raise UsageError(f"--log-every must be at least 1, got {self.log_every}")
        compression = parse_compression(self.compress)
        if self.local_sgd is not None and self.local_sgd < 1:
            raise UsageError(
                f"--local-sgd {self.local_sgd}: the averaging period must be at least 1 step "
                "(leave it out for synchronous training)"
            )
        if self.local_sgd and compression.enabled:
            raise UsageError(f"--local-sgd averages weights, --compress {self.compress} gradients; choose one")
        if self.eval_every < 0 or self.eval_batches < 1:
            raise UsageError(
                f"--eval-every must be at least 0 and --eval-batches at least 1, got {self.eval_every} "
                f"and {self.eval_batches}"
            )
        if self.ep < 1:
            raise UsageError(f"--ep must be at least 1, got {self.ep}")
        if self.cp_mode not in CP_MODES:
            raise UsageError(f"--cp-mode {self.cp_mode} is not one of {', '.join(CP_MODES)}")
        if not self.mtp_weight > 0:
            raise UsageError(
                f"--mtp-weight must be above 0 (DeepSeek-V3 trained with 0.3, then 0.1), got {self.mtp_weight}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise UsageError(f"--optimizer {self.optimizer} is not one of {', '.join(OPTIMIZERS)}")
        if self.objective not in ("lm", "dpo", "ipo", "simpo"):
            raise UsageError(f"--objective {self.objective} is not one of lm, dpo, ipo, simpo")
        if self.simpo_gamma is not None and self.objective != "simpo":
            raise UsageError("--simpo-gamma is SimPO's target margin; drop it, or pass --objective simpo")
        if self.label_smoothing and self.objective not in ("dpo", "simpo"):
            raise UsageError(f"--label-smoothing smooths DPO's and SimPO's labels, not --objective {self.objective}")
        if self.vpp > 1 and self.pp == 1:
            raise UsageError(f"--vpp {self.vpp} splits each pipeline stage into chunks, so it needs --pp > 1")
        if self.schedule == "zb-h1" and self.vpp > 1:
            raise UsageError(
                f"--schedule zb-h1 runs one model chunk per stage, got --vpp {self.vpp}; drop --vpp, "
                "or use --schedule interleaved"
            )


PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True, kw_only=True)
class Run:
    """Everything ``train`` derives from a ``TrainConfig`` and the job's size (see ``resolve``)."""

    cfg: TrainConfig
    layout: Layout
    ds_config: dict  # as DeepSpeed gets it: validated, batch sizes filled in for this layout
    model: ModelConfig
    batch: BatchPlan
    start_step: int
    checkpoint: Path | None  # what --load resolved to (a directory, or the newest intact one of a series)
    precision: str  # "fp32" | "bf16" | "fp16": the weights' and the exchanged activations' type
    zero_stage: int
    sequence_parallel: bool  # asked for, and TP > 1 (nothing to split otherwise)
    loss_chunks: int  # the head and loss over this many token chunks (1: in one piece), --loss-chunks or its rule
    schedule: str  # the pipeline schedule (PP > 1)
    compression: Compression  # of the DP gradients (``kind == "none"``: DeepSpeed all-reduces them)
    corpus: Corpus | None = None  # what --data names, opened (its vocabulary is the model's)
    compile: bool = False  # --compile, its default resolved for this device
    attention: KernelChoice = KernelChoice("auto")  # --attention-kernel on this device
    data_offset: int = 0  # step s reads the batch of step s + data_offset (batches a spike rollback skipped)
    spike_window: list | None = None  # the spike guard's recent losses, as the checkpoint saved them
    lr_schedule: str = ""  # the banner's line on the LR schedule: over --steps, or as the ds_config pins it
    lora_base: Path | None = None  # with LoRA: the checkpoint of the frozen base (None: the seed's weights)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype of the run's precision."""
        return PRECISION_DTYPES[self.precision]


def _cp_a2a_degree(cfg: TrainConfig, model: ModelConfig) -> int:
    """The all-to-all degree of ``cfg``'s CP mode (CP with a2a, 1 with the ring, ``--cp-a2a`` or its default with
    hybrid); UsageError where the heads per TP rank do not divide by it."""
    heads = model.heads // cfg.tp  # each TP rank's heads, split again by the all-to-all
    if cfg.cp_a2a and cfg.cp_mode != "hybrid":
        raise UsageError(
            f"--cp-a2a {cfg.cp_a2a} sets the all-to-all degree of --cp-mode hybrid; add --cp-mode hybrid "
            "or drop --cp-a2a"
        )
    if cfg.cp == 1 or cfg.cp_mode == "ring":
        return 1
    if cfg.cp_mode == "a2a":
        if heads % cfg.cp:
            raise UsageError(
                f"--cp-mode a2a splits each TP rank's {heads} attention heads over CP {cfg.cp}, which "
                f"does not divide them; use a --cp that divides {heads}, or --cp-mode ring"
            )
        return cfg.cp
    proper = hybrid_degrees(cfg.cp, heads)
    if cfg.cp_a2a and cfg.cp_a2a in proper:
        return cfg.cp_a2a
    if cfg.cp_a2a or not proper:
        given = f"--cp-a2a {cfg.cp_a2a}" if cfg.cp_a2a else "it"
        choices = ", ".join(map(str, proper)) or "none at this --cp"
        raise UsageError(
            f"--cp-mode hybrid runs an all-to-all inside groups of --cp-a2a CP ranks and a ring across "
            f"them; {given} must be above 1, below --cp {cfg.cp}, and divide both CP and each TP rank's "
            f"{heads} heads: {choices} (or use --cp-mode ring or a2a)"
        )
    return proper[-1]


def resolve(cfg: TrainConfig, world_size: int, *, say=print) -> Run:
    """The ``Run`` of ``cfg`` on ``world_size`` processes; UsageError on any mistake, before any process group.

    ``say`` prints what it chose (which checkpoint ``--load`` resumes from)."""
    check_fp8(cfg.fp8)  # torchao and a GPU with float8 GEMMs, or one line now
    layout = Layout.for_world(world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp)
    ds_config = load_ds_config(cfg.ds_config, dp=layout.dp, pp=layout.pp)
    if cfg.optimizer == "muon":
        check_muon(ds_config, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay)
        if cfg.lora is not None:  # its TP exchange knows the model's matrices, not the adapters' low-rank halves
            raise UsageError("--optimizer muon does not train LoRA adapters; drop --lora-rank or use AdamW")
    else:
        require_optimizer(ds_config)
    corpus = open_corpus(cfg.data, max_bytes=cfg.max_bytes)
    model = with_moe_flags(model_for_corpus(ModelConfig.load(cfg.model), cfg.model, corpus), cfg)
    _check_expert_parallel(cfg, model, layout, ds_config)
    check_qk_clip(model, tau=cfg.qk_clip, optimizer=cfg.optimizer, cp=cfg.cp)
    layout = dataclasses.replace(layout, ep=cfg.ep)
    seq_len = cfg.seq_len or model.max_seq_len
    check_seq_len(model, seq_len)
    model.check_tp(cfg.tp)  # the model's shards and stages, refused here once rather than by every rank's model
    if model.linear:  # Gated DeltaNet's key heads split over TP, then over CP by the all-to-all
        model.linear.check_parallel(tp=cfg.tp, cp=cfg.cp)
    if model.mamba is not None:  # Mamba-2's heads and groups go over TP x CP (megakit.nn.linear_attention.mamba2)
        model.mamba.check_split(cfg.tp, cfg.cp)
    mtp = trained_mtp_depth(model, cfg.mtp, cfg.mtp_weight)  # --mtp of a model that has no prediction modules
    partition_layers(model, cfg.pp, cfg.vpp, cfg.stage_layers or "params", mtp=mtp)
    layout = dataclasses.replace(layout, cp_a2a=_cp_a2a_degree(cfg, model))
    _check_sequence_split(cfg, seq_len)
    if cfg.cp > 1:  # DeepSpeed counts every rank that holds the same weights, DP x CP, in its batch
        ds_config["train_batch_size"] *= cfg.cp
    sequence_parallel = cfg.sequence_parallel and cfg.tp > 1
    load = auto_load(cfg.save, cfg.load, init=cfg.init, say=say)  # --load auto and --init: what --save holds now
    load, lora_base = lora_run.base_for_load(cfg.lora, load, cfg.lora_base)  # LoRA: --load BASE starts a fine-tune
    start, checkpoint = check_checkpoint_flags(save=cfg.save, load=load, steps=cfg.steps, series=cfg.keep > 0, say=say)
    lora_base = lora_run.check_resume(cfg.lora, checkpoint, lora_base)
    if cfg.lora is not None:
        say(lora_run.banner(cfg.lora, lora_base))
    batch = BatchPlan(
        seq_len=seq_len,
        micro_batch=ds_config["train_micro_batch_size_per_gpu"],
        accumulation=ds_config["gradient_accumulation_steps"],
        dp=layout.dp,
        seed=cfg.seed,
    )
    extra = read_manifest(checkpoint)["extra"] if checkpoint is not None else {}
    lr_schedule = schedule_over_steps(ds_config, steps=cfg.steps, resumed=extra.get("lr_total_steps"))
    if checkpoint is not None:
        _check_resumed_run(cfg, checkpoint, extra, batch=batch, model=model, corpus=corpus, say=say)
    saved_with = extra.get("optimizer", "adamw")  # checkpoints from before --optimizer: AdamW's moments
    if checkpoint is not None and saved_with != cfg.optimizer and state_keys(read_manifest(checkpoint)):
        raise UsageError(
            f"checkpoint {checkpoint} holds --optimizer {saved_with}'s state (its moments), this run has "
            f"--optimizer {cfg.optimizer}; resume with --optimizer {saved_with}"
        )
    _check_data(cfg, corpus, batch, seq_len)
    compression = _check_dp_sync(cfg, ds_config)
    schedule = cfg.schedule or ("interleaved" if cfg.vpp > 1 else "1f1b")
    _check_schedule(schedule, pp=cfg.pp, vpp=cfg.vpp, accumulation=batch.accumulation)
    attention = device_kernel(cfg.attention_kernel)
    if model.attention_sinks and cfg.attention_kernel != "auto":
        raise UsageError(
            f"--attention-kernel {cfg.attention_kernel} cannot take this model's attention sinks (SDPA's "
            "kernels return no log-sum-exp to scale by); megakit runs sinks on its ring's fused blocks "
            "(on CPU, or CUDA's memory-efficient kernel): use --attention-kernel auto"
        )
    zero_stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    compile = _check_zero3(cfg, zero_stage, schedule)
    lora_run.check_layout(cfg.lora, model, ep=cfg.ep, zero_stage=zero_stage)
    return Run(
        cfg=cfg,
        layout=layout,
        ds_config=ds_config,
        model=model,
        batch=batch,
        start_step=start,
        checkpoint=checkpoint,
        precision=_precision(ds_config),
        zero_stage=zero_stage,
        sequence_parallel=sequence_parallel,
        loss_chunks=loss_chunks_of(
            model, tp=cfg.tp, tokens=batch.micro_batch * seq_len // cfg.cp, loss_chunks=cfg.loss_chunks
        ),
        schedule=schedule,
        compression=compression,
        corpus=corpus,
        compile=compile,
        attention=attention,
        data_offset=data_offset(extra),
        spike_window=extra.get("spike_guard"),
        lr_schedule=lr_schedule,
        lora_base=lora_base,
    )


def _check_sequence_split(cfg: TrainConfig, seq_len: int) -> None:
    """Refuse a sequence that CP's chunks or sequence parallelism's shards do not divide, here rather than on the
    first stage of every rank."""
    if cfg.cp > 1 and seq_len % (2 * cfg.cp):
        raise UsageError(
            f"sequence length {seq_len} is not divisible by 2 x CP = {2 * cfg.cp}; context parallelism "
            "splits it into that many equal chunks (change --seq-len or --cp)"
        )
    if cfg.sequence_parallel and cfg.tp > 1 and seq_len // cfg.cp % cfg.tp:  # the model would find out only later
        held = f"sequence length {seq_len}" if cfg.cp == 1 else f"sequence length {seq_len // cfg.cp} per CP rank"
        raise UsageError(
            f"{held} is not divisible by TP {cfg.tp}; sequence parallelism needs it to be (change "
            "--seq-len or drop --sequence-parallel)"
        )


def _check_resumed_run(cfg: TrainConfig, checkpoint, extra: dict, *, batch: BatchPlan, model, corpus, say) -> None:
    """A checkpoint resumes only the run that saved it (seed, global batch, vocabulary); other data is warned of,
    since its data position (the step) then continues on data it never read."""
    check_same_run(checkpoint, seed=cfg.seed, global_batch=batch.global_batch, vocab_size=model.vocab_size)
    trained_on = extra.get("data", {}).get("corpus")
    if trained_on not in (None, corpus.fingerprint):
        say(
            f"megakit: warning: checkpoint {checkpoint} was trained on other data than {corpus.source}; its data "
            "position (the step) continues on this data"
        )


def _check_data(cfg: TrainConfig, corpus, batch: BatchPlan, seq_len: int) -> None:
    """What the data flags ask of the corpus, refused in one line now rather than at the first batch or eval."""
    corpus.loader_options(cfg)  # one clear line now if packed documents are asked of data without document starts
    corpus.check_packed(cfg, seq_len)
    check_pairs(corpus, cfg)  # a pair objective on data without pairs
    if cfg.eval_every:  # one clear line now if there is no validation split (each data set of a mixture's)
        for part in corpus.parts:
            ValidationBatches(part, batch, cfg.eval_batches, part.loader_options(cfg, "validation"))


def _check_zero3(cfg: TrainConfig, zero_stage: int, schedule: str) -> bool:
    """Whether blocks are compiled (--compile, else the device's default); refuses what ZeRO 3's gathering hooks
    cannot run under: compiled blocks, an interleaved pipeline, a spike guard's rollback."""
    compile = (
        cfg.compile
        if cfg.compile is not None
        else default_compile("cuda" if torch.cuda.is_available() else "cpu", cp=cfg.cp, zero_stage=zero_stage)
    )
    if compile and zero_stage == 3:
        raise UsageError(
            "--compile with ZeRO 3: DeepSpeed gathers each layer's weights in hooks inside the block "
            "that a compiled block cannot hold; use ZeRO 0-2, or --no-compile"
        )
    if zero_stage == 3 and cfg.pp > 1 and schedule not in ("1f1b", "gpipe"):  # megakit.train.engine.zero3_pipeline
        raise UsageError(
            f"--schedule {schedule} with ZeRO 3: its model chunks run outside DeepSpeed's engine, which "
            "gathers ZeRO 3's weights for each forward and backward; use --schedule 1f1b (no --vpp) with "
            "ZeRO 3, or ZeRO 0-1"
        )
    if cfg.spike_guard and zero_stage == 3:
        raise UsageError(
            f"--spike-guard {cfg.spike_guard:g} with ZeRO 3: a rollback loads the weights into the "
            "running model, which ZeRO 3 partitions; use ZeRO 0-2 with --spike-guard, or drop it"
        )
    return compile


def _precision(ds_config: dict) -> str:
    """The ds_config's training precision: bf16, fp16 or fp32."""
    if ds_config.get("bf16", {}).get("enabled"):
        return "bf16"
    return "fp16" if ds_config.get("fp16", {}).get("enabled") else "fp32"


def _check_schedule(schedule: str, *, pp: int, vpp: int, accumulation: int) -> None:
    """Build the pipeline schedule once here (it is pure data), so that what it refuses is refused before any
    process group. A step's micro-batches are the ds_config's ``gradient_accumulation_steps``, which the
    interleaved schedule runs in groups of PP."""
    if pp == 1:
        return
    if schedule == "interleaved" and accumulation % pp:
        raise UsageError(
            f"the interleaved schedule runs a step's micro-batches in groups of --pp {pp}, but the "
            f"ds_config's gradient_accumulation_steps is {accumulation}; set it to a multiple of {pp} "
            f"(e.g. {pp * max(1, -(-accumulation // pp))})"
        )
    build_schedule(schedule, pp, accumulation, vpp)


def _moe_flags_given(cfg: TrainConfig) -> list[str]:
    """The ``--moe-*`` fields of ``cfg`` that were given (a number, or a switch turned on)."""
    return [name for name in MOE_FLAGS if getattr(cfg, name) is not None and getattr(cfg, name) is not False]


def with_moe_flags(model: ModelConfig, cfg: TrainConfig) -> ModelConfig:
    """``model`` with the ``--moe-*`` flags applied to its experts (MoEConfig checks the values)."""
    given = _moe_flags_given(cfg)
    if not given:
        return model
    if model.moe is None:
        flags = ", ".join("--" + name.replace("_", "-") for name in given)
        raise UsageError(
            f"{flags}: model {cfg.model} has no experts; drop the flag, or train an MoE model (e.g. --model moe-tiny)"
        )
    changes = {MOE_FLAGS[name]: getattr(cfg, name) for name in given}
    return model.replace(moe=dataclasses.replace(model.moe, **changes))


def _check_expert_parallel(cfg: TrainConfig, model: ModelConfig, layout: Layout, ds_config: dict) -> None:
    """``--ep`` against the model, the grid and the ds_config; one line each, before any process group."""
    if cfg.ep == 1:
        return
    if model.moe is None:
        raise UsageError(
            f"--ep {cfg.ep}: model {cfg.model} has no experts to split; drop --ep, or train an MoE "
            "model (e.g. --model moe-tiny)"
        )
    if model.moe.experts % cfg.ep:
        raise UsageError(
            f"--ep {cfg.ep} does not divide the {model.moe.experts} experts of each MoE layer; use a "
            f"divisor of {model.moe.experts}"
        )
    check_ep_fold(
        layout.tp,
        layout.cp,
        layout.dp,
        cfg.ep,
        fix=f", or launch a multiple of PP x EP = {layout.pp * cfg.ep} processes",
    )
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    zero = ds_config.get("zero_optimization", {})
    if stage == 3:  # the experts are partitioned over EDP as DeepSpeed's AutoEP ones (engine.experts)
        for key, fine in (("zero_hpz_partition_size", 1), ("zero_quantized_gradients", False)):
            if zero.get(key, fine) not in (fine, None):
                raise UsageError(
                    f"--ep {cfg.ep} with ZeRO 3 and zero_optimization.{key} {zero[key]}: DeepSpeed's "
                    "ZeRO 3 shards experts over their own group only without it; drop the key, or use "
                    "ZeRO 1-2 with --ep"
                )
    contiguous = zero.get("contiguous_gradients") is not False
    if stage in (1, 2) and (zero.get("reduce_scatter") is False or (stage == 2 and not contiguous)):
        raise UsageError(
            f"--ep {cfg.ep} with ZeRO {stage}: DeepSpeed reduces experts over their own group only with "
            "zero_optimization.reduce_scatter and contiguous_gradients on; drop those keys (both default "
            "to true)"
        )
    if parse_compression(cfg.compress).enabled or cfg.local_sgd:
        flag = f"--compress {cfg.compress}" if not cfg.local_sgd else f"--local-sgd {cfg.local_sgd}"
        raise UsageError(
            f"{flag} with --ep {cfg.ep}: megakit's DP exchange would average the experts over ranks "
            "that hold different ones; drop one of the two"
        )


def _check_dp_sync(cfg: TrainConfig, ds_config: dict) -> Compression:
    """``--compress`` and ``--local-sgd`` replace DeepSpeed's DP all-reduce: at ZeRO 0 all of them, at ZeRO 1 the
    gradient codecs (fp16, int8), through the one all-reduce DeepSpeed's ZeRO-1 optimizer makes with its
    reduce-scatter off (``megakit.train.engine.dp_sync``)."""
    compression = parse_compression(cfg.compress)
    flag = (
        f"--compress {cfg.compress}"
        if compression.enabled
        else f"--local-sgd {cfg.local_sgd}"
        if cfg.local_sgd
        else None
    )
    zero = ds_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if flag and stage > 1:
        raise UsageError(
            f"{flag} needs ZeRO stage 0 or 1 (ds_configs/zero0.json, zero1.json): ZeRO {stage} "
            "reduce-scatters the gradients inside DeepSpeed's backward hooks, where megakit cannot "
            "compress or skip the exchange"
        )
    if flag and stage == 1 and (cfg.local_sgd or 1 not in compression.zero_stages):
        raise UsageError(
            f"{flag} averages whole weights (or their updates), but ZeRO 1 keeps each rank's optimizer "
            "step to its own shard; use ZeRO 0 (ds_configs/zero0.json), or --compress fp16/int8 with ZeRO 1"
        )
    bf16 = ds_config.get("bf16", {}).get("enabled")
    fp32_accumulation = str(ds_config.get("data_types", {}).get("grad_accum_dtype", "")).lower() in ("fp32", "float32")
    if compression.enabled and stage == 1 and bf16 and fp32_accumulation and not zero.get("offload_optimizer"):
        raise UsageError(
            f"{flag} with ZeRO 1: bf16 with fp32 gradient accumulation (data_types.grad_accum_dtype) "
            "makes DeepSpeed use its BF16_Optimizer, whose reduction megakit cannot replace; drop "
            "grad_accum_dtype, or use ZeRO 0"
        )
    if compression.enabled and stage == 1:  # one all-reduce per bucket, through the method dp_sync replaces
        ds_config["zero_optimization"] = {**zero, "reduce_scatter": False, "contiguous_gradients": True}
    fp32 = not (ds_config.get("bf16", {}).get("enabled") or ds_config.get("fp16", {}).get("enabled"))
    if (cfg.local_sgd or compression.after_optimizer) and not fp32:
        raise UsageError(
            f"{flag} averages the module's weights (or their updates), but with bf16/fp16 DeepSpeed "
            "steps a separate fp32 master copy; use fp32, or --compress fp16/int8 for mixed precision"
        )
    return compression
