"""Compute time of one transformer block and of the LM head on one GPU, from the shapes it runs.

Each GEMM of the block (q, k, v, o, the MLP's two or three matrices, at their TP-sharded sizes over
the micro-batch's tokens) costs its FLOPs at the GPU's best matmul rate (``GPU.matmul_fraction`` of
the datasheet peak, measured by MAMF, times ``IN_TRAINING``) plus the HBM traffic its arithmetic
intensity implies, not overlapped: ``time = FLOPs / rate × (1 + ROOFLINE · ridge / intensity)``, with the
GPU's ridge point ``rate / HBM bandwidth``. So an H100, whose ridge is twice an A100's, needs twice as large
a GEMM to get as close to its peak, and a thin TP-sharded GEMM is slower everywhere. (The sum, not a smooth
maximum, is what the calibration rows were fitted with; it is harshest on thin GEMMs of micro-batch 1 at TP 8,
where Megatron-Core's H100 runs come out 7-13 % slow: tests/core/planner/test_planner_mcore.py.)

Under LoRA (``plan.lora``) the base is frozen: its GEMMs run forward and input-gradient only (no weight-gradient
GEMM, 2 of the 3), and each adapter adds its two thin GEMMs three times (``lora_gemm_time``); the head likewise.

Fused (flash) attention runs at ``GPU.attention_fraction`` of the peak (FlashAttention-2's causal rate at
long sequences) scaled by ``s / (s + ATTENTION_SEQ_HALF)``: a causal kernel computes the diagonal tiles
whole and short sequences fill fewer waves of tiles. The causal mask halves its FLOPs; its backward is
2.5 × the forward (it recomputes the scores), at the same rate: the published curves are forward + backward.
Sliding-window blocks attend to ``w - w(w - 1)/(2s)`` keys a query (``ModelConfig.attention_context``), so a typical
block's attention is the model's mean share of the causal work (``attention_share``: about half for Gemma 3's 5:1).
Under context parallelism the kernel runs on what one call sees (``cp_kernel_seq``): the whole sequence after
Ulysses' all-to-all, but a ring's chunk pairs of ``S / (2 ring)`` tokens, so a long ring of short chunks runs
further from the peak than Ulysses at the same CP (the per-block kernel time the ring pays).
Written-out attention (no flash) is two batched GEMMs over the full ``s × s``.

The elementwise kernels (norms, activations, rotary, residuals, dropout, softmax) are memory-bound:
``K_MEM`` (eager PyTorch) or ``K_MEM_FUSED`` (torch.compile, Megatron's fused kernels) passes over
the block's saved activations through HBM. Recompute adds the forward part of what it recomputes.

An MoE block (``moe=True``) runs, in place of the MLP, its shared experts (TP-sharded, like the MLP),
the router and, on each rank, the grouped GEMMs of its E / EP experts over the tokens they receive:
top-k copies of the rank's 1/TP share of the tokens, spread over the experts, ``imbalance`` times the
balanced count on the busiest rank. Each expert's GEMM is priced from its own shape (tokens per expert
x H x F), so fine-grained experts with few tokens each run further from the peak: the grouped GEMM's
efficiency follows from the per-expert token count, with no separate constant.

FP8 (``Plan.fp8``, torchao's Float8Linear): each of the block's linears runs its three GEMMs (forward,
input and weight gradient) on the FP8 tensor cores (``GPU.fp8_tflops``, at the same MAMF fraction and
roofline as bf16, with 1-byte operands) at ``FP8_GEMM[recipe]`` of that rate, after scaling and casting its
operands: ``FP8_CAST_BYTES[recipe]`` of HBM traffic per element of input, weight and output gradient, three
times as much without torch.compile to fuse amax, scale and cast. A linear takes FP8 only where that is faster than
bf16, as a shape filter does (small GEMMs get slower); attention, the LM head and the norms stay in bf16.

The host issues the kernels: ``LAUNCH_S`` per block and micro-batch in eager PyTorch (Python, autograd
and launch per op), less fused. CUDA runs them asynchronously, so a block takes the smooth maximum
of the GPU's time and the host's, and small models on fast GPUs are host-bound (``BlockTime.cpu``).
"""

from __future__ import annotations

import dataclasses

from megakit.core.planner import lora_cost, mamba
from megakit.core.planner.hardware import GPU
from megakit.core.planner.memory import PRECISIONS, activation_tensors, routed_imbalance, routing_tensors
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan

IN_TRAINING = 0.845  # a GEMM inside a training step vs the same GEMM alone (MAMF): clocks, caches, gaps
ROOFLINE = 2.9  # HBM bytes a GEMM moves, in multiples of reading A, B and writing C once (tiles re-read)
# Sequence length at which causal flash attention reaches half its best rate. FlashAttention-2's own forward +
# backward benchmark, causal, head dim 128 (Dao-AILab/flash-attention assets/flash2_{a100,h100}_fwd_bwd_benchmark.png
# @0251105, panel d; tests/data/long-sequence-runs.json "kernel"): A100 99, 133, 155, 173, 182, 189 TFLOP/s and
# H100 163, 221, 265, 294, 308, 328 at 512 ... 16k lie on R·s/(s + s0) with s0 = 495 and 553 (R = 195 and 339):
# 512 for both (the old 128 put A100 at 162 TFLOP/s at 512 and H100 at 277, 64 % and 70 % above the figures).
ATTENTION_SEQ_HALF = 512
K_MEM = 13.5  # HBM passes over the saved activations of eager elementwise kernels (forward + backward)
K_MEM_FUSED = 0.5  # the same, fused (torch.compile, Megatron's bias-GeLU / bias-dropout-add / softmax)
LAUNCH_S = 2e-4  # host time per block and micro-batch (forward + backward): ~50 kernel launches x 4 us
# FP8 (torchao Float8Linear, dynamic scaling): the GEMM's rate over the bf16 GEMM's fraction of its own peak,
# and the HBM bytes that scaling costs per element of the three tensors a linear casts (input, weight and
# output gradient: amax, scale, cast, and the transposed copy each GEMM layout needs). Tensorwise from
# torchao's H100 microbenchmark of a compiled linear (float8/README.md @0cf1281: 0.80x at M,K,N = 1024,2048,1024,
# 1.39x at 4096,8192,16384; these give 0.83x and 1.35x); rowwise (a scale per row, CUTLASS's slower GEMM,
# the transposes re-scaled) from torchao's Llama-3-8B table (+10 %; tests/data/fp8-runs.json).
# Megatron-Core's recipes (Transformer Engine, ``Plan.megatron``): "tensorwise" is its current scaling (FP8-CS),
# "blockwise" DeepSeek-V3's 1 x 128 activation and 128 x 128 weight scales (Hopper: a scale per K-block, promoted
# to FP32 in the main loop, as rowwise's per-row scale costs), "mxfp8" Blackwell's 1 x 32 scales, which its tensor
# cores apply in hardware (the tensorwise rate).
FP8_GEMM = {"tensorwise": 1.0, "rowwise": 0.9, "blockwise": 0.9, "mxfp8": 1.0}
FP8_CAST_BYTES = {"tensorwise": 21.0, "rowwise": 21.0, "blockwise": 21.0, "mxfp8": 21.0}
# Transformer Engine casts in fused kernels (the norm's output, cast-transpose, the scale's amax in the same pass):
# read bf16 once for the amax and once to cast (2 + 2), write the FP8 copy and its transpose (1 + 1). And it keeps a
# weight's FP8 copy (and its transpose) for every micro-batch of a step (``is_first_microbatch``; with
# --fp8-param-gather the weights are gathered in FP8), so a weight is cast once per optimizer step, not per
# micro-batch as torchao's Float8Linear does.
FP8_CAST_BYTES_TE = 6.0
LAUNCH_FUSED = 0.4  # compiled blocks launch fewer, larger kernels (the GEMMs and attention stay; ~20 of ~50)
FP8_CAST_EAGER = 3.0  # amax, scale and cast as separate kernels without torch.compile


@dataclasses.dataclass(frozen=True)
class BlockTime:
    """Seconds of one block for one micro-batch on one GPU, without TP communication."""

    forward: float
    backward: float  # including what recompute runs again
    cpu: float  # the host's time to issue both
    weight_grad: float = 0.0  # the backward's weight-gradient GEMMs (what Megatron's async TP comm hides behind)

    @property
    def total(self) -> float:
        return self.forward + self.backward


def gemm_time(gpu: GPU, m: float, k: float, n: float, *, peak: float, nbytes: int) -> float:
    """One ``(m × k) @ (k × n)`` GEMM: FLOPs at the matmul rate plus the traffic its intensity leaves exposed."""
    rate = peak * gpu.matmul_fraction * IN_TRAINING
    intensity = 2 / nbytes / (1 / m + 1 / k + 1 / n)  # FLOPs per HBM byte, each operand moved once
    ridge = rate / (gpu.hbm_gbps * 1e9)
    return 2 * m * k * n / rate * (1 + ROOFLINE * ridge / intensity)


def linear_time(gpu: GPU, plan: Plan, m: float, k: float, n: float, *, peak: float) -> float:
    """A third of the forward + backward seconds of one ``(m x k) @ (k x n)`` linear of a block (its three
    GEMMs), in bf16 or, with ``plan.fp8``, on the FP8 tensor cores where that is faster, as a shape filter picks."""
    nbytes = PRECISIONS[plan.precision]
    dense = gemm_time(gpu, m, k, n, peak=peak, nbytes=nbytes)
    if plan.fp8 == "none" or not gpu.fp8_tflops:
        return dense
    if plan.megatron:  # Transformer Engine: fused casts, the weight's cast once a step
        cast = FP8_CAST_BYTES_TE * (m * k + k * n / plan.accumulation + m * n) / (gpu.hbm_gbps * 1e9)
    else:  # torchao: under FSDP2 a tensorwise weight is cast on its shard, then gathered in FP8
        weight = k * n / (plan.shard_group if plan.zero_stage == 3 and plan.fp8 == "tensorwise" else 1)
        cast = FP8_CAST_BYTES[plan.fp8] * (m * k + weight + m * n) / (gpu.hbm_gbps * 1e9)
        cast *= 1 if plan.fused else FP8_CAST_EAGER
    fp8 = gemm_time(gpu, m, k, n, peak=gpu.fp8_tflops * 1e12, nbytes=1) / FP8_GEMM[plan.fp8] + cast / 3
    return min(dense, fp8)


def _linears(
    model: ModelSpec, tp: int, moe: bool = False, *, sequence_parallel: bool = False
) -> list[tuple[float, float, float]]:
    """(rows, k, n) of the block's weight GEMMs on one TP rank, in execution order, ``rows`` the share of the rank's
    tokens each runs over (an MoE block: attention and the shared experts; ``expert_gemm_time`` adds the rest).
    MLA's projections at their own shapes (``MLAConfig.projections``: latents whole, up-projections by heads), not
    q, k, v and o at the query width, which for DeepSeek-V3 would be 3.8x its attention weights."""
    if model.config.layer_pattern:  # a hybrid's mean block: each part's GEMMs over its share of the tokens
        return mamba.linears(model, tp)
    h, hd = model.hidden, model.head_dim
    q, kv = model.heads // tp * hd, model.kv_heads_per_rank(tp) * hd
    f = (model.moe.shared_ffn if moe else model.ffn) // tp
    mlp = [] if f == 0 else [(h, f), (h, f), (f, h)] if model.gated_mlp else [(h, f), (f, h)]
    mla = model.config.mla
    attention = (
        [(rows, k, n) for _, rows, k, n in mla.projections(h, model.heads, tp, sequence_parallel=sequence_parallel)]
        if mla
        else [(1.0, h, q), (1.0, h, kv), (1.0, h, kv), (1.0, q, h)]
    )
    return attention + [(1.0, k, n) for k, n in mlp]


def expert_gemm_time(model: ModelSpec, gpu: GPU, plan: Plan, *, tokens: float, peak: float) -> float:
    """Forward seconds of an MoE block's router and routed experts on one rank: ``tokens`` (this
    rank's, before the TP split) routed, and the grouped GEMMs (fc1: H -> 2F, or F non-gated; fc2: F -> H) of the
    E / EP local experts, each over its share of the top-k copies the rank receives, in FP8 with ``plan.fp8``
    (the experts are most of an MoE's linears: Megatron's and torchao's FP8 recipes quantize the grouped GEMMs)."""
    m, nbytes = model.moe, PRECISIONS[plan.precision]
    local = tokens / plan.tp  # each TP rank routes its 1/TP of the tokens (sequence-parallel split)
    router = gemm_time(gpu, local, model.hidden, m.experts, peak=peak, nbytes=nbytes)
    per_expert = local * m.top_k * routed_imbalance(model, plan.moe_imbalance, plan.ep) * plan.ep / m.experts
    one = (
        linear_time(gpu, plan, per_expert, model.hidden, (m.matrices - 1) * m.ffn, peak=peak)  # FP8 too
        + linear_time(gpu, plan, per_expert, m.ffn, model.hidden, peak=peak)
    )
    return router + one * m.experts / plan.ep


def cp_kernel_seq(plan: Plan, seq_len: int) -> int:
    """The tokens one fused attention call sees under ``plan``'s CP: a ring's chunk pairs, ``S / (2 x ring)`` for
    a ring of ``CP / a2a degree`` ranks, else (Ulysses, no CP) the whole sequence."""
    ring = plan.cp // plan.a2a_degree
    return seq_len // (2 * ring) if ring > 1 else seq_len


def attention_time(
    model: ModelSpec,
    gpu: GPU,
    *,
    tp: int,
    seq_len: int,
    micro_batch: int,
    flash: bool,
    peak: float,
    nbytes: int,
    kernel_seq: int | None = None,
) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core (scores, softmax, values) of one block; ``kernel_seq``:
    the tokens each kernel call sees, when the ring cuts the sequence into chunk pairs (``cp_kernel_seq``)."""
    s, b = seq_len, micro_batch
    heads = model.heads // tp
    if flash and gpu.attention_fraction > 0:
        # causal: the kernel skips masked tiles; windows (sliding blocks) skip more: the blocks' mean share
        fwd_flops = 4 * b * s * s * heads * model.head_dim / 2 * model.config.attention_share(s)
        k = s if kernel_seq is None else kernel_seq
        rate = peak * gpu.attention_fraction * k / (k + ATTENTION_SEQ_HALF)
        return fwd_flops / rate, 2.5 * fwd_flops / rate
    one = gemm_time(gpu, s, model.head_dim, s, peak=peak, nbytes=nbytes) * b * heads
    one *= model.config.attention_share(s) if model.config.layer_pattern else 1.0  # a hybrid: its attention blocks
    return 2 * one, 4 * one  # q k^T and p v, full s x s; backward twice each


def block_time(model: ModelSpec, gpu: GPU, plan: Plan, *, seq_len: int, peak: float, moe: bool = False) -> BlockTime:
    """One block (``moe``: an MoE block), one micro-batch: GEMMs, attention core, elementwise traffic,
    launches, recompute.

    With context parallelism a rank runs everything on its ``s/cp`` tokens, and attention on its
    queries against the whole sequence: ``1/cp`` of the causal attention (the load-balanced split)."""
    t, b, s = plan.tp, plan.micro_batch, seq_len // plan.cp
    nbytes = PRECISIONS[plan.precision]
    tokens = b * s
    per_gemm = [
        linear_time(gpu, plan, rows * tokens, k, n, peak=peak)
        for rows, k, n in _linears(model, t, moe, sequence_parallel=plan.sequence_parallel)
    ]
    gemm_f = sum(per_gemm) + (expert_gemm_time(model, gpu, plan, tokens=tokens, peak=peak) if moe else 0.0)
    attn_f, attn_b = attention_time(
        model,
        gpu,
        tp=t,
        seq_len=seq_len,
        micro_batch=b,
        flash=plan.flash_attention or plan.cp > 1,
        peak=peak,
        nbytes=nbytes,
        kernel_seq=cp_kernel_seq(plan, seq_len),
    )
    attn_f, attn_b = attn_f / plan.cp, attn_b / plan.cp
    saved = sum(
        x.bytes(seq_len=s, micro_batch=b)
        for x in activation_tensors(
            model,
            tp=t,
            sequence_parallel=plan.sequence_parallel,
            precision=plan.precision,
            flash_attention=plan.flash_attention,
            moe=moe,
            fused_swiglu=plan.megatron,
            ring=plan.a2a_degree < plan.cp,
        )
        + (
            routing_tensors(
                model,
                tp=t,
                precision=plan.precision,  # permute, unpermute, SwiGLU
                imbalance=routed_imbalance(model, plan.moe_imbalance, plan.ep),
            )
            if moe
            else []
        )
    )
    elementwise = (K_MEM_FUSED if plan.fused else K_MEM) * saved / (gpu.hbm_gbps * 1e9)
    ew_f = elementwise / 3
    scan_f, scan_b = mamba.scan_time(model, tp=t, tokens=tokens, peak=peak)  # a hybrid's Mamba-2 blocks' share
    forward = gemm_f + attn_f + ew_f + scan_f
    backward = 2 * gemm_f + attn_b + 2 * ew_f + scan_b
    if plan.lora is not None:  # the frozen base: input gradients only; the adapters' GEMMs forward and backward
        adapters = lora_gemm_time(model, gpu, plan, tokens=tokens, peak=peak, moe=moe)
        forward += adapters
        backward += 2 * adapters - gemm_f
        gemm_f = adapters  # the weight-gradient GEMMs left: the adapters'
    cpu = LAUNCH_S * (LAUNCH_FUSED if plan.fused else 1.0)
    if plan.recompute == "full":
        backward += plan.recompute_fraction * forward
        cpu *= 1 + plan.recompute_fraction / 3
    elif plan.recompute == "selective":  # the attention core (Korthikanti et al. 2022), and the Mamba-2 scans
        backward += attn_f + scan_f
    elif plan.recompute == "per-op":  # every other matmul (k, o, the MLP's second) and the elementwise ops
        backward += sum(per_gemm[1::2][:3]) + ew_f
        cpu *= 4 / 3
    return BlockTime(forward, backward, cpu, weight_grad=gemm_f)


def lora_gemm_time(model: ModelSpec, gpu: GPU, plan: Plan, *, tokens: float, peak: float, moe: bool) -> float:
    """Forward seconds of one block's LoRA adapters on one TP rank (``lora_cost.adapted``): the thin GEMMs
    ``(m x k) @ (k x r)`` and ``(m x r) @ (r x n)`` of each, at the roofline's rate (far below the peak at small r)."""
    assert plan.lora is not None, "the adapters' time of a plan without LoRA"
    nbytes, r = PRECISIONS[plan.precision], plan.lora.rank
    time: float = sum(
        gemm_time(gpu, rows * tokens, k, r, peak=peak, nbytes=nbytes)
        + gemm_time(gpu, rows * tokens, r, n, peak=peak, nbytes=nbytes)
        for _, _, rows, k, n in lora_cost.adapted(model, plan.lora, plan.tp, moe=moe)
    )
    return time


def eh_proj_time(model: ModelSpec, gpu: GPU, plan: Plan, *, seq_len: int, peak: float) -> float:
    """Forward + backward seconds of one MTP depth's ``eh_proj`` (``megakit.nn.mtp``: 2H -> H, column-parallel over
    the gathered tokens, its output gathered), one micro-batch of ``seq_len`` tokens on a rank."""
    return 3 * linear_time(gpu, plan, plan.micro_batch * seq_len, 2 * model.hidden, model.hidden // plan.tp, peak=peak)


def head_time(model: ModelSpec, gpu: GPU, plan: Plan, *, seq_len: int, peak: float) -> float:
    """LM head forward + backward and the vocab-parallel cross-entropy on the last stage."""
    nbytes = PRECISIONS[plan.precision]
    tokens = plan.micro_batch * seq_len
    vocab_shard = model.padded_vocab(plan.tp) // plan.tp
    gemms = 2 if plan.lora is not None else 3  # a frozen head (LoRA) computes no weight gradient
    gemm = gemms * gemm_time(gpu, tokens, model.hidden, vocab_shard, peak=peak, nbytes=nbytes)
    k_mem = K_MEM_FUSED if plan.fused else K_MEM
    return gemm + k_mem * tokens * vocab_shard * (nbytes + 4) / (gpu.hbm_gbps * 1e9)
