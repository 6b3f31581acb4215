"""Llama and the families that share its block: Mistral, Qwen2 and Qwen3 (``LlamaForCausalLM`` and kin).

RMSNorm, SwiGLU, RoPE and grouped-query attention; Qwen2 adds q/k/v biases, Qwen3 a per-head RMSNorm on q and k,
Mistral a sliding window. ``read_decoder`` and ``write_decoder`` are the shared config translation that the MoE
families (Mixtral, Qwen-MoE, gpt-oss, DeepSeek-V3) extend with their experts and attention.
"""

from __future__ import annotations

from megakit.core.families.base import Family, WeightMap
from megakit.core.families.windows import sliding_window, window_to_hf
from megakit.core.rope import read_rope, write_rope
from megakit.errors import UsageError

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# our suffix under layers.{i}. -> theirs under model.layers.{i}. (both nn.Linear, (out, in)); absent ones skipped
BLOCK = (
    ("attn_norm.weight", "input_layernorm.weight", "rename"),
    ("mlp_norm.weight", "post_attention_layernorm.weight", "rename"),
    *((f"attn.{x}_proj.{p}", f"self_attn.{x}_proj.{p}", "rename") for x in "qkvo" for p in ("weight", "bias")),
    *((f"mlp.{x}_proj.{p}", f"mlp.{x}_proj.{p}", "rename") for x in ("gate", "up", "down") for p in ("weight", "bias")),
    *((f"attn.{x}_norm.weight", f"self_attn.{x}_norm.weight", "rename") for x in "qk"),  # Qwen3
)
EMBEDDINGS = (("embed.weight", "model.embed_tokens.weight"),)
FINAL = (("norm.weight", "model.norm.weight"),)


def read_decoder(data: dict, kind: str, source: str, *, moe=None, mla=None) -> dict:
    """``ModelConfig``'s fields of a Llama-like config.json of ``kind``; ``moe`` and ``mla`` as its family read them."""
    heads = data["num_attention_heads"]
    qwen = kind in ("qwen2", "qwen2_moe")
    bias = data.get("attention_bias", qwen) if kind != "qwen2_moe" else data.get("qkv_bias", True)
    if kind in ("qwen2", "mistral", "mixtral"):  # transformers fixes these: q/k/v biases (Qwen2) or none
        bias = kind == "qwen2"
    theta, scaling = read_rope(data, source=source)
    window, window_from, types = sliding_window(data, kind, source)
    return dict(
        family="llama",
        vocab_size=data["vocab_size"],
        max_seq_len=data.get("max_position_embeddings", 2048),
        hidden=data["hidden_size"],
        layers=data["num_hidden_layers"],
        heads=heads,
        kv_heads=heads if mla else data.get("num_key_value_heads") or heads,
        ffn=data["intermediate_size"],
        norm_eps=data.get("rms_norm_eps", 1e-6),
        tie_embeddings=data.get("tie_word_embeddings", False),
        dropout=data.get("attention_dropout", 0.0),
        head_dim=mla.qk_head_dim if mla else data.get("head_dim") or 0,
        mla=mla,
        mtp_layers=data.get("num_nextn_predict_layers", 0) if mla else 0,
        rope_theta=theta,
        rope_scaling=scaling,
        sliding_window=window,
        sliding_window_from=window_from,
        layer_types=types,
        qkv_bias=bool(bias),
        out_bias=bool(bias) and not qwen,
        mlp_bias=kind == "llama" and bool(data.get("mlp_bias", False)),  # only Llama reads it
        init_std=data.get("initializer_range", 0.02),
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        moe=moe,
        hf_type=kind if kind not in ("llama", "mistral", "qwen2") else "",
        attention_sinks=kind == "gpt_oss",
    )


def write_decoder(config, kind: str, architecture: str) -> dict:
    """``read_decoder``'s inverse for ``kind``; the experts' and MLA's fields as their families write them."""
    if config.nope_layers:
        raise UsageError(
            f"blocks without RoPE (nope_layers {list(config.nope_layers)}) cannot be written as a "
            f"transformers {config.hf_type or 'llama'} config; SmolLM3's (smollm3) has them"
        )
    out = {
        "model_type": kind,
        "architectures": [architecture],
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_seq_len,
        "hidden_size": config.hidden,
        "intermediate_size": config.ffn,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.norm_eps,
        **write_rope(config.rope_theta, config.rope_scaling),
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.qkv_bias,
        "mlp_bias": config.mlp_bias,
        "attention_dropout": config.dropout,
        "initializer_range": config.init_std,
    }
    if kind in ("qwen2", "qwen2_moe"):
        del out["attention_bias"]
    types = config.layer_types or (("full_attention",) * config.layers if kind == "gpt_oss" else ())
    out |= window_to_hf(kind, config.sliding_window, config.sliding_window_from, types)
    if config.moe:
        out |= config.moe.to_hf(kind, layers=config.layers)
    if config.mla:  # transformers derives head_dim (the RoPE's) from the MLA widths itself
        del out["head_dim"], out["mlp_bias"]
        out |= config.mla.to_hf() | {"num_nextn_predict_layers": config.mtp_layers}
    return out


def _read(data: dict, kind: str, source: str) -> dict:
    return read_decoder(data, kind, source)


def _write(config) -> dict:
    """Llama, or what the fields say: Qwen2 (q/k/v biases without o_proj's), Mistral (a window), Qwen3 (kept)."""
    qwen2 = config.qkv_bias and not config.out_bias  # Llama's attention_bias covers o_proj too
    kind = config.hf_type or ("qwen2" if qwen2 else "mistral" if config.sliding_window else "llama")
    if kind == "mistral" and (config.qkv_bias or config.mlp_bias) and not config.nope_layers:
        raise UsageError(
            "a sliding window with Llama's biases cannot be written as a transformers config "
            "(Mistral has no biases, Llama no window)"
        )
    return write_decoder(config, kind, ARCHITECTURES[kind])


FAMILY = Family(
    name="llama",
    architectures=ARCHITECTURES,
    read=_read,
    write=_write,
    weights=WeightMap(embeddings=EMBEDDINGS, final=FINAL, block=BLOCK),
)
