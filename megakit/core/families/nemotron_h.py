"""NVIDIA's Nemotron-H (``nemotron_h``): a hybrid of Mamba-2, attention, MLP and MoE layers, one mixer per layer.

Its ``hybrid_override_pattern`` names each layer by one character: ``M`` Mamba-2, ``*`` attention (no RoPE),
``-`` a squared-ReLU MLP (not gated), ``E`` an MoE block (Nemotron-3). Each HF layer is one megakit block with that
one part (``ModelConfig.layer_pattern``). HF's ``in_proj`` of a mixer packs z, x, B, C and dt, and its ``conv1d``
x, B and C: megakit keeps them as separate parameters, so that each splits over TP by its own rows.

An 'E' block (``read_moe``; ``megakit.nn.moe``) routes as DeepSeek-V3 does (sigmoid scores, the score-correction
bias choosing, group-limited top-k, ``routed_scaling_factor``) to non-gated squared-ReLU experts, plus one shared
expert of the same kind; ``ModelConfig.moe.dense_layers`` are the pattern's other blocks. Not built, refused by name:
``moe_latent_size`` (LatentMoE, Nemotron-3 Super and Ultra) and the shared expert's ``mlp_bias``.
"""

from __future__ import annotations

from megakit.core.families.base import Family, WeightMap
from megakit.core.mamba_config import Mamba2Config
from megakit.core.moe_config import MoEConfig, read_common, write_common
from megakit.errors import UsageError

PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern's characters


HF_TYPES = {"mamba": "linear_attention", "attention": "full_attention", "mlp": "mlp", "moe": "moe"}
FROM_HF_TYPES = {v: k for k, v in HF_TYPES.items()}
CHARACTERS = {part: c for c, part in PATTERN.items()}


def _pattern(data: dict, source: str) -> str:
    """The layer pattern from ``hybrid_override_pattern`` (NVIDIA's files) or ``layers_block_type`` (transformers
    5's), refusing a layer type megakit does not build by name."""
    if data.get("hybrid_override_pattern"):
        pattern = data["hybrid_override_pattern"]
    else:
        types = data.get("layers_block_type") or data.get("layer_types")
        if not types:
            raise UsageError(f"model config {source} has neither hybrid_override_pattern nor layers_block_type")
        unknown = sorted(set(types) - set(FROM_HF_TYPES))
        if unknown:
            raise UsageError(f"model config {source} has layer type {unknown[0]!r}, which megakit does not build")
        pattern = "".join(CHARACTERS[FROM_HF_TYPES[t]] for t in types)
    bad = sorted(set(pattern) - set(PATTERN))
    if bad:
        raise UsageError(
            f"model config {source} has layer type {bad[0]!r} (unknown) in its pattern, which megakit does not build; "
            "it builds 'M' (Mamba-2), '*' (attention), '-' (MLP) and 'E' (MoE)"
        )
    return pattern


def read_moe(data: dict, *, layers: int, source: str, pattern: str | None = None) -> MoEConfig:
    """The experts of Nemotron-3's 'E' blocks (transformers' ``NemotronHMoE``): DeepSeek-V3's sigmoid router with the
    score-correction bias and group-limited top-k, non-gated squared-ReLU experts, one shared expert of
    ``moe_shared_expert_intermediate_size`` (transformers builds it whatever ``n_shared_experts`` says)."""
    pattern = _pattern(data, source) if pattern is None else pattern
    if data.get("moe_latent_size") is not None:
        raise UsageError(
            f"model config {source} sets moe_latent_size (LatentMoE's projections, Nemotron-3 Super and Ultra), "
            "which megakit does not build; Nemotron-3-Nano has none"
        )
    if data.get("mlp_bias"):
        raise UsageError(
            f"model config {source} sets mlp_bias with 'E' blocks: megakit's shared expert has no biases; "
            "set mlp_bias false"
        )
    ffn = data.get("moe_intermediate_size", 7688)
    return MoEConfig(
        experts=data.get("n_routed_experts", data.get("num_local_experts", 8)),
        ffn=ffn,
        shared_ffn=data.get("moe_shared_expert_intermediate_size", 7688),
        score="sigmoid",
        normalize_top_k=bool(data.get("norm_topk_prob", True)),
        route_scale=float(data.get("routed_scaling_factor", 1.0)),
        groups=data.get("n_group", 1) or 1,
        group_top_k=data.get("topk_group", 1) or 1,
        expert_bias=True,
        dense_layers=tuple(i for i, c in enumerate(pattern) if c != "E"),
        activation="relu2",
        **read_common({"num_experts_per_tok": 2} | data, source),
    )


def write_moe(moe: MoEConfig, kind: str, *, layers: int) -> dict:
    """``read_moe``'s inverse (the pattern's 'E' blocks are ``layers_block_type``'s)."""
    return write_common(moe) | {
        "n_routed_experts": moe.experts,
        "moe_intermediate_size": moe.ffn,
        "moe_shared_expert_intermediate_size": moe.shared_ffn,
        "n_shared_experts": 1,
        "norm_topk_prob": moe.normalize_top_k,
        "routed_scaling_factor": moe.route_scale,
        "n_group": moe.groups,
        "topk_group": moe.group_top_k,
    }


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a ``nemotron_h`` config.json (transformers' ``NemotronHConfig`` defaults where
    absent)."""
    if data.get("mamba_hidden_act", "silu") != "silu":
        raise UsageError(f"model config {source} uses mamba_hidden_act {data['mamba_hidden_act']!r}; Nemotron-H: silu")
    try:
        pattern = _pattern(data, source)
        heads = data.get("num_attention_heads", 32)
        return dict(
            family="llama",
            vocab_size=data["vocab_size"],
            max_seq_len=data.get("max_position_embeddings", 4096),
            hidden=data["hidden_size"],
            layers=len(pattern),
            heads=heads,
            kv_heads=data.get("num_key_value_heads") or heads,
            head_dim=data.get("head_dim") or 0,
            ffn=data.get("intermediate_size", 21504),
            norm_eps=data.get("layer_norm_epsilon", 1e-5),
            tie_embeddings=data.get("tie_word_embeddings", False),
            dropout=data.get("attention_dropout", 0.0),
            qkv_bias=bool(data.get("attention_bias", False)),
            out_bias=bool(data.get("attention_bias", False)),
            mlp_bias=bool(data.get("mlp_bias", False)),
            mlp_act="relu2",
            init_std=data.get("initializer_range", 0.02),
            nope_layers=tuple(range(len(pattern))),  # Nemotron-H's attention has no RoPE
            layer_pattern=pattern,
            mamba=Mamba2Config.from_hf(data) if "M" in pattern else None,
            moe=read_moe(data, layers=len(pattern), source=source, pattern=pattern) if "E" in pattern else None,
            hf_type="nemotron_h",
        )
    except KeyError as exc:
        raise UsageError(
            f"model config {source} lacks the field {exc.args[0]!r}; give a complete HF config.json"
        ) from exc


def write(config) -> dict:
    """The ``nemotron_h`` config.json of ``config`` (``read`` reads it back unchanged)."""
    out = {
        "model_type": "nemotron_h",
        "architectures": ["NemotronHForCausalLM"],
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "hidden_size": config.hidden,
        "num_hidden_layers": config.layers,
        "layers_block_type": [HF_TYPES[PATTERN[c]] for c in config.layer_pattern],
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.ffn,
        "mlp_hidden_act": "relu2",
        "mamba_hidden_act": "silu",
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "attention_dropout": config.dropout,
        "initializer_range": config.init_std,
    }
    if config.mamba is not None:
        out |= config.mamba.to_hf()
    if config.moe is not None:
        out |= write_moe(config.moe, "nemotron_h", layers=config.layers)
    return out


def shares(config) -> dict[str, float]:
    """Each part's share of the blocks of a hybrid model (``{"mamba": 24/52, "attention": 4/52, "mlp": 24/52,
    "moe": 0.0}``)."""
    return {part: config.layer_pattern.count(c) / config.layers for c, part in PATTERN.items()}


def part_params(config, part: str, tp: int = 1) -> tuple[int, int, int]:
    """(matrix, TP-sharded vector, replicated) parameters of one block of ``part`` on one TP rank, its norm included;
    an 'E' block's without its routed experts (``expert_params``): the shared expert and the router."""
    h, hd = config.hidden, config.head_dim
    if part == "mamba":
        matmul, vectors, replicated = config.mamba.params(h, tp)
        return matmul, vectors, replicated + h
    if part == "attention":
        q, kv = config.heads // tp * hd, config.kv_heads_per_rank(tp) * hd
        return h * (q + 2 * kv) + q * h, config.qkv_bias * (q + 2 * kv), h + config.out_bias * h
    if part == "moe":
        return 2 * h * (config.moe.shared_ffn // tp), 0, h + config.moe.experts * h
    f = config.ffn // tp
    return 2 * h * f, config.mlp_bias * f, h + config.mlp_bias * h


def expert_params(config) -> int:
    """One routed expert's parameters (up and down, not split over TP; EP splits the experts)."""
    return config.moe.matrices * config.hidden * config.moe.ffn


def total_params(config) -> int:
    """Every block's parameters, summed exactly (``ModelConfig.num_params``' blocks for a hybrid)."""
    experts = config.layer_pattern.count("E") * config.moe.experts * expert_params(config) if config.moe else 0
    return sum(sum(part_params(config, PATTERN[c])) for c in config.layer_pattern) + experts


def mean_block(config, tp: int = 1) -> tuple[int, int, int]:
    """The mean block's (matrix, sharded vector, replicated) parameters on one TP rank, rounded down: the planner
    prices a hybrid's blocks as so many mean blocks (its stages hold whole blocks of every kind alike). The routed
    experts are not in it: an 'E' block adds them (``counting.block_params(moe=True)``), so ``layers`` mean blocks
    and one set of experts per 'E' block make the model."""
    parts = [part_params(config, PATTERN[c], tp) for c in config.layer_pattern]
    return tuple(sum(p[i] for p in parts) // config.layers for i in range(3))


# The weights: ``megakit.interop.hf`` calls ``megakit.interop.hf_mamba`` (the mixers' in_proj and conv1d are split
# and packed there, which a key table cannot say); the table names the embeddings and the final norm.
FAMILY = Family(
    name="nemotron_h",
    architectures={"nemotron_h": "NemotronHForCausalLM"},
    read=read,
    write=write,
    weights=WeightMap(
        embeddings=(("embed.weight", "model.embeddings.weight"),), final=(("norm.weight", "model.norm_f.weight"),)
    ),
    activation_key="mlp_hidden_act",
    activations=("relu2",),
    read_moe=read_moe,
    write_moe=write_moe,
)
