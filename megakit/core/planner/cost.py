"""Step time of one plan: compute, tensor/pipeline/data-parallel communication, bubble.

The model is physical, not one efficiency per run. Per micro-batch and block a GPU spends

* GEMM time: hardware FLOPs / (peak × ``gemm_efficiency``), where the efficiency
  falls as the smallest GEMM dimension a GPU sees shrinks (tile and wave
  quantisation: ``E_MAX · d / (d + D_HALF)``);
* memory-bound time: the elementwise kernels (norms, softmax, GELU, dropout,
  residuals) stream the block's activations, ``K_MEM`` × the Korthikanti bytes,
  through HBM; this is what makes small hidden sizes and long sequences slower;
* a fixed kernel-launch cost per block (``LAUNCH_S``), which is what makes tiny
  micro-batches of small models slow;
* TP all-reduces (or SP all-gather + reduce-scatter) on the intra-node link:
  2 forward, 2 backward, 2 more when the block is recomputed, not overlapped;

then the 1F1B pipeline runs ``m`` micro-batches through ``p`` stages:
``m·T_slowest + (ΣT − T_slowest)/v`` plus P2P sends (exact when the last stage is the
slowest, a slight upper bound when the trainer's split leaves a middle stage slowest), and data parallelism
adds the gradient traffic (all-reduce for ZeRO 0-1, per-micro-batch
reduce-scatter for ZeRO-2, gather-forward + gather-backward + reduce-scatter
per micro-batch for ZeRO-3) on the slowest link the DP group spans, which overlaps the compute it
runs beside only partly: together they take ``(C^k + Z^k)^(1/k)``. Collectives run at
``LINK_EFFICIENCY`` of the link's bandwidth.

The five constants were fitted once to Narayanan et al. 2021 (Tables 1 and 2,
``shared/calibration/megatron-2021.json``) and are then used unchanged for every
model, GPU and layout; ``tests/test_planner_cost.py`` checks the fit row by row.
"""

from __future__ import annotations

import dataclasses

from megakit.core.model_config import recompute_flops
from megakit.core.planner.hardware import Cluster
from megakit.core.planner.memory import (
    PRECISIONS,
    activation_tensors,
    stage_layer_counts,
    stage_params,
)
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan

E_MAX = 0.68  # best GEMM efficiency of large bf16/fp16 matmuls (fraction of datasheet peak)
D_HALF = 256  # smallest GEMM dimension at which efficiency halves
K_MEM = 4.0  # HBM traffic of the elementwise kernels, in multiples of the saved-activation bytes
LINK_EFFICIENCY = {"intra": 0.90, "inter": 0.72}  # achieved collective bandwidth / link bandwidth
OVERLAP_NORM = 2.0  # compute and traffic running together take (C^k + Z^k)^(1/k): k=1 no overlap, k=inf perfect
LAUNCH_S = 2e-4  # fixed cost per block and micro-batch (forward + backward): ~50 kernel launches x 4 µs
ADAM_BYTES = 36  # HBM bytes the optimizer step touches per local parameter (fp32 master, m, v, grads)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cost:
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    hardware_tflops_per_gpu: float
    mfu: float
    comm_fraction: float  # exposed communication / step time
    bubble_fraction: float
    compute_s: float
    tp_comm_s: float
    pp_comm_s: float
    dp_comm_s: float  # exposed
    bubble_s: float
    optimizer_s: float
    pipeline_s: float = 0.0  # the 1F1B schedule's length: m·T_slowest + (ΣT − T_slowest)/v
    stage_times: tuple = ()  # forward + backward of one micro-batch, per stage (no P2P)


def flops_per_token(model: ModelSpec, seq_len: int, *, recompute: str = "none", flash_attention: bool = False,
                    hardware: bool = True) -> float:
    """Training FLOPs per token (``ModelConfig.flops_per_token``, Megatron's Eq. 3 convention): 3 × forward,
    plus, when ``hardware``, the recomputed forward ('full'), the recomputed core attention ('selective')
    or flash attention's recomputed scores."""
    if not hardware:
        recompute, flash_attention = "none", False
    return model.config.flops_per_token(seq_len, convention="megatron", recompute=recompute,
                                        flash_attention=flash_attention)


def overlapped(compute_s: float, comm_s: float) -> float:
    """Time of compute and communication that run concurrently: a smooth maximum, because NCCL
    kernels take SMs and HBM bandwidth from the GEMMs they hide behind (perfect only when one is tiny)."""
    if comm_s <= 0:
        return compute_s
    k = OVERLAP_NORM
    return (compute_s**k + comm_s**k) ** (1 / k)


def gemm_efficiency(smallest_dim: float) -> float:
    return E_MAX * smallest_dim / (smallest_dim + D_HALF)


def collective_time(nbytes: float, ranks: int, gbps: float, where: str, *, kind: str = "all_reduce") -> float:
    """Ring collective time: all-reduce moves 2(n-1)/n of the data, gather / scatter (n-1)/n."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks
    return factor * nbytes / (gbps * 1e9 * LINK_EFFICIENCY[where])


def _where(cluster: Cluster, span: int, stride: int) -> tuple[float, str]:
    group = span * stride
    if group <= cluster.gpus_per_node and cluster.gpus_per_node % group == 0:
        return cluster.gpu.intra_gbps, "intra"
    return cluster.gpu.inter_gbps, "inter"


def estimate_cost(model: ModelSpec, cluster: Cluster, plan: Plan, *, seq_len: int | None = None) -> Cost:
    s = model.seq_len if seq_len is None else seq_len
    t, p, d, v, b, m = plan.tp, plan.pp, plan.dp, plan.vpp, plan.micro_batch, plan.accumulation
    gpu = cluster.gpu
    peak = gpu.peak_tflops * 1e12 * (0.5 if plan.precision == "fp32" else 1.0)  # fp32 runs as TF32: half rate
    nbytes = PRECISIONS[plan.precision]
    tokens = b * s

    # ---- one block, one micro-batch, forward + backward (+ recompute) on one GPU --------
    per_layer_fwd, attn_fwd = model.config.block_flops(s, t, convention="megatron")
    layer_flops = tokens * (3 * per_layer_fwd + recompute_flops(per_layer_fwd, attn_fwd, plan.recompute,
                                                                  plan.flash_attention))
    smallest = min(tokens, model.hidden, model.heads // t * model.head_dim, model.ffn // t)
    gemm_s = layer_flops / (peak * gemm_efficiency(smallest))
    saved = sum(x.bytes(seq_len=s, micro_batch=b)
                for x in activation_tensors(model, tp=t, sequence_parallel=plan.sequence_parallel,
                                            precision=plan.precision, flash_attention=plan.flash_attention))
    mem_s = K_MEM * saved * (1.25 if plan.recompute == "full" else 1.0) / (gpu.hbm_gbps * 1e9)
    tp_bw, tp_where = _where(cluster, t, 1)
    n_collectives = 6 if plan.recompute == "full" else 4
    tp_s = n_collectives * collective_time(tokens * model.hidden * nbytes, t, tp_bw, tp_where)
    launch_s = LAUNCH_S * (4 / 3 if plan.recompute == "full" else 1.0)
    layer_s = gemm_s + mem_s + tp_s + launch_s
    layer_bwd_share = 2 / 3  # of a block's compute, the backward part (what DP traffic can hide behind)

    # ---- embedding and LM head on the first / last stage --------------------------------
    vocab_shard = model.padded_vocab(t) // t
    head_flops = tokens * 6 * model.hidden * vocab_shard
    head_s = head_flops / (peak * gemm_efficiency(min(tokens, model.hidden, vocab_shard)))
    head_s += K_MEM * tokens * vocab_shard * (nbytes + 4) / (gpu.hbm_gbps * 1e9)
    head_s += 2 * collective_time(tokens * model.hidden * nbytes, t, tp_bw, tp_where)
    embed_s = 2 * collective_time(tokens * model.hidden * nbytes, t, tp_bw, tp_where)

    counts = stage_layer_counts(model, p, v)  # the trainer's split (partition_layers)
    stage_s = []
    for stage, n_layers in enumerate(counts):
        stage_s.append(n_layers * layer_s + (embed_s if stage == 0 else 0) + (head_s if stage == p - 1 else 0))
    # P2P: activations forward, gradients backward, per micro-batch and stage boundary; with TP the
    # send is split over the TP ranks (Megatron's scatter/gather) when it crosses nodes.
    p2p_bw, p2p_where = _where(cluster, 2, t * d)
    p2p_bytes = tokens * model.hidden * nbytes / (t if p2p_where == "inter" else 1)
    p2p_s = 2 * v * p2p_bytes / (p2p_bw * 1e9 * LINK_EFFICIENCY[p2p_where]) if p > 1 else 0.0
    slowest = max(stage_s) + p2p_s
    compute_s = m * max(stage_s)
    bubble_s = (sum(stage_s) + p * p2p_s - slowest) / v if p > 1 else 0.0
    pipeline_s = m * slowest + bubble_s
    tp_total = m * counts[stage_s.index(max(stage_s))] * tp_s

    # ---- data parallelism / ZeRO ---------------------------------------------------------
    psi = max(stage_params(model, tp=t, pp=p, stage=i, layers=counts[i]) for i in range(p))
    grad_bytes = psi * nbytes
    dp_bw, dp_where = _where(cluster, d, t)
    last_bwd = max(stage_s) * layer_bwd_share
    if d == 1:
        dp_exposed = 0.0
    elif plan.zero_stage <= 1:  # one all-reduce at the accumulation boundary, behind the last backward
        traffic = collective_time(grad_bytes, d, dp_bw, dp_where)
        dp_exposed = overlapped(last_bwd, traffic) - last_bwd
    elif plan.zero_stage == 2:  # reduce-scatter in every micro-batch's backward, gather after the step
        per_mb = collective_time(grad_bytes, d, dp_bw, dp_where, kind="reduce_scatter")
        gather = collective_time(grad_bytes, d, dp_bw, dp_where, kind="all_gather")
        dp_exposed = m * (overlapped(last_bwd, per_mb) - last_bwd) + gather
    else:  # every micro-batch: gather for forward, gather + reduce-scatter for backward
        one = collective_time(grad_bytes, d, dp_bw, dp_where, kind="all_gather")
        fwd = max(stage_s) - last_bwd
        dp_exposed = m * (overlapped(fwd, one) - fwd + overlapped(last_bwd, 2 * one) - last_bwd)

    shard = d if plan.zero_stage >= 1 else 1
    optimizer_s = ADAM_BYTES * psi / shard / (gpu.hbm_gbps * 1e9)
    if plan.offload != "none":  # gradients down and parameters up over PCIe, Adam on the host (~1 ns/param)
        optimizer_s = 2 * nbytes * psi / shard / 25e9 + psi / shard * 1e-9

    step = pipeline_s + dp_exposed + optimizer_s
    global_tokens = plan.global_batch * s
    model_flops = flops_per_token(model, s, hardware=False) * global_tokens
    hardware_flops = flops_per_token(model, s, recompute=plan.recompute, flash_attention=plan.flash_attention) \
        * global_tokens
    world = plan.world
    comm = tp_total + m * p2p_s + dp_exposed
    return Cost(step_time_s=step, tokens_per_s=global_tokens / step,
                model_tflops_per_gpu=model_flops / step / world / 1e12,
                hardware_tflops_per_gpu=hardware_flops / step / world / 1e12,
                mfu=model_flops / step / world / peak, comm_fraction=comm / step, bubble_fraction=bubble_s / step,
                compute_s=compute_s, tp_comm_s=tp_total, pp_comm_s=m * p2p_s, dp_comm_s=dp_exposed,
                bubble_s=bubble_s, optimizer_s=optimizer_s, pipeline_s=pipeline_s, stage_times=tuple(stage_s))
