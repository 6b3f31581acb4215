"""What a hybrid model's Mamba-2 blocks cost the planner: their GEMMs, the chunked scan, what they keep for backward,
and context parallelism's all-to-alls (``megakit.nn.linear_attention.mamba2``).

The planner prices a hybrid (Nemotron-H: Mamba-2, attention and MLP blocks by a pattern) as ``layers`` mean blocks:
each part's GEMMs run over its share of the tokens (``linears``), attention's core over the attention blocks' share
(``ModelConfig.attention_share``), and the scan over the Mamba blocks'. Nemotron-3's 'E' blocks are the model's MoE
layers (``ModelConfig.is_moe_layer``): their norm, router and shared expert are in the mean block by their share, and
each one adds its routed experts as any MoE block does (their weights, grouped GEMMs, routing tensors, all-to-alls),
as Qwen3-Next's MoE blocks are priced. The scan is SSD's chunked form (Dao and Gu
2024): per token and head ``2 Q n`` (C B^T in its chunk of ``Q``), ``2 Q p`` (those scores times x), ``4 n p`` (the
chunk's state in and out): linear in the sequence. Megakit's torch scan keeps, per token and head, its chunk's
decays and scores (``Q`` each, fp32) and ``p n / Q`` of the chunk states, which ``tensors`` lists.
"""

from __future__ import annotations


def shares(config) -> dict[str, float]:
    """Each part's share of the blocks (``core.families.nemotron_h.shares``); {} for a model without a pattern."""
    if not config.layer_pattern:
        return {}
    from megakit.core.families.nemotron_h import shares as of  # noqa: PLC0415

    return of(config)


def linears(model, tp: int) -> list[tuple[float, float, float]]:
    """(rows, k, n) of a hybrid's mean block's GEMMs on one TP rank: each part's over its share of the tokens."""
    share, m, h, hd = shares(model.config), model.config.mamba, model.hidden, model.head_dim
    q, kv = model.heads // tp * hd, model.kv_heads_per_rank(tp) * hd
    out = [(share["attention"], h, q), (share["attention"], h, kv), (share["attention"], h, kv)]
    out += [(share["attention"], q, h), (share["mlp"], h, model.ffn // tp), (share["mlp"], model.ffn // tp, h)]
    if m is not None:  # z, x, B, C, dt as one GEMM's width, then out_proj
        out += [(share["mamba"], h, (m.inner + m.conv_channels + m.heads) // tp), (share["mamba"], m.inner // tp, h)]
    if model.config.moe is not None:  # an 'E' block's shared expert (its router and experts: ``expert_gemm_time``)
        f = model.config.moe.shared_ffn // tp
        out += [(share["moe"], h, f), (share["moe"], f, h)]
    return [row for row in out if row[0] > 0]


def scan_flops(model, tp: int) -> float:
    """Forward FLOPs per token of one Mamba block's conv and chunked scan on one TP rank (0 without Mamba)."""
    m = model.config.mamba
    return 0.0 if m is None else m.scan_flops_per_token() / tp


def scan_time(model, *, tp: int, tokens: float, peak: float, efficiency: float = 0.3) -> tuple[float, float]:
    """(forward, backward) seconds of the mean block's scans over ``tokens`` (the Mamba blocks' share of them): small
    batched matmuls at ``efficiency`` of the peak (the torch scan's einsums), backward twice the forward."""
    share = shares(model.config).get("mamba", 0.0)
    forward = share * scan_flops(model, tp) * tokens / (peak * efficiency)
    return forward, 2 * forward


def tensors(model, *, tp: int, sequence_parallel: bool, precision: str) -> list:
    """What one Mamba-2 block keeps for backward per token on one TP rank (megakit's torch path): its norm, the
    projections' input and outputs, the conv's input and output, dt, the scan's fp32 operands, decays, scores and
    chunk states, the gated norm's input and out_proj's."""
    from megakit.core.planner.activations import PRECISIONS, SavedTensor  # noqa: PLC0415 (it reads this module)

    m, p, h = model.config.mamba, PRECISIONS[precision], model.hidden
    rest = tp if sequence_parallel else 1
    heads, inner, conv = m.heads / tp, m.inner / tp, m.conv_channels / tp

    def t(name, per_token, bytes_=p, shard="tp"):
        return SavedTensor(name, per_token, 0.0, bytes_, shard)

    return [
        t("mamba norm input", h / rest, shard="sp"),
        t("mamba norm normalised", h / rest, shard="sp"),
        t("mamba norm stats", 1 / rest, 4, "sp"),
        t("in_proj input", h / rest, shard="sp"),
        t("z", inner),
        t("conv input", conv),
        t("conv output", conv),
        t("dt", 2 * heads),
        t("scan x, B, C (fp32)", inner + heads * (5 * m.state + 4), 4),  # B, C per head and chunked; dt's sums
        t("scan decays and scores (fp32)", 3 * heads * m.chunk, 4),
        t("scan chunk states (fp32)", 2 * heads * m.head_dim * m.state / m.chunk, 4),
        t("scan output (fp32)", 2 * inner, 4),
        t("gated norm", 2 * inner + heads, 4),
        t("out_proj input", inner),
    ]


def mean_tensors(
    block: list, model, *, tp: int, sequence_parallel: bool, precision: str, experts: tuple | list = ()
) -> list:
    """A hybrid's mean block: an attention+MLP block's tensors (``block``, in ``activation_tensors``' order: the
    attention part up to ``norm2``), a Mamba block's (``tensors``) and an 'E' block's norm and shared expert
    (``experts``; its routing is ``routing_tensors``', per 'E' block), each scaled by its part's share; ``block``
    itself for a model without a pattern."""
    from megakit.core.planner.activations import SavedTensor  # noqa: PLC0415

    config = model.config
    if not config.layer_pattern:
        return block
    mamba = tensors(model, tp=tp, sequence_parallel=sequence_parallel, precision=precision) if config.mamba else []
    share = shares(config)
    split = next(i for i, x in enumerate(block) if x.name == "norm2 input")

    def scaled(xs, f):
        return [SavedTensor(x.name, x.per_token * f, x.per_token_seq * f, x.bytes_per_element, x.shard) for x in xs]

    return (
        scaled(block[:split], share["attention"])
        + scaled(block[split:], share["mlp"])
        + scaled(mamba, share["mamba"])
        + scaled(list(experts), share["moe"])
    )


def a2a_widths(model, tp: int) -> tuple[float, float]:
    """(in, out) channels per token a Mamba block's CP all-to-alls move on one TP rank: x, B, C and dt to the whole
    sequence of a head group, the scan's output back (``nn.linear_attention.context_parallel``)."""
    m = model.config.mamba
    return (m.conv_channels + m.heads) / tp, m.inner / tp
