"""Qwen2-MoE and Qwen3-MoE (``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``): the Qwen block with routed experts.

Qwen2-MoE adds a shared expert gated by ``sigmoid(Linear(h, 1))``; both may keep some blocks dense
(``mlp_only_layers``, ``decoder_sparse_step``). On disk each expert is ``mlp.experts.{j}.{gate,up,down}_proj``.
"""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.moe_config import MoEConfig, read_common, write_common

ARCHITECTURES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def read_moe(data: dict, *, layers: int, source: str) -> MoEConfig:
    """The experts of a Qwen2-MoE or Qwen3-MoE config.json."""
    kind, common = data.get("model_type"), read_common(data, source)
    step = data.get("decoder_sparse_step", 1) or 1
    only = set(data.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    shared = data.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
    experts = data["num_experts"] if "num_experts" in data else data["num_local_experts"]  # transformers 4 | 5
    return MoEConfig(
        experts=experts,
        ffn=data["moe_intermediate_size"],
        shared_ffn=shared,
        shared_gate=bool(shared),
        normalize_top_k=bool(data.get("norm_topk_prob", False)),
        dense_layers=dense,
        **common,
    )


def write_moe(moe: MoEConfig, kind: str, *, layers: int) -> dict:
    """``read_moe``'s inverse."""
    out = write_common(moe) | {
        "num_experts": moe.experts,
        "moe_intermediate_size": moe.ffn,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(moe.dense_layers),
        "norm_topk_prob": moe.normalize_top_k,
    }
    if kind == "qwen2_moe":
        out["shared_expert_intermediate_size"] = moe.shared_ffn
    return out


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a Qwen-MoE config.json."""
    moe = read_moe(data, layers=data["num_hidden_layers"], source=source)
    return llama.read_decoder(data, kind, source, moe=moe)


def write(config) -> dict:
    """``read``'s inverse."""
    return llama.write_decoder(config, config.hf_type, ARCHITECTURES[config.hf_type])


FAMILY = Family(
    name="qwen_moe",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    weights=WeightMap(embeddings=llama.EMBEDDINGS, final=llama.FINAL, block=llama.BLOCK, experts="stack"),
    read_moe=read_moe,
    write_moe=write_moe,
)
