"""DeepSeek-V3 (``DeepseekV3ForCausalLM``), and Kimi K2 (``kimi_k2``), whose config is DeepSeek-V3's under another
name: Multi-head Latent Attention (``megakit.core.mla_config``), sigmoid group-limited routing with an aux-loss-free
expert bias and shared experts, dense first blocks, and Multi-Token Prediction modules.

On disk: the shared experts are ``mlp.shared_experts.*``; MTP module k is decoder layer ``L + k`` with its own parts
beside its block; the released weights are FP8 with 128 x 128 block scales (``megakit.interop.quantized``).
"""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.mla_config import MLAConfig
from megakit.core.moe_config import MoEConfig, read_common, write_common
from megakit.errors import UsageError

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM"}
MLA_BLOCK = tuple(
    (f"attn.{x}", f"self_attn.{x}", "rename")
    for x in (
        "q_a_proj.weight",
        "q_a_proj.bias",
        "q_a_layernorm.weight",
        "q_b_proj.weight",
        "kv_a_proj_with_mqa.weight",
        "kv_a_proj_with_mqa.bias",
        "kv_a_layernorm.weight",
        "kv_b_proj.weight",
    )
)
# MTP module k's own tensors in layer L + k (ours under mtp.{k}., theirs); its block is mapped like any other
MTP = (
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("norm.weight", "shared_head.norm.weight"),
)


def read_moe(data: dict, *, layers: int, source: str) -> MoEConfig:
    """The experts of a DeepSeek-V3 config.json (its ``noaux_tc`` routing only)."""
    common = read_common(data, source)
    if data.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UsageError(
            f"model config {source} uses topk_method {data['topk_method']!r}; megakit implements DeepSeek-V3's noaux_tc"
        )
    return MoEConfig(
        experts=data["n_routed_experts"],
        ffn=data["moe_intermediate_size"],
        shared_ffn=data.get("n_shared_experts", 0) * data["moe_intermediate_size"],
        score=data.get("scoring_func", "sigmoid"),
        normalize_top_k=bool(data.get("norm_topk_prob", True)),
        route_scale=float(data.get("routed_scaling_factor", 1.0)),
        groups=data.get("n_group", 1) or 1,
        group_top_k=data.get("topk_group", 1) or 1,
        expert_bias=True,
        dense_layers=tuple(range(min(data.get("first_k_dense_replace", 0), layers))),
        **common,
    )


def write_moe(moe: MoEConfig, kind: str, *, layers: int) -> dict:
    """``read_moe``'s inverse."""
    return write_common(moe) | {
        "n_routed_experts": moe.experts,
        "moe_intermediate_size": moe.ffn,
        "n_shared_experts": moe.shared_ffn // moe.ffn,
        "scoring_func": moe.score,
        "norm_topk_prob": moe.normalize_top_k,
        "routed_scaling_factor": moe.route_scale,
        "n_group": moe.groups,
        "topk_group": moe.group_top_k,
        "first_k_dense_replace": len(moe.dense_layers),
        "topk_method": "noaux_tc",
    }


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a DeepSeek-V3 or Kimi K2 config.json."""
    moe = read_moe(data, layers=data["num_hidden_layers"], source=source)
    return llama.read_decoder(data, kind, source, moe=moe, mla=MLAConfig.from_hf(data))


def write(config) -> dict:
    """``read``'s inverse (``write_decoder`` adds the MLA widths and the MTP depth)."""
    return llama.write_decoder(config, config.hf_type, ARCHITECTURES[config.hf_type])


FAMILY = Family(
    name="deepseek_v3",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    weights=WeightMap(
        embeddings=llama.EMBEDDINGS,
        final=llama.FINAL,
        block=(*llama.BLOCK, *MLA_BLOCK),
        experts="stack",
        shared_expert="shared_experts",
        mtp=MTP,
        dequantize=("fp8_blocks",),
    ),
    read_moe=read_moe,
    write_moe=write_moe,
)
