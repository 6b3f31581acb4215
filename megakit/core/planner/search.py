"""Enumerate, prune, rank: the layout search and the seed's rule.

The seed's rule (FAQ row 1): while the whole training state of the model fits one
GPU within the memory threshold, train data-parallel (TP = PP = 1), adding ZeRO
only as memory requires; beyond it, model parallelism: TP inside a node
(dividing the heads), PP across nodes, DP for the rest, with ZeRO 0-1 under a
pipeline (ZeRO-2 only with PP = 1; ZeRO-3 only when nothing else fits, under a pipeline with 1F1B or GPipe, one chunk
per stage). Any pinned dimension overrides the rule for that dimension.

Context parallelism (CP) is searched when the sequence is long (``LONG_SEQ`` tokens or more: below
that the per-layer ring costs more than the memory it saves is worth) or pinned, outside the
data-parallel branch: a CP group sits right after TP in the rank order, so TP x CP inside a node
keeps its ring on NVLink, and the cost model prefers CP inside the node to TP across it (which the
search never builds).

Expert parallelism (EP) is searched for an MoE model (or pinned, ``--ep``) inside each layout: every
degree that divides TP x CP x DP and the experts (Megatron's "MoE parallel folding" with expert TP 1,
torchtitan's dp2ep), EP consecutive ranks of a stage, so an EP group fills its node before it leaves it;
attention stays on TP x CP x DP x PP. ZeRO-3 shards the experts over EDP (DeepSpeed's AutoEP placement).

Pruning keeps the search fast: a layout whose model states alone already exceed
the limit is dropped before any micro-batch or recompute choice is tried, and
micro-batches are tried smallest first, stopping at the first that does not fit
(activations only grow with it). The cost model runs only on plans that fit.
"""

from __future__ import annotations

import dataclasses
import itertools

from megakit.core.compression import parse_compression
from megakit.core.partition import max_virtual_stages
from megakit.core.planner.cost import Cost, estimate_cost
from megakit.core.planner.hardware import Cluster
from megakit.core.planner.memory import (
    GIB,
    MemoryEstimate,
    estimate_memory,
    peak_memory,
)
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.pins import Pins, check_pins, divisors, hybrid_degree
from megakit.core.planner.plan import Plan, optimizer_runs_zero, pipeline_runs_zero
from megakit.core.planner.verdict import suggest_fix, verdict
from megakit.errors import UsageError

NO_PINS = Pins()  # nothing fixed: every dimension searched (frozen, so one shared default is safe)
RECOMPUTE_ORDER = ("none", "selective", "full")
TIE = 0.01  # plans within 1 % of the fastest count as equally fast
LONG_SEQ = 16384  # sequences from this length on are also split over CP ranks in the search
OVERHEAD_BYTES = 1.0 * GIB  # CUDA context, cuBLAS/NCCL workspaces, allocator fragmentation


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan that fits, with the memory and cost that ranked it."""

    plan: Plan
    memory: MemoryEstimate
    cost: Cost


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A plan the search dropped and why, so the report can say what stood in the way."""

    plan: Plan | None
    reason: str
    tokens_per_s: float | None = None  # what it would have done, when the cost was evaluated
    kind: str = "memory"  # memory | floor | tp-node | zero-pp | zero-dp | batch | vpp | rule
    peak_gib: float | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The search's answer: the best plan, the ranking behind it and the rejections, for the report."""

    best: Candidate
    ranked: list  # all feasible candidates, best first
    rejected: list
    branch: str  # "data-parallel" | "model-parallel" | "pinned"
    branch_why: str
    limit_bytes: float
    evaluated: int
    fits: str = "yes"  # verdict.VERDICTS: 'above_threshold' only for a fully pinned (judged) layout
    threshold: float = 0.8


def fits_one_gpu(
    model: ModelSpec,
    cluster: Cluster,
    *,
    threshold: float,
    precision: str,
    flash: bool,
    seq_len: int,
    optimizer: str = "adamw",
) -> tuple[bool, float]:
    """Whole training state (ZeRO-0 model states + one sequence with full recompute) on one GPU."""
    est = estimate_memory(
        model,
        optimizer=optimizer,
        precision=precision,
        micro_batch=1,
        seq_len=seq_len,
        recompute="full",
        flash_attention=flash,
        overhead_bytes=OVERHEAD_BYTES,
    )
    return est.total <= threshold * cluster.gpu.mem_gib * GIB, est.total


def tp_choices(model: ModelSpec, world: int) -> list[int]:
    """TP degrees that divide the world and that megakit's model can shard by (``ModelConfig.check_tp``:
    heads, KV heads, hidden and FFN; KV heads are split, never replicated)."""
    return [t for t in divisors(world) if model.tp_ok(t)]


def search(
    model: ModelSpec,
    cluster: Cluster,
    *,
    global_batch: int,
    pins: Pins = NO_PINS,
    threshold: float = 0.8,
    precision: str = "bf16",
    offload: str = "none",
    flash_attention: bool | None = None,
    seq_len: int | None = None,
    keep_rejected: int = 200,
    zero3_fallback: bool = True,
    moe_imbalance: float = 1.0,
    execution: dict | None = None,
) -> SearchResult:
    """The fastest layout under the memory line (``moe_imbalance``: the routing regime, ``Plan.moe_imbalance``;
    ``execution``: Plan fields of how the run executes, the same for every layout: kernels, fp8, ...)."""
    s = model.seq_len if seq_len is None else seq_len
    flash = cluster.gpu.flash_attention if flash_attention is None else flash_attention
    limit = threshold * cluster.gpu.mem_gib * GIB
    pins = pins.resolved()
    if pins.stage_layers is not None:  # planner.stages reads the pinned split from the model
        model = model.with_overrides(stage_layers=pins.stage_layers)
    judged = pins.memory_pinned  # "will my layout fit?": against the whole memory, then a verdict
    world = cluster.num_gpus
    check_pins(model, cluster, pins, global_batch, seq_len=s)
    optimizer = (execution or {}).get("optimizer", "adamw")
    one_gpu, one_gpu_bytes = fits_one_gpu(
        model, cluster, threshold=threshold, precision=precision, flash=flash, seq_len=s, optimizer=optimizer
    )
    branch, why = _branch(cluster, pins, one_gpu, one_gpu_bytes, threshold=threshold)

    hard = cluster.gpu.mem_gib * GIB if judged else limit
    ctx = _Context(
        model,
        cluster,
        pins,
        global_batch,
        s,
        hard,
        precision,
        offload,
        flash,
        keep_rejected,
        moe_imbalance,
        execution or {},
    )
    zeros: tuple[int, ...] = (0, 1, 2, 3) if branch != "model-parallel" or pins.zero is not None else (0, 1, 2)
    if pins.compress != "none":  # megakit compresses ZeRO 0's all-reduce, and (fp16, int8) ZeRO 1's buckets
        zeros = tuple(z for z in zeros if z in ctx.compress_stages)
    zeros = tuple(z for z in zeros if z in ctx.zero_stages)
    ctx.run(branch, zeros)
    if not ctx.feasible and branch == "data-parallel":  # e.g. a global batch smaller than the GPU count
        branch = "model-parallel"
        why += (
            f"; but data parallelism alone cannot use {world} GPUs with a global batch of {global_batch}, "
            "so TP inside a node and PP across nodes take the rest"
        )
        ctx.run(branch, tuple(z for z in (0, 1, 2) if z in ctx.zero_stages))
    zero3_fallback = zero3_fallback and 3 in ctx.zero_stages  # Muon: never ZeRO 3, nor offload
    if not ctx.feasible and branch == "model-parallel" and zero3_fallback:  # memory requires ZeRO-3
        why += "; nothing fit with ZeRO 0-2, so ZeRO-3 shards the model states too"
        ctx.run(branch, (3,))
    if not ctx.feasible and zero3_fallback and offload == "none" and not judged and pins.zero is None:
        # ZeRO-Offload (Ren et al. 2021): fp32 master weights and Adam states in host memory, stepped by
        # DeepSpeed's CPU Adam, gradients down and parameters up over PCIe each step; one GPU is enough.
        typed, ctx.offload = ctx.closest, "optimizer"
        ctx.run(branch, (1, 2, 3))
        ctx.closest = typed or ctx.closest  # a fix is named for the plan without offload (_no_plan_reason)
        if ctx.feasible:
            host = max(_host_bytes(model, c.plan, s) for c in ctx.feasible) * min(cluster.gpus_per_node, world)
            why += (
                f"; nothing fit on the GPUs under the {threshold:.0%} line (pin --zero to judge a layout against "
                "the whole memory instead), so ZeRO-Offload keeps the optimizer in host memory (up to "
                f"{host / GIB:.0f} GiB of CPU memory per node, and PCIe traffic every step)"
            )
    if not ctx.feasible:
        if judged and ctx.closest is not None:
            raise _judged_no(model, cluster, ctx, threshold=threshold, limit=limit)
        raise NoPlan(_no_plan_reason(ctx), memory_bound=ctx.evaluated > 0)
    ranked, rejected = _rank(ctx, limit=limit, keep_rejected=keep_rejected)
    fits = verdict(ranked[0].memory.total, threshold_bytes=limit, gpu_bytes=hard)
    return SearchResult(
        best=ranked[0],
        ranked=ranked,
        rejected=rejected,
        branch=branch,
        branch_why=why,
        limit_bytes=limit,
        evaluated=ctx.evaluated,
        fits=fits,
        threshold=threshold,
    )


def _branch(cluster: Cluster, pins: Pins, one_gpu: bool, one_gpu_bytes: float, *, threshold: float) -> tuple:
    """(branch, why): the rule the search starts from, in words for the report: the pinned layout, data parallelism
    when the whole training state fits one GPU, else TP inside a node and PP across nodes."""
    if pins.layout_pinned:
        return "pinned", "the layout was pinned on the command line"
    if one_gpu:
        return "data-parallel", (
            f"the whole training state ({one_gpu_bytes / GIB:.1f} GiB with one sequence) fits one GPU within "
            f"{threshold:.0%} of {cluster.gpu.mem_gib:,.4g} GiB, so: data parallelism, ZeRO only as memory requires"
        )
    return "model-parallel", (
        f"the whole training state ({one_gpu_bytes / GIB:.0f} GiB) exceeds {threshold:.0%} of one GPU's "
        f"{cluster.gpu.mem_gib:,.4g} GiB, so: TP inside a node, PP across nodes, DP for the rest"
    )


def _rank(ctx: _Context, *, limit: float, keep_rejected: int) -> tuple[list, list]:
    """(ranked, rejected): the feasible plans under the line, fastest first with the simplest near the top first;
    the fastest plans that did not fit (up to ``keep_rejected``), then every structural reason once."""
    under = [c for c in ctx.feasible if c.memory.total <= limit]
    ranked = sorted(under or ctx.feasible, key=lambda c: -c.cost.tokens_per_s)
    # Within TIE of the fastest, the simplest plan wins (lower ZeRO, fewer stages, ...): the seed's
    # "ZeRO only as memory requires" and no complexity the cost model cannot tell apart.
    near = [c for c in ranked if c.cost.tokens_per_s >= (1 - TIE) * ranked[0].cost.tokens_per_s]
    best = min(near, key=_simplicity)
    ranked = [best] + [c for c in ranked if c is not best]
    priced = (r for r in ctx.rejected if r.tokens_per_s is not None)
    rejected = sorted(priced, key=lambda r: -(r.tokens_per_s or 0.0))  # ``or``: mypy cannot see the filter
    return ranked, rejected[:keep_rejected] + [r for r in ctx.rejected if r.tokens_per_s is None]


class NoPlan(UsageError):
    """No layout fits this cluster; ``memory_bound``: some layout got as far as the memory check
    (else every layout was excluded by divisibility: batch, heads, layers). For a judged (fully
    pinned) layout, ``closest`` is its evaluated candidate and ``fix`` the change that fits."""

    def __init__(
        self, message: str, *, memory_bound: bool = True, closest: Candidate | None = None, fix: str | None = None
    ):
        super().__init__(message)
        self.memory_bound, self.closest, self.fix = memory_bound, closest, fix


def _judged_no(model, cluster, ctx, *, threshold, limit) -> NoPlan:
    """Verdict 'no': the pinned layout's peak is over the GPU's memory; name the fix."""
    c = ctx.closest
    fix = suggest_fix(
        model,
        c.plan,
        seq_len=ctx.seq_len,
        world=cluster.num_gpus,
        gpus_per_node=cluster.gpus_per_node,
        threshold_bytes=limit,
        gpu_bytes=cluster.gpu.mem_gib * GIB,
        overhead_bytes=OVERHEAD_BYTES,
    )
    return NoPlan(
        f"the pinned layout {c.plan.describe()} does not fit: peak {c.memory.total / GIB:.1f} GiB > "
        f"the {cluster.gpu.mem_gib:,.4g} GiB of one {cluster.gpu.name} ({threshold:.0%} line "
        f"{limit / GIB:.1f} GiB); fix: {fix}",
        closest=c,
        fix=fix,
    )


def _host_bytes(model: ModelSpec, plan: Plan, seq_len: int) -> float:
    """What an offloaded plan keeps in host memory per GPU: the fp32 master, Adam and step gradients, the experts'
    with the dense ones."""
    on_gpu = peak_memory(model, seq_len=seq_len, **dataclasses.replace(plan, offload="none").memory_kwargs())
    return sum(
        on_gpu.items.get(k, 0.0)
        for k in ("master_params", "optimizer", "expert_master_params", "expert_optimizer", "fp32_step_grads")
    )


def _simplicity(c: Candidate):
    p = c.plan
    return (
        p.zero_stage,
        p.pp,
        p.cp,
        p.tp,
        p.ep,
        RECOMPUTE_ORDER.index(p.recompute),
        p.vpp,
        not p.sequence_parallel,
        c.memory.total,
    )


def _no_plan_reason(ctx) -> str:
    where = f"{ctx.cluster.num_gpus} x {ctx.cluster.gpu.name}"
    if ctx.evaluated == 0:
        dps = sorted({r.plan.dp for r in ctx.rejected if r.kind == "batch"})
        if dps:
            return (
                f"no layout of {where} divides the global batch {ctx.global_batch} (DP would be "
                f"{', '.join(map(str, dps[:6]))}); pick --global-batch divisible by one of them or another "
                "GPU count"
            )
        # the pin that excluded everything says more than the seed's rule or the node boundary
        why = sorted(ctx.rejected, key=lambda r: r.kind in ("rule", "tp-node"))
        if not why:
            return (
                f"no layout of {where} passes the pinned dimensions; relax --tp, --pp, --zero or --vpp, or "
                "use another GPU count"
            )
        return f"no layout of {where} can run: {why[0].reason}"
    smallest = min((r for r in ctx.rejected if r.peak_gib is not None), default=None, key=lambda r: r.peak_gib)
    detail = f" (the smallest peak found: {smallest.reason})" if smallest else ""
    c = ctx.closest
    if ctx.pins.layout_pinned and c is not None:  # a layout the user typed: name the change that fits it
        fix = suggest_fix(
            ctx.model,
            c.plan,
            seq_len=ctx.seq_len,
            world=ctx.cluster.num_gpus,
            gpus_per_node=ctx.cluster.gpus_per_node,
            threshold_bytes=ctx.limit,
            gpu_bytes=ctx.cluster.gpu.mem_gib * GIB,
            overhead_bytes=OVERHEAD_BYTES,
        )
        detail += f"; the closest layout {c.plan.describe()} peaks at {c.memory.total / GIB:.1f} GiB, fix: {fix}"
    return f"no layout fits {where}{detail}"


class _Context:
    """Search state: what fits, what was rejected and why."""

    def __init__(
        self,
        model,
        cluster,
        pins,
        global_batch,
        seq_len,
        limit,
        precision,
        offload,
        flash,
        keep,
        moe_imbalance=1.0,
        execution=None,
    ) -> None:
        self.model, self.cluster, self.pins, self.global_batch = model, cluster, pins, global_batch
        self.execution = execution or {}
        self.moe_imbalance = moe_imbalance
        self.seq_len, self.limit, self.precision, self.offload, self.flash = seq_len, limit, precision, offload, flash
        self.keep = keep
        self.compress_stages = parse_compression(pins.compress).zero_stages  # where --compress applies
        optimizer = self.execution.get("optimizer", "adamw")  # the stages it runs at (Muon: 1-2, 0 in fp32)
        self.zero_stages = tuple(
            z for z in range(4) if optimizer_runs_zero(z, optimizer=optimizer, precision=precision)
        )
        self.feasible: list[Candidate] = []
        self.rejected: list[Rejection] = []
        self.reasons_seen: set = set()
        self.evaluated = 0
        self.closest: Candidate | None = None  # the evaluated plan with the smallest peak over the limit

    def reject(self, plan, reason, tokens_per_s=None, *, unique_key=None, kind="memory", peak=None):
        key = unique_key or reason
        if tokens_per_s is None and key in self.reasons_seen:
            return
        self.reasons_seen.add(key)
        plan = dataclasses.replace(plan, **self.execution)  # a structural rejection is built without them
        self.rejected.append(Rejection(plan, reason, tokens_per_s, kind, None if peak is None else peak / GIB))

    def run(self, branch: str, zeros) -> None:
        m, c, pins = self.model, self.cluster, self.pins
        world, node = c.num_gpus, c.gpus_per_node
        tps = [pins.tp] if pins.tp is not None else tp_choices(m, world)
        for tp in tps:
            if pins.tp is None and branch == "data-parallel" and tp > 1:
                self.reject(
                    Plan(tp=tp),
                    "model fits one GPU: the seed's rule trains it data-parallel (TP=1)",
                    unique_key="dp-branch-tp",
                    kind="rule",
                )
                continue
            if pins.tp is None and (tp > node or node % tp):
                self.reject(
                    Plan(tp=tp),
                    f"TP={tp} {'crosses' if tp > node else 'straddles'} the node ({node} "
                    "GPUs per node): its per-layer all-reduces would run on the network",
                    unique_key=f"tp-node-{tp}",
                    kind="tp-node",
                )
                continue
            for cp in self._cps(branch, tp):
                self._pps(branch, zeros, tp, cp)

    def _cps(self, branch: str, tp: int) -> list[int]:
        """CP degrees to try with this TP: the pin, 1, and for a long sequence outside the data-parallel
        branch every degree that splits it into 2 x CP chunks and fits beside TP in the GPU count."""
        if self.pins.cp is not None:
            return [self.pins.cp]
        if branch == "data-parallel" or self.seq_len < LONG_SEQ:
            return [1]
        mixers = self.model.config.mamba  # Mamba-2 splits its heads and groups over TP x CP
        return [
            c
            for c in divisors(self.cluster.num_gpus // tp)
            if self.seq_len % (2 * c) == 0 and not (mixers and mixers.split_conflicts(tp * c))
        ]

    def _pps(self, branch: str, zeros, tp: int, cp: int) -> None:
        m, pins, world = self.model, self.pins, self.cluster.num_gpus
        pps = [pins.pp] if pins.pp is not None else [p for p in divisors(world // (tp * cp)) if p <= m.layers]
        if (pins.vpp or 1) > 1:  # interleaving needs a pipeline
            for pp in [p for p in pps if p == 1]:
                self.reject(
                    Plan(tp=tp, pp=pp),
                    f"--vpp {pins.vpp} needs PP > 1; pin --pp 2 or more, or drop --vpp",
                    unique_key="vpp-pp1",
                    kind="vpp",
                )
            pps = [p for p in pps if p > 1]
        for pp in pps:
            if world % (tp * pp * cp):
                continue
            dp = world // (tp * pp * cp)
            if pins.pp is None and branch == "data-parallel" and pp > 1:
                self.reject(
                    Plan(pp=pp),
                    "model fits one GPU: the seed's rule trains it data-parallel (PP=1)",
                    unique_key="dp-branch-pp",
                    kind="rule",
                )
                continue
            if self.global_batch % dp:
                self.reject(
                    Plan(tp=tp, pp=pp, dp=dp),
                    f"global batch {self.global_batch} is not a multiple of DP={dp}",
                    unique_key=f"batch-dp-{dp}",
                    kind="batch",
                )
                continue
            for zero in [pins.zero] if pins.zero is not None else zeros:
                if not pipeline_runs_zero(
                    zero, pp=pp, vpp=pins.vpp or 1, zero_bubble=pins.schedule == "zb-h1", offload=self.offload
                ):
                    self.reject(
                        Plan(tp=tp, pp=pp, dp=dp, zero_stage=zero),
                        f"ZeRO-{zero} with PP={pp}: megakit's "
                        "pipeline runs ZeRO 0, 1 and 3 (3 with 1F1B, one chunk per stage, no offload)",
                        unique_key=f"zero-pp-{zero}",
                        kind="zero-pp",
                    )
                    continue
                shard = self.execution.get("dp_shard", 0)
                if zero == 3 and shard and dp * cp > shard and dp * cp % shard:
                    self.reject(
                        Plan(tp=tp, pp=pp, dp=dp, zero_stage=zero),
                        f"HSDP shard group {shard} does not divide DP x CP = {dp * cp}; pick --dp-shard dividing it",
                        unique_key=f"hsdp-{dp * cp}",
                        kind="zero-dp",
                    )
                    continue
                if zero >= 1 and dp * cp == 1 and self.offload == "none" and 0 in self.zero_stages:  # offload runs
                    # ZeRO on one replica; Muon in bf16 or fp16 runs ZeRO 1 there
                    if pins.zero is not None:
                        self.reject(
                            Plan(tp=tp, pp=pp, dp=dp, zero_stage=zero),
                            f"--zero {zero} shards over "
                            f"data-parallel replicas but TP={tp} x PP={pp} leaves DP=1 with {world} "
                            "GPU(s); use --zero 0 (the same with one replica) or more GPUs",
                            unique_key=f"zero-dp1-{tp}-{pp}",
                            kind="zero-dp",
                        )
                    continue  # identical to ZeRO-0
                self._layout(tp, pp, dp, zero, cp)

    def _eps(self, tp, pp, dp, cp) -> list[int]:
        """EP degrees for this layout: the pin, or every one dividing TP x CP x DP and the experts (1 if dense)."""
        moe = self.model.moe
        if moe is None:
            return [1]
        folded = tp * dp * cp
        eps = [self.pins.ep] if self.pins.ep is not None else divisors(folded)
        ok = [e for e in eps if folded % e == 0 and moe.experts % e == 0]
        for e in sorted(set(eps) - set(ok)):
            self.reject(
                Plan(tp=tp, pp=pp, dp=dp, cp=cp, ep=e),
                f"EP={e} does not divide TP x CP x DP = {folded} and the {moe.experts} experts",
                unique_key=("ep", e, folded),
                kind="ep",
            )
        return ok

    def _cp_modes(self, tp: int, cp: int) -> list[tuple[str, int]]:
        """How CP ranks attend, ``(mode, hybrid's a2a degree)``: the pin, or the ring, Ulysses' a2a where each TP
        rank's heads divide by CP, and hybrid at ``hybrid_degree`` where one exists."""
        if cp == 1:
            return [("ring", 0)]
        heads, a = self.model.heads // tp, hybrid_degree(self.model, self.cluster, tp, cp, self.pins.cp_a2a)
        modes = [("ring", 0)] + ([("a2a", 0)] if heads % cp == 0 else []) + ([("hybrid", a)] if a else [])
        return [m for m in modes if self.pins.cp_mode in (None, m[0])]

    def _layout(self, tp, pp, dp, zero, cp=1) -> None:
        for ep in self._eps(tp, pp, dp, cp):
            self._layout_ep(tp, pp, dp, zero, cp, ep)

    def _layout_ep(self, tp, pp, dp, zero, cp, ep) -> None:
        m, pins = self.model, self.pins
        per_rank = self.global_batch // dp
        base = Plan(
            tp=tp,
            pp=pp,
            dp=dp,
            cp=cp,
            zero_stage=zero,
            micro_batch=1,
            accumulation=per_rank,
            recompute="full",
            sequence_parallel=tp > 1,
            precision=self.precision,
            offload=self.offload,
            flash_attention=self.flash,
            compress=pins.compress if zero in self.compress_stages else "none",
            zero_bubble=pins.schedule == "zb-h1" and pp > 1,
            ep=ep,
            loss_chunks=pins.loss_chunks,
            moe_imbalance=self.moe_imbalance if m.moe is not None else 1.0,
            **self.execution,
        )
        if self.offload == "params" and zero != 3:
            return
        # Lower bound: the smallest activations this layout can have (one sequence, full recompute);
        # a judged layout skips it: its own plan is evaluated, so that a verdict 'no' can name the fix.
        floor = (
            None
            if pins.memory_pinned
            else peak_memory(m, seq_len=self.seq_len, overhead_bytes=OVERHEAD_BYTES, **base.memory_kwargs())
        )
        self.evaluated += 1
        if floor is not None and floor.total > self.limit:
            self.reject(
                base,
                f"peak {floor.total / GIB:.2f} GiB > {self.limit / GIB:.2f} GiB even with one "
                f"sequence and full recompute (model states {floor.model_states / GIB:.1f} GiB)",
                unique_key=("floor", tp, pp, zero, ep),
                kind="floor",
                peak=floor.total,
            )
            return
        # Virtual stages need not divide the layers: the split (partition_layers) gives some chunks fewer.
        vpps = [pins.vpp] if pins.vpp is not None else [v for v in (1, 2, 3, 4) if v == 1 or pp > 1]
        vpps = [1] if pins.schedule is not None or zero == 3 else vpps  # a pinned schedule, ZeRO 3: one chunk
        mixers = m.config.linear is not None or bool(m.config.layer_pattern)  # selective recomputes their cores
        recomputes = (
            [pins.recompute]
            if pins.recompute
            else [r for r in RECOMPUTE_ORDER if not (r == "selective" and self.flash and not mixers)]
        )
        sps = [pins.sequence_parallel] if pins.sequence_parallel is not None else ([True, False] if tp > 1 else [False])
        mbs = [pins.micro_batch] if pins.micro_batch else [b for b in divisors(per_rank) if b <= 64]
        for vpp in vpps:
            if pp * vpp > max_virtual_stages(m.layers) and pins.stage_layers is None:  # ends may hold no block
                self.reject(
                    Plan(tp=tp, pp=pp, vpp=vpp),
                    f"PP={pp} x VPP={vpp} stages exceed the {m.layers} layers "
                    "plus an embedding-only and a loss-only stage",
                    unique_key=("vpp-layers", pp, vpp),
                    kind="vpp",
                )
                continue
            # the CP mode prices the attention exchange only (memory is the same), so it is tried past the floor
            for recompute, sp, (cp_mode, cp_a2a) in itertools.product(recomputes, sps, self._cp_modes(tp, cp)):
                layout = dict(vpp=vpp, recompute=recompute, sequence_parallel=sp, cp_mode=cp_mode, cp_a2a=cp_a2a)
                self._micro_batches(base, layout, mbs, per_rank=per_rank)

    def _micro_batches(self, base: Plan, layout: dict, mbs: list, *, per_rank: int) -> None:
        """Each micro-batch of one layout, smallest first, until one does not fit: a bigger one only needs more."""
        m, pp, vpp = self.model, base.pp, layout["vpp"]
        for mb in mbs:
            if per_rank % mb:
                continue
            ga = per_rank // mb
            plan = dataclasses.replace(base, **layout, micro_batch=mb, accumulation=ga)
            if vpp > 1 and ga % pp:
                self.reject(
                    plan,
                    f"interleaving (VPP={vpp}) needs the {ga} micro-batches to be a multiple of PP={pp}",
                    unique_key=("vpp-ga", pp, vpp),
                    kind="vpp",
                )
                continue
            self.evaluated += 1
            mem = peak_memory(m, seq_len=self.seq_len, overhead_bytes=OVERHEAD_BYTES, **plan.memory_kwargs())
            cost = estimate_cost(m, self.cluster, plan, seq_len=self.seq_len)
            if mem.total > self.limit:
                if self.closest is None or mem.total < self.closest.memory.total:
                    self.closest = Candidate(plan, mem, cost)
                self.reject(
                    plan,
                    f"peak {mem.total / GIB:.2f} GiB > {self.limit / GIB:.2f} GiB "
                    f"({self.limit / GIB / self.cluster.gpu.mem_gib:.0%} of "
                    f"{self.cluster.gpu.mem_gib:,.4g} GiB)",
                    cost.tokens_per_s,
                    peak=mem.total,
                )
                break  # a bigger micro-batch only needs more
            self.feasible.append(Candidate(plan, mem, cost))


def smallest_cluster(model: ModelSpec, make_cluster, *, global_batch: int, max_nodes: int = 4096, **kwargs):
    """Search 1, 2, 3 … nodes (starting from a memory lower bound) and return the first result that fits."""
    probe = make_cluster(1)
    per_node = probe.gpus_per_node
    limit = kwargs.get("threshold", 0.8) * probe.gpu.mem_gib * GIB
    floor_states = estimate_memory(model, dp=1, zero_stage=3, precision=kwargs.get("precision", "bf16"))
    start = max(1, int(floor_states.model_states // (limit * per_node)))
    pins = kwargs.get("pins", Pins())
    fixed = (pins.tp or 1) * (pins.pp or 1) * (pins.cp or 1) * (pins.ep or 1)
    for nodes in range(start, max_nodes + 1):
        if (nodes * per_node) % fixed:
            continue  # the pinned TP x PP does not divide this many GPUs
        try:
            return nodes, search(model, make_cluster(nodes), global_batch=global_batch, zero3_fallback=False, **kwargs)
        except NoPlan:
            continue
    raise UsageError(f"the model does not fit on {max_nodes} nodes of {probe.gpu.name}; use bigger GPUs")
