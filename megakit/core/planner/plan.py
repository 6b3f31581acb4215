"""Plan: one point of the search space (a parallel layout plus the knobs that change memory and speed)."""

from __future__ import annotations

import dataclasses

from megakit.core.lora import LoraSpec

# The routing regimes an MoE plan is priced in: the busiest expert rank's tokens over the balanced share.
# "balanced" is what most published MoE throughput forces (Megatron-Bridge docs/performance-summary.md:
# "we force-balance the token distribution among experts"; torchtitan's --debug.moe_force_load_balance).
# "real" is dropless training with a load-balancing loss, which Megatron measured costing 3 % for
# Mixtral-8x22B (Megatron-MoE-ModelZoo best_practice/Mixtral: 455 TFLOP/s dropless, 470 at capacity 1.0)
# and 9-25 % for the fine-grained Qwen3-235B (best_practice/Qwen3: forced balance vs dropless, 16K-128K
# tokens): 1.1 on the expert side puts the planner between the two (tests/core/planner/test_planner_moe.py), so it
# under-prices imbalance for many small experts and over-prices it for a few large ones. Default: real.
ROUTING = {"balanced": 1.0, "real": 1.1}
FP8_RECIPES = ("none", "tensorwise", "rowwise")  # torchao float8 scaling (train.py --fp8)
# Transformer Engine's block-scaled recipes, priced for Megatron's runtimes only (megakit's trainer runs torchao's):
# DeepSeek-V3's 1 x 128 / 128 x 128 scales (Hopper) and MXFP8's 1 x 32 (Blackwell's tensor cores apply them).
FP8_TE_RECIPES = ("blockwise", "mxfp8")
# Whose trainer runs the plan (megakit plan --runtime), as Plan fields: megakit's (DeepSpeed, the default),
# Megatron-LM's, PyTorch FSDP's ZeRO-3, or DeepSpeed's ZeRO-3 of 2021 (Narayanan et al. 2021, Table 2).
RUNTIMES = {
    "megakit": {},
    "megatron": {"megatron": True},
    "megatron-core": {"megatron": True, "comm_overlap": True},
    "fsdp": {"zero3": "fsdp"},
    "deepspeed-2021": {"zero3": "deepspeed-2021"},
}


def pipeline_runs_zero(zero: int, *, pp: int, vpp: int = 1, zero_bubble: bool = False, offload: str = "none") -> bool:
    """Whether megakit's pipeline runs ZeRO ``zero`` at PP ``pp``: ZeRO 0-1 always; 3 with one chunk per stage, no zero
    bubble and no offload (``megakit.train.engine.zero3_pipeline``); 2 only without a pipeline."""
    if pp == 1 or zero <= 1:
        return True
    return zero == 3 and vpp == 1 and not zero_bubble and offload == "none"


def optimizer_runs_zero(zero: int, *, optimizer: str, precision: str, offload: str = "none") -> bool:
    """Whether megakit's trainer runs ``optimizer`` at ZeRO ``zero``: AdamW at every stage; Muon
    (``megakit.train.engine.muon.check_muon``) at 1 and 2, at 0 in fp32 only (DeepSpeed's bf16 and fp16 optimizers
    step flat copies without ZeRO's layout), never at 3 (each weight partitioned over DP) nor offloaded."""
    if optimizer != "muon":
        return True
    return offload == "none" and (zero in (1, 2) or (zero == 0 and precision == "fp32"))


def megatron_fp32_grads(precision: str) -> bool:
    """Whether Megatron-LM keeps and reduces fp32 gradients (main-grad buffers) for this training precision: under bf16
    only, where its arguments.py forces --accumulate-allreduce-grads-in-fp32; under fp16 they stay fp16 until the
    step."""
    return precision == "bf16"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """TP × CP × PP × DP with ZeRO, micro-batching and recomputation.

    ``accumulation`` is the number of micro-batches per optimizer step per DP rank, so the
    global batch is ``micro_batch × accumulation × dp`` sequences; with PP > 1 these
    micro-batches are what the 1F1B pipeline streams. ``cp``: context parallelism, each
    sequence split over CP ranks (ring attention); they hold the same weights, so ZeRO shards
    and gradients reduce over DP × CP."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    vpp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    accumulation: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    precision: str = "bf16"
    offload: str = "none"
    flash_attention: bool = True
    zero_bubble: bool = False  # ZB-H1 (--schedule zb-h1): each backward split into B and W, the W's deferred
    # How the run executes, beyond the layout (defaults: megakit's trainer). The calibration rows set
    # them to what each published run did.
    recompute_fraction: float = 1.0  # full recompute on this share of the blocks (HF/FSDP: every n-th block)
    fused_kernels: bool = False  # elementwise ops fused (torch.compile, Megatron's kernels), not eager PyTorch
    fp8: str = "none"  # FP8 GEMMs in the blocks' linears and experts: FP8_RECIPES (torchao), FP8_TE_RECIPES (Megatron)
    # Megatron-LM's trainer rather than megakit's (``memory.estimate_memory(megatron=True)``): gradients
    # accumulated in fp32 main-grad buffers. (Both free a stage's output once sent, and keep each
    # column-parallel input split under SP and overlap its backward: ``column_overlap``.)
    megatron: bool = False
    # Megatron-Core's communication overlap (2023-; its README's scaling runs): --tp-comm-overlap pipelines every TP
    # all-gather and reduce-scatter with its GEMM, and the distributed optimizer's --overlap-grad-reduce and
    # --overlap-param-gather reduce-scatter gradients behind the last backward and gather the weights behind the
    # next step's first forward (``sharding.dp_time``).
    comm_overlap: bool = False
    dp_shard: int = 0  # ZeRO-3/FSDP shard group (HSDP: shard inside it, replicate across); 0: all of DP
    zero3: str = "deepspeed"  # who runs ZeRO-3 (sharding.ZERO3): DeepSpeed today, FSDP, or DeepSpeed of 2021
    reduce_precision: str = ""  # dtype of the gradient reduction ('fp32' in FSDP2's default policy); '': training's
    compress: str = "none"  # megakit's DP gradient compression (--compress; ZeRO 0): core.compression prices it
    # Mixture of Experts: the experts sharded over EP consecutive ranks of a stage's TP x CP x DP (the trainer's
    # folding, ``core.layout``; Megatron-Core's with ETP = 1), replicated over the EDP = TP x CP x DP / EP ranks
    # left; ``moe_imbalance``: tokens the busiest expert rank gets over the balanced share (1.0: forced-balanced
    # routing, as most published runs).
    cp_mode: str = "ring"  # how CP ranks attend: "ring" (K/V blocks passed on), "a2a" (Ulysses, heads over CP) or
    # "hybrid" (an all-to-all inside groups of ``cp_a2a`` consecutive CP ranks, a ring across them: USP)
    cp_a2a: int = 0
    ep: int = 1
    moe_imbalance: float = 1.0
    # How tokens reach their experts: "alltoall" sends a copy per chosen expert (megakit's dispatcher, Megatron's
    # alltoall); "deepep" a copy per node, fanned out over NVLink there (DeepEP, HybridEP: Megatron's flex
    # dispatcher; ``sharding.node_deduplicated_all_to_all_time``). Megatron's 1F1B A2A overlap
    # (--overlap-moe-expert-parallel-comm) is not priced: tests/data/moe-runs.json lists what it measured.
    dispatcher: str = "alltoall"
    loss_chunks: int = 1  # the LM head and loss over K token chunks (--loss-chunks; 0: the trainer's auto rule)
    # Megatron-Core's selective recompute modules (--recompute-modules; ``memory.MEGATRON_RECOMPUTE``), with
    # recompute="selective" and a Megatron runtime; (): its default, the attention core.
    recompute_modules: tuple[str, ...] = ()
    moments: str = "fp32"  # Adam's m and v (--adam-moments bf16: Megatron's precision-aware optimizer)
    lora: LoraSpec | None = (
        None  # LoRA fine-tuning (--lora-rank): the base frozen, adapters trained (planner.lora_cost)
    )
    optimizer: str = "adamw"  # --optimizer muon: Muon for the hidden matrices, AdamW for the rest (planner.muon)

    @property
    def fused(self) -> bool:
        """Whether the elementwise ops run fused: as asked (``fused_kernels``), but megakit's trainer compiles no
        block under DeepSpeed's ZeRO 3, whose gathering hooks a compiled block cannot hold (``nn.compile``)."""
        return self.fused_kernels and not (self.zero_stage == 3 and self.zero3 == "deepspeed" and not self.megatron)

    @property
    def column_overlap(self) -> bool:
        """Whether the column-parallel linears keep their input split under SP (all-gathered again in
        backward) and hide the backward's TP exchange behind the weight-gradient GEMMs: Megatron-LM's
        (Korthikanti et al. 2022) and megakit's (``megakit.nn.tensor_parallel.overlapped_linear``) do; torchtitan's
        (the FSDP runtime) keep the gathered input and exchange after the GEMMs."""
        return self.zero3 != "fsdp"

    @property
    def grad_reduce_precision(self) -> str:
        """The dtype data parallelism reduces gradients in: as pinned (``reduce_precision``), else fp32 where
        Megatron's trainer keeps fp32 main grads (reduced as they are kept, unless --grad-reduce-in-bf16), else
        training's."""
        if self.reduce_precision:
            return self.reduce_precision
        return "fp32" if self.megatron and megatron_fp32_grads(self.precision) else self.precision

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: the replicas of one expert shard, EP ranks apart (EP x EDP = TP x CP x DP)."""
        return self.tp * self.dp * self.cp // self.ep

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp

    def memory_kwargs(self) -> dict:
        """The keyword arguments of ``memory.estimate_memory`` for this plan."""
        return dict(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            zero_stage=self.zero_stage,
            micro_batch=self.micro_batch,
            accumulation=self.accumulation,
            recompute=self.recompute,
            sequence_parallel=self.sequence_parallel,
            vpp=self.vpp,
            precision=self.precision,
            offload=self.offload,
            flash_attention=self.flash_attention,
            recompute_fraction=self.recompute_fraction,
            dp_shard=self.dp_shard,
            gathered_inputs=not self.column_overlap,
            megatron=self.megatron,
            zero_bubble=self.zero_bubble,
            ep=self.ep,
            moe_imbalance=self.moe_imbalance,
            loss_chunks=self.loss_chunks,
            cp_ring=self.a2a_degree < self.cp,
            recompute_modules=self.recompute_modules if self.recompute == "selective" else (),
            main_grads_fp32=self.megatron and self.grad_reduce_precision == "fp32",
            moments=self.moments,
            lora=self.lora,
            optimizer=self.optimizer,
        )

    @property
    def a2a_degree(self) -> int:
        """The CP ranks of one all-to-all: 1 for the ring, CP for Ulysses, ``cp_a2a`` for hybrid."""
        return {"ring": 1, "a2a": self.cp, "hybrid": self.cp_a2a}[self.cp_mode] if self.cp > 1 else 1

    @property
    def cp_label(self) -> str:
        """``CP=8(ring)``, ``CP=8(a2a)``, ``CP=8(a2a 2 x ring 4)``."""
        ring = self.cp // max(self.cp_a2a, 1)
        mode = {"ring": "(ring)", "a2a": "(a2a)", "hybrid": f"(a2a {self.cp_a2a} x ring {ring})"}
        return f"CP={self.cp}{mode[self.cp_mode]}"

    @property
    def shard_group(self) -> int:
        """Ranks ZeRO-3 shards the model states over: all of DP, or HSDP's shard group."""
        return self.dp_shard if 0 < self.dp_shard < self.dp else self.dp

    def describe(self) -> str:
        """The plan in one line (``TP=2 PP=4 DP=8 ...``), as the report and the rejection list print it."""
        parts = [f"TP={self.tp}"] + ([self.cp_label] if self.cp > 1 else []) + [f"PP={self.pp}", f"DP={self.dp}"]
        if self.ep > 1:
            parts.append(f"EP={self.ep}")
        if self.vpp > 1:
            parts.append(f"VPP={self.vpp}")
        if self.zero_bubble:
            parts.append("ZB-H1")
        parts.append(f"ZeRO-{self.zero_stage}")
        parts.append(f"mb={self.micro_batch}x{self.accumulation}")
        parts.append(f"recompute={self.recompute}")
        if self.recompute == "selective" and self.recompute_modules:
            parts[-1] += f"({','.join(self.recompute_modules)})"
        if self.recompute_fraction < 1 and self.recompute == "full":
            parts[-1] += f" ({self.recompute_fraction:.0%} of blocks)"
        if 0 < self.dp_shard < self.dp:
            parts.append(f"HSDP shard={self.dp_shard}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        if self.lora is not None:
            parts.append(f"LoRA r={self.lora.rank}")
        if self.optimizer != "adamw":
            parts.append(self.optimizer.capitalize())
        return " ".join(parts)
