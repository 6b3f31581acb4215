"""Per-GPU memory of one training layout, itemised, for one pipeline stage.

``estimate_memory(model, tp=, pp=, dp=, zero_stage=, micro_batch=, ...)`` returns
a ``MemoryEstimate``: bytes per item (params, grads, master params, optimizer,
fp32 step gradients, activations, logits, recompute working set, communication
buckets, ZeRO-3 gather buffers, framework overhead) plus the activation model it
used, tensor by tensor, so a measured run (the trainer's ``--verify-memory``)
can be compared item by item.

Model states follow what DeepSpeed allocates (Ψ = parameters on this TP×PP
shard, N = DP size, p = bytes of the training dtype, 2 for bf16/fp16, 4 for fp32):

=========  ===========  ==========  =================  ===========  =====================
ZeRO       params       grads       fp32 master        Adam m, v    fp32 grads at step
=========  ===========  ==========  =================  ===========  =====================
0          pΨ           pΨ          4Ψ (mixed only)    8Ψ           4Ψ (mixed only)
1          pΨ           pΨ          4Ψ/N               8Ψ/N         4Ψ/N
2          pΨ           pΨ/N        4Ψ/N               8Ψ/N         4Ψ/N
3          pΨ/N         pΨ/N        4Ψ/N               8Ψ/N         4 × min(Ψ/N, sub-group)
=========  ===========  ==========  =================  ===========  =====================

The routed experts' states are their own items (``expert_params``, ``expert_grads``, ``expert_master_params``,
``expert_optimizer``): Ψ_E = E/EP experts per GPU, N = EDP (the TP x CP x DP / EP ranks holding the same experts;
at EP 1 the experts are dense weights, N = DP x CP); their fp32 step copy joins ``fp32_step_grads``.

With p = 2 this is the ZeRO paper's 16Ψ / 4Ψ+12Ψ/N / 2Ψ+14Ψ/N / 16Ψ/N plus the
fp32 copy of the gradient partition DeepSpeed makes at ``step()`` (which is why
DeepSpeed's own ZeRO-2 estimator says 2Ψ+18Ψ/N); that copy is transient (it lives
during ``step()`` only) and ZeRO 1-3 make it in fp32 training too (the flatten copies). ZeRO 1-3 keep an fp32 master
partition even when training in fp32 (DeepSpeed clones it). CPU offload moves
master params, optimizer states and fp32 step gradients to the host
(``offload="optimizer"``) and, with ZeRO-3, the parameters too (``"params"``).

Activations per layer and micro-batch follow Korthikanti et al. 2022 (Table 2):
``sbh(34 + 5as/h)`` bytes in 16-bit with dropout, which ``activation_tensors``
lists tensor by tensor so it also covers GQA, SwiGLU, fp32, no-dropout and
fused (flash) attention, where the ``as²`` scores are never stored. TP shards
the tensors inside attention and the MLP; sequence parallelism shards the rest.
Context parallelism (``cp``) divides every activation by CP (a rank holds ``s/cp`` tokens; ring
attention keeps q, k, v, its output and log-sum-exp, never the scores) and shards ZeRO's states over
DP x CP; the ring adds two K/V blocks in flight. A 1F1B stage ``i`` of ``p`` keeps ``min(p - i, m)`` micro-batches in
flight; the interleaved schedule keeps ``(p - i - 1)·2 + (v - 1)·p + 1`` model chunks, counted chunk by chunk
(``in_flight_chunks``: earlier chunks hold more, and chunks hold unequal layers). A chunk's output is
freed once sent (``megakit.nn.pipeline.sent_output``, Megatron-LM's ``deallocate_output_tensor``) except under zero
bubble, whose B and W take the output itself; a stage that receives gradients holds one during a backward
(a communication buffer: the output's handle hands it to autograd, which saves none of it).
The fp32 gradient copies of ``step()`` live once every activation is freed: ``MemoryEstimate.total``
counts the larger of the two phases.
ZB-H1 (``zero_bubble``, Qi et al. 2023) keeps a micro-batch's activations until its deferred W,
so every stage holds ``min(p, m)`` (1F1B's first stage's count), and, for each W still pending
(at most ``i + 1`` on stage ``i``; none on the first, whose B does nothing), the gradient that B
left at each weight's matmul output and, with recompute, the activations B rebuilt, which the
retained graph keeps until W (``weight_grad_inputs``): the extra memory of zero bubble.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

from megakit.core.lora import LoraSpec
from megakit.core.planner import lora_cost, muon
from megakit.core.planner.activations import (  # noqa: F401 (memory's API: what one block keeps)
    MIXER_CORES,
    PER_OP_KEPT,
    PRECISIONS,
    ROUTING_GROUPS,
    SHARED_EXPERT,
    SavedTensor,
    activation_tensors,
    dispatch_buffers,
    latent_tensors,
    logits_bytes,
    routed_imbalance,
    routing_tensors,
)
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import megatron_fp32_grads
from megakit.core.planner.stages import (  # noqa: F401 (memory's API: where the stages' blocks and micro-batches are)
    in_flight_chunks,
    in_flight_micro_batches,
    stage_chunk_layers,
    stage_chunk_moe_layers,
    stage_layer_counts,
    stage_moe_layers,
)
from megakit.errors import UsageError

GIB = 1024**3
STATES = ("params", "grads", "master_params", "optimizer")  # per parameter; the routed experts' as ``expert_*``
STEP_ONLY = ("fp32_step_grads", "muon_step")  # items that live during ``step()`` only
MUON_STATES = ("muon_momentum", "expert_muon_momentum")  # --optimizer muon: one fp32 moment per hidden-matrix weight
BACKWARD_ONLY = (
    "activations",
    "pipeline_outputs",
    "moe_routing",
    "weight_grad_inputs",
    "recompute_working_set",
    "logits",
    "lora_activations",
)  # items freed by the end of the last backward
FROZEN = ("grads", "master_params", "optimizer") + tuple(f"expert_{k}" for k in ("grads", "master_params", "optimizer"))
RECOMPUTE = ("none", "selective", "full", "per-op")
# Megatron-Core's selective recompute (--recompute-modules, TransformerConfig.recompute_modules): what each module's
# checkpoint frees of the tensors ``activation_tensors`` and ``routing_tensors`` name, on MoE blocks, dense blocks or
# both. "layernorm", "mla_up_proj" and "moe_act" discard their outputs (CheckpointWithoutOutput: every consumer's saved
# copy is that storage); "mlp" is a no-op on MoE blocks, "moe" and "shared_experts" on dense ones; "core_attn" keeps the
# kernel's inputs and output as flash attention does. The byte counts follow Megatron's own estimator
# (Megatron-MoE-ModelZoo misc/tools/deepseek_mem_estimate.py, its "By ... recompute, can save" lines).
MEGATRON_RECOMPUTE = {
    "core_attn": (("attention log-sum-exp",), ("attention log-sum-exp",)),
    "layernorm": (("qkv input", "mlp input"), ("qkv input", "mlp input")),
    "mla_up_proj": (("q", "k", "v"), ("q", "k", "v")),
    "mlp": (
        (),
        ("gate output", "up output", "act(gate)", "down input", "gate and up output", "gelu input", "fc2 input"),
    ),
    "moe_act": (("down input", "expert fc2 input"), ()),
    "shared_experts": (("gate and up output", "down input"), ()),
    "moe": (
        (
            "gate and up output",
            "down input",
            "router probabilities",
            "permutation map",
            "permuted tokens",
            "expert fc1 output",
            "expert fc2 input",
            "expert outputs",
        ),
        (),
    ),
}
# Transformer Engine's fused norms (Megatron-Core) save their input and rstd; the normalised output is the next
# linear's saved input. megakit's composite RMSNorm keeps the normalised input apart for the weight's gradient.
TE_NORM_DROPS = ("normalised",)
OFFLOAD = ("none", "optimizer", "params")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Buckets:
    """DeepSpeed communication buffer sizes, in elements (the values ``emit.py`` writes)."""

    reduce_bucket: int = 200_000_000
    allgather_bucket: int = 200_000_000
    stage3_prefetch: int = 50_000_000
    stage3_max_live: int = 1_000_000_000
    stage3_sub_group: int = 1_000_000_000


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes per GPU, by item; ``total`` is the predicted peak."""

    items: dict
    stage: int
    breakdown: dict = dataclasses.field(default_factory=dict)  # item -> {line inside it: bytes}, for the report
    layers: int
    in_flight: float
    params_local: float
    activation_per_layer: float  # bytes, one micro-batch
    tensors: tuple  # the SavedTensor list behind the activations

    @property
    def total(self) -> float:
        """Model states and buffers, plus the larger of the two phases: backward (what activations hold) and
        ``step()``, whose fp32 gradient copies come once every activation is freed (the step follows the last
        backward, with or without a pipeline)."""
        step = sum(self.items.get(k, 0.0) for k in STEP_ONLY)
        backward = sum(self.items.get(k, 0.0) for k in BACKWARD_ONLY)
        return float(sum(self.items.values()) - min(step, backward))

    @property
    def model_states(self) -> float:
        return float(
            sum(self.items.get(k, 0.0) for k in STATES + tuple(f"{w}_{k}" for w in ("expert", "lora") for k in STATES))
            + sum(self.items.get(k, 0.0) for k in MUON_STATES)
            + self.items.get("fp32_step_grads", 0.0)
        )

    @property
    def expert_states(self) -> float:
        """The routed experts' parameters, gradients, fp32 master and Adam states or Muon momentum (E/EP per GPU, ZeRO
        over EDP)."""
        return float(sum(self.items.get(f"expert_{k}", 0.0) for k in STATES + ("muon_momentum",)))

    def gib(self) -> dict:
        """The breakdown in GiB, as the report and ``--json`` print it."""
        return {k: v / GIB for k, v in self.items.items()}


def _resolve_stage(stage, pp: int) -> int:
    if stage in ("first", None):
        return 0
    if stage == "last":
        return pp - 1
    if stage == "middle":
        return min(pp // 2, pp - 1) if pp > 2 else min(1, pp - 1)
    stage = int(stage)
    if not 0 <= stage < pp:
        raise UsageError(f"stage {stage} is outside the pipeline's {pp} stages")
    return stage


def stage_params(model: ModelSpec, *, tp: int, pp: int, stage: int, layers: int | None = None, vpp: int = 1) -> int:
    """Parameters one GPU of this TP rank × PP stage holds (embedding on the first stage, head on the last),
    routed experts aside (``stage_expert_params``)."""
    n_layers = stage_layer_counts(model, pp, vpp)[stage] if layers is None else layers
    n_moe = stage_moe_layers(model, pp, vpp)[stage] if layers is None else (n_layers if model.config.moe else 0)
    count = sum(n * sum(model.layer_params(tp, moe=moe)) for n, moe in ((n_moe, True), (n_layers - n_moe, False)))
    if stage == 0:
        count += model.embedding_params(tp)
    if stage == pp - 1:
        count += model.head_params(tp, separate=not model.tie_embeddings or pp > 1) + mtp_params(model, tp=tp, pp=pp)
    return count


def mtp_params(model: ModelSpec, *, tp: int, pp: int) -> int:
    """The last stage's Multi-Token Prediction modules on one TP rank (``ModelConfig.mtp_module_params``: block,
    ``eh_proj``, three norms; routed experts aside) and, under PP, the token embedding's copy that they read
    (``megakit.nn.model``: a last stage with MTP keeps one; a tied head already is one)."""
    if not model.mtp:
        return 0
    modules = sum(
        model.config.mtp_module_params(k, tp).sharded + model.config.mtp_module_params(k, tp).replicated
        for k in range(1, model.mtp + 1)
    )
    return modules + (model.embedding_params(tp) if pp > 1 and not model.tie_embeddings else 0)


def stage_expert_params(
    model: ModelSpec, *, pp: int, stage: int, ep: int = 1, layers: int | None = None, vpp: int = 1
) -> float:
    """Routed-expert parameters one GPU of this PP stage holds: E / EP experts of each of its MoE blocks
    (every TP rank holds them whole: ETP = 1)."""
    if model.config.moe is None:
        return 0.0
    n_moe = stage_moe_layers(model, pp, vpp)[stage] if layers is None else layers
    mtp = sum(model.config.mtp_module_params(k).experts for k in range(1, model.mtp + 1)) if stage == pp - 1 else 0
    return (n_moe * model.config.block_params().experts + mtp) / ep


def _replicated_shared_experts(
    model: ModelSpec, *, tp: int, pp: int, stage: int, layers: int | None, vpp: int
) -> float:
    """What megakit's shared experts add on one TP rank to ``stage_params``' count, which shards them over TP as
    Megatron does: megakit replicates them (``megakit.nn.moe.layer.SharedExpert`` runs on the rank's tokens), so each TP
    rank holds the other ``(tp - 1) / tp`` of each MoE block's three ``H x shared_ffn`` matrices too (two: relu2)."""
    n_moe = stage_moe_layers(model, pp, vpp)[stage] if layers is None else layers
    if stage == pp - 1:  # the MTP modules' blocks
        n_moe += sum(model.config.is_moe_layer(model.layers + k - 1) for k in range(1, model.mtp + 1))
    moe = model.config.moe
    assert moe is not None, "only MoE models have shared experts"
    return n_moe * moe.matrices * model.hidden * moe.shared_ffn * (1 - 1 / tp)


def model_state_bytes(
    psi: float,
    *,
    dp: int,
    zero_stage: int,
    precision: str,
    offload: str = "none",
    buckets: Buckets | None = None,
    main_grads: bool = False,
    moments: str = "fp32",
) -> dict:
    """Parameters, gradients, fp32 master, Adam m and v, fp32 step gradients of ``psi`` parameters
    whose ZeRO group has ``dp`` ranks (the table in the module docstring). ``main_grads``: Megatron-LM's
    optimizer (ZeRO 0-1: its distributed optimizer shards master and Adam), which under bf16 accumulates
    gradients in an fp32 buffer that the step reads: 4Ψ of gradients and no 16-bit ones or step copy.
    Under fp16 its buffer holds fp16 gradients, copied to fp32 at the step as DeepSpeed's are (arguments.py
    forces --accumulate-allreduce-grads-in-fp32 for bf16 only; optimizer.py _copy_model_grads_to_main_grads).
    ``moments``: the dtype of Adam's m and v (bf16: Megatron's --use-precision-aware-optimizer --exp-avg-dtype bf16
    --exp-avg-sq-dtype bf16), 2 x 4 bytes or 2 x 2 per parameter."""
    buckets = buckets or Buckets()
    p, mixed = PRECISIONS[precision], precision != "fp32"
    adam = 2 * PRECISIONS[moments]
    if main_grads and zero_stage <= 1 and megatron_fp32_grads(precision) and offload == "none":
        shard = dp if zero_stage == 1 else 1
        return {
            "params": p * psi,
            "grads": 4 * psi,
            "master_params": 4 * psi / shard,
            "optimizer": adam * psi / shard,
            "fp32_step_grads": 0.0,
        }
    shard = dp if zero_stage >= 1 else 1
    on_gpu = 0 if offload != "none" else 1
    if zero_stage == 0 and not mixed:  # torch's Adam steps on p.grad directly
        step_grads = 0.0
    elif zero_stage == 3:  # the flattened (copied) gradient of one optimizer sub-group at a time
        step_grads = 4 * min(psi / dp, buckets.stage3_sub_group)
    else:
        step_grads = 4 * psi / shard
    return {
        "params": p * psi / (dp if zero_stage == 3 else 1) * (0 if offload == "params" else 1),
        "grads": p * psi / (dp if zero_stage >= 2 else 1),
        "master_params": (4 * psi / shard if (mixed or zero_stage >= 1) else 0) * on_gpu,
        "optimizer": adam * psi / shard * on_gpu,
        "fp32_step_grads": step_grads * on_gpu,
    }


def estimate_memory(
    model: ModelSpec,
    *,
    tp: int = 1,
    pp: int = 1,
    dp: int = 1,
    cp: int = 1,
    zero_stage: int = 0,
    micro_batch: int = 1,
    seq_len: int | None = None,
    accumulation: int | None = None,
    recompute: str = "none",
    sequence_parallel: bool = False,
    vpp: int = 1,
    precision: str = "bf16",
    offload: str = "none",
    stage="first",
    flash_attention: bool = True,
    dropout: bool | None = None,
    dropout_mask_bytes: int = 1,
    layers: int | None = None,
    recompute_fraction: float = 1.0,
    dp_shard: int = 0,
    gathered_inputs: bool = False,
    zero_bubble: bool = False,
    ep: int = 1,
    moe_imbalance: float = 1.0,
    buckets: Buckets = Buckets(),
    overhead_bytes: float = 0.0,
    megatron: bool = False,
    loss_chunks: int = 1,
    cp_ring: bool = True,
    recompute_modules: tuple[str, ...] = (),
    main_grads_fp32: bool | None = None,
    moments: str = "fp32",
    lora: LoraSpec | None = None,
    optimizer: str = "adamw",
) -> MemoryEstimate:
    """Itemised per-GPU bytes of one layout on one pipeline ``stage`` (index, 'first', 'last', 'middle').

    ``accumulation``: micro-batches per optimizer step (gradient accumulation),
    which caps the micro-batches in flight; default: enough to fill the pipeline.
    ``layers``: the blocks on this stage if not the trainer's split (``stage_layer_counts``).
    ``recompute_fraction``: with full recompute, the share of blocks recomputed (the rest keep all).
    ``dp_shard``: ZeRO-3's shard group when smaller than DP (HSDP); 0: all of DP.
    ``gathered_inputs``: with SP the column-parallel layers keep their all-gathered input (torchtitan)
    instead of re-gathering it in backward (Megatron-LM, Korthikanti's table; megakit's layers too).
    ``ep``: expert parallelism (``stage_expert_params``; ZeRO shards the experts' states over the
    EDP = TP x CP x DP / EP ranks that hold the same experts); ``moe_imbalance``: the busiest rank's share
    of routed tokens over the balanced one (``routing_tensors``).
    ``megatron``: Megatron-LM's trainer (``Plan.megatron``): fp32 main gradients (``model_state_bytes``), its fused
    SwiGLU (``activation_tensors(fused_swiglu=True)``). ``loss_chunks``: the head
    and loss over that many token chunks (``logits_bytes``; 0: the trainer's default rule, ``auto_loss_chunks``).
    ``cp_ring``: with ``cp`` > 1 the attention core runs on a ring (ring or hybrid CP; False: Ulysses' all-to-all),
    whose output MLA keeps apart from ``o_proj``'s copy (``activation_tensors(ring=True)``).
    ``recompute_modules``: with ``megatron`` and ``recompute="selective"``, Megatron-Core's modules
    (``MEGATRON_RECOMPUTE``; none given: its default, core_attn). ``main_grads_fp32``: Megatron's main-gradient buffers
    in fp32 (default: ``megatron``; False: --grad-reduce-in-bf16, Megatron-Bridge's performance recipes, which keep
    them in bf16 and copy the shard to fp32 at the step as DeepSpeed does). ``moments``: Adam's m and v dtype.
    ``lora``: LoRA fine-tuning (``lora_states``, ``lora_activations``): the base frozen, the adapters trained.
    ``optimizer``: "muon" keeps one fp32 moment for the hidden matrices and Adam's two for the rest, and adds the
    step's buffers (``muon_states``)."""
    _check_options(
        precision, recompute, offload, zero_stage, recompute_modules, megatron, moments, (tp, pp, dp, vpp, micro_batch)
    )
    _check_muon(optimizer, zero_stage=zero_stage, offload=offload, megatron=megatron, lora=lora)
    return _Stage.of(**locals()).estimate()


def _check_options(precision, recompute, offload, zero_stage, recompute_modules, megatron, moments, sizes) -> None:
    """One line naming the bad option and its fix, before any arithmetic runs on it."""
    if precision not in PRECISIONS:
        raise UsageError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    if recompute not in RECOMPUTE:
        raise UsageError(f"recompute {recompute!r} is not one of {', '.join(RECOMPUTE)}")
    if offload not in OFFLOAD:
        raise UsageError(f"offload {offload!r} is not one of {', '.join(OFFLOAD)}")
    if zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"ZeRO stage {zero_stage} does not exist; use 0, 1, 2 or 3")
    if offload == "params" and zero_stage != 3:
        raise UsageError("parameter offload needs ZeRO stage 3; use --offload optimizer or --zero 3")
    unknown = sorted(set(recompute_modules) - set(MEGATRON_RECOMPUTE))
    if unknown:
        raise UsageError(f"recompute module {unknown[0]!r} is not one of {', '.join(MEGATRON_RECOMPUTE)}")
    if recompute_modules and not (megatron and recompute == "selective"):
        raise UsageError(
            "recompute modules are Megatron-Core's selective recompute: use them with --runtime megatron "
            "or megatron-core and --recompute selective"
        )
    if moments not in PRECISIONS:
        raise UsageError(f"Adam moments {moments!r} are not one of {', '.join(PRECISIONS)}")
    if min(sizes) < 1:
        raise UsageError("tp, pp, dp, vpp and micro-batch must all be at least 1")


def _check_muon(optimizer: str, *, zero_stage: int, offload: str, megatron: bool, lora) -> None:
    """What megakit's trainer runs Muon with (``megakit.train.engine.muon.check_muon``): ZeRO 0-2, no offload."""
    if optimizer not in muon.OPTIMIZERS:
        raise UsageError(f"optimizer {optimizer!r} is not one of {', '.join(muon.OPTIMIZERS)}")
    if optimizer == "adamw":
        return
    if zero_stage == 3:
        raise UsageError("Muon with ZeRO 3: each weight is partitioned over DP, and Newton-Schulz needs whole matrices")
    if offload != "none" or megatron or lora is not None:
        raise UsageError("Muon is priced as megakit's trainer runs it: no offload, no Megatron runtime, no LoRA")


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Activations:
    """The activation items' by-products that the buffers and the report read."""

    tensors: list  # a typical block's saved tensors
    kept: float  # their bytes kept per micro-batch
    in_flight: float  # whole-stage units of micro-batches in flight
    hidden: float  # one (S', B, H) tensor
    chunk_moe: tuple
    lines: dict


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Stage:
    """``estimate_memory``'s arguments, resolved for one stage (``seq_len``: this rank's tokens; ``dp`` counts the
    CP ranks), with one method per memory item, so each item reads its rule alone."""

    model: ModelSpec
    tp: int
    pp: int
    dp: int
    cp: int
    zero_stage: int
    micro_batch: int
    seq_len: int
    accumulation: int | None
    recompute: str
    sequence_parallel: bool
    vpp: int
    precision: str
    offload: str
    stage: int
    flash_attention: bool
    dropout: bool | None
    dropout_mask_bytes: int
    layers: int | None
    recompute_fraction: float
    dp_shard: int
    gathered_inputs: bool
    zero_bubble: bool
    ep: int
    moe_imbalance: float
    buckets: Buckets
    overhead_bytes: float
    megatron: bool
    loss_chunks: int
    cp_ring: bool
    recompute_modules: tuple
    main_grads_fp32: bool | None
    moments: str
    lora: LoraSpec | None
    optimizer: str

    @classmethod
    def of(cls, *, seq_len, cp, dp, flash_attention, stage, model, pp, **layout) -> _Stage:
        """The arguments as given, CP folded in (a rank's s/cp tokens; the ring keeps what flash attention keeps;
        ZeRO over DP x CP) and the stage named by its index."""
        s = model.seq_len if seq_len is None else seq_len
        if cp > 1:
            s, dp, flash_attention = s // cp, dp * cp, True
        stage = _resolve_stage(stage, pp)
        return cls(seq_len=s, cp=cp, dp=dp, flash_attention=flash_attention, stage=stage, model=model, pp=pp, **layout)

    @property
    def p(self) -> int:
        """Bytes of the training dtype."""
        return PRECISIONS[self.precision]

    @functools.cached_property
    def n_layers(self) -> int:
        """The blocks on this stage."""
        return stage_layer_counts(self.model, self.pp, self.vpp)[self.stage] if self.layers is None else self.layers

    @property
    def state_dp(self) -> int:
        """The ranks ZeRO shards the dense states over: HSDP's shard group under ZeRO-3 when smaller than DP."""
        return self.dp_shard if self.zero_stage == 3 and 0 < self.dp_shard < self.dp else self.dp

    @property
    def moe(self) -> bool:
        return self.model.config.moe is not None

    @functools.cached_property
    def imbalance(self) -> float:
        """The busiest expert rank's share of routed tokens over the balanced one."""
        return routed_imbalance(self.model, self.moe_imbalance, self.ep)

    def estimate(self) -> MemoryEstimate:
        """Every item of this stage: model states, activations, buffers, overhead."""
        items, psi, psi_experts = self.state_items()
        act = self.activation_items(items)
        items["comm_buffers"] = self.comm_buffers(psi, act)
        items["zero3_gather"] = self.zero3_gather(psi_experts, act.chunk_moe)
        items["overhead"] = float(self.overhead_bytes)
        return MemoryEstimate(
            items=items,
            breakdown=act.lines,
            stage=self.stage,
            layers=self.n_layers,
            in_flight=act.in_flight,
            params_local=psi,
            activation_per_layer=act.kept,
            tensors=tuple(act.tensors),
        )

    def state_items(self) -> tuple[dict, float, float]:
        """(items, dense params, expert params) of the model states: the dense ones over DP (or HSDP's shard
        group), the routed experts' over EDP, each by ``model_state_bytes``."""
        model, tp, pp, dp, ep, stage, vpp = self.model, self.tp, self.pp, self.dp, self.ep, self.stage, self.vpp
        psi: float = stage_params(model, tp=tp, pp=pp, stage=stage, layers=self.layers, vpp=vpp)
        moe = model.config.moe
        if moe is not None and moe.shared_ffn and tp > 1 and not self.megatron:
            psi += _replicated_shared_experts(model, tp=tp, pp=pp, stage=stage, layers=self.layers, vpp=vpp)
        folded = tp * dp  # TP x CP x DP (dp counts the CP ranks here): the ranks EP folds over
        if ep < 1 or folded % ep or (moe is not None and moe.experts % ep) or (ep > 1 and not self.moe):
            raise UsageError(f"EP {ep} must divide TP x CP x DP {folded} and the experts of an MoE model")
        psi_experts = stage_expert_params(
            model, pp=pp, stage=stage, ep=ep, layers=self.n_layers if self.layers is not None else None, vpp=vpp
        )
        # EDP: the ranks holding the same experts, over which ZeRO (stage 3 too) shards their states, HSDP's shard group
        # aside; at EP 1 the experts are dense weights, replicated over TP and sharded over DP x CP
        edp = folded // ep if ep > 1 else dp
        states: dict[str, Any] = dict(
            zero_stage=self.zero_stage,
            precision=self.precision,
            offload=self.offload,
            buckets=self.buckets,
            main_grads=self.megatron if self.main_grads_fp32 is None else self.main_grads_fp32,
            moments=self.moments,
        )
        items = model_state_bytes(psi, dp=self.state_dp, **states)
        experts = model_state_bytes(psi_experts, dp=edp, **states)
        # over EP and EDP: the same ZeRO formulas, DP -> EDP, each on its own line; their fp32 step copy joins the dense
        # one (DeepSpeed's and Megatron's distributed optimizer copy each group's shard in ``step()`` and free it)
        items |= {f"expert_{k}": v for k, v in experts.items() if k != "fp32_step_grads"}
        items["fp32_step_grads"] += experts["fp32_step_grads"]
        if self.lora is not None:
            items = self.lora_states(items, states)
        if self.optimizer == "muon":
            items = self.muon_states(items, psi_experts, edp)
        return items, psi, psi_experts

    def muon_states(self, items: dict, psi_experts: float, edp: int) -> dict:
        """--optimizer muon: the hidden matrices' one fp32 moment (``muon_momentum``) in place of their share of Adam's
        two (``optimizer`` keeps AdamW's weights' m and v), sharded as ZeRO 1-2 shard Adam's, and the step's buffers
        (``muon.step_bytes``: the updates, the TP and DP exchanges' buffers, Newton-Schulz's working set)."""
        share = muon.stage_share(
            self.model, tp=self.tp, pp=self.pp, stage=self.stage, ep=self.ep, layers=self.layers, vpp=self.vpp
        )
        adam = 2 * PRECISIONS[self.moments]
        dense_shard, expert_shard = (self.state_dp, edp) if self.zero_stage >= 1 else (1, 1)
        for prefix, weights, shard in (("", share.dense, dense_shard), ("expert_", share.experts, expert_shard)):
            if weights:
                items[f"{prefix}optimizer"] -= adam * weights / shard
                items[f"{prefix}muon_momentum"] = muon.MOMENT_BYTES * weights / shard
        items["muon_step"] = muon.step_bytes(
            share, tp=self.tp, zero_stage=self.zero_stage, dp=dense_shard, edp=expert_shard
        )
        return items

    def lora_blocks(self) -> tuple[float, float]:
        """(dense, MoE) blocks on this stage, whose adapters ``lora_*`` count."""
        if self.layers is not None:
            n_moe = self.n_layers if self.moe else 0
        else:
            n_moe = stage_moe_layers(self.model, self.pp, self.vpp)[self.stage]
        return self.n_layers - n_moe, n_moe

    def lora_states(self, items: dict, states: dict) -> dict:
        """LoRA's model states: the frozen base keeps its parameters (in the training dtype, ZeRO-3 partitions them
        too) and nothing else; the adapters (``lora_*``) have every state a trained weight has (ZeRO over the dense
        states' ranks), and only their fp32 copy is made at the step."""
        assert self.lora is not None, "LoRA's states of a plan without LoRA"
        dense, moe = self.lora_blocks()
        psi: float = sum(
            n * lora_cost.block_params(self.model, self.lora, self.tp, moe=is_moe)
            for n, is_moe in ((dense, False), (moe, True))
        )
        adapters = model_state_bytes(psi, dp=self.state_dp, **states)
        items |= {k: 0.0 for k in FROZEN} | {f"lora_{k}": v for k, v in adapters.items() if k != "fp32_step_grads"}
        items["fp32_step_grads"] = adapters["fp32_step_grads"]
        return items

    # ---- what one block keeps ----------------------------------------------------------

    @property
    def block_input(self) -> float:
        """One block's input, one micro-batch: what full recompute keeps of a block."""
        return self.p * self.seq_len * self.micro_batch * self.model.hidden / (self.tp if self.sequence_parallel else 1)

    def size(self, tensors) -> float:
        """Bytes of ``tensors`` at this rank's tokens and micro-batch."""
        return sum(x.bytes(seq_len=self.seq_len, micro_batch=self.micro_batch) for x in tensors)

    def saved(self, tensors: list) -> list:
        """What the runtime saves of ``tensors``: Megatron-Core's fused norms keep no normalised copy, nor do frozen
        norms (LoRA), whose weight wants no gradient."""
        frozen = self.megatron or self.lora is not None
        return [x for x in tensors if not (frozen and x.name.endswith(TE_NORM_DROPS))]

    def megatron_kept(self, tensors: list, is_moe: bool) -> list:
        """``tensors`` less what selective recompute frees: Megatron-Core's ``recompute_modules``, or the attention
        core (megakit's selective recompute, and Megatron's default)."""
        dropped = {
            name
            for module in (self.recompute_modules or ("core_attn",))
            for name in MEGATRON_RECOMPUTE[module][0 if is_moe else 1]
        }
        return [x for x in tensors if x.name not in dropped]

    def block_tensors(self, is_moe: bool, flash: bool | None = None) -> list:
        """A dense or MoE block's saved tensors (``activation_tensors``), flash attention's or not."""
        shape: dict[str, Any] = dict(
            tp=self.tp,
            sequence_parallel=self.sequence_parallel,
            precision=self.precision,
            dropout=self.dropout,
            dropout_mask_bytes=self.dropout_mask_bytes,
            gathered_inputs=self.gathered_inputs,
            fused_swiglu=self.megatron,
            ring=self.cp > 1 and self.cp_ring,
            cp=self.cp > 1,
        )
        flash = self.flash_attention if flash is None else flash
        return self.saved(activation_tensors(self.model, flash_attention=flash, moe=is_moe, **shape))

    def kept_tensors(self, is_moe: bool) -> list:
        """The tensors a block keeps under selective, per-op or no recompute. A recomputed attention core keeps
        its inputs q, k, v (K and V unrepeated under GQA) and o_proj's input, as flash attention keeps them."""
        if self.recompute == "selective":
            flash = self.flash_attention or "core_attn" in (self.recompute_modules or ("core_attn",))
            kept = self.megatron_kept(self.block_tensors(is_moe, flash), is_moe)
            return kept if self.megatron else [x for x in kept if x.name not in MIXER_CORES]  # megakit's mixers too
        if self.recompute == "per-op":
            return [x for x in self.block_tensors(is_moe) if x.name in PER_OP_KEPT]
        return self.block_tensors(is_moe)

    def kept_bytes(self, is_moe: bool) -> tuple[list, float, float]:
        """(the block's saved tensors, their bytes, the bytes recompute leaves kept) of a dense or MoE block."""
        tensors = self.block_tensors(is_moe)
        full = self.size(tensors)
        if self.recompute == "full":  # the block input only, on recompute_fraction of the blocks
            return tensors, full, self.recompute_fraction * self.block_input + (1 - self.recompute_fraction) * full
        kept = self.size(self.kept_tensors(is_moe))
        return tensors, full, kept + (2 * self.block_input if self.recompute == "per-op" else 0.0)

    def kept_named(self, is_moe: bool, names) -> float:
        """Of a block's kept bytes, those of the tensors ``names`` (the recomputed ones left out)."""
        if self.recompute == "full":
            return (1 - self.recompute_fraction) * self.size(x for x in self.block_tensors(is_moe) if x.name in names)
        return self.size(x for x in self.kept_tensors(is_moe) if x.name in names)

    # ---- activations -------------------------------------------------------------------

    def activation_items(self, items: dict) -> _Activations:
        """The activation items (activations, MoE routing, pipeline outputs, W's inputs, recompute working set,
        logits): what the micro-batches in flight keep at the stage's peak moment."""
        model, pp, vpp, stage, recompute = self.model, self.pp, self.vpp, self.stage, self.recompute
        tensors, full_layer, kept = self.kept_bytes(self.moe)  # a typical block: the MoE one in an MoE model
        dense_kept = self.kept_bytes(False)[2] if self.moe else kept
        route = self.routing_tensors()
        routing = self.size(route)
        route_kept = self.megatron_kept(route, True) if recompute == "selective" else route  # Megatron's "moe" modules
        routing_kept = (1 - self.recompute_fraction) * routing if recompute == "full" else self.size(route_kept)
        m = self.accumulation if self.accumulation is not None else pp * vpp
        chunk_layers, chunk_moe = self.chunk_blocks()
        weights = self.chunk_weights(chunk_layers, chunk_moe, kept=kept, dense_kept=dense_kept, routing=routing_kept)
        mtp = self.mtp_depths(routing_kept, routing)
        mtp_kept, mtp_routing = sum(x[0] for x in mtp), sum(x[1] for x in mtp)
        if mtp_kept:  # the MTP modules follow the last block, in the last chunk, kept as long as it is in flight
            w, r, o = weights[-1]
            weights[-1] = (w + mtp_kept, r + mtp_routing, o)
        peak = max(
            in_flight_chunks(pp=pp, stage=stage, accumulation=m, vpp=vpp),
            key=lambda live: sum(n * sum(w) for n, w in zip(live, weights)),
        )
        items["pipeline_outputs"] = sum(n * o for n, (_, _, o) in zip(peak, weights)) if self.zero_bubble else 0.0
        if self.zero_bubble:
            peak = in_flight_chunks(pp=pp, stage=stage, accumulation=m, vpp=vpp, zero_bubble=True)[0]
        items["activations"] = sum(n * w for n, (w, _, _) in zip(peak, weights))
        items["moe_routing"] = sum(n * r for n, (_, r, _) in zip(peak, weights))
        lines: dict = {}  # the lines inside items, for ``megakit plan``
        if self.zero_bubble:
            lines |= self.weight_grad_inputs(items, chunk_moe, full_layer=full_layer, kept=kept, accumulation=m)
        in_flight = sum(peak) / vpp  # in whole-stage units
        # Recomputing one block in backward rebuilds its full activations for one micro-batch.
        items["recompute_working_set"] = max(
            [
                full_layer + routing
                if recompute == "full"
                else full_layer + routing - kept - routing_kept
                if recompute in ("selective", "per-op")
                else 0.0
            ]
            + [x[3] for x in mtp]
        )
        items["logits"] = self.logits() if stage == pp - 1 else 0.0
        items["lora_activations"] = self.lora_activations(in_flight=sum(peak) / vpp)
        if stage == pp - 1 and vpp > 1 and not chunk_layers[-1] and not self.zero_bubble:
            peak = self.loss_only_chunk(items, weights, accumulation=m)
            in_flight = sum(peak) / vpp
        lines |= _breakdown(
            model,
            items,
            peak=peak,
            chunk_layers=chunk_layers,
            chunk_moe=chunk_moe,
            kept_named=self.kept_named,
            routing=self.size(route_kept),
            listed=route_kept,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
        )
        return _Activations(
            tensors=tensors, kept=kept, in_flight=in_flight, hidden=self.block_input, chunk_moe=chunk_moe, lines=lines
        )

    def lora_activations(self, *, in_flight: float) -> float:
        """What the adapters keep (``lora_cost.block_activations``) on this stage's blocks, ``in_flight`` micro-batches
        of them (whole-stage units); full recompute rebuilds them with the rest of the block."""
        if self.lora is None:
            return 0.0
        kept = 1 - self.recompute_fraction if self.recompute == "full" else 1.0
        per_stage: float = sum(
            n
            * lora_cost.block_activations(
                self.model,
                self.lora,
                moe=is_moe,
                tp=self.tp,
                tokens=self.seq_len * self.micro_batch,
                precision=self.precision,
                sequence_parallel=self.sequence_parallel,
            )
            for n, is_moe in zip(self.lora_blocks(), (False, True))
        )
        return kept * in_flight * per_stage

    def routing_tensors(self) -> list:
        """An MoE block's routing tensors (none in a dense model), the busiest expert rank's."""
        if not self.moe:
            return []
        return routing_tensors(
            self.model,
            tp=self.tp,
            precision=self.precision,
            imbalance=self.imbalance,
            megatron=self.megatron,
            ep=self.ep,
        )

    def chunk_blocks(self) -> tuple[tuple, tuple]:
        """(blocks, MoE blocks) of each model chunk on this stage."""
        model, pp, vpp = self.model, self.pp, self.vpp
        if self.layers is not None:
            chunk_layers = (self.n_layers / vpp,) * vpp
            return chunk_layers, chunk_layers if self.moe else (0,) * vpp
        return stage_chunk_layers(model, pp, vpp)[self.stage], stage_chunk_moe_layers(model, pp, vpp)[self.stage]

    def chunk_weights(self, chunk_layers, chunk_moe, *, kept: float, dense_kept: float, routing: float) -> list:
        """Per chunk, per micro-batch in it: (its blocks' kept tensors with the first chunk's embedding inputs, their
        routing tensors, its output). Every chunk that sends on keeps its output under zero bubble, whose executor
        keeps it until B (not saved by autograd; freed once sent otherwise)."""
        model, s, b, tp = self.model, self.seq_len, self.micro_batch, self.tp
        uses_dropout = model.dropout > 0 if self.dropout is None else self.dropout
        mask_split = tp if self.sequence_parallel else 1  # the embedding is dropped out after its reduce-scatter
        embedded = (
            s * b * (8 + (model.hidden * self.dropout_mask_bytes / mask_split if uses_dropout else 0))
        )  # ids, mask
        last_chunk = self.vpp - 1 if self.stage == self.pp - 1 else self.vpp  # the last virtual stage sends nothing on
        return [
            (
                kept * moe_c + dense_kept * (layers_c - moe_c) + (embedded if self.stage == 0 and c == 0 else 0.0),
                routing * moe_c,
                self.block_input if c < last_chunk else 0.0,
            )
            for c, (layers_c, moe_c) in enumerate(zip(chunk_layers, chunk_moe))
        ]

    def mtp_depths(self, routing_kept: float, routing: float) -> list:
        """(kept, routing kept, -, recompute working set) of each MTP depth on the last stage (``_mtp_depth_bytes``)."""
        model = self.model
        if self.stage < self.pp - 1 or not model.mtp:
            return [(0.0, 0.0, 0.0, 0.0)]
        return [
            _mtp_depth_bytes(
                model,
                self.kept_bytes(model.config.is_moe_layer(model.layers + k - 1)),
                routing_kept,
                routing,
                moe_block=model.config.is_moe_layer(model.layers + k - 1),
                recompute=self.recompute,
                fraction=self.recompute_fraction,
                hidden=self.block_input,
                rows=self.seq_len * self.micro_batch / (self.tp if self.sequence_parallel else 1),
            )
            for k in range(1, model.mtp + 1)
        ]

    def weight_grad_inputs(self, items: dict, chunk_moe, *, full_layer: float, kept: float, accumulation: int) -> dict:
        """Zero bubble's item: per pending W, the gradients B left and what B recomputed (kept by the retained
        graph). Returns its line for the report."""
        model, stage, pp = self.model, self.stage, self.pp
        moe_blocks = sum(chunk_moe) + (
            sum(model.config.is_moe_layer(model.layers + k - 1) for k in range(1, model.mtp + 1))
            if stage == pp - 1
            else 0
        )  # an MTP module's block like the others
        dense_blocks = self.n_layers + (model.mtp if stage == pp - 1 else 0) - moe_blocks
        out: dict[str, Any] = dict(
            tp=self.tp,
            precision=self.precision,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            sequence_parallel=self.sequence_parallel,
        )
        dense_full, dense_kept = self.kept_bytes(False)[1:]
        pending = min(stage + 1, accumulation) if stage > 0 else 0
        experts_out = _matmul_output_bytes(model, moe=True, imbalance=self.imbalance, **out) if self.moe else 0.0
        items["weight_grad_inputs"] = pending * (
            dense_blocks * (_matmul_output_bytes(model, **out) + dense_full - dense_kept)
            + moe_blocks * (experts_out + full_layer - kept)
        )
        if not self.moe:
            return {}
        line = "MoE blocks' matmul outputs (experts at top-k x FFN width)"
        return {"weight_grad_inputs": {line: pending * moe_blocks * experts_out}}

    @property
    def head(self) -> dict:
        """``logits_bytes``' layout arguments."""
        return dict(
            tp=self.tp,
            sequence_parallel=self.sequence_parallel,
            precision=self.precision,
            seq_len=self.seq_len,
            micro_batch=self.micro_batch,
            loss_chunks=self.loss_chunks,
        )

    def logits(self) -> float:
        """The last stage's main head's, and each MTP depth's head and loss (saved until backward; the transient
        logits of one head at a time), less what full recompute rebuilds: depth k's final norm."""
        model, s, b, head = self.model, self.seq_len, self.micro_batch, self.head
        norm = s * b * (2 * self.p * model.hidden + 4) / (self.tp if self.sequence_parallel else 1)  # RMSNorm (llama)
        if self.lora is not None and self.loss_chunks == 1:  # a frozen head and final norm: no weight gradients,
            # so neither keeps its normalised input (RMSNorm's, or the head's input: one copy each)
            frozen = self.seq_len * self.micro_batch * self.p * model.hidden
            frozen *= 1 if model.family == "gpt2" else 1 + 1 / (self.tp if self.sequence_parallel else 1)
            return logits_bytes(model, **head) - frozen
        return logits_bytes(model, **head) + model.mtp * (
            logits_bytes(model, transient=False, **head)
            - (self.recompute_fraction * norm if self.recompute == "full" else 0)
        )

    def loss_only_chunk(self, items: dict, weights: list, *, accumulation: int) -> tuple:
        """The moment a loss-only last chunk (Megatron's "L" stage) peaks at, its items set. It holds the logits only
        while a micro-batch is in it, not when the chunks before it hold the most: the stage peaks at the larger of
        the two moments. The activations item stays at least the saved tensors' peak (what --verify-memory counts):
        the total may then exceed the loss's moment by up to its transient logits."""
        model, head = self.model, self.head
        states = in_flight_chunks(pp=self.pp, stage=self.stage, accumulation=accumulation, vpp=self.vpp)
        blocks = {live: sum(n * w for n, (w, _, _) in zip(live, weights)) for live in states}
        held = max(states, key=lambda live: blocks[live] + items["logits"] * (live[-1] > 0))
        kept_logits = items["logits"] - logits_bytes(model, **head) + logits_bytes(model, transient=False, **head)
        items["activations"] = max(blocks[held], max(blocks.values()) - kept_logits) if held[-1] else blocks[held]
        items["moe_routing"] = sum(n * r for n, (_, r, _) in zip(held, weights))
        items["logits"] *= held[-1] > 0
        return held

    # ---- buffers -----------------------------------------------------------------------

    def comm_buffers(self, psi: float, act: _Activations) -> float:
        """DeepSpeed's reduce and all-gather buckets, the pipeline's receive buffers, ring attention's K/V blocks and
        the MoE all-to-all's buffers (the latter's line into ``act.lines``)."""
        p, pp, buckets, zero_stage, dp = self.p, self.pp, self.buckets, self.zero_stage, self.state_dp
        if dp > 1 or zero_stage >= 1:
            if zero_stage == 0:
                comm = p * min(buckets.reduce_bucket, psi)
            elif zero_stage in (1, 2):
                # With contiguous gradients DeepSpeed allocates whole reduce buckets up front, however small
                # the model (stage_1_and_2.setup_buckets): two with overlap_comm, which emit.py sets without PP.
                comm = (2 if pp == 1 else 1) * p * buckets.reduce_bucket + p * min(buckets.allgather_bucket, psi / dp)
            else:
                comm = p * min(buckets.reduce_bucket, psi)
        else:
            comm = 0.0
        if pp > 1:  # the receive buffer posted for the next micro-batch's activation or gradient
            comm += act.hidden
        if pp > 1 and self.stage < pp - 1:  # the gradient received for the micro-batch in backward, held until it ends
            comm += act.hidden
        if self.cp > 1:  # ring attention: the K/V block in use and the one arriving
            comm += (
                2
                * 2
                * p
                * self.seq_len
                * self.micro_batch
                * self.model.kv_heads_per_rank(self.tp)
                * self.model.head_dim
            )
        if self.moe and self.ep > 1:  # an all-to-all's send and receive buffers: top-k copies of the rank's tokens
            buffers = dispatch_buffers(
                self.model, tp=self.tp, precision=self.precision, imbalance=self.imbalance, ep=self.ep
            )
            a2a = self.size(buffers[1])
            comm += a2a
            act.lines["comm_buffers"] = {"MoE all-to-all send and receive buffers": a2a}
        return comm

    def zero3_gather(self, psi_experts: float, chunk_moe) -> float:
        """ZeRO-3's full (TP-sharded) parameters of the layer in use plus the prefetched one."""
        if self.zero_stage != 3:
            return 0.0
        sharded, replicated = self.model.layer_params(self.tp)
        sharded += psi_experts / max(sum(chunk_moe), 1)  # with this rank's experts, gathered over EDP
        live = min(self.buckets.stage3_max_live, 2 * (sharded + replicated) + self.buckets.stage3_prefetch)
        return self.p * live


def _breakdown(
    model: ModelSpec,
    items: dict,
    *,
    peak,
    chunk_layers,
    chunk_moe,
    kept_named,
    routing: float,
    listed: list,
    seq_len: int,
    micro_batch: int,
) -> dict:
    """Lines inside items, for ``megakit plan``: ``moe_routing`` by ``ROUTING_GROUPS`` (each group's share of a block's
    routing tensors), and of ``activations`` the MoE blocks' shared experts, MLA's latents and the attention output's
    second copy (CP, sinks), over the blocks in flight (the MTP modules' left out)."""
    out = {}
    if routing and items["moe_routing"]:
        groups = {
            name: sum(x.bytes(seq_len=seq_len, micro_batch=micro_batch) for x in listed if x.name in names)
            for name, names in ROUTING_GROUPS.items()
        }
        out["moe_routing"] = {name: items["moe_routing"] * v / routing for name, v in groups.items() if v}
    moe_blocks = sum(n * c for n, c in zip(peak, chunk_moe))
    blocks = sum(n * c for n, c in zip(peak, chunk_layers))
    latents = tuple(x.name for x in latent_tensors(model)) + ("q_proj input (gathered)",) if model.config.mla else ()
    lines = {
        "shared experts (MoE blocks)": moe_blocks * kept_named(True, SHARED_EXPERT) if model.config.moe else 0.0,
        "MLA latents": (moe_blocks * kept_named(True, latents) + (blocks - moe_blocks) * kept_named(False, latents)),
        "attention output kept twice (CP, sinks)": (
            moe_blocks * kept_named(True, ("ring attention output",))
            + (blocks - moe_blocks) * kept_named(False, ("ring attention output",))
        ),
    }
    if any(lines.values()):
        out["activations"] = {k: v for k, v in lines.items() if v}
    return out


def _mtp_depth_bytes(
    model: ModelSpec,
    block: tuple,
    routing_kept: float,
    routing: float,
    *,
    moe_block: bool,
    recompute: str,
    fraction: float,
    hidden: float,
    rows: float,
) -> tuple[float, float, float, float]:
    """(kept, routing kept, -, recompute working set) bytes of one MTP depth for one micro-batch, beside its head
    (``megakit.nn.mtp.PredictionModule``). ``block``: ``kept_bytes`` of its block, at the stage's recompute like the
    others. Before the block, ahead of ``eh_proj``: the looked-up embedding (enorm's input; the previous depth's
    normed state, hnorm's input, is the head's input, already kept), the two normed halves with their fp32 rstd and
    their concatenation, ``eh_proj``'s 2H-wide input; ``eh_proj``'s output is the block's input. ``hidden``: one
    ``(S', B, H)`` tensor; ``rows``: its rows. Full recompute checkpoints the whole module: kept is the embedding."""
    _, full, kept = block
    inputs = hidden + 2 * (hidden + 4 * rows) + 2 * hidden  # Emb, enorm and hnorm outputs (+ rstd), the concat
    route = routing_kept if moe_block else 0.0
    if recompute == "full":  # ``kept`` already counts the embedding as the checkpoint's input (the block input)
        return kept + (1 - fraction) * inputs, route, 0.0, full + inputs + (routing if moe_block else 0.0)
    return kept + inputs, route, 0.0, full - kept if recompute in ("selective", "per-op") else 0.0


def _matmul_output_bytes(
    model: ModelSpec,
    *,
    tp: int,
    precision: str,
    seq_len: int,
    micro_batch: int,
    sequence_parallel: bool = False,
    moe: bool = False,
    imbalance: float = 1.0,
) -> float:
    """One block's matmul outputs on a TP rank (q, k, v, attention out, MLP in and out): the gradients W reads.
    MLA's at its projections' own widths and rows (``MLAConfig.projections``: the latents over the rank's tokens).
    An MoE block's (``moe``) over the rank's 1/TP of the tokens: the fp32 router logits, the shared experts' gate, up
    and down, and the routed experts' fc1 (2F) and fc2 (H) for each of the top-k copies that the rank's experts
    compute (``imbalance`` x the balanced share)."""
    c = model.config
    q, kv, f = c.heads // tp * c.head_dim, c.kv_heads_per_rank(tp) * c.head_dim, c.ffn // tp
    attention = (
        sum(rows * n for _, rows, _, n in c.mla.projections(c.hidden, c.heads, tp, sequence_parallel=sequence_parallel))
        if c.mla
        else q + 2 * kv + c.hidden
    )
    p = PRECISIONS[precision]
    if moe and c.moe is not None:
        fc1 = c.moe.matrices - 1  # gate and up, or up (relu2)
        shared = (fc1 * c.moe.shared_ffn + c.hidden) if c.moe.shared_ffn else 0
        routed = c.moe.top_k * imbalance * (fc1 * c.moe.ffn + c.hidden)
        mlp = (shared + routed) / tp + 4 / p * c.moe.experts / tp
    else:
        mlp = (2 if c.gated_mlp else 1) * f + c.hidden
    return p * seq_len * micro_batch * (attention + mlp)


def peak_memory(model: ModelSpec, **layout) -> MemoryEstimate:
    """The stage with the largest total, over every distinct stage of the trainer's split.

    Stages differ by their blocks (how many in each chunk, and which of them are MoE blocks: a model's
    first dense blocks keep far less than its MoE blocks), the embedding (first), the head and logits
    (last) and the micro-batches in flight, which only fall along the pipeline; so among middle stages
    with the same blocks the earliest dominates, and only it is evaluated (the search stays fast)."""
    pp, vpp = layout.get("pp", 1), layout.get("vpp", 1)
    stages = {0, pp - 1}
    if layout.get("layers") is None:
        chunks, moe_chunks = stage_chunk_layers(model, pp, vpp), stage_chunk_moe_layers(model, pp, vpp)
        first_with: dict[tuple, int] = {}
        for stage in range(1, pp - 1):
            first_with.setdefault((chunks[stage], moe_chunks[stage]), stage)
        stages |= set(first_with.values())
    best = None
    for stage in sorted(stages):
        est = estimate_memory(model, stage=stage, **layout)
        if best is None or est.total > best.total:
            best = est
    assert best is not None  # stages holds stage 0 at least
    return best
