"""Step time of one plan: compute, tensor/pipeline/data-parallel communication, bubble.

The model is physical, not one efficiency per run. Per micro-batch and block a GPU spends its
compute (``compute.block_time``: each GEMM from its shape on this GPU generation, flash attention,
memory-bound elementwise kernels, launches, recompute) plus the TP all-reduces (or SP all-gather +
reduce-scatter) on the intra-node link: 2 forward, 2 backward, 2 more when the block is recomputed,
not overlapped. The 1F1B pipeline then runs ``m`` micro-batches through ``p`` stages:
``m·T_slowest + (ΣT − T_slowest)/v`` plus P2P sends (exact when the last stage is the slowest, a
slight upper bound when the trainer's split leaves a middle stage slowest). That form assumes each of
a stage's ``v`` chunks is 1/v of its work; a pinned ``--stage-layers`` split, or one whose ends hold no block
(more virtual stages than blocks), is instead timed chunk by chunk, its schedule run in ``core.simulator``
(``stages.interleaved_step_time``). Data parallelism adds
the traffic that its compute does not hide (over DP x CP with context parallelism, whose ring passes
each K/V block around the CP group beside the block's attention, exposed only where it outlasts it; a sliding
block whose window fits in a chunk swaps K/V with its two neighbours only) (``sharding.dp_time``: DDP/ZeRO-1
all-reduce, ZeRO-2 reduce-scatter, ZeRO-3/FSDP gathers prefetched behind the previous block), then the optimizer step
(with ``--optimizer muon`` also its Newton-Schulz iterations and its TP and DP exchanges, ``muon_times``).

An MoE block (``compute.block_time(moe=True)``) adds its dispatch and combine all-to-alls over the EP
group, EP consecutive ranks (TP first: ``core.layout``), NVLink while it fits a node, the network for what
leaves it: with ``Plan.dispatcher`` "alltoall" (megakit's, Megatron's alltoall) each moves top-k copies of
the rank's tokens (its 1/TP share), of which (EP - 1)/EP leave the rank (``sharding.all_to_all_time``);
with "deepep" (DeepEP/HybridEP) one copy per node reached (``sharding.node_deduplicated_all_to_all_time``);
times the routing imbalance on the busiest rank; four per block and micro-batch (forward dispatch and
combine, their backward twins), two more when the block is recomputed; not overlapped (Megatron's 1F1B
A2A overlap is listed in tests/data/moe-runs.json, not priced). Expert gradients
reduce over the EDP ranks (and over TP at EP 1, whose ranks route different tokens through the same
experts), beside the dense ones over DP x CP.

One set of constants (here, in ``compute`` and ``sharding``, and the GPU presets' measured matmul and
attention rates) is used for every model, GPU and layout; ``tests/core/planner/test_planner_calibration.py``
checks it row by row against Narayanan et al. 2021, 26 published FSDP/ZeRO-3 runs and megakit's own.
"""

from __future__ import annotations

import dataclasses

from megakit.core.planner import lora_cost, mamba, muon
from megakit.core.planner.compute import attention_time, block_time, cp_kernel_seq, eh_proj_time, head_time
from megakit.core.planner.hardware import Cluster
from megakit.core.planner.memory import (
    PRECISIONS,
    routed_imbalance,
    stage_expert_params,
    stage_params,
)
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan
from megakit.core.planner.sharding import (
    LINK_EFFICIENCY,
    all_to_all_time,
    collective_time,
    dp_time,
    exposed,
    group_bandwidth,
    node_deduplicated_all_to_all_time,
    overlapped,
)
from megakit.core.planner.stages import (
    interleaved_step_time,
    stage_chunk_layers,
    stage_chunk_moe_layers,
    zero_bubble_bubble_share,
)

ADAM_BYTES = 36  # HBM bytes the optimizer step touches per local parameter (fp32 master, m, v, grads)
STEP_S = 0.015  # host time per optimizer step (engine bookkeeping, grad-norm sync, logging)
PCIE_GBPS = 25  # host <-> GPU, PCIe 4.0 x16, one direction (ZeRO-Offload's gradient and parameter copies)
CPU_ADAM_S = 1e-9  # seconds per parameter of DeepSpeed's CPU Adam (Ren et al. 2021, ZeRO-Offload: ~1 ns)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cost:
    """One plan's modelled step time and throughput, so the search can rank plans and the report explain them."""

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
    cp_comm_s: float = 0.0  # ring attention's K/V traffic that the attention compute does not hide
    pipeline_s: float = 0.0  # the 1F1B schedule's length: m·T_slowest + (ΣT − T_slowest)/v
    stage_times: tuple = ()  # forward + backward of one micro-batch, per stage (no P2P)
    a2a_s: float = 0.0  # the MoE dispatch and combine all-to-alls of the step on the slowest stage
    muon_s: float = 0.0  # of ``optimizer_s``, Muon's Newton-Schulz and exchanges (``muon_times``)


def flops_per_token(
    model: ModelSpec, seq_len: int, *, recompute: str = "none", flash_attention: bool = False, hardware: bool = True
) -> float:
    """Training FLOPs per token (``ModelConfig.flops_per_token``, Megatron's Eq. 3 convention): 3 × forward,
    plus, when ``hardware``, the recomputed forward ('full'), the recomputed core attention ('selective')
    or flash attention's recomputed scores.

    Two conventions, said so wherever a figure is shown: model FLOPs (``hardware=False``, for MFU) count
    attention's full S x S, as PaLM's and Megatron's MFU do; hardware FLOPs count what the kernels execute:
    the recomputation, and for fused (flash) attention only the unmasked half of the causal S x S, whose
    masked tiles the kernel skips, and of sliding blocks only their window (``ModelConfig.attention_share``;
    written-out attention computes the whole square and masks it)."""
    if not hardware:
        recompute, flash_attention = "none", False
    total = model.config.flops_per_token(
        seq_len, convention="megatron", recompute=recompute, flash_attention=flash_attention, mtp=model.mtp
    )
    if hardware and flash_attention:  # each attention pass the kernels run does half the square, windows less
        attn = 4 * seq_len * model.hidden  # one forward pass of scores and values per token and block (width H)
        passes = 3.5 + (1.0 if recompute == "full" else 0.0)  # forward, 2.5 x for backward (scores again), recompute
        share = model.config.attention_share(seq_len)
        # windows: of each block's whole square (counted) the window's half runs; a hybrid (Nemotron-H): its attention
        # blocks' share of the square is counted (``counting.block_flops``), and half of it runs
        kept = share / 2 if model.config.layer_pattern else 1 - share / 2
        total -= (model.layers + model.mtp) * passes * attn * kept
    return total


def weight_grad_share(model: ModelSpec, seq_len: int, plan: Plan) -> float:
    """W's share of a stage's compute: the weight-gradient GEMMs, 2 FLOPs per weight and token (the
    blocks' matmuls and the LM head), over all the training FLOPs the hardware runs (a third without
    recompute, a quarter with full recompute, whose extra forward falls in B)."""
    weights = _matmul_weights(model)
    total = flops_per_token(
        model,
        seq_len,
        recompute=plan.recompute if plan.recompute != "per-op" else "none",
        flash_attention=plan.flash_attention,
    )
    return 2 * weights / total


def _dispatch_time(model: ModelSpec, cluster: Cluster, plan: Plan, token_bytes: float) -> float:
    """One dispatch (or combine) of this rank's tokens (``token_bytes`` once) over its EP group, consecutive
    ranks (``core.layout``); the busiest rank receives ``routed_imbalance`` times the balanced share."""
    k = model.moe.top_k * routed_imbalance(model, plan.moe_imbalance, plan.ep)
    if plan.dispatcher == "deepep":
        return node_deduplicated_all_to_all_time(cluster, token_bytes, k, plan.ep)
    return all_to_all_time(cluster, token_bytes * k, plan.ep, 1)


def estimate_cost(model: ModelSpec, cluster: Cluster, plan: Plan, *, seq_len: int | None = None) -> Cost:
    """The step time of ``plan`` on ``cluster`` and what it is made of: the slowest stage's blocks, the exposed TP,
    CP, EP, PP and DP exchanges, the pipeline bubble and the optimizer step."""
    s = model.seq_len if seq_len is None else seq_len
    t, p, d, v, b, m = plan.tp, plan.pp, plan.dp, plan.vpp, plan.micro_batch, plan.accumulation
    gpu = cluster.gpu
    peak = gpu.peak_tflops * 1e12 * (gpu.fp32_rate if plan.precision == "fp32" else 1.0)
    nbytes = PRECISIONS[plan.precision]
    tokens = b * s // plan.cp  # this rank's

    # ---- one block, one micro-batch, forward + backward (+ recompute) on one GPU --------
    moe = model.moe is not None
    block = block_time(model, gpu, plan, seq_len=s, peak=peak, moe=moe)  # a typical block: MoE in an MoE model
    dense_block = block_time(model, gpu, plan, seq_len=s, peak=peak) if moe else block
    tp_bw, tp_where = group_bandwidth(cluster, t, 1)
    one_tp = collective_time(tokens * model.hidden * nbytes, t, tp_bw, tp_where)
    recomputed = plan.recompute_fraction if plan.recompute == "full" else 0.0
    tp_s = _tp_exposed(plan, block, one_tp=one_tp, recomputed=recomputed)
    cp_s = _cp_time(model, cluster, plan, tokens=tokens, nbytes=nbytes, peak=peak, seq_len=s)
    a2a_s = (
        (4 + 2 * recomputed) * _dispatch_time(model, cluster, plan, tokens / t * model.hidden * nbytes) if moe else 0.0
    )
    layer_s = overlapped(block.total + tp_s + cp_s + a2a_s, block.cpu)  # the host issues while the GPU runs
    dense_s = overlapped(dense_block.total + tp_s + cp_s, dense_block.cpu)

    # ---- embedding and LM head on the first / last stage --------------------------------
    head_s = head_time(model, gpu, plan, seq_len=s // plan.cp, peak=peak) + 2 * one_tp
    embed_s = 2 * one_tp

    # each virtual stage (chunk c of rank r is c·p + r), as the trainer splits them (partition_layers): its blocks,
    # the embedding on the first, the head on the last; a rank holds its chunks
    chunk_layers, chunk_moes = stage_chunk_layers(model, p, v), stage_chunk_moe_layers(model, p, v)
    counts, moes = [sum(n) for n in chunk_layers], [sum(k) for k in chunk_moes]
    # the blocks whose TP, CP and EP exchanges a stage runs: the last one's MTP modules' too
    blocks = counts[:-1] + [counts[-1] + model.mtp]
    moe_blocks = moes[:-1] + [moes[-1] + sum(model.config.is_moe_layer(model.layers + k) for k in range(model.mtp))]
    chunk_s = [
        chunk_moes[r][c] * layer_s + (chunk_layers[r][c] - chunk_moes[r][c]) * dense_s
        for c in range(v)
        for r in range(p)
    ]
    chunk_s[0] += embed_s
    chunk_s[-1] += head_s + _mtp_time(
        model,
        gpu,
        plan,
        layer_s=layer_s,
        dense_s=dense_s,
        head_s=head_s,
        one_tp=one_tp,
        seq_len=s // plan.cp,
        peak=peak,
    )
    stage_s = [sum(chunk_s[c * p + r] for c in range(v)) for r in range(p)]
    # P2P: activations forward, gradients backward, per micro-batch and stage boundary; with TP the
    # send is split over the TP ranks (Megatron's scatter/gather) when it crosses nodes.
    p2p_bw, p2p_where = group_bandwidth(cluster, 2, t * plan.cp * d)
    p2p_bytes = tokens * model.hidden * nbytes / (t if p2p_where == "inter" else 1)
    p2p_s = 2 * v * p2p_bytes / (p2p_bw * 1e9 * LINK_EFFICIENCY[p2p_where]) if p > 1 else 0.0
    slowest = max(stage_s) + p2p_s
    compute_s = m * max(stage_s)
    bubble_s = _bubble(model, plan, block, chunk_s, stage_s, p2p_s=p2p_s, seq_len=s)
    pipeline_s = m * slowest + bubble_s
    worst = stage_s.index(max(stage_s))
    tp_total = m * blocks[worst] * tp_s

    # ---- data parallelism / ZeRO / FSDP, and the optimizer step ---------------------------
    dp_exposed, optimizer_s = _data_parallel(
        model, cluster, plan, block, counts=counts, moes=moes, worst=worst, stage_s=max(stage_s), one_tp=one_tp
    )

    muon_s = sum(muon_times(model, cluster, plan).values()) if plan.optimizer == "muon" else 0.0
    optimizer_s += muon_s
    step = pipeline_s + dp_exposed + optimizer_s + STEP_S
    global_tokens = plan.global_batch * s
    model_flops, hardware_flops = _step_flops(model, plan, seq_len=s, tokens=global_tokens)
    world = plan.world
    cp_total = m * blocks[worst] * cp_s
    a2a_total = m * moe_blocks[worst] * a2a_s
    comm = tp_total + m * p2p_s + dp_exposed + cp_total + a2a_total
    return Cost(
        cp_comm_s=cp_total,
        step_time_s=step,
        tokens_per_s=global_tokens / step,
        model_tflops_per_gpu=model_flops / step / world / 1e12,
        hardware_tflops_per_gpu=hardware_flops / step / world / 1e12,
        mfu=model_flops / step / world / peak,
        comm_fraction=comm / step,
        bubble_fraction=bubble_s / step,
        compute_s=compute_s,
        tp_comm_s=tp_total,
        pp_comm_s=m * p2p_s,
        dp_comm_s=dp_exposed,
        bubble_s=bubble_s,
        optimizer_s=optimizer_s,
        pipeline_s=pipeline_s,
        stage_times=tuple(stage_s),
        a2a_s=a2a_total,
        muon_s=muon_s,
    )


def muon_plan_cost(model: ModelSpec, plan: Plan) -> muon.MuonCost:
    """``muon.muon_cost`` of the plan: ZeRO 1-2 share the orthogonalisation over DP x CP (the experts' over EDP)."""
    sharded = plan.zero_stage >= 1
    return muon.muon_cost(
        model.config,
        tp=plan.tp,
        pp=plan.pp,
        ep=plan.ep,
        dp=plan.dp * plan.cp if sharded else 1,
        edp=plan.edp if sharded else 1,
    )


def muon_times(model: ModelSpec, cluster: Cluster, plan: Plan) -> dict:
    """Seconds of one Muon step on a GPU of ``plan``, not overlapped: its Newton-Schulz iterations (bf16 GEMMs at the
    GPU's achievable matmul rate, whatever the training precision: torch's iterations run in bf16), the TP exchange
    (two all-to-alls over TP, each of the rank's split matrices' fp32 bytes) and at ZeRO 1-2 the DP exchange (two
    all-to-alls over DP x CP of the rank's partition of the dense Muon weights, and over EDP of the experts')."""
    cost, gpu = muon_plan_cost(model, plan), cluster.gpu
    times = {"newton_schulz": cost.ns_flops / (gpu.peak_tflops * 1e12 * gpu.matmul_fraction)}
    if plan.tp > 1 and cost.gather_bytes:  # received = sent: (TP-1)/TP of the bytes each all-to-all sends
        sent = cost.gather_bytes / 2 * plan.tp / (plan.tp - 1)
        times["tp_exchange"] = 2 * all_to_all_time(cluster, sent, plan.tp, 1)
    if cost.dp_bytes:
        dense = cost.params - cost.expert_params
        groups = [(dense, plan.dp * plan.cp, plan.tp), (cost.expert_params, plan.edp, plan.ep)]
        times["dp_exchange"] = sum(
            2 * all_to_all_time(cluster, muon.MOMENT_BYTES * n / g, g, stride) for n, g, stride in groups if n
        )
    return times


def _tp_exposed(plan: Plan, block, *, one_tp: float, recomputed: float) -> float:
    """One block's exposed TP exchanges: four (and two per recomputed forward), less what overlaps its GEMMs."""
    t = plan.tp
    tp_s = (4 + 2 * recomputed) * one_tp
    if plan.column_overlap and t > 1:
        # Megatron-LM's column-parallel backward launches its input gradient's all-reduce (reduce-scatter with
        # SP) asynchronously and computes the weight gradient meanwhile (--async-tensor-model-parallel-allreduce,
        # 2021-22; Korthikanti et al. 2022 Sec. 4.2.2), and so does megakit's (nn.tensor_parallel.overlapped_linear):
        # two of the four exchanges hide behind the wgrad GEMMs. With SP it also all-gathers each
        # column-parallel input again there, behind the same GEMMs.
        hidden_comm = (2 + (1 if plan.sequence_parallel else 0)) * one_tp
        tp_s += exposed(block.weight_grad, hidden_comm) - 2 * one_tp
    if plan.comm_overlap and t > 1:  # every exchange pipelined with its GEMM: only what outlasts the block shows
        tp_s = exposed(block.total, (4 + 2 * recomputed + (1 if plan.sequence_parallel else 0)) * one_tp)
    return tp_s


def _bubble(model: ModelSpec, plan: Plan, block, chunk_s: list, stage_s: list, *, p2p_s: float, seq_len: int) -> float:
    """The pipeline's idle time per step: 1F1B's or interleaving's, zero bubble's share of it, or the interleaved
    schedule timed chunk by chunk when the chunks are unequal (pinned, or empty ends)."""
    p, v, m = plan.pp, plan.vpp, plan.accumulation
    slowest = max(stage_s) + p2p_s
    bubble_s = (sum(stage_s) + p * p2p_s - slowest) / v if p > 1 else 0.0
    if plan.zero_bubble:  # ZB-H1: the W's fill what 1F1B leaves idle, (p-1)(F+B-W) instead of (p-1)(F+B+W)
        bubble_s *= zero_bubble_bubble_share(weight_grad_share(model, seq_len, plan))
    if v > 1 and (model.stage_layers is not None or p * v > model.layers):  # unequal chunks: pinned, or empty ends
        timed = interleaved_step_time(
            tuple(chunk_s),
            pp=p,
            vpp=v,
            micro_batches=m,
            forward_share=block.forward / block.total,
            message_s=p2p_s / (2 * v),
        )
        if timed is not None:
            bubble_s = max(timed - m * slowest, 0.0)
    return bubble_s


def _data_parallel(
    model: ModelSpec, cluster: Cluster, plan: Plan, block, *, counts, moes, worst: int, stage_s: float, one_tp: float
) -> tuple[float, float]:
    """(exposed DP/ZeRO/FSDP communication, optimizer step) of the slowest stage: the dense gradients over DP x CP,
    the experts' over EDP, and Adam over the parameters this GPU steps (on the host under offload)."""
    t, p, d, v = plan.tp, plan.pp, plan.dp, plan.vpp
    gpu, nbytes = cluster.gpu, PRECISIONS[plan.precision]
    recomputed = plan.recompute_fraction if plan.recompute == "full" else 0.0
    tp_bw, tp_where = group_bandwidth(cluster, t, 1)
    psi: float = max(stage_params(model, tp=t, pp=p, stage=i, layers=counts[i]) for i in range(p))
    sharded: float
    sharded, replicated = model.layer_params(t)
    if plan.lora is not None and plan.zero_stage < 3:  # only the adapters' gradients cross DP (ZeRO-3: and the base's
        # gathers, priced as a full model's)
        sharded, replicated = lora_cost.block_params(model, plan.lora, t, moe=model.moe is not None), 0
        psi = sharded * max(counts)
    replicas = dataclasses.replace(plan, dp=d * plan.cp, cp=1)  # ZeRO shards, gradients reduce over DP x CP
    dp_exposed = dp_time(
        cluster,
        replicas,
        psi=psi,
        layer_params=sharded + replicated,
        layers=counts[worst],
        stage_s=stage_s,
        layer_fwd_s=block.forward + 2 * one_tp,
        layer_bwd_s=block.backward + (2 + 2 * recomputed) * one_tp,
    )

    psi_e = stage_expert_params(model, pp=p, stage=worst, ep=plan.ep, vpp=v) if plan.lora is None else 0.0
    if psi_e:  # expert gradients: over the EDP ranks (EP apart); at EP 1 also over TP, which routes other tokens
        experts = dataclasses.replace(replicas, dp=plan.edp, tp=plan.ep, compress="none")  # tp: the stride
        dp_exposed += dp_time(
            cluster,
            experts,
            psi=psi_e,
            layer_params=psi_e / max(moes[worst], 1),
            layers=moes[worst],
            stage_s=stage_s,
            layer_fwd_s=block.forward,
            layer_bwd_s=block.backward,
        )
        if plan.ep == 1:
            rbytes = PRECISIONS[plan.grad_reduce_precision]
            dp_exposed += exposed(stage_s * 2 / 3, collective_time(psi_e * rbytes, t, tp_bw, tp_where))

    shard = (replicas.shard_group if plan.zero_stage == 3 else d * plan.cp) if plan.zero_stage >= 1 else 1
    local = psi / shard + psi_e / (plan.edp if plan.zero_stage >= 1 else 1)  # parameters this GPU steps
    optimizer_s = ADAM_BYTES * local / (gpu.hbm_gbps * 1e9)
    if plan.offload != "none":  # gradients down and parameters up over PCIe, Adam on the host
        optimizer_s = 2 * nbytes * local / (PCIE_GBPS * 1e9) + local * CPU_ADAM_S
    return dp_exposed, optimizer_s


def _step_flops(model: ModelSpec, plan: Plan, *, seq_len: int, tokens: int) -> tuple[float, float]:
    """(model, hardware) FLOPs of one step: the hardware's count recompute and written-out attention."""
    model_flops = flops_per_token(model, seq_len, hardware=False) * tokens
    hardware_flops = (
        flops_per_token(
            model,
            seq_len,
            recompute=plan.recompute if plan.recompute != "per-op" else "none",
            flash_attention=plan.flash_attention,
        )
        * tokens
    )
    if plan.lora is not None:  # no weight gradients of the base; the adapters' 6 FLOPs a parameter and token
        lora = (6 * lora_cost.model_params(model, plan.lora) - 2 * _matmul_weights(model)) * tokens
        model_flops, hardware_flops = model_flops + lora, hardware_flops + lora
    return model_flops, hardware_flops


def _matmul_weights(model: ModelSpec) -> float:
    """The weights a token multiplies (the blocks' matmuls and the head): a weight-gradient GEMM's 2 FLOPs each."""
    c = model.config
    return (
        c.moe_layers * c.block_params(moe=True).flop_weights("matmul")
        + (c.layers - c.moe_layers) * c.block_params(moe=False).flop_weights("matmul")
        + c.vocab_size * model.hidden
    )


def _mtp_time(
    model: ModelSpec,
    gpu,
    plan: Plan,
    *,
    layer_s: float,
    dense_s: float,
    head_s: float,
    one_tp: float,
    seq_len: int,
    peak: float,
) -> float:
    """The last stage's MTP modules, one micro-batch: per depth its block (with its TP, CP and EP exchanges, as the
    other blocks), ``eh_proj`` and its gather (one all-gather forward, one exchange backward) and one more head."""
    if not model.mtp:
        return 0.0
    eh = eh_proj_time(model, gpu, plan, seq_len=seq_len, peak=peak) + 2 * one_tp
    return sum(
        (layer_s if model.config.is_moe_layer(model.layers + k - 1) else dense_s) + eh + head_s
        for k in range(1, model.mtp + 1)
    )


def _a2a_heads(model: ModelSpec, plan: Plan) -> tuple[int, int]:
    """Query and K/V heads a rank sends through the all-to-all: its TP rank's, K/V replicated to one per query head
    when they do not divide by the a2a degree (``megakit.nn.attention.ulysses``)."""
    q, kv = model.heads // plan.tp, model.kv_heads_per_rank(plan.tp)
    return q, (kv if kv % plan.a2a_degree == 0 else q)


def _ulysses_time(model: ModelSpec, cluster: Cluster, plan: Plan, *, tokens: int, nbytes: int) -> float:
    """Ulysses' all-to-alls per block and micro-batch (``nn.attention.ulysses``): q, k, v in and the output back,
    forward and again in backward (and in the recomputed forward), not overlapped; K/V at their width, or at the
    query heads' when their heads do not divide by the a2a degree (replicated). The a2a group's ranks are TP apart:
    all of CP with a2a, ``cp_a2a`` consecutive CP ranks with hybrid, none with the ring. Plus a hybrid model's
    Mamba-2 all-to-alls, which run over all of CP in every mode (``_mamba_a2a_time``)."""
    mixers = _mamba_a2a_time(model, cluster, plan, tokens=tokens, nbytes=nbytes)  # a hybrid's Mamba-2 blocks'
    a = plan.a2a_degree
    if a == 1:
        return mixers
    q, kv = (heads * model.head_dim for heads in _a2a_heads(model, plan))
    one_pass = sum(all_to_all_time(cluster, tokens * width * nbytes, a, plan.tp) for width in (q, kv, kv, q))
    recomputed = plan.recompute_fraction if plan.recompute == "full" else 0.0
    return (2 + recomputed) * one_pass + mixers


def _mamba_a2a_time(model: ModelSpec, cluster: Cluster, plan: Plan, *, tokens: int, nbytes: int) -> float:
    """A hybrid's Mamba-2 all-to-alls per mean block and micro-batch (``nn.linear_attention.context_parallel``): x, B,
    C and dt to the whole sequence of a head group and the scan's output back, over all of CP whatever attention's
    CP mode, forward and again in backward (and in the recomputed forward); the Mamba blocks' share of them."""
    share = mamba.shares(model.config).get("mamba", 0.0)
    if plan.cp == 1 or not share:
        return 0.0
    one_pass = sum(
        all_to_all_time(cluster, tokens * width * nbytes, plan.cp, plan.tp)
        for width in mamba.a2a_widths(model, plan.tp)
    )
    recomputed = plan.recompute_fraction if plan.recompute == "full" else 0.0
    return share * (2 + recomputed) * one_pass


def _cp_time(model: ModelSpec, cluster: Cluster, plan: Plan, *, tokens: int, nbytes: int, peak: float, seq_len: int):
    """CP's exposed time per typical block and micro-batch: Ulysses' all-to-alls and the ring's exposed part; in a
    hybrid model, those in its attention blocks and the mixer's all-to-alls in the others (``_linear_cp_mix``)."""
    cp_s = _ulysses_time(model, cluster, plan, tokens=tokens, nbytes=nbytes) + _ring_exposed(
        model, cluster, plan, tokens=tokens, nbytes=nbytes, peak=peak, seq_len=seq_len
    )
    if model.config.linear is None:
        return cp_s
    return _linear_cp_mix(model, cluster, plan, attention_s=cp_s, tokens=tokens, nbytes=nbytes)


def _linear_cp_mix(
    model: ModelSpec, cluster: Cluster, plan: Plan, *, attention_s: float, tokens: int, nbytes: int
) -> float:
    """A hybrid model's CP time per typical block and micro-batch: ``attention_s`` in its share of attention blocks,
    in the others Gated DeltaNet's all-to-alls over the whole CP group whatever ``--cp-mode`` (q, k, v, beta and the
    decay to head groups of the whole sequence, the output back: ``nn.linear_attention.context_parallel``), forward
    and again in backward (and in the recomputed forward), not overlapped."""
    linear = model.config.linear
    assert linear is not None, "the CP time of a hybrid model without linear attention"
    share = sum(linear.is_linear(i) for i in range(model.layers)) / model.layers
    if plan.cp == 1:
        return (1 - share) * attention_s
    out_width = linear.value_heads * linear.value_head_dim / plan.tp
    one_pass = sum(
        all_to_all_time(cluster, tokens * width * nbytes, plan.cp, plan.tp)
        for width in (linear.cp_all_to_all_elements_per_token(plan.tp) - out_width, out_width)
    )
    recomputed = plan.recompute_fraction if plan.recompute == "full" else 0.0
    return (1 - share) * attention_s + share * (2 + recomputed) * one_pass


def _ring_exposed(
    model: ModelSpec, cluster: Cluster, plan: Plan, *, tokens: int, nbytes: int, peak: float, seq_len: int
) -> float:
    """Ring attention's K/V traffic per block and micro-batch that its attention compute does not hide, the mean over
    the blocks of the full ring's and, on sliding blocks whose window fits in a chunk, the neighbours' exchange's.

    The ring has ``CP / a`` ranks, ``a`` the a2a degree (1: the plain ring; CP: Ulysses, no ring), each holding
    ``a x tokens`` tokens of ``1/a`` of the heads after hybrid's all-to-all. Forward: ring - 1 K/V blocks arrive,
    each behind the previous block's attention; backward: ring - 1 K/V blocks and ring blocks of their gradients
    (fp32). The zig-zag split gives every block the same causal half of the work (the fused ring skips the masked
    chunk pairs), so the rank's attention, ``1/CP`` of the whole, hides the traffic evenly. The ring's neighbours are
    ``TP x a`` ranks apart, so it stays on NVLink while TP x CP fits a node. A block whose window fits in a chunk
    (``_bounded_layers``) swaps a chunk of K/V with each of its two neighbours instead: one block forward, one block
    and one block of gradients backward, hidden the same way."""
    ring = plan.cp // plan.a2a_degree
    if ring == 1:
        return 0.0
    kv = _ring_block_bytes(model, plan, tokens=tokens, nbytes=nbytes)
    grads = kv / nbytes * 4  # a block's gradients travel in fp32
    bw, where = group_bandwidth(cluster, ring, plan.tp * plan.a2a_degree)
    rate = bw * 1e9 * LINK_EFFICIENCY[where]
    attn_f, attn_b = attention_time(
        model,
        cluster.gpu,
        tp=plan.tp,
        seq_len=seq_len,
        micro_batch=plan.micro_batch,
        flash=True,
        peak=peak,
        nbytes=nbytes,
        kernel_seq=cp_kernel_seq(plan, seq_len),
    )
    passes = 1 + (plan.recompute_fraction if plan.recompute == "full" else 0.0)

    def hidden(fwd: float, bwd: float) -> float:
        return passes * exposed(attn_f / plan.cp, fwd / rate) + exposed(attn_b / plan.cp, bwd / rate)

    full = hidden((ring - 1) * kv, (ring - 1) * kv + ring * grads)
    bounded = len(_bounded_layers(model, seq_len, ring))
    return ((model.layers - bounded) * full + bounded * hidden(kv, kv + grads)) / model.layers


def _ring_block_bytes(model: ModelSpec, plan: Plan, *, tokens: int, nbytes: int) -> float:
    """Bytes of one ring rank's K/V block: ``a x tokens`` tokens of its K/V heads after hybrid's all-to-all, each
    head's key and value at their own widths (``_kv_width``)."""
    a = plan.a2a_degree
    kv_heads = model.kv_heads_per_rank(plan.tp) if a == 1 else _a2a_heads(model, plan)[1] // a
    return tokens * a * kv_heads * _kv_width(model) * nbytes


def _kv_width(model: ModelSpec) -> int:
    """A K/V head's key plus value width: MLA's values (``v_head_dim``) are narrower than its keys (``qk_head_dim``)
    and the ring carries them at their own width (``megakit.nn.attention.transport.pack``), no zero columns."""
    mla = model.config.mla
    return model.head_dim + (mla.v_head_dim if mla else model.head_dim)


def _bounded_layers(model: ModelSpec, seq_len: int, ring: int) -> list[int]:
    """The blocks whose window fits in a ring chunk (``S / (2 ring)`` tokens): their K/V come from the two zig-zag
    neighbours alone (``megakit.nn.attention.transport.Halo``), not around the ring."""
    chunk = seq_len // (2 * ring)
    return [i for i in range(model.layers) if 0 < model.config.attention_window(i) <= chunk]
