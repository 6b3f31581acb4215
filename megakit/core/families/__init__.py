"""The model families megakit reads and writes, one module each, and the registry from ``model_type`` to them.

Every list of supported ``model_type``\\ s (error messages, docs) derives from ``FAMILIES``. Adding a family is a
module here, an entry below, a preset in ``models/`` and a test file (docs/adding-a-model-family.md).
"""

from __future__ import annotations

from megakit.core.families import (
    deepseek_v3,
    gemma3,
    gpt2,
    gpt_oss,
    llama,
    mixtral,
    nemotron_h,
    qwen3_next,
    qwen_moe,
    smollm3,
)
from megakit.core.families.base import Family, WeightMap
from megakit.errors import UsageError

__all__ = ["FAMILIES", "MODEL_TYPES", "Family", "WeightMap", "family_for", "family_of"]

FAMILIES: tuple[Family, ...] = tuple(
    m.FAMILY for m in (gpt2, llama, gemma3, smollm3, mixtral, qwen_moe, gpt_oss, deepseek_v3, qwen3_next, nemotron_h)
)
MODEL_TYPES: tuple[str, ...] = tuple(t for f in FAMILIES for t in f.model_types)
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}
assert len(_BY_TYPE) == len(MODEL_TYPES), "a model_type belongs to one family"


def family_for(model_type, *, source: str = "config") -> Family:
    """The family that reads ``model_type``; a UsageError listing the supported ones for any other."""
    if model_type not in _BY_TYPE:
        raise UsageError(f"model config {source} has model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}")
    return _BY_TYPE[model_type]


def family_of(config) -> Family:
    """The family a ``ModelConfig`` is written as: GPT-2, else its ``hf_type``'s ("": Llama, Mistral or Qwen2)."""
    return gpt2.FAMILY if config.family == "gpt2" else _BY_TYPE[config.hf_type or "llama"]
