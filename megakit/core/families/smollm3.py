"""SmolLM3 (``SmolLM3ForCausalLM``): Llama with some blocks that do not rotate q and k (``no_rope_layers``, megakit's
``nope_layers``) and an optional window on those blocks."""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.families.windows import check_layer_types
from megakit.core.rope import read_rope, write_rope
from megakit.errors import UsageError

ARCHITECTURES = {"smollm3": "SmolLM3ForCausalLM"}


def read(data: dict, kind: str, source: str) -> dict:
    """SmolLM3 (``SmolLM3ForCausalLM``): Llama with ``no_rope_layers`` and an optional window on its NoPE blocks,
    transformers 5's defaults (``SmolLM3Config``) where a field is absent."""
    layers, heads = data["num_hidden_layers"], data["num_attention_heads"]
    theta, scaling = read_rope({"rope_theta": 2e6, **data}, source=source)  # SmolLM3Config.default_theta
    window, types = _windows(data, source)
    bias = bool(data.get("attention_bias", False))
    return dict(
        family="llama",
        vocab_size=data["vocab_size"],
        max_seq_len=data.get("max_position_embeddings", 32768),
        hidden=data["hidden_size"],
        layers=layers,
        heads=heads,
        kv_heads=data.get("num_key_value_heads") or heads,
        ffn=data["intermediate_size"],
        norm_eps=data.get("rms_norm_eps", 1e-6),
        tie_embeddings=data.get("tie_word_embeddings", True),
        dropout=data.get("attention_dropout", 0.0),
        head_dim=data.get("head_dim") or 0,
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        layer_types=types,
        nope_layers=_nope_layers(data, source),
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bool(data.get("mlp_bias", False)),
        init_std=data.get("initializer_range", 0.02),
        hf_type="smollm3",
    )


def write(config) -> dict:
    """``read``'s inverse: the fields transformers' ``SmolLM3Config.to_dict`` writes and its model reads
    (``head_dim`` only where it is not ``hidden / heads``, as transformers derives it)."""
    out = {
        "model_type": "smollm3",
        "architectures": [ARCHITECTURES["smollm3"]],
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "hidden_size": config.hidden,
        "intermediate_size": config.ffn,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        "rope_parameters": write_rope(config.rope_theta, config.rope_scaling)["rope_parameters"],
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "attention_dropout": config.dropout,
        "initializer_range": config.init_std,
        "use_sliding_window": "sliding_attention" in config.layer_types,
        "sliding_window": config.sliding_window if "sliding_attention" in config.layer_types else None,
        "layer_types": list(config.layer_types or ("full_attention",) * config.layers),
        "no_rope_layers": [int(config.block_uses_rope(i)) for i in range(config.layers)],
        "pad_token_id": None,
    }  # megakit trains every embedding row; transformers' default 128004 freezes one
    if config.head_dim != config.hidden // config.heads:
        out["head_dim"] = config.head_dim
    return out


def _nope_layers(data: dict, source: str) -> tuple[int, ...]:
    """The blocks SmolLM3 does not rotate: the 0s of ``no_rope_layers`` (1: RoPE), or, without the list, every
    ``no_rope_layer_interval``-th block (transformers' ``SmolLM3Config.__post_init__``: ``(i + 1) % interval == 0``)."""
    n, flags = data["num_hidden_layers"], data.get("no_rope_layers")
    if flags is None:
        interval = data.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise UsageError(f"model config {source} has no_rope_layer_interval {interval!r}; give a positive integer")
        return tuple(i for i in range(n) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise UsageError(f"model config {source} has no_rope_layers {flags!r}; give a 1 (RoPE) or 0 (none) per block")
    return tuple(i for i in range(n) if not flags[i])


def _windows(data: dict, source: str) -> tuple[int, tuple[str, ...]]:
    """``(window, layer_types)`` as SmolLM3 reads them: a block slides only where ``use_sliding_window`` is set and
    its ``layer_types`` entry says so (by default its NoPE blocks, when ``sliding_window`` is set too)."""
    types, window = data.get("layer_types"), data.get("sliding_window")
    check_layer_types(types)
    sliding = "sliding_attention" in (types or ())
    if not data.get("use_sliding_window", False):
        if sliding:  # transformers' eager mask would slide, its flash path would not
            raise UsageError(
                f"model config {source} has sliding_attention in layer_types but use_sliding_window "
                "false, which transformers' attention paths read differently; set one of them"
            )
        return 0, ()
    if types is None and window is not None:
        nope = _nope_layers(data, source)
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(data["num_hidden_layers"])]
    if not types or "sliding_attention" not in types:
        return 0, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UsageError(f"model config {source} has sliding_window {window!r}; give a positive integer")
    return window, tuple(types)


FAMILY = Family(
    name="smollm3",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    weights=WeightMap(embeddings=llama.EMBEDDINGS, final=llama.FINAL, block=llama.BLOCK),
)
