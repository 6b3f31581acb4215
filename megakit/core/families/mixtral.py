"""Mixtral (``MixtralForCausalLM``): the Mistral block with a top-k routed MoE of SwiGLU experts.

On disk each expert is three matrices under ``block_sparse_moe.experts.{j}.``: ``w1`` (gate), ``w3`` (up), ``w2``
(down); megakit stacks them.
"""

from __future__ import annotations

from megakit.core.families import llama
from megakit.core.families.base import Family, WeightMap
from megakit.core.moe_config import MoEConfig, read_common, write_common

ARCHITECTURES = {"mixtral": "MixtralForCausalLM"}


def read_moe(data: dict, *, layers: int, source: str) -> MoEConfig:
    """The experts of a Mixtral config.json."""
    common = read_common(data, source)
    return MoEConfig(experts=data["num_local_experts"], ffn=data["intermediate_size"], **common)


def write_moe(moe: MoEConfig, kind: str, *, layers: int) -> dict:
    """``read_moe``'s inverse."""
    return write_common(moe) | {"num_local_experts": moe.experts, "intermediate_size": moe.ffn}


def read(data: dict, kind: str, source: str) -> dict:
    """``ModelConfig``'s fields of a Mixtral config.json."""
    moe = read_moe(data, layers=data["num_hidden_layers"], source=source)
    return llama.read_decoder(data, kind, source, moe=moe)


def write(config) -> dict:
    """``read``'s inverse."""
    return llama.write_decoder(config, config.hf_type, ARCHITECTURES[config.hf_type])


FAMILY = Family(
    name="mixtral",
    architectures=ARCHITECTURES,
    read=read,
    write=write,
    weights=WeightMap(
        embeddings=llama.EMBEDDINGS,
        final=llama.FINAL,
        block=llama.BLOCK,
        experts="stack",
        expert_prefix="block_sparse_moe.",
        expert_names=("w1", "w3", "w2"),
    ),
    read_moe=read_moe,
    write_moe=write_moe,
)
