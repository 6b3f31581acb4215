"""What ``--optimizer muon`` costs one GPU: its moment, its Newton-Schulz FLOPs and its TP exchanges.

As ``megakit.train.engine.muon`` runs it: Muon keeps one fp32 moment (``momentum_buffer``) per hidden matrix where
Adam keeps two, and every step orthogonalises each whole matrix with 5 Newton-Schulz iterations. An iteration on an
``m x n`` matrix (``m <= n``, torch transposes a tall one) costs ``X X^T`` (2 m^2 n), ``A A`` (2 m^3) and ``B X`` (2
m^2 n) FLOPs: ``4 m^2 n + 2 m^3``. TP-split matrices go layer-wise over TP: each goes whole to one owner rank, which
runs its iterations (so the TP ranks share the FLOPs), and its slices come back: two all-to-alls in which each rank
receives about ``2 (TP-1)/TP^2`` of the split matrices' fp32 bytes. Replicated ones (MLA's down projections) run on
every TP rank, and every DP rank runs the same iterations (ZeRO 0). Experts are whole on their EP rank: each of an
expert's gate, up and down is a matrix of its own. Pure arithmetic on the ``ModelConfig``; the MTP modules' matrices
are left out (small next to the blocks).
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """The hidden matrices of one block (dense or MoE) of ``config``, as Muon steps them."""
    h, hd = config.hidden, config.head_dim
    out = []
    if config.mla is not None:
        m = config.mla
        if m.q_lora_rank:
            out += [Matrix(what="q_a", rows=m.q_lora_rank, cols=h, tp_split=False)]
            out += [Matrix(what="q_b", rows=config.heads * m.qk_head_dim, cols=m.q_lora_rank)]
        else:
            out += [Matrix(what="q", rows=config.heads * m.qk_head_dim, cols=h)]
        out += [Matrix(what="kv_a", rows=m.kv_lora_rank + m.qk_rope_head_dim, cols=h, tp_split=False)]
        out += [Matrix(what="kv_b", rows=config.heads * (m.qk_nope_head_dim + m.v_head_dim), cols=m.kv_lora_rank)]
        out += [Matrix(what="o", rows=h, cols=config.heads * m.v_head_dim)]
    else:
        out += [
            Matrix(what="q", rows=config.heads * hd, cols=h),
            Matrix(what="k, v", rows=config.kv_heads * hd, cols=h, count=2),
        ]
        out += [Matrix(what="o", rows=h, cols=config.heads * hd)]
    if moe:
        e = config.moe
        out += [Matrix(what="experts' gate, up", rows=e.ffn, cols=h, count=2 * e.experts, tp_split=False, expert=True)]
        out += [Matrix(what="experts' down", rows=h, cols=e.ffn, count=e.experts, tp_split=False, expert=True)]
        if e.shared_ffn:
            out += [Matrix(what="shared gate, up", rows=e.shared_ffn, cols=h, count=2)]
            out += [Matrix(what="shared down", rows=h, cols=e.shared_ffn)]
    else:
        mats = 2 if config.gated_mlp else 1
        out += [Matrix(what="gate, up" if mats == 2 else "up", rows=config.ffn, cols=h, count=mats)]
        out += [Matrix(what="down", rows=h, cols=config.ffn)]
    return out


@dataclass(frozen=True, kw_only=True)
class MuonCost:
    """Per GPU and step: Muon's parameters, its moment's bytes (Adam's would be twice), Newton-Schulz FLOPs, the
    bytes each GPU receives in the TP exchange, and the rows of the largest matrices for the report."""

    params: float
    moment_bytes: float
    ns_flops: float
    gather_bytes: float
    rows: tuple[tuple[str, int, int, int, float], ...]  # (what, rows, cols, in the GPU's stage, FLOPs per iteration)


def muon_cost(config, *, tp: int = 1, pp: int = 1, ep: int = 1) -> MuonCost:
    """``config``'s Muon cost on one GPU of a TP x PP x EP layout (an even share of the blocks per stage)."""
    params = moment = flops = gather = 0.0
    rows: dict[tuple[str, int, int], float] = {}
    kinds = [(config.moe_layers, True), (config.layers - config.moe_layers, False)]
    for blocks, moe in kinds:
        per_stage = blocks / pp
        for m in block_matrices(config, moe=moe) if blocks else []:
            count = per_stage * m.count / (ep if m.expert else 1)
            size = m.rows * m.cols
            shard = size / tp if m.tp_split else size
            params += count * shard
            moment += count * shard * MOMENT_BYTES
            flops += count * newton_schulz_flops(m.rows, m.cols) / (tp if m.tp_split else 1)
            if m.tp_split and tp > 1:  # to the owners and back: each rank's 1/TP of the matrices, less its own slice
                gather += 2 * count * size / tp * (tp - 1) / tp * MOMENT_BYTES
            key = (m.what, m.rows, m.cols)
            rows[key] = rows.get(key, 0.0) + count
    table = tuple((w, r, c, round(n), newton_schulz_flops(r, c, 1)) for (w, r, c), n in rows.items())
    return MuonCost(params=params, moment_bytes=moment, ns_flops=flops, gather_bytes=gather, rows=table)


def render(
    cost: MuonCost,
    *,
    step_flops_per_gpu: float | None = None,
    matmul_flops: float | None = None,
    link_gbps: float | None = None,
    step_s: float | None = None,
) -> list[str]:
    """The lines ``megakit plan --optimizer muon`` prints, one per matrix kind, then the totals. ``matmul_flops``:
    the GPU's achievable matmul rate (FLOP/s); ``link_gbps``: the TP link (GB/s); ``step_s``: the plan's step."""
    lines = [f"Muon (--optimizer muon), per GPU and step, {NS_STEPS} Newton-Schulz iterations per matrix:"]
    for what, r, c, n, per_iteration in cost.rows:
        lines.append(
            f"  {what:<18} {r:>6} x {c:<6} {n:>5} in the stage: {per_iteration / 1e9:10.3f} GFLOP per iteration"
        )
    lines.append(
        f"  moment: one fp32 per hidden weight, {cost.moment_bytes / 2**30:.2f} GiB where Adam keeps two "
        f"({2 * cost.moment_bytes / 2**30:.2f} GiB); {cost.params / 1e9:.3f} B weights on Muon"
    )
    share = ""
    if step_flops_per_gpu:
        share = f", {100 * cost.ns_flops / (cost.ns_flops + step_flops_per_gpu):.1f} % of the step's FLOPs"
    lines.append(f"  Newton-Schulz: {cost.ns_flops / 1e12:.2f} TFLOP per step{share}")
    seconds = 0.0
    if matmul_flops:
        seconds += cost.ns_flops / matmul_flops
        lines[-1] += f", {cost.ns_flops / matmul_flops * 1e3:.1f} ms"
    lines.append(
        f"  TP exchange of the split matrices (to their owners and back): {cost.gather_bytes / 2**20:.1f} MiB "
        "received per step" + ("" if cost.gather_bytes else " (TP 1: none)")
    )
    if link_gbps and cost.gather_bytes:
        seconds += cost.gather_bytes / (link_gbps * 1e9)
        lines[-1] += f", {cost.gather_bytes / (link_gbps * 1e9) * 1e3:.1f} ms"
    if step_s and seconds:
        lines.append(
            f"  optimizer's share of the step: {100 * seconds / (step_s + seconds):.1f} % ({seconds * 1e3:.0f} ms "
            f"added to the plan's {step_s:.2f} s; megakit's trainer runs it at ZeRO 0 in fp32 today)"
        )
    return lines
