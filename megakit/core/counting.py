"""Counting a model: its parameters (per TP rank, split as TP splits them) and its training FLOPs per token.

The one count the model, the pipeline partition and the planner all read; ``ModelConfig`` keeps one-line delegates
(``config.num_params()``). Pure Python over a ``ModelConfig``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from megakit.core.families import nemotron_h

if TYPE_CHECKING:
    from megakit.core.model_config import ModelConfig


class BlockParams(NamedTuple):
    """One block's parameters on one TP rank."""

    matmul: int  # weight matrices (TP-sharded; in an MoE block, attention and the shared experts)
    column_bias: int  # biases of the column-parallel layers (q/k/v, up/gate), sharded with them
    replicated: int  # norms, the row-parallel layers' biases (o_proj, down), the router: every TP rank holds them
    experts: int = 0  # the routed experts' weights, all E of them (EP shards them, TP does not)
    active_experts: int = 0  # the top-k experts' weights one token runs through
    router: int = 0  # the router's (and shared gate's) matrix, part of ``replicated``

    @property
    def sharded(self) -> int:
        """What TP splits: the matrices and their column biases."""
        return self.matmul + self.column_bias

    @property
    def total(self) -> int:
        """Every parameter of the block, all experts included."""
        return self.sharded + self.replicated + self.experts

    def flop_weights(self, kind: str) -> int:
        """The weights a FLOPs convention counts (``FLOPS_CONVENTIONS``): of the routed experts the
        active ones, and the router as a matmul in each convention."""
        if kind == "total":
            return self.sharded + self.replicated + self.active_experts
        return getattr(self, kind) + self.router + self.active_experts


# The weights 2 FLOPs/token each are counted for (``BlockParams.flop_weights``) and attention's width:
FLOPS_CONVENTIONS = {
    # model FLOPs for MFU, PaLM's 6N + 12 L q S (Chowdhery et al. 2022, App. B): every block parameter
    "palm": ("total", "q"),
    # the planner's, Megatron's Eq. 3 (Narayanan et al. 2021) plus column biases: TP-sharded weights, width H
    "megatron": ("sharded", "hidden"),
    # the pipeline partition's time balance: weight matrices only
    "matmul": ("matmul", "q"),
}


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to a multiple of TP, so every rank holds ``padded_vocab // tp`` rows.

    Rows past ``vocab_size`` are zero, never looked up, and masked out of the loss and logits.
    """
    return -(-vocab_size // tp) * tp


def recompute_flops(block_fwd: float, attn_fwd: float, recompute: str = "none", flash_attention: bool = False) -> float:
    """Forward FLOPs per token of one block that training runs a second time: the whole block
    (``recompute="full"``), its core attention ("selective"), and flash attention's scores in backward."""
    if recompute == "full":
        return block_fwd + (attn_fwd / 2 if flash_attention else 0)
    if recompute == "selective" and not flash_attention:
        return attn_fwd
    return attn_fwd / 2 if flash_attention else 0.0


def model_flops_per_token(config: ModelConfig, seq_len: int, *, mtp: int = 0) -> float:
    """Training FLOPs per token (forward + backward), for MFU: ``6N + 12 L q S``.

    N counts the matrices that do matmuls -- every block plus the LM head (``V x H``, paid
    even when tied); the lookup tables (token, position) are free. ``12 L q S`` is
    attention's score and value products (q = heads x head_dim), PaLM's convention, not
    halved for the causal mask. (``ModelConfig.flops_per_token``'s default convention.) ``mtp``: the MTP
    modules trained, their blocks, ``eh_proj`` and head products too.
    """
    return config.flops_per_token(seq_len, mtp=mtp)


def _mean(kinds: list[tuple[float, BlockParams]]) -> BlockParams:
    """The weighted mean of block kinds, field by field (a hybrid model's typical block)."""
    total = sum(w for w, _ in kinds)
    return BlockParams._make(sum(w * b[f] for w, b in kinds) / total for f in range(len(BlockParams._fields)))


def _linear_share(config: ModelConfig, moe: bool | None) -> float:
    """The share of ``moe``'s kind of blocks (None: of all) that run Gated DeltaNet."""
    assert config.linear is not None, "the share of linear blocks of a model without linear attention"
    blocks = [i for i in range(config.layers) if moe is None or config.is_moe_layer(i) == moe] or range(config.layers)
    return sum(config.linear.is_linear(i) for i in blocks) / len(blocks)


def block_params(
    config: ModelConfig, tp: int = 1, *, moe: bool | None = None, linear: bool | None = None
) -> BlockParams:
    """``_block_params``; for a hybrid model (``config.linear``) with ``linear`` None, the mean of its Gated DeltaNet
    and attention blocks of that kind, so that ``n x`` it is their sum (the planner's blocks of one kind)."""
    if config.linear is None or linear is not None:
        return _block_params(config, tp, moe=moe, linear=bool(linear))
    share = _linear_share(config, moe)
    kinds = [(share, _block_params(config, tp, moe=moe, linear=True))]
    kinds.append((1 - share, _block_params(config, tp, moe=moe, linear=False)))
    return _mean([(w, b) for w, b in kinds if w])


def _block_params(config: ModelConfig, tp: int = 1, *, moe: bool | None = None, linear: bool = False) -> BlockParams:
    """One transformer block's parameters on one TP rank, split as tensor parallelism splits them.

    ``moe``: an MoE block (default: whenever the model has experts) or a dense one. An MoE block
    has, in place of the MLP, a router (E x H, replicated over TP), the routed experts (E x 3 x H x F,
    sharded over EP, never over TP: ETP = 1), and shared experts TP-sharded like a dense MLP of
    width ``shared_ffn`` (plus Qwen2-MoE's H x 1 shared gate, replicated)."""
    moe = config.moe is not None if moe is None else (moe and config.moe is not None)
    if config.layer_pattern:  # a hybrid (Nemotron-H): its mean block (core.families.nemotron_h.mean_block), and an
        mean = BlockParams(*nemotron_h.mean_block(config, tp))  # 'E' block's routed experts on top of it
        return _routed_experts(config, mean) if moe and config.moe is not None else mean
    h, hd = config.hidden, config.head_dim
    q, kv = config.heads // tp * hd, config.kv_heads_per_rank(tp) * hd
    m = config.moe if moe else None
    f = (m.shared_ffn if m else config.ffn) // tp
    mats = 3 if config.gated_mlp else 2
    matmul = h * ((1 + config.attn_output_gate) * q + 2 * kv) + q * h + mats * h * f  # Qwen3-Next: q and its gate
    if config.mla:  # latent attention in place of q, k, v, o
        matmul, latent_norms = config.mla.attention_params(h, config.heads, tp)
        matmul += mats * h * f
    column_bias = config.qkv_bias * (q + 2 * kv) + config.mlp_bias * (mats - 1) * f + config.attention_sinks * q // hd
    norms = (
        4 if config.family == "gpt2" else 4 if config.sandwich_norms else 2
    ) * h + 2 * config.qk_norm * hd  # + q, k
    replicated = norms + config.out_bias * h + config.mlp_bias * h + (latent_norms if config.mla else 0)
    if linear:  # Gated DeltaNet in place of attention (no q/k norms, no attention biases)
        assert config.linear is not None, "a linear block of a model without linear attention"
        mixer, vectors, gated_norm = config.linear.mixer_params(h, tp)
        matmul, column_bias = mixer + mats * h * f, vectors + config.mlp_bias * (mats - 1) * f
        replicated = 2 * h + gated_norm + config.mlp_bias * h
    if m is None:
        return BlockParams(matmul, column_bias, replicated)
    router = m.experts * h + (h if m.shared_gate else 0) + (m.experts if m.router_bias else 0)
    expert = m.matrices * h * m.ffn + (2 * m.ffn + h if m.expert_biases else 0)  # gpt-oss: biases on both
    return BlockParams(
        matmul,
        column_bias,
        replicated + router,
        experts=m.experts * expert,
        active_experts=m.top_k * expert,
        router=router,
    )


def layer_params(config: ModelConfig, layer: int | None = None) -> int:
    """Parameters of one transformer block (``layer``: that one, its own kind; default: a typical one)."""
    if layer is None:
        return config.block_params(1).total
    return own_block_params(config, layer).total


def own_block_params(config: ModelConfig, layer: int, tp: int = 1) -> BlockParams:
    """Block ``layer``'s own parameters on one TP rank: in a hybrid its own mixer (Gated DeltaNet or attention; in
    Nemotron-H its one part) with its own MLP kind, where ``block_params`` gives the mean of a kind's blocks."""
    part = config.block_part(layer)
    if part is not None:
        own = BlockParams(*nemotron_h.part_params(config, part, tp))
        return _routed_experts(config, own) if part == "moe" else own
    linear = config.linear is not None and config.linear.is_linear(layer)
    return _block_params(config, tp, moe=config.is_moe_layer(layer), linear=linear)


def _routed_experts(config: ModelConfig, block: BlockParams) -> BlockParams:
    """A Nemotron-3 'E' block: ``block`` (its norm and shared expert, or the mean block) with its routed experts
    (E of them, top-k active) and its router."""
    expert, routed = nemotron_h.expert_params(config), config.moe
    assert routed is not None
    return block._replace(
        experts=routed.experts * expert, active_experts=routed.top_k * expert, router=routed.experts * config.hidden
    )


def own_block_flops(config: ModelConfig, layer: int, seq_len: int, tp: int = 1) -> float:
    """Block ``layer``'s forward FLOPs per token in the weight-matrices convention (``block_flops``' "matmul"), from
    its own parameters and its own core: attention's scores and values, the chunked delta rule, or the SSD scan."""
    attention = 4 * seq_len * (config.heads // tp * config.head_dim)
    if config.layer_pattern:
        part = config.block_part(layer)
        core = attention if part == "attention" else 0.0
        if part == "mamba" and config.mamba is not None:
            core = config.mamba.scan_flops_per_token() / tp
    elif config.linear is not None and config.linear.is_linear(layer):
        core = config.linear.core_flops_per_token(tp)
    else:
        core = attention
    return 2 * own_block_params(config, layer, tp).flop_weights("matmul") + core


def _blocks(config: ModelConfig) -> list[tuple[int, bool]]:
    """(count, is MoE) of the two kinds of block, skipping an absent kind."""
    n = config.moe_layers
    return [(c, moe) for c, moe in ((n, True), (config.layers - n, False)) if c]


def embedding_params(config: ModelConfig, tp: int = 1) -> int:
    """Token embedding rows one TP rank holds (padded vocab), plus GPT-2's learned positions (replicated)."""
    positions = config.max_seq_len * config.hidden if config.family == "gpt2" else 0
    return config.padded_vocab(tp) // tp * config.hidden + positions


def head_params(config: ModelConfig, tp: int = 1, *, separate: bool = True) -> int:
    """Final norm + the LM head's rows on one TP rank; ``separate``: the head is its own matrix
    (untied, or tied but held by another pipeline stage than the embedding)."""
    norm = (2 if config.family == "gpt2" else 1) * config.hidden
    return norm + (config.padded_vocab(tp) // tp * config.hidden if separate else 0)


def num_params(config: ModelConfig) -> int:
    """Total parameters (tied embeddings counted once, vocab unpadded; every expert)."""
    if config.linear is not None:  # block by block: Gated DeltaNet or attention, MoE or dense
        blocks = sum(
            _block_params(config, moe=config.is_moe_layer(i), linear=config.linear.is_linear(i)).total
            for i in range(config.layers)
        )
        return blocks + config.embedding_params() + config.head_params(separate=not config.tie_embeddings)
    blocks = sum(n * config.block_params(moe=moe).total for n, moe in _blocks(config))
    return (
        (nemotron_h.total_params(config) if config.layer_pattern else blocks)
        + config.embedding_params()
        + config.head_params(separate=not config.tie_embeddings)
    )


def active_params(config: ModelConfig) -> int:
    """Parameters one token uses: ``num_params`` with each MoE block's top-k experts only."""
    return config.num_params() - round(
        config.moe_layers * (config.block_params().experts - config.block_params().active_experts)
    )


def block_flops(
    config, seq_len: int, tp: int = 1, *, convention: str = "palm", moe: bool | None = None
) -> tuple[float, float]:
    """(forward FLOPs per token of one block on one TP rank, of which core attention).

    2 FLOPs per weight the ``convention`` counts (``FLOPS_CONVENTIONS``; of the routed experts only
    the top-k a token uses, and the router in every convention), plus attention's score and value
    products, 2 x 2 x ``seq_len`` per channel of its width (full S x S, not halved for the causal mask)."""
    if convention not in FLOPS_CONVENTIONS:
        raise ValueError(f"unknown FLOPs convention {convention!r}; use one of {', '.join(FLOPS_CONVENTIONS)}")
    weights, width = FLOPS_CONVENTIONS[convention]
    attn = 4 * seq_len * (config.heads // tp * config.head_dim) if width == "q" else 4 * seq_len * config.hidden / tp
    if config.linear is not None:  # Gated DeltaNet's chunked core is constant per token: linear in the sequence
        share = _linear_share(config, moe)
        attn = share * config.linear.core_flops_per_token(tp) + (1 - share) * attn
    if config.layer_pattern:  # a hybrid's mean block: its attention blocks' share of attention, its mixers' scans
        parts = nemotron_h.shares(config)
        attn *= parts["attention"]
        scan = parts["mamba"] * config.mamba.scan_flops_per_token() / tp if config.mamba else 0.0
        return 2 * config.block_params(tp, moe=moe).flop_weights(weights) + attn + scan, attn
    return 2 * config.block_params(tp, moe=moe).flop_weights(weights) + attn, attn


def attention_context(config: ModelConfig, index: int, seq_len: int) -> float:
    """The keys a query of block ``index`` attends to on average under the causal mask and its window ``w``:
    ``w - w (w - 1) / (2 s)`` (query ``i`` sees ``min(i + 1, w)``; Megatron-Bridge's ``calculate_swa_context``),
    ``(s + 1) / 2`` without a window; 0 in a hybrid's blocks without attention (Mamba-2, MLP)."""
    if config.layer_pattern and config.block_part(index) != "attention":
        return 0.0
    w = min(config.attention_window(index) or seq_len, seq_len)
    return w - w * (w - 1) / (2 * seq_len)


def attention_share(config: ModelConfig, seq_len: int) -> float:
    """The blocks' mean causal attention work over what it would be without windows (1.0: no windows)."""
    if config.layer_pattern:  # a hybrid: the share of its blocks that attend (Nemotron-H 8B: 4 of 52)
        return config.layer_pattern.count("*") / config.layers
    if not config.sliding_window:  # the planner's search asks for every candidate: no loop where nothing slides
        return 1.0
    full = (seq_len + 1) / 2
    return sum(config.attention_context(i, seq_len) for i in range(config.layers)) / (config.layers * full)


def causal_flops_per_token(config: ModelConfig, seq_len: int, *, windows: bool = True, mtp: bool = False) -> float:
    """Training FLOPs per token as Megatron's formula counts them, with causal and window-aware attention
    (Megatron-Bridge's ``flop_utils``, the convention its published throughputs use): 6 x the weight matrices
    a token runs through (attention, the MLP or its top-k experts, the LM head; norms, biases and the router's
    small E x H aside), plus ``12 x q x`` the keys each query attends to (``attention_context``; ``windows``
    False: as if there were none); MLA's scores and values at their own widths. ``mtp``: with DeepSeek-V3's
    prediction modules, each a block like the last, its ``2H x H`` projection and the LM head again."""
    total = 3.0 * config.head_flops()
    widths = config.heads * config.head_dim + config.heads * (config.mla.v_head_dim if config.mla else config.head_dim)
    for i in range(config.layers):
        if config.linear is not None and config.linear.is_linear(i):  # the chunked delta rule, fwd + bwd
            block = _block_params(config, moe=config.is_moe_layer(i), linear=True)
            total += 6 * (block.matmul + block.active_experts) + 3 * config.linear.core_flops_per_token()
            continue
        block = _block_params(config, moe=config.is_moe_layer(i))
        context = config.attention_context(i, seq_len) if windows or config.layer_pattern else (seq_len + 1) / 2
        total += 6 * (block.matmul + block.active_experts) + 6 * widths * context  # scores, then values
        if config.mamba is not None and config.block_part(i) == "mamba":  # the chunked scan, linear in the sequence
            total += 3 * config.mamba.scan_flops_per_token()
    for k in range(1, config.mtp_layers + 1 if mtp else 1):  # block L + k - 1 of DeepSeek's checkpoints
        block = config.block_params(moe=config.is_moe_layer(config.layers + k - 1))
        total += (
            6 * (block.matmul + block.active_experts + 2 * config.hidden**2)
            + 6 * widths * (seq_len + 1) / 2
            + 3 * config.head_flops()
        )
    return total


def mtp_module_params(config: ModelConfig, depth: int, tp: int = 1) -> BlockParams:
    """MTP module ``depth``'s (1-based) parameters on one TP rank (``megakit.nn.mtp.PredictionModule``): its block,
    numbered ``layers + depth - 1`` as DeepSeek's checkpoint numbers it (MoE or dense by that index), ``eh_proj``
    (2H x H, column-parallel) and three norms (enorm, hnorm and the one before the shared head), replicated.
    The embedding copy and the head it shares are not its own."""
    block = config.block_params(tp, moe=config.is_moe_layer(config.layers + depth - 1))
    norm = (2 if config.family == "gpt2" else 1) * config.hidden
    return block._replace(
        matmul=block.matmul + 2 * config.hidden * config.hidden // tp, replicated=block.replicated + 3 * norm
    )


def head_flops(config: ModelConfig) -> int:
    """Forward FLOPs per token of the LM head (``V x H``, paid even when tied; the lookups are free)."""
    return 2 * config.hidden * config.vocab_size


def flops_per_token(
    config,
    seq_len: int,
    *,
    convention: str = "palm",
    recompute: str = "none",
    flash_attention: bool = False,
    mtp: int = 0,
) -> float:
    """Training FLOPs per token: 3 x forward (blocks and LM head), plus what ``recompute`` and
    flash attention run again (``recompute_flops``; the defaults: none, the model FLOPs). ``mtp``: the MTP
    modules trained (``mtp_depth``), each a block (numbered ``layers + k - 1``), ``eh_proj``'s 2H x H and one
    more head product, as ``causal_flops_per_token(mtp=True)`` counts them (Megatron's: one extra layer,
    ``6 (2h^2)`` and ``6 h V`` per depth)."""
    total = 3.0 * config.head_flops()
    for n, moe in _blocks(config):
        fwd, attn = config.block_flops(seq_len, convention=convention, moe=moe)
        total += n * (3 * fwd + recompute_flops(fwd, attn, recompute, flash_attention))
    for k in range(1, mtp + 1):
        fwd, attn = config.block_flops(seq_len, convention=convention, moe=config.is_moe_layer(config.layers + k - 1))
        total += (
            3 * fwd
            + recompute_flops(fwd, attn, recompute, flash_attention)
            + 6 * 2 * config.hidden**2
            + 3 * config.head_flops()
        )
    return float(total)
