"""ModelSpec: the planner's scenario -- a ``ModelConfig`` plus what planning adds to it.

The shape (validation, parameter counts, padded vocab, FLOPs, the HF config.json) is the
``ModelConfig``'s, the same object megakit's model reads; a ModelSpec adds the training
sequence length, a name, the exact parameter count when known and the one-line
``assumed`` text, and reads the shape under the same field names (``vocab_size``,
``max_seq_len``, ``layers``, ...): ModelConfig's own names. Three ways in:

* ``ModelSpec.from_params("175B")`` picks the nearest shape from ``KNOWN_SHAPES``
  (GPT-3 and Megatron-LM table sizes, Llama friends) and, when the requested
  size is more than 10 % away from every entry, scales the layer count of the
  nearest one. ``spec.assumed`` says which entry was used and how.
* ``ModelSpec.from_config(path_or_preset)`` reads a Hugging Face ``config.json``
  (GPT-2, Llama, Mistral, Qwen2-style incl. grouped-query attention) or a preset
  name from ``models/`` through ``ModelConfig.load``; the exact parameter count comes
  from a function passed in (``megakit.interop.hf.exact_param_count`` builds the
  transformers model on the meta device), since the core imports no torch.
* ``ModelSpec(config=..., name=..., seq_len=...)``, or with the shape as keywords under the
  same names instead of ``config`` (tests, the calibration rows).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from megakit.core.model_config import PRESETS as MODELS_DIR
from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError

_SUFFIX = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}
_NUMBER = re.compile(r"^\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?)\s*([kmbgt]?)\s*$", re.IGNORECASE)


def parse_count(text: str, *, what: str = "--params", minimum: float = 1.0) -> float:
    """Parse '175B', '1.3b', '70B', '175e9', '1T', '125M' into a number; UsageError otherwise."""
    match = _NUMBER.match(str(text))
    if not match:
        raise UsageError(f"{what} {text!r} is not a size; write e.g. 125M, 1.3B, 175e9 or 1T")
    value = float(match.group(1)) * _SUFFIX[match.group(2).lower()]
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"{what} {text!r} must be a positive size; write e.g. 125M, 1.3B or 1T")
    if value < minimum:
        raise UsageError(f"{what} {text!r} is below the smallest supported {_fmt(minimum)}; write e.g. 125M or 1.3B")
    return value


class _Shape:
    """A ModelSpec attribute that reads its ModelConfig's field of the same name."""

    def __set_name__(self, owner, name: str) -> None:
        self.field = name

    def __get__(self, spec, owner=None):
        return self if spec is None else getattr(spec.config, self.field)


@dataclasses.dataclass(frozen=True, init=False)
class ModelSpec:
    """A ``ModelConfig`` as the planner plans it. ``family`` is 'gpt2' (LayerNorm, biases, GELU MLP,
    learned positions) or 'llama' (RMSNorm, no biases unless the config sets them, SwiGLU, rotary, GQA)."""

    config: ModelConfig
    name: str
    seq_len: int  # the training sequence length planned for
    exact_params: int | None = None  # from the meta-device model, when known
    assumed: str = ""  # one line: where this shape came from
    stage_layers: tuple[int, ...] | None = None  # blocks per virtual stage when pinned (--stage-layers); None: balanced
    mtp: int = 0  # Multi-Token Prediction modules trained on the last stage (--mtp: the config's; 0: none)

    family = _Shape()
    layers = _Shape()
    hidden = _Shape()
    heads = _Shape()
    kv_heads = _Shape()
    ffn = _Shape()
    vocab_size = _Shape()
    max_seq_len = _Shape()
    tie_embeddings = _Shape()
    qkv_bias = _Shape()
    out_bias = _Shape()  # llama-style attention_bias also biases o_proj
    mlp_bias = _Shape()
    head_dim = _Shape()
    dropout = _Shape()
    norm_eps = _Shape()
    rope_theta = _Shape()
    init_std = _Shape()

    def __init__(
        self,
        *,
        name: str,
        seq_len: int,
        config: ModelConfig | None = None,
        exact_params: int | None = None,
        assumed: str = "",
        stage_layers: tuple[int, ...] | None = None,
        mtp: int = 0,
        **shape,
    ):
        """``shape``: ModelConfig fields by their own names (``vocab_size``, ``max_seq_len``, ...):
        the whole shape without ``config``, else changes to it (so ``dataclasses.replace(spec, layers=8)``
        works). Biases default by family: GPT-2 has them all, Llama none."""
        unknown = sorted(set(shape) - _SHAPE_FIELDS)
        if unknown:
            raise TypeError(f"ModelSpec got unexpected keyword arguments {', '.join(unknown)}")
        fields = dict(shape)
        if config is None:
            gpt2 = fields.get("family") == "gpt2"
            for bias in ("qkv_bias", "out_bias", "mlp_bias"):
                fields.setdefault(bias, gpt2)
            config = ModelConfig(**fields)
        elif fields:
            config = config.replace(**fields)
        if int(seq_len) < 1:
            raise UsageError(f"model seq_len must be a positive integer, got {seq_len!r}")
        for key, value in (
            ("config", config),
            ("name", name),
            ("seq_len", seq_len),
            ("exact_params", exact_params),
            ("assumed", assumed),
            ("stage_layers", None if stage_layers is None else tuple(stage_layers)),
            ("mtp", mtp),
        ):
            object.__setattr__(self, key, value)

    def to_model_config(self) -> ModelConfig:
        """The shape as megakit's model reads it (the same object: one rule for TP, partition and counts)."""
        return self.config

    def check_tp(self, tp: int) -> None:
        """UsageError unless megakit's model can shard this model ``tp`` ways (``ModelConfig.check_tp``:
        TP divides heads, KV heads, hidden and FFN; KV heads are never replicated)."""
        self.config.check_tp(tp)

    def tp_ok(self, tp: int) -> bool:
        """Whether TP ``tp`` divides the model's heads, vocabulary and widths (the planner skips it otherwise)."""
        return not self.config.tp_conflicts(tp)

    # ---- shapes and parameter counts: the ModelConfig's ----------------------------------
    @property
    def gated_mlp(self) -> bool:
        return self.config.gated_mlp

    def kv_heads_per_rank(self, tp: int) -> int:
        """K/V heads on one TP rank (replicated when TP exceeds them), which sizes the K/V activations."""
        return self.config.kv_heads_per_rank(tp)

    def padded_vocab(self, tp: int) -> int:
        """The vocabulary padded to a multiple of TP, as the model builds it, so memory counts the real tensors."""
        return self.config.padded_vocab(tp)

    def layer_params(self, tp: int = 1, *, moe: bool | None = None) -> tuple[int, int]:
        """(params this TP rank holds that TP shards, params every TP rank replicates) of one block,
        routed experts aside (``ModelConfig.block_params``: EP shards those, not TP)."""
        block = self.config.block_params(tp, moe=moe)
        return block.sharded, block.replicated

    @property
    def moe(self):
        """The ``MoEConfig`` (None: dense)."""
        return self.config.moe

    def active_params(self) -> int:
        """Parameters one token uses (all of them for a dense model)."""
        return self.config.active_params()

    def embedding_params(self, tp: int = 1) -> int:
        """Token embedding shard (+ learned positions, replicated) held by the first stage."""
        return self.config.embedding_params(tp)

    def head_params(self, tp: int = 1, *, separate: bool) -> int:
        """Final norm + LM head shard on the last stage (``ModelConfig.head_params``)."""
        return self.config.head_params(tp, separate=separate)

    @property
    def params(self) -> int:
        """Total parameters (exact when read from a config, else analytic, unpadded vocab)."""
        if self.exact_params is not None:
            return self.exact_params
        return self.analytic_params()

    def analytic_params(self) -> int:
        """The model's parameter count from its shapes, the same figure the built model has."""
        return self.config.num_params()

    def largest_layer_params(self) -> int:
        """The biggest single module (DeepSpeed's ZeRO-3 estimator and gather buffer want it)."""
        return max(self.config.layer_params(), self.vocab_size * self.hidden)

    def with_overrides(
        self,
        *,
        seq_len: int | None = None,
        vocab_size: int | None = None,
        stage_layers: tuple[int, ...] | None = None,
        mtp: bool | None = None,
    ) -> "ModelSpec":
        """``stage_layers``: the split over virtual stages that ``planner.stages`` uses where it has as many
        entries as the layout's ``pp * vpp`` stages (the layout it was pinned with). ``mtp``: plan the config's
        Multi-Token Prediction modules (``--mtp``; refused for a model without them, as the trainer refuses it)."""
        changes: dict[str, Any] = {}
        if mtp is not None:
            changes["mtp"] = self.config.mtp_depth(mtp)
        if stage_layers is not None:
            changes["stage_layers"] = tuple(stage_layers)
        if seq_len is not None:
            if seq_len < 1:
                raise UsageError(f"--seq-len {seq_len} must be a positive integer")
            if self.family == "gpt2" and seq_len > self.max_seq_len and self.exact_params is not None:
                raise UsageError(
                    f"--seq-len {seq_len} exceeds this GPT-2 model's {self.max_seq_len} learned "
                    "positions; use a shorter --seq-len or a config with larger n_positions"
                )
            changes["seq_len"] = seq_len
            if self.exact_params is None and self.family == "gpt2":
                changes["max_seq_len"] = max(self.max_seq_len, seq_len)
        if vocab_size is not None:
            if vocab_size < 1:
                raise UsageError(f"--vocab {vocab_size} must be a positive integer")
            changes["vocab_size"] = vocab_size
            changes["exact_params"] = None  # the count from the config no longer applies
        return dataclasses.replace(self, **changes) if changes else self

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json dict of this shape (what ``--emit-config`` writes for --params models)."""
        return self.config.to_hf()

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_params(cls, size: str | float, *, seq_len: int = 2048, vocab: int | None = None) -> "ModelSpec":
        """The known shape nearest ``size`` parameters, for planning a model given only its size (``--params 7B``)."""
        target = parse_count(size, minimum=1e6) if isinstance(size, str) else float(size)
        if not target >= 1e6:
            raise UsageError(f"--params {size!r} must be at least 1M")
        candidates = [_known(name, seq_len=seq_len) for name in KNOWN_SHAPES]
        nearest = min(candidates, key=lambda s: abs(math.log(s.params / target)))
        if abs(nearest.params / target - 1) <= 0.10:
            spec = dataclasses.replace(
                nearest,
                assumed=f"{_fmt(target)} -> the {nearest.name} shape from the table "
                f"of well-known sizes ({_fmt(nearest.params)} parameters)",
            )
        else:
            block = nearest.config.layer_params()
            fixed = nearest.params - nearest.layers * block
            layers = max(1, round((target - fixed) / block))
            # mypy checks replace() against the fields, not the custom __init__'s **shape that takes ``layers``
            spec = dataclasses.replace(nearest, layers=layers, name=f"{_fmt(target)}-scaled")  # type: ignore[call-arg]
            spec = dataclasses.replace(
                spec,
                assumed=f"{_fmt(target)} is not in the table: took the {nearest.name} "
                f"shape with {layers} layers ({_fmt(spec.params)} parameters)",
            )
        return spec.with_overrides(vocab_size=vocab) if vocab else spec

    @classmethod
    def from_config(cls, name_or_path: str, *, count_params: Callable[[dict], int] | None = None) -> "ModelSpec":
        """Read through ``ModelConfig.load``, the model code's own parser: the same accepted
        families, fields (head_dim, biases) and error messages as ``megakit train``.

        ``count_params(raw config dict)``: the exact parameter count, e.g.
        ``megakit.interop.hf.exact_param_count`` (transformers on the meta device); without
        it the count is analytic.
        """
        path = _resolve_config(name_or_path)
        config = ModelConfig.load(path)
        raw = json.loads(path.read_text())  # already parsed once by ModelConfig.load
        return cls(
            config=config,
            name=path.stem,
            seq_len=min(config.max_seq_len, 8192),
            assumed=f"read from {path.stem} ({raw.get('model_type')})",
            exact_params=count_params(raw) if count_params is not None else None,
        )

    @classmethod
    def from_model_config(cls, config: ModelConfig, *, name: str) -> "ModelSpec":
        """The spec of a model read from a config, planned at its context length (at most 8192)."""
        return cls(config=config, name=name, seq_len=min(config.max_seq_len, 8192), assumed=f"read from {name}")


_SHAPE_FIELDS = frozenset(name for name, attr in vars(ModelSpec).items() if isinstance(attr, _Shape))


def _fmt(n: float) -> str:
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.3g}{suffix}"
    return f"{n:.0f}"


def _resolve_config(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists() or "/" in name_or_path:
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UsageError(
                f"model config {name_or_path} does not exist; pass a config.json path or a preset "
                f"({', '.join(preset_names())})"
            )
        return path
    preset = MODELS_DIR / f"{name_or_path}.json"
    if not preset.is_file():
        raise UsageError(f"unknown model preset {name_or_path!r}; known presets: {', '.join(preset_names())}")
    return preset


def preset_names() -> list[str]:
    """The model presets shipped in megakit/models, for ``--model``'s help and its error message."""
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def _known(name: str, *, seq_len: int) -> ModelSpec:
    family, layers, hidden, heads, kv_heads, ffn, vocab, tie = KNOWN_SHAPES[name]
    return ModelSpec(
        name=name,
        family=family,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        vocab_size=vocab,
        seq_len=seq_len,
        max_seq_len=seq_len,
        tie_embeddings=tie,
        dropout=0.1 if family == "gpt2" else 0.0,
    )


# name: (family, layers, hidden, heads, kv_heads, ffn, vocab, tied embeddings)
# GPT-3 family: Brown et al. 2020, Table 2.1. Megatron-LM sizes: Narayanan et al. 2021, Table 1
# (vocab 51200 = GPT-2's 50257 padded as Megatron does). Llama: the published config.json files.
KNOWN_SHAPES = {
    "gpt3-125m": ("gpt2", 12, 768, 12, 12, 3072, 51200, True),
    "gpt3-350m": ("gpt2", 24, 1024, 16, 16, 4096, 51200, True),
    "gpt3-760m": ("gpt2", 24, 1536, 16, 16, 6144, 51200, True),
    "gpt3-1.3b": ("gpt2", 24, 2048, 16, 16, 8192, 51200, True),
    "megatron-1.7b": ("gpt2", 24, 2304, 24, 24, 9216, 51200, True),
    "gpt3-2.7b": ("gpt2", 32, 2560, 32, 32, 10240, 51200, True),
    "megatron-3.6b": ("gpt2", 30, 3072, 32, 32, 12288, 51200, True),
    "gpt3-6.7b": ("gpt2", 32, 4096, 32, 32, 16384, 51200, True),
    "megatron-7.5b": ("gpt2", 36, 4096, 32, 32, 16384, 51200, True),
    "llama-3-8b": ("llama", 32, 4096, 32, 8, 14336, 128256, False),
    "gpt3-13b": ("gpt2", 40, 5120, 40, 40, 20480, 51200, True),
    "megatron-18.4b": ("gpt2", 40, 6144, 48, 48, 24576, 51200, True),
    "megatron-39.1b": ("gpt2", 48, 8192, 64, 64, 32768, 51200, True),
    "llama-2-70b": ("llama", 80, 8192, 64, 8, 28672, 32000, False),
    "megatron-76.1b": ("gpt2", 60, 10240, 80, 80, 40960, 51200, True),
    "megatron-145.6b": ("gpt2", 80, 12288, 96, 96, 49152, 51200, True),
    "gpt3-175b": ("gpt2", 96, 12288, 96, 96, 49152, 51200, True),
    "megatron-310.1b": ("gpt2", 96, 16384, 128, 128, 65536, 51200, True),
    "llama-3.1-405b": ("llama", 126, 16384, 128, 8, 53248, 128256, False),
    "megatron-529.6b": ("gpt2", 105, 20480, 128, 128, 81920, 51200, True),
    "megatron-1t": ("gpt2", 128, 25600, 160, 160, 102400, 51200, True),
}


def known_shape(name: str, *, seq_len: int = 2048) -> ModelSpec:
    """One row of the table as a ModelSpec (used by the calibration tests)."""
    if name not in KNOWN_SHAPES:
        raise UsageError(f"unknown shape {name!r}; known: {', '.join(KNOWN_SHAPES)}")
    return _known(name, seq_len=seq_len)
