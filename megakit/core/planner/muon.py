"""What ``--optimizer muon`` costs one GPU: its moment, its Newton-Schulz FLOPs, its TP and DP exchanges, its step's
buffers.

As ``megakit.train.engine.muon`` runs it: Muon keeps one fp32 moment (``momentum_buffer``) per hidden matrix where
Adam keeps two, and every step orthogonalises each whole matrix with 5 Newton-Schulz iterations. An iteration on an
``m x n`` matrix (``m <= n``, torch transposes a tall one) costs ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2
m^2 n) FLOPs: ``4 m^2 n + 2 m^3``. TP-split matrices go layer-wise over TP: each goes whole to one owner rank, which
runs its iterations (so the TP ranks share the FLOPs), and its slices come back: two all-to-alls in which each rank
receives about ``2 (TP-1)/TP^2`` of the split matrices' fp32 bytes. Replicated ones (MLA's down projections,
megakit's shared experts) run on every TP rank. At ZeRO 0 every DP rank runs the same iterations; at ZeRO 1-2 the
momentum is partitioned over DP like Adam's moments, each matrix has one owner DP rank, and two all-to-alls over DP
(EDP for the experts) each move about the rank's partition of the Muon weights (pieces to owners, orthogonalised
pieces back), so the DP ranks share the FLOPs too (``megakit.train.engine.muon_zero``). Experts are whole on their EP
rank: each of an expert's gate, up and down is a matrix of its own.

Which weights: ``ModelConfig.block_params``' matrices (``matmul``: attention's or a mixer's projections, the MLP's,
the shared experts') and the routed experts' matrices step with Muon; the embeddings, the head, the norms, the
biases, the routers and the conv taps with AdamW (``uses_muon``). The FLOPs walk each block's own matrices
(``layer_matrices``: a hybrid's Gated DeltaNet or Mamba-2 mixers theirs). Pure arithmetic on the ``ModelConfig``; the
FLOPs leave the MTP modules' matrices out (small next to the blocks), the memory counts them.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakit.core.families import nemotron_h
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.stages import stage_layer_counts, stage_moe_layers

OPTIMIZERS = ("adamw", "muon")
NS_STEPS = 5  # torch.optim.Muon's default
MOMENT_BYTES = 4  # one fp32 moment


@dataclass(frozen=True, kw_only=True)
class Matrix:
    """``count`` matrices of ``rows x cols`` per block kind: ``tp_split`` over TP, or an ``expert``'s (over EP)."""

    what: str
    rows: int
    cols: int
    count: int = 1
    tp_split: bool = True
    expert: bool = False


def newton_schulz_flops(rows: int, cols: int, steps: int = NS_STEPS) -> float:
    """FLOPs of ``steps`` Newton-Schulz iterations on one whole ``rows x cols`` matrix."""
    m, n = min(rows, cols), max(rows, cols)
    return steps * (4.0 * m * m * n + 2.0 * m**3)


def block_matrices(config, *, moe: bool) -> list[Matrix]:
    """The hidden matrices of one attention block (dense or MoE) of ``config``, as Muon steps them."""
    return _attention(config) + _mlp(config, moe=moe)


def layer_matrices(config, index: int) -> list[Matrix]:
    """The hidden matrices of block ``index``: its mixer's (attention, MLA, Gated DeltaNet or Mamba-2) and its MLP's
    or experts' (Nemotron-H: one of them per block, by its pattern)."""
    if config.layer_pattern:
        part = nemotron_h.PATTERN[config.layer_pattern[index]]
        if part == "mamba":
            return _mamba(config)
        return _attention(config) if part == "attention" else _mlp(config, moe=part == "moe")
    moe = config.is_moe_layer(index)
    if config.linear is not None and config.linear.is_linear(index):
        return _gated_deltanet(config) + _mlp(config, moe=moe)
    return block_matrices(config, moe=moe)


def _attention(config) -> list[Matrix]:
    h, hd = config.hidden, config.head_dim
    if config.mla is None:  # Qwen3-Next's q_proj holds each head's output gate too
        q = Matrix(what="q", rows=(1 + config.attn_output_gate) * config.heads * hd, cols=h)
        kv = Matrix(what="k, v", rows=config.kv_heads * hd, cols=h, count=2)
        return [q, kv, Matrix(what="o", rows=h, cols=config.heads * hd)]
    m, out = config.mla, []
    if m.q_lora_rank:
        out += [Matrix(what="q_a", rows=m.q_lora_rank, cols=h, tp_split=False)]
        out += [Matrix(what="q_b", rows=config.heads * m.qk_head_dim, cols=m.q_lora_rank)]
    else:
        out += [Matrix(what="q", rows=config.heads * m.qk_head_dim, cols=h)]
    out += [Matrix(what="kv_a", rows=m.kv_lora_rank + m.qk_rope_head_dim, cols=h, tp_split=False)]
    out += [Matrix(what="kv_b", rows=config.heads * (m.qk_nope_head_dim + m.v_head_dim), cols=m.kv_lora_rank)]
    return out + [Matrix(what="o", rows=h, cols=config.heads * m.v_head_dim)]


def _gated_deltanet(config) -> list[Matrix]:
    """``megakit.nn.linear_attention``'s projections: in_q, in_k, in_v, in_z, in_b, in_a and out_proj."""
    a, h = config.linear, config.hidden
    nk, nv = a.key_heads * a.key_head_dim, a.value_heads * a.value_head_dim
    return [
        Matrix(what="in_q, in_k", rows=nk, cols=h, count=2),
        Matrix(what="in_v, in_z", rows=nv, cols=h, count=2),
        Matrix(what="in_b, in_a", rows=a.value_heads, cols=h, count=2),
        Matrix(what="out_proj", rows=h, cols=nv),
    ]


def _mamba(config) -> list[Matrix]:
    """Mamba-2's projections as megakit splits its in_proj: z, x, B, C, dt, and out_proj."""
    m, h = config.mamba, config.hidden
    return [
        Matrix(what="z, x", rows=m.inner, cols=h, count=2),
        Matrix(what="B, C", rows=m.groups * m.state, cols=h, count=2),
        Matrix(what="dt", rows=m.heads, cols=h),
        Matrix(what="out_proj", rows=h, cols=m.inner),
    ]


def _mlp(config, *, moe: bool) -> list[Matrix]:
    h = config.hidden
    if not moe:
        mats = 2 if config.gated_mlp else 1
        up = Matrix(what="gate, up" if mats == 2 else "up", rows=config.ffn, cols=h, count=mats)
        return [up, Matrix(what="down", rows=h, cols=config.ffn)]
    e = config.moe
    ups, what = e.matrices - 1, "gate, up" if e.matrices == 3 else "up"  # Nemotron-3's relu2 experts: up only
    out = [Matrix(what=f"experts' {what}", rows=e.ffn, cols=h, count=ups * e.experts, tp_split=False, expert=True)]
    out += [Matrix(what="experts' down", rows=h, cols=e.ffn, count=e.experts, tp_split=False, expert=True)]
    if e.shared_ffn:  # whole on every TP rank (``megakit.nn.moe.layer.SharedExpert``)
        out += [Matrix(what=f"shared {what}", rows=e.shared_ffn, cols=h, count=ups, tp_split=False)]
        out += [Matrix(what="shared down", rows=h, cols=e.shared_ffn, tp_split=False)]
    return out


@dataclass(frozen=True, kw_only=True)
class MuonCost:
    """Per GPU and step: Muon's parameters (the routed experts' among them), its moment's bytes (Adam's would be
    twice), the Newton-Schulz FLOPs this GPU runs, the bytes it receives in the TP and the DP exchanges, and the
    rows of the largest matrices for the report."""

    params: float
    expert_params: float
    moment_bytes: float
    ns_flops: float
    gather_bytes: float  # the TP exchange, received
    dp_bytes: float  # ZeRO 1-2's DP (and EDP) exchange, received
    rows: tuple[tuple[str, int, int, int, float], ...]  # (what, rows, cols, in the GPU's stage, FLOPs per iteration)


def muon_cost(config, *, tp: int = 1, pp: int = 1, ep: int = 1, dp: int = 1, edp: int = 1) -> MuonCost:
    """``config``'s Muon cost on one GPU of a TP x PP x EP layout (an even share of the blocks per stage). ``dp``,
    ``edp``: the ranks that share the orthogonalisation and hold 1/``dp`` of the momentum (ZeRO 1-2: DP x CP, and
    EDP for the experts; 1 at ZeRO 0, where every DP rank runs all of it)."""
    params = experts = flops = gather = 0.0
    rows: dict[tuple[str, int, int], float] = {}
    for index in range(config.layers):
        for m in layer_matrices(config, index):
            count = m.count / pp / (ep if m.expert else 1)
            size = m.rows * m.cols
            shard = size / tp if m.tp_split else size
            share = edp if m.expert else dp  # the ranks that share this matrix's momentum and iterations
            params += count * shard
            experts += count * shard if m.expert else 0.0
            flops += count * newton_schulz_flops(m.rows, m.cols) / (tp if m.tp_split else 1) / share
            if m.tp_split and tp > 1:  # to the owners and back: each rank's 1/TP of the matrices, less its own slice
                gather += 2 * count * size / tp * (tp - 1) / tp * MOMENT_BYTES / share
            key = (m.what, m.rows, m.cols)
            rows[key] = rows.get(key, 0.0) + count
    dense = params - experts
    exchanged = [(dense, dp), (experts, edp)]
    dp_bytes = sum(2 * n * MOMENT_BYTES / g * (g - 1) / g for n, g in exchanged if g > 1)
    table = tuple((w, r, c, round(n), newton_schulz_flops(r, c, 1)) for (w, r, c), n in rows.items())
    return MuonCost(
        params=params,
        expert_params=experts,
        moment_bytes=MOMENT_BYTES * (dense / dp + experts / edp),
        ns_flops=flops,
        gather_bytes=gather,
        dp_bytes=dp_bytes,
        rows=table,
    )


@dataclass(frozen=True, kw_only=True)
class StageShare:
    """The weights of one GPU of one stage that step with Muon (the rest of ``memory.stage_params`` and
    ``stage_expert_params`` step with AdamW): ``dense`` (``split``: of them, those TP splits) and ``experts``;
    ``largest``: the rows and columns of the largest whole matrix, which its owner holds at once."""

    dense: float
    experts: float
    split: float
    largest: tuple[int, int]

    @property
    def largest_size(self) -> int:
        """Elements of the largest whole matrix."""
        return self.largest[0] * self.largest[1]


def stage_share(
    model: ModelSpec, *, tp: int, pp: int, stage: int, ep: int = 1, layers: int | None = None, vpp: int = 1
) -> StageShare:
    """``StageShare`` of ``stage`` as ``memory.stage_params`` counts it: its blocks' matrices (``block_params``'
    ``matmul``), the shared experts whole on every TP rank, and on the last stage the MTP modules' (``eh_proj``
    and their blocks'); the routed experts' matrices, E / EP of each MoE block, their biases aside."""
    config = model.config
    n = stage_layer_counts(model, pp, vpp)[stage] if layers is None else layers
    n_moe = stage_moe_layers(model, pp, vpp)[stage] if layers is None else (n if config.moe else 0)
    blocks = [(n_moe, True), (n - n_moe, False)]
    if stage == pp - 1:  # the MTP modules' blocks, each MoE or dense by its index
        blocks += [(1, config.is_moe_layer(config.layers + k - 1)) for k in range(1, model.mtp + 1)]
    blocks = [(k, moe) for k, moe in blocks if k]
    dense: float = sum(k * config.block_params(tp, moe=moe).matmul for k, moe in blocks)
    dense += (2 * config.hidden * config.hidden // tp) * model.mtp if stage == pp - 1 else 0  # eh_proj
    moe_blocks, experts = sum(k for k, moe in blocks if moe), 0.0
    if config.moe is not None:  # block_params counts a shared expert split over TP; megakit keeps it whole
        shared = config.moe.matrices * config.hidden * config.moe.shared_ffn
        dense += moe_blocks * shared * (1 - 1 / tp)
        experts = moe_blocks * config.moe.experts * config.moe.matrices * config.hidden * config.moe.ffn / ep
    matrices = [(k, m) for k, moe in blocks for m in block_matrices(config, moe=moe)]
    whole = sum(k * m.rows * m.cols * m.count for k, m in matrices if not m.tp_split and not m.expert)
    largest = max(((m.rows, m.cols) for _, m in matrices), key=lambda rc: rc[0] * rc[1], default=(0, 0))
    return StageShare(dense=dense, experts=experts, split=max(dense - whole, 0.0) if tp > 1 else 0.0, largest=largest)


# The elements of consecutive weights one ZeRO 1-2 exchange carries (``megakit.train.engine.muon_zero``, which
# imports it: one number for the trainer and the planner).
BUCKET_NUMEL = 1 << 26


def step_bytes(share: StageShare, *, tp: int, zero_stage: int, dp: int, edp: int) -> float:
    """The buffers one Muon step holds at its peak on this GPU (``step()`` only, in the activations' place), fp32.

    ZeRO 0 (``MuonWithAdamW.step``, one group): every Nesterov update (``U``, one per Muon weight), the whole
    matrices' results, and at TP > 1 the split matrices' send, receive, whole result, send-back and returned
    buffers (``orthogonalise_over_tp``): ``U + whole + 5 split`` weights. ZeRO 1-2 (``muon_zero.orthogonalise_flat``,
    one group at a time, the dense weights' partition ``P`` over ``dp`` ranks, the experts' over ``edp``, in buckets
    of ``BUCKET_NUMEL`` elements): the partition's update ``P``, and of one bucket this rank's pieces ``H`` (sent,
    then returned: at most the bucket or ``P``) and the owner's received, rebuilt, orthogonalised and sent-back
    weights (``O``: the bucket's share, at least the largest weight): ``P`` and the larger of ``H + 4 O`` and
    ``3 O + 5 O_split`` (inside the TP exchange).
    Both: Newton-Schulz's bf16 working set on the largest matrix (X, its Gram matrix, the quintic's update and the
    next X)."""
    m, n = sorted(share.largest)
    ns = 2.0 * (2 * m * n + 2 * m * m)
    split = share.split if tp > 1 else 0.0
    if zero_stage == 0:
        return ns + MOMENT_BYTES * (2 * (share.dense + share.experts) + 4 * split)
    peaks = [0.0]
    bucket = max(BUCKET_NUMEL, share.largest_size)
    for weights, ranks, split_share in ((share.dense, dp, split / max(share.dense, 1)), (share.experts, edp, 0.0)):
        if weights:
            p, o = weights / ranks, max(min(bucket, weights) / ranks, share.largest_size)
            peaks.append(p + max(min(bucket, p) + 4 * o, 3 * o + 5 * o * split_share))
    return ns + MOMENT_BYTES * max(peaks)


def render(
    cost: MuonCost,
    *,
    zero_stage: int = 0,
    step_flops_per_gpu: float | None = None,
    times: dict | None = None,
    step_s: float | None = None,
) -> list[str]:
    """The lines ``megakit plan --optimizer muon`` prints, one per matrix kind, then the totals. ``times``: seconds of
    the plan's step (``cost.muon_times``: Newton-Schulz, the TP and the DP exchanges); ``step_s``: the plan's step,
    which holds them."""
    times = times or {}
    lines = [f"Muon (--optimizer muon), per GPU and step, {NS_STEPS} Newton-Schulz iterations per matrix:"]
    for what, r, c, n, per_iteration in cost.rows:
        lines.append(
            f"  {what:<18} {r:>6} x {c:<6} {n:>5} in the stage: {per_iteration / 1e9:10.3f} GFLOP per iteration"
        )
    where = "partitioned over DP at ZeRO " + str(zero_stage) if zero_stage else "whole on every DP rank (ZeRO 0)"
    lines.append(
        f"  Muon momentum: one fp32 per hidden-matrix weight, {cost.moment_bytes / 2**30:.2f} GiB, {where}, "
        f"where Adam's moments would take {2 * cost.moment_bytes / 2**30:.2f} GiB; {cost.params / 1e9:.3f} B "
        "weights on Muon, the rest on AdamW (its moments in the memory table)"
    )
    share = ""
    if step_flops_per_gpu:
        share = f", {100 * cost.ns_flops / (cost.ns_flops + step_flops_per_gpu):.1f} % of the step's FLOPs"
    lines.append(f"  Newton-Schulz: {cost.ns_flops / 1e12:.2f} TFLOP per step{share}")
    if "newton_schulz" in times:
        lines[-1] += f", {times['newton_schulz'] * 1e3:.1f} ms"
    lines.append(
        f"  TP exchange of the split matrices (to their owners and back): {cost.gather_bytes / 2**20:.1f} MiB "
        "received per step" + ("" if cost.gather_bytes else " (TP 1: none)")
    )
    if cost.gather_bytes and "tp_exchange" in times:
        lines[-1] += f", {times['tp_exchange'] * 1e3:.1f} ms"
    lines.append(
        f"  DP exchange of the partitions (pieces to their owners and back): {cost.dp_bytes / 2**20:.1f} MiB "
        "received per step" + ("" if cost.dp_bytes else " (ZeRO 0 or one replica: none)")
    )
    if cost.dp_bytes and "dp_exchange" in times:
        lines[-1] += f", {times['dp_exchange'] * 1e3:.1f} ms"
    seconds = sum(times.values())
    if step_s and seconds:
        lines.append(
            f"  optimizer's share of the step: {100 * seconds / step_s:.1f} % ({seconds * 1e3:.0f} ms of the plan's "
            f"{step_s:.2f} s, which the search ranked the layouts by)"
        )
    return lines
