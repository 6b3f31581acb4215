"""Gemma 3's text model (``Gemma3ForCausalLM``, model_type ``gemma3_text``).

The Llama block with (1 + w) RMSNorms in fp32, norms after attention and the MLP too ("sandwich"), GeGLU, a scaled
embedding, QK-norm, its own score scale, and local and global RoPE on its sliding and full blocks.
"""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.families.windows import LAYER_TYPES, number
from megakit.core.rope import read_rope, write_rope
from megakit.errors import UsageError

ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}
_SANDWICH = {"mlp_norm.weight": "pre_feedforward_layernorm.weight"}  # Gemma's norm before the MLP; after it, below
BLOCK = tuple((ours, _SANDWICH.get(ours, theirs), how) for ours, theirs, how in llama.BLOCK) + (
    ("attn_post_norm.weight", "post_attention_layernorm.weight", "rename"),
    ("mlp_post_norm.weight", "post_feedforward_layernorm.weight", "rename"),
)


def read(data: dict, kind: str, source: str) -> dict:
    """Gemma 3's text model (``Gemma3ForCausalLM``), transformers 5's defaults where a field is absent."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        if data.get(field) is not None:
            raise UsageError(
                f"model config {source} sets {field} {data[field]!r} (Gemma 2's soft-capping), "
                "which megakit does not implement; set it null as Gemma 3 does"
            )
    if data.get("use_bidirectional_attention"):
        raise UsageError(
            f"model config {source} sets use_bidirectional_attention, which megakit (causal "
            "language models) does not implement; set it false"
        )
    layers, heads = data["num_hidden_layers"], data["num_attention_heads"]
    pattern = data.get("sliding_window_pattern", data.get("_sliding_window_pattern", 6))
    types = data.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    params = data.get("rope_parameters")
    if isinstance(params, dict) and set(params) <= set(LAYER_TYPES) and params:
        per_type = {
            t: read_rope({**data, "rope_scaling": None, "rope_parameters": p}, source=source) for t, p in params.items()
        }
    else:  # transformers 4's fields: rope_theta (global), rope_local_base_freq, rope_scaling (global)
        per_type = {
            "full_attention": read_rope({"rope_theta": 1e6, **data}, source=source),
            "sliding_attention": (float(data.get("rope_local_base_freq", 10000.0)), None),
        }
    full = per_type.get("full_attention", (1e6, None))
    sliding = per_type.get("sliding_attention", full)
    bias = bool(data.get("attention_bias", False))
    return dict(
        family="llama",
        vocab_size=data["vocab_size"],
        max_seq_len=data.get("max_position_embeddings", 131072),
        hidden=data["hidden_size"],
        layers=layers,
        heads=heads,
        kv_heads=data.get("num_key_value_heads") or heads,
        ffn=data["intermediate_size"],
        norm_eps=data.get("rms_norm_eps", 1e-6),
        tie_embeddings=data.get("tie_word_embeddings", True),
        dropout=data.get("attention_dropout", 0.0),
        head_dim=data.get("head_dim") or 256,
        rope_theta=full[0],
        rope_scaling=full[1],
        sliding_window=data.get("sliding_window") or 4096,
        layer_types=tuple(types),
        qkv_bias=bias,
        out_bias=bias,
        init_std=data.get("initializer_range", 0.02),
        qk_norm=True,
        norm_offset=True,
        sandwich_norms=True,
        mlp_act="gelu_tanh",
        embed_scale=data["hidden_size"] ** 0.5,
        query_pre_attn_scalar=float(data.get("query_pre_attn_scalar", 256)),
        sliding_rope_theta=sliding[0],
        sliding_rope_scaling=sliding[1],
        hf_type="gemma3_text",
    )


def write(config) -> dict:
    """``read``'s inverse."""
    rope = {
        "full_attention": write_rope(config.rope_theta, config.rope_scaling)["rope_parameters"],
        "sliding_attention": write_rope(config.sliding_rope_theta or config.rope_theta, config.sliding_rope_scaling)[
            "rope_parameters"
        ],
    }
    return {
        "model_type": "gemma3_text",
        "architectures": [ARCHITECTURES["gemma3_text"]],
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "hidden_size": config.hidden,
        "intermediate_size": config.ffn,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "rope_parameters": rope,
        "attention_bias": config.qkv_bias,
        "attention_dropout": config.dropout,
        "query_pre_attn_scalar": number(config.query_pre_attn_scalar),
        "sliding_window": config.sliding_window,
        "layer_types": list(config.layer_types),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "initializer_range": config.init_std,
    }


FAMILY = Family(
    name="gemma3",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    weights=WeightMap(embeddings=llama.EMBEDDINGS, final=llama.FINAL, block=BLOCK),
    activation_key="hidden_activation",
    activations=("gelu_pytorch_tanh",),
)
