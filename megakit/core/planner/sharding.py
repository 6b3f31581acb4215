"""Data-parallel traffic and how much of it the compute hides: DDP/ZeRO-1/2 and sharded DP (ZeRO-3, FSDP).

Bandwidth: a group inside one node runs on the intra-node link. A group that spans nodes runs on
the network, and when ``k`` of its members share a node, NCCL's rings use all ``k`` of their NICs
at once (one channel per rail), so the group moves ``k ×`` one GPU's share, up to the intra-node
link (``group_bandwidth``). A DP group strided by TP = 8 has one member per node: one NIC's worth.

Sharded data parallelism as FSDP and DeepSpeed ZeRO-3 run it today (Zhao et al. 2023, PyTorch FSDP,
Sec. 3.3-3.4; the PyTorch/IBM blog "Maximizing training throughput using PyTorch FSDP", 2024): per
micro-batch, every block's parameters are all-gathered before its forward, the next block's gather
prefetched behind the current block's compute; in backward each block is gathered again and its
gradient reduce-scattered, both behind the backward of its neighbour. What cannot hide: the first
gathers (the root unit -- embedding, final norm, head -- and the first block) and the last
reduce-scatter. Each overlap is the smooth maximum ``overlapped`` (NCCL kernels take SMs and HBM
bandwidth from the GEMMs beside them). HSDP shards inside ``dp_shard`` ranks (a node) and all-reduces
the gradient shard across the replicas.

``Plan.zero3`` says who runs it (``ZERO3``): FSDP prefetches the whole next block; DeepSpeed prefetches
only ``stage3_prefetch_bucket_size`` elements ahead (``Buckets.stage3_prefetch``, what ``emit`` writes),
so the rest of a large block's gather waits in the open. DeepSpeed ZeRO-3 of 2021 (Narayanan et al.
2021, Table 2) is the planner's previous model, kept for those rows: the whole step's gathers and
reduce-scatters at one GPU's network share, overlapped with the step's compute as one smooth maximum.
"""

from __future__ import annotations

from megakit.core.compression import parse_compression
from megakit.core.planner.hardware import Cluster
from megakit.core.planner.memory import PRECISIONS, Buckets
from megakit.core.planner.plan import Plan

ZERO3 = ("deepspeed", "fsdp", "deepspeed-2021")
LINK_EFFICIENCY = {"intra": 0.90, "inter": 0.63}  # achieved collective bandwidth / link bandwidth
# An all-to-all's cross-node part is one RDMA write per peer, no ring of n - 1 dependent steps through every node:
# it keeps the NIC near its line rate. DeepEP's normal kernels (deepseek-ai/DeepEP README, H800 + CX7 400 Gb/s,
# ~50 GB/s): 43, 58 and 51 GB/s of RDMA bottleneck bandwidth at EP 16, 32 and 64 (dispatch; combine 43, 57, 50).
A2A_LINK_EFFICIENCY = {"intra": LINK_EFFICIENCY["intra"], "inter": 0.90}
OVERLAP_NORM = 8.0  # compute and traffic running together take (C^k + Z^k)^(1/k): k=1 no overlap, k=inf perfect
OVERLAP_NORM_2021 = 2.75  # the previous model's whole-step overlap, fitted to Narayanan et al. 2021 Table 2


def overlapped(compute_s: float, comm_s: float, k: float | None = None) -> float:
    """Time of compute and communication that run concurrently: a smooth maximum."""
    if comm_s <= 0:
        return compute_s
    k = OVERLAP_NORM if k is None else k
    return (compute_s**k + comm_s**k) ** (1 / k)


def exposed(compute_s: float, comm_s: float, k: float | None = None) -> float:
    """What communication adds to compute it runs beside."""
    return overlapped(compute_s, comm_s, k) - compute_s


def group_bandwidth(cluster: Cluster, span: int, stride: int) -> tuple[float, str]:
    """(GB/s, 'intra' | 'inter') of a group of ``span`` ranks ``stride`` apart."""
    group = span * stride
    node = cluster.gpus_per_node
    if group <= node and node % group == 0:
        return cluster.gpu.intra_gbps, "intra"
    per_node = max(1, min(span, node // stride)) if stride < node else 1
    return min(cluster.gpu.intra_gbps, per_node * cluster.gpu.inter_gbps), "inter"


def collective_time(nbytes: float, ranks: int, gbps: float, where: str, *, kind: str = "all_reduce") -> float:
    """Ring collective time: all-reduce moves 2(n-1)/n of the data, gather / scatter (n-1)/n."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    factor = (2 if kind == "all_reduce" else 1) * (ranks - 1) / ranks
    return factor * nbytes / (gbps * 1e9 * LINK_EFFICIENCY[where])


def all_to_all_time(cluster: Cluster, nbytes: float, ranks: int, stride: int) -> float:
    """One all-to-all in which each of ``ranks`` ranks (``stride`` apart) sends ``nbytes`` spread evenly
    over the group, keeping 1/ranks: the peers inside its node are reached over the intra-node link,
    the others over its NIC, both at once (the slower part sets the time). So an EP group inside a
    node runs on NVLink, and one that spans nodes pays the network for the share that leaves the node."""
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    node = cluster.gpus_per_node
    local = max(1, min(ranks, node // stride)) if stride < node else 1  # group members in one node
    intra = nbytes * (local - 1) / ranks / (cluster.gpu.intra_gbps * 1e9 * A2A_LINK_EFFICIENCY["intra"])
    inter = nbytes * (ranks - local) / ranks / (cluster.gpu.inter_gbps * 1e9 * A2A_LINK_EFFICIENCY["inter"])
    return max(intra, inter)


def node_deduplicated_all_to_all_time(cluster: Cluster, token_bytes: float, top_k: float, ranks: int) -> float:
    """One dispatch (or combine) by a DeepEP-class dispatcher (DeepEP, HybridEP: Megatron's ``flex``): each of this
    rank's tokens crosses to each *node* holding one of its ``top_k`` experts once, over the NIC, and fans out to
    the experts' GPUs there over NVLink (DeepSeek-V3 Sec. 3.2.2; the DeepEP README). With experts spread evenly over
    the EP group's ``n`` nodes, a token reaches ``(n - 1)(1 - (1 - 1/n)^k)`` other nodes, against ``k (n - 1)/n``
    copies for a dispatcher that sends one copy per expert (``all_to_all_time``). ``token_bytes``: the rank's tokens
    once."""
    node = cluster.gpus_per_node
    nodes = -(-ranks // node)
    if ranks <= 1 or token_bytes <= 0:
        return 0.0
    remote_nodes = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)
    intra = token_bytes * top_k * (ranks - 1) / ranks / (cluster.gpu.intra_gbps * 1e9 * A2A_LINK_EFFICIENCY["intra"])
    inter = token_bytes * remote_nodes / (cluster.gpu.inter_gbps * 1e9 * A2A_LINK_EFFICIENCY["inter"])
    return max(intra, inter)


def dp_time(
    cluster: Cluster,
    plan: Plan,
    *,
    psi: float,
    layer_params: float,
    layers: int,
    stage_s: float,
    layer_fwd_s: float,
    layer_bwd_s: float,
    prefetch: float = Buckets().stage3_prefetch,
) -> float:
    """Exposed data-parallel communication of one optimizer step on the slowest stage.

    ``psi``: parameters on this GPU's TP×PP shard; ``layer_params``: one block's; ``stage_s``: one
    micro-batch's forward + backward on the stage; ``layer_*_s``: one block's (with TP traffic)."""
    t, d, m = plan.tp, plan.dp, plan.accumulation
    if d == 1:
        return 0.0
    nbytes = PRECISIONS[plan.precision]
    rbytes = PRECISIONS[plan.grad_reduce_precision]
    bw, where = group_bandwidth(cluster, d, t)
    last_bwd = stage_s * 2 / 3  # a micro-batch's backward: what DP traffic can hide behind
    if plan.compress != "none" and plan.zero_stage <= 1:  # megakit's exchange, after the backward: nothing hides it
        codec = parse_compression(plan.compress)
        payload = psi * codec.wire_bytes_per_element()  # what each rank contributes
        if codec.collective == "all_reduce":  # fp16; int8, sign in two phases (all-to-all, all-gather), same bytes
            grads = collective_time(payload, d, bw, where)
        else:  # Top-K: every rank's pairs
            grads = collective_time(payload * d, d, bw, where, kind="all_gather")
        if plan.zero_stage == 1:  # ZeRO-1 then gathers every rank's updated shard of the weights
            grads += collective_time(psi * nbytes, d, bw, where, kind="all_gather")
        return grads
    if plan.zero_stage == 1 and plan.comm_overlap:  # Megatron-Core's distributed optimizer, overlapped both ways
        reduce = collective_time(psi * rbytes, d, bw, where, kind="reduce_scatter")
        gather = collective_time(psi * nbytes, d, bw, where, kind="all_gather")
        return exposed(last_bwd, reduce) + exposed(stage_s - last_bwd, gather)
    if plan.zero_stage <= 1:  # one all-reduce at the accumulation boundary, behind the last backward
        return exposed(last_bwd, collective_time(psi * rbytes, d, bw, where))
    if plan.zero_stage == 2:  # reduce-scatter in every micro-batch's backward, gather after the step
        per_mb = collective_time(psi * rbytes, d, bw, where, kind="reduce_scatter")
        return m * exposed(last_bwd, per_mb) + collective_time(psi * nbytes, d, bw, where, kind="all_gather")
    if plan.zero3 == "deepspeed-2021":
        one_gpu = cluster.gpu.intra_gbps if t * d <= cluster.gpus_per_node else cluster.gpu.inter_gbps
        gather = collective_time(psi * nbytes, d, one_gpu, where, kind="all_gather")
        forward = stage_s - last_bwd
        k = OVERLAP_NORM_2021
        return m * (exposed(forward, gather, k) + exposed(last_bwd, 2 * gather, k))
    g = plan.shard_group
    bw, where = group_bandwidth(cluster, g, t)
    r_bw, r_where = group_bandwidth(cluster, d // g, t * g)  # HSDP replicas: one member per shard group

    def unit(params):  # (gather, reduce-scatter + replica all-reduce) of one FSDP unit
        gather = collective_time(params * nbytes, g, bw, where, kind="all_gather")
        reduce = collective_time(params * rbytes, g, bw, where, kind="reduce_scatter")
        reduce += collective_time(params / g * rbytes, d // g, r_bw, r_where)
        return gather, reduce

    block_gather, block_reduce = unit(layer_params)
    root_gather, root_reduce = unit(max(psi - layers * layer_params, 0.0))
    ahead = 1.0 if plan.zero3 == "fsdp" else min(1.0, prefetch / layer_params)  # share of a gather prefetched
    late = (1 - ahead) * block_gather  # what DeepSpeed fetches only when the block starts
    forward = root_gather + block_gather + (layers - 1) * (late + exposed(layer_fwd_s, ahead * block_gather))
    backward = layers * (late + exposed(layer_bwd_s, ahead * block_gather + block_reduce))
    return m * (forward + backward + block_reduce + root_reduce)
