"""GPT-2 (``GPT2LMHeadModel``): LayerNorm, GELU, learned positions, tied embeddings, one fused q/k/v.

transformers' GPT-2 stores its ``Conv1D`` weights ``(in, out)`` (transposed from megakit's ``(out, in)``) and fuses
q, k and v into ``c_attn``.
"""

from __future__ import annotations

from megakit.core.families.base import Family, WeightMap
from megakit.errors import UsageError

BLOCK = (  # our suffix under layers.{i}. -> theirs under transformer.h.{i}.
    ("attn_norm.weight", "ln_1.weight", "rename"),
    ("attn_norm.bias", "ln_1.bias", "rename"),
    ("mlp_norm.weight", "ln_2.weight", "rename"),
    ("mlp_norm.bias", "ln_2.bias", "rename"),
    ("attn.o_proj.weight", "attn.c_proj.weight", "transpose"),
    ("attn.o_proj.bias", "attn.c_proj.bias", "rename"),
    ("mlp.up_proj.weight", "mlp.c_fc.weight", "transpose"),
    ("mlp.up_proj.bias", "mlp.c_fc.bias", "rename"),
    ("mlp.down_proj.weight", "mlp.c_proj.weight", "transpose"),
    ("mlp.down_proj.bias", "mlp.c_proj.bias", "rename"),
)
WEIGHTS = WeightMap(
    embeddings=(("embed.weight", "transformer.wte.weight"), ("pos_embed.weight", "transformer.wpe.weight")),
    final=(("norm.weight", "transformer.ln_f.weight"), ("norm.bias", "transformer.ln_f.bias")),
    layer="transformer.h.{i}.",
    block=BLOCK,
    block_required=True,
    fused_qkv=(("weight", "attn.c_attn.weight", "transpose"), ("bias", "attn.c_attn.bias", "rename")),
)


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a GPT-2 config.json."""
    hidden = data["n_embd"]
    return dict(
        family="gpt2",
        vocab_size=data["vocab_size"],
        max_seq_len=data["n_positions"],
        hidden=hidden,
        layers=data["n_layer"],
        heads=data["n_head"],
        kv_heads=data["n_head"],
        ffn=data.get("n_inner") or 4 * hidden,
        norm_eps=data.get("layer_norm_epsilon", 1e-5),
        tie_embeddings=data.get("tie_word_embeddings", True),
        dropout=_dropout(data, source),
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        init_std=data.get("initializer_range", 0.02),
        scale_attn_weights=bool(data.get("scale_attn_weights", True)),
        scale_attn_by_inverse_layer_idx=bool(data.get("scale_attn_by_inverse_layer_idx", False)),
    )


def write(config) -> dict:
    """``read``'s inverse."""
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_positions": config.max_seq_len,
        "n_embd": config.hidden,
        "n_layer": config.layers,
        "n_head": config.heads,
        "n_inner": config.ffn,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "initializer_range": config.init_std,
        "scale_attn_weights": config.scale_attn_weights,
        "scale_attn_by_inverse_layer_idx": config.scale_attn_by_inverse_layer_idx,
    }


def _dropout(data: dict, source: str) -> float:
    """GPT-2's one dropout rate: megakit drops embeddings, attention and residuals alike (transformers: 0.1 each)."""
    rates = {k: data.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(rates.values())) > 1:
        raise UsageError(
            f"model config {source} sets {', '.join(f'{k} {v}' for k, v in rates.items())}; megakit uses "
            "one dropout rate for all three: set them equal"
        )
    if data.get("add_cross_attention"):
        raise UsageError(
            f"model config {source} sets add_cross_attention (blocks that attend to an encoder), which "
            "megakit does not implement; set it false"
        )
    return rates["resid_pdrop"]


FAMILY = Family(
    name="gpt2",
    architectures={"gpt2": "GPT2LMHeadModel"},
    read=read,
    write=write,
    weights=WEIGHTS,
    activation_key="activation_function",
    activations=("gelu_new", "gelu_pytorch_tanh"),
)
