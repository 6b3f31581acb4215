"""gpt-oss (``GptOssForCausalLM``): Mixtral's routing with a router bias, experts with biases and a clamped SwiGLU,
attention biases and sinks, and alternating 128-token windows.

Its experts sit stacked on disk in ``x @ W`` layout with gate and up columns interleaved (``interleave``); the
released checkpoints store them in MXFP4 (``megakit.interop.quantized``).
"""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.moe_config import MoEConfig, read_common, write_common

ARCHITECTURES = {"gpt_oss": "GptOssForCausalLM"}


def read_moe(data: dict, *, layers: int, source: str) -> MoEConfig:
    """The experts of a gpt-oss config.json: top-k of the biased logits, softmax over the k."""
    return MoEConfig(
        experts=data["num_local_experts"],
        ffn=data["intermediate_size"],
        router_bias=True,
        expert_biases=True,
        swiglu_limit=float(data.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(data.get("swiglu_alpha", 1.702)),
        **read_common(data, source),
    )


def write_moe(moe: MoEConfig, kind: str, *, layers: int) -> dict:
    """``read_moe``'s inverse."""
    return write_common(moe) | {
        "num_local_experts": moe.experts,
        "intermediate_size": moe.ffn,
        "swiglu_limit": moe.swiglu_limit,
        "swiglu_alpha": moe.swiglu_alpha,
    }


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a gpt-oss config.json (``read_decoder`` sets its sinks)."""
    moe = read_moe(data, layers=data["num_hidden_layers"], source=source)
    return llama.read_decoder(data, kind, source, moe=moe)


def write(config) -> dict:
    """``read``'s inverse."""
    return llama.write_decoder(config, "gpt_oss", ARCHITECTURES["gpt_oss"])


FAMILY = Family(
    name="gpt_oss",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    weights=WeightMap(
        embeddings=llama.EMBEDDINGS,
        final=llama.FINAL,
        block=(*llama.BLOCK, ("attn.sinks", "self_attn.sinks", "rename")),
        experts="interleave",
        dequantize=("mxfp4",),
    ),
    read_moe=read_moe,
    write_moe=write_moe,
)
