"""Qwen3-Next and Qwen3.5 (``Qwen3NextForCausalLM``, ``Qwen3_5ForCausalLM``'s text model): hybrid Gated DeltaNet.

Three blocks in four (``layer_types``, or every ``full_attention_interval``-th block full) run the Gated DeltaNet
mixer (``LinearAttentionConfig``; ``megakit.nn.linear_attention``), the others gated full attention: q_proj gives
each head's q and an output gate (``attn_output_gate``), q and k are RMS-normed per head, RoPE turns the first
``partial_rotary_factor`` of each head (``rotary_fraction``). Every RMSNorm but the mixer's gated one is times
``1 + w`` (``norm_offset``). Qwen3-Next's MLPs are experts with a shared expert gated by ``sigmoid(Linear(h, 1))``
(``mlp_only_layers`` keep a dense one),
Qwen3.5-MoE's in every block; Qwen3.5's text model is dense. On disk Qwen3-Next fuses the mixer's
projections per key head, Qwen3.5 keeps them apart (``megakit.interop.hf_linear``).
"""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.linear_attention_config import LinearAttentionConfig
from megakit.core.moe_config import MoEConfig, read_common, write_common
from megakit.errors import UsageError

ARCHITECTURES = {
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
}
MOE_TYPES = ("qwen3_next", "qwen3_5_moe_text")  # Qwen3.5-MoE: experts in every block, top-k always renormalised


def read_moe(data: dict, *, layers: int, source: str) -> MoEConfig:
    """Qwen3-Next's experts: routed (softmax top-k) and one shared expert behind a sigmoid gate."""
    only = set(data.get("mlp_only_layers") or ())
    step = data.get("decoder_sparse_step", 1) or 1
    shared = data.get("shared_expert_intermediate_size", 0)
    return MoEConfig(
        experts=data["num_experts"],
        ffn=data["moe_intermediate_size"],
        shared_ffn=shared,
        shared_gate=bool(shared),
        normalize_top_k=bool(data.get("norm_topk_prob", True)),  # Qwen3.5-MoE has no such field: always
        dense_layers=tuple(i for i in range(layers) if i in only or (i + 1) % step),
        **read_common(data, source),
    )


def write_moe(moe: MoEConfig, kind: str, *, layers: int) -> dict:
    """``read_moe``'s inverse."""
    if kind == "qwen3_5_moe_text":
        if moe.dense_layers or not moe.normalize_top_k:
            raise UsageError(
                "a qwen3_5_moe_text config has experts in every block with renormalised top-k weights; "
                "write this model as qwen3_next"
            )
        return write_common(moe) | {
            "num_experts": moe.experts,
            "moe_intermediate_size": moe.ffn,
            "shared_expert_intermediate_size": moe.shared_ffn,
        }
    return write_common(moe) | {
        "num_experts": moe.experts,
        "moe_intermediate_size": moe.ffn,
        "shared_expert_intermediate_size": moe.shared_ffn,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
        "norm_topk_prob": moe.normalize_top_k,
    }


def _rotary_fraction(data: dict) -> float:
    params = data.get("rope_parameters") or data.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor", data.get("partial_rotary_factor", 0.25)))


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a Qwen3-Next or Qwen3.5 text config.json."""
    layers = data["num_hidden_layers"]
    rope = {k: v for k, v in (data.get("rope_parameters") or {}).items() if k not in _ROPE_EXTRAS}
    plain = {k: v for k, v in data.items() if k != "partial_rotary_factor"} | {"rope_parameters": rope}
    plain.pop("rope_scaling", None)
    moe = read_moe(data, layers=layers, source=source) if kind in MOE_TYPES and data.get("num_experts") else None
    if kind == "qwen3_5_moe_text":  # no dense MLP anywhere: its width is the experts'
        plain.setdefault("intermediate_size", data["moe_intermediate_size"])
    fields = llama.read_decoder(plain, kind, source, moe=moe)
    return fields | dict(
        linear=LinearAttentionConfig.from_hf(data, layers),
        attn_output_gate=True,
        rotary_fraction=_rotary_fraction(data),
        qk_norm=True,
        norm_offset=True,
        hf_type=kind,
    )


# Qwen3.5's multimodal RoPE: text positions are the same on its three axes, where it is plain RoPE
_ROPE_EXTRAS = ("partial_rotary_factor", "mrope_section", "mrope_interleaved")


def write(config) -> dict:
    """``read``'s inverse."""
    out = llama.write_decoder(config, config.hf_type, ARCHITECTURES[config.hf_type])
    out |= config.linear.to_hf()
    out["rope_parameters"] = {
        "rope_type": "default",
        "rope_theta": config.rope_theta,
        "partial_rotary_factor": config.rotary_fraction,
    }
    out.pop("rope_theta", None)
    if config.hf_type == "qwen3_5_moe_text":
        del out["intermediate_size"]
    return out


FAMILY = Family(
    name="qwen3_next",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    # the mixer's tensors (``linear_attn.*``) go through megakit.interop.hf_linear, which knows both layouts
    weights=WeightMap(embeddings=llama.EMBEDDINGS, final=llama.FINAL, block=llama.BLOCK, experts="stack"),
    read_moe=read_moe,
    write_moe=write_moe,
)
