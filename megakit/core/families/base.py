"""What a model family is: its config reader and writer and its weight-key table, as plain data (no torch).

A family is one Hugging Face architecture (or a few that share one: Llama, Mistral, Qwen2 and Qwen3). Its module
under ``megakit.core.families`` builds one ``Family``; the registry (``megakit.core.families``) maps each
config.json ``model_type`` to it. ``ModelConfig.from_hf`` and ``to_hf`` call ``read`` and ``write``;
``megakit.interop.hf`` applies ``weights`` (the only place that touches tensors).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

TRANSFORMS = ("rename", "transpose")  # how a block tensor goes from megakit's layout to transformers'


@dataclass(frozen=True, kw_only=True)
class WeightMap:
    """How megakit's full (TP-gathered) tensor names map to transformers' safetensors names, as strings.

    ``block`` rows are ``(our suffix, their suffix, transform)`` under ``layers.{i}.`` and ``layer``'s prefix;
    ``transform`` is one of ``TRANSFORMS`` (``transpose``: GPT-2's ``Conv1D`` keeps ``(in, out)``).
    """

    embeddings: tuple[tuple[str, str], ...]  # (ours, theirs) before the blocks
    final: tuple[tuple[str, str], ...]  # (ours, theirs) after them (the LM head is apart: tied or not)
    layer: str = "model.layers.{i}."  # transformers' prefix of block i
    block: tuple[tuple[str, str, str], ...] = ()
    block_required: bool = False  # every ``block`` row must be in an imported checkpoint (else: where present)
    # q, k and v fused into one tensor: (their name, transform) per our kind ("weight", "bias"); GPT-2's c_attn
    fused_qkv: tuple[tuple[str, str, str], ...] = ()
    # MoE: "" (none), "stack" (one matrix per expert on disk, stacked on import) or "interleave" (gpt-oss: stacked
    # on disk in ``x @ W`` layout, gate and up columns interleaved)
    experts: str = ""
    expert_prefix: str = "mlp."  # where the router and experts sit in a layer (Mixtral's ``block_sparse_moe.``)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # each expert's on disk
    shared_expert: str = "shared_expert"  # their name of the shared expert (DeepSeek-V3's ``shared_experts``)
    mtp: tuple[tuple[str, str], ...] = ()  # DeepSeek-V3's MTP module parts (ours, theirs) in layer L + k
    dequantize: tuple[str, ...] = ()  # how released checkpoints are stored: "mxfp4", "fp8_blocks" (interop.quantized)

    def __post_init__(self) -> None:
        assert all(t in TRANSFORMS for _, _, t in self.block), self.block
        assert self.experts in ("", "stack", "interleave"), self.experts


@dataclass(frozen=True, kw_only=True)
class Family:
    """One model family: the ``model_type``\\ s it reads, their transformers classes, and how to translate them."""

    name: str
    architectures: Mapping[str, str]  # model_type -> transformers' class, in the registry's order
    read: Callable[[dict, str, str], dict]  # (config.json, its model_type, source) -> ModelConfig's fields
    write: Callable[[Any], dict]  # ModelConfig -> config.json (its ``hf_type`` names the model_type)
    weights: WeightMap
    activation_key: str = "hidden_act"  # the config.json key naming the MLP's activation
    activations: tuple[str, ...] = ("silu",)  # the values megakit implements (the first is named when refusing)
    read_moe: Callable[..., Any] | None = None  # (config.json, layers=, source=) -> MoEConfig
    write_moe: Callable[..., dict] | None = None  # (MoEConfig, model_type, layers=) -> its fields

    @property
    def model_types(self) -> tuple[str, ...]:
        """The config.json ``model_type``\\ s this family reads."""
        return tuple(self.architectures)
