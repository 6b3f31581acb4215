"""ModelSpec: the shape of a decoder-only transformer, as the planner needs it.

Three ways in, all ending in the same frozen dataclass:

* ``ModelSpec.from_params("175B")`` picks the nearest shape from ``KNOWN_SHAPES``
  (GPT-3 and Megatron-LM table sizes, Llama friends) and, when the requested
  size is more than 10 % away from every entry, scales the layer count of the
  nearest one. ``spec.assumed`` says which entry was used and how.
* ``ModelSpec.from_config(path_or_preset)`` reads a Hugging Face ``config.json``
  (GPT-2, Llama, Mistral, Qwen2-style incl. grouped-query attention) or a preset
  name from ``models/``; the exact parameter count comes from a function passed in
  (``megakit.interop.hf.exact_param_count`` builds the transformers model on the meta
  device), since the core imports no torch.
* ``ModelSpec(...)`` directly (tests, the calibration rows).

Parameter counts per layer are split into the part tensor parallelism shards
and the part it replicates, because per-GPU memory depends on both.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """A decoder-only transformer. ``family`` is 'gpt2' (LayerNorm, biases, GELU MLP,
    learned positions) or 'llama' (RMSNorm, no biases, SwiGLU MLP, rotary, GQA)."""

    name: str
    family: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq_len: int
    max_positions: int
    tie_embeddings: bool
    qkv_bias: bool = False
    out_bias: bool = False  # llama-style attention_bias also biases o_proj
    mlp_bias: bool = False
    head_dim: int = 0  # 0: hidden // heads (configs such as Qwen3's set it independently)
    dropout: float = 0.0
    exact_params: int | None = None  # from the meta-device model, when known
    assumed: str = ""  # one line: where this shape came from

    def __post_init__(self):
        if self.family not in ("gpt2", "llama"):
            raise UsageError(f"model family {self.family!r} is not supported; use a GPT-2 or Llama-style config")
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
            if int(getattr(self, field)) < 1:
                raise UsageError(f"model {field} must be a positive integer, got {getattr(self, field)!r}")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise UsageError(f"hidden size {self.hidden} is not a multiple of the {self.heads} heads; "
                                 "fix the config or set head_dim")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if self.heads % self.kv_heads:
            raise UsageError(f"{self.heads} heads are not a multiple of {self.kv_heads} key/value heads; fix the config")

    # ---- the model code's view ----------------------------------------------------------
    def to_model_config(self) -> ModelConfig:
        """The same shape as megakit's model reads it (one rule for TP, partition and counts)."""
        gpt2 = self.family == "gpt2"
        return ModelConfig(family=self.family, vocab_size=self.vocab, max_seq_len=self.max_positions,
                           hidden=self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads,
                           ffn=self.ffn, tie_embeddings=self.tie_embeddings, dropout=self.dropout,
                           head_dim=self.head_dim, qkv_bias=gpt2 or self.qkv_bias, out_bias=gpt2 or self.out_bias,
                           mlp_bias=gpt2 or self.mlp_bias)

    def check_tp(self, tp: int) -> None:
        """UsageError unless megakit's model can shard this model ``tp`` ways (``ModelConfig.check_tp``:
        TP divides heads, KV heads, hidden and FFN; KV heads are never replicated)."""
        self.to_model_config().check_tp(tp)

    def tp_ok(self, tp: int) -> bool:
        try:
            self.check_tp(tp)
        except UsageError:
            return False
        return True

    # ---- shapes -------------------------------------------------------------------------

    @property
    def gated_mlp(self) -> bool:
        return self.family == "llama"

    def kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads a TP rank holds: split when they divide, else one replicated head."""
        return max(self.kv_heads // tp, 1)

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rows after padding to a multiple of TP (vocab-parallel embedding)."""
        return -(-self.vocab // tp) * tp

    # ---- parameter counts ---------------------------------------------------------------
    def layer_params(self, tp: int = 1) -> tuple[int, int]:
        """(params this TP rank holds that TP shards, params every TP rank replicates) of one block."""
        h, f, hd = self.hidden, self.ffn, self.head_dim
        q = self.heads // tp * hd
        kv = self.kv_heads_per_rank(tp) * hd
        if self.family == "gpt2":
            sharded = h * (q + 2 * kv) + (q + 2 * kv) + q * h + 2 * h * (f // tp) + f // tp
            replicated = 2 * h + 2 * 2 * h  # proj and fc2 biases, two LayerNorms
        else:
            bias = (q + 2 * kv) * self.qkv_bias + 2 * (f // tp) * self.mlp_bias  # column-parallel biases
            sharded = h * (q + 2 * kv) + bias + q * h + 3 * h * (f // tp)
            replicated = 2 * h + h * self.out_bias + h * self.mlp_bias  # two RMSNorms, row-parallel biases
        return sharded, replicated

    def embedding_params(self, tp: int = 1) -> int:
        """Token embedding shard (+ learned positions, replicated) held by the first stage."""
        positions = self.max_positions * self.hidden if self.family == "gpt2" else 0
        return self.padded_vocab(tp) // tp * self.hidden + positions

    def head_params(self, tp: int = 1, *, separate: bool) -> int:
        """Final norm + LM head shard on the last stage; ``separate``: the head is its own matrix
        (untied, or tied but on another stage than the embedding)."""
        norm = 2 * self.hidden if self.family == "gpt2" else self.hidden
        return norm + (self.padded_vocab(tp) // tp * self.hidden if separate else 0)

    @property
    def params(self) -> int:
        """Total parameters (exact when read from a config, else analytic, unpadded vocab)."""
        if self.exact_params is not None:
            return self.exact_params
        return self.analytic_params()

    def analytic_params(self) -> int:
        sharded, replicated = self.layer_params(1)
        return (self.layers * (sharded + replicated) + self.embedding_params(1)
                + self.head_params(1, separate=not self.tie_embeddings))

    def largest_layer_params(self) -> int:
        """The biggest single module (DeepSpeed's ZeRO-3 estimator and gather buffer want it)."""
        sharded, replicated = self.layer_params(1)
        return max(sharded + replicated, self.vocab * self.hidden)

    def with_overrides(self, *, seq_len: int | None = None, vocab: int | None = None) -> "ModelSpec":
        changes = {}
        if seq_len is not None:
            if seq_len < 1:
                raise UsageError(f"--seq-len {seq_len} must be a positive integer")
            if self.family == "gpt2" and seq_len > self.max_positions and self.exact_params is not None:
                raise UsageError(f"--seq-len {seq_len} exceeds this GPT-2 model's {self.max_positions} learned "
                                 "positions; use a shorter --seq-len or a config with larger n_positions")
            changes["seq_len"] = seq_len
            if self.exact_params is None and self.family == "gpt2":
                changes["max_positions"] = max(self.max_positions, seq_len)
        if vocab is not None:
            if vocab < 1:
                raise UsageError(f"--vocab {vocab} must be a positive integer")
            changes["vocab"] = vocab
            changes["exact_params"] = None  # the count from the config no longer applies
        return dataclasses.replace(self, **changes) if changes else self

    def to_hf_config(self) -> dict:
        """A Hugging Face config.json dict of this shape (what ``--emit-config`` writes for --params models)."""
        if self.family == "gpt2":
            return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": self.vocab,
                    "n_positions": self.max_positions, "n_embd": self.hidden, "n_layer": self.layers,
                    "n_head": self.heads, "n_inner": self.ffn, "activation_function": "gelu_new",
                    "layer_norm_epsilon": 1e-5, "resid_pdrop": self.dropout, "embd_pdrop": self.dropout,
                    "attn_pdrop": self.dropout, "tie_word_embeddings": self.tie_embeddings}
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": self.vocab,
                "hidden_size": self.hidden, "intermediate_size": self.ffn, "num_hidden_layers": self.layers,
                "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
                "max_position_embeddings": self.max_positions, "hidden_act": "silu", "rms_norm_eps": 1e-5,
                "head_dim": self.head_dim, "attention_bias": self.qkv_bias, "attention_dropout": self.dropout,
                "tie_word_embeddings": self.tie_embeddings}

    # ---- constructors ---------------------------------------------------------------------
    @classmethod
    def from_params(cls, size: str | float, *, seq_len: int = 2048, vocab: int | None = None) -> "ModelSpec":
        target = parse_count(size, minimum=1e6) if isinstance(size, str) else float(size)
        if not target >= 1e6:
            raise UsageError(f"--params {size!r} must be at least 1M")
        candidates = [_known(name, seq_len=seq_len) for name in KNOWN_SHAPES]
        nearest = min(candidates, key=lambda s: abs(math.log(s.params / target)))
        if abs(nearest.params / target - 1) <= 0.10:
            spec = dataclasses.replace(nearest, assumed=f"{_fmt(target)} -> the {nearest.name} shape from the table "
                                                        f"of well-known sizes ({_fmt(nearest.params)} parameters)")
        else:
            sharded, replicated = nearest.layer_params(1)
            fixed = nearest.params - nearest.layers * (sharded + replicated)
            layers = max(1, round((target - fixed) / (sharded + replicated)))
            spec = dataclasses.replace(nearest, layers=layers, name=f"{_fmt(target)}-scaled")
            spec = dataclasses.replace(spec, assumed=f"{_fmt(target)} is not in the table: took the {nearest.name} "
                                                     f"shape with {layers} layers ({_fmt(spec.params)} parameters)")
        return spec.with_overrides(vocab=vocab) if vocab else spec

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
        spec = cls.from_model_config(config, name=path.stem)
        raw = json.loads(path.read_text())  # already parsed once by ModelConfig.load
        spec = dataclasses.replace(spec, assumed=f"read from {path.stem} ({raw.get('model_type')})")
        if count_params is not None:
            spec = dataclasses.replace(spec, exact_params=count_params(raw))
        return spec

    @classmethod
    def from_model_config(cls, config: ModelConfig, *, name: str) -> "ModelSpec":
        gpt2 = config.family == "gpt2"
        return cls(name=name, family=config.family, layers=config.layers, hidden=config.hidden, heads=config.heads,
                   kv_heads=config.kv_heads, ffn=config.ffn, vocab=config.vocab_size,
                   seq_len=min(config.max_seq_len, 8192), max_positions=config.max_seq_len,
                   tie_embeddings=config.tie_embeddings, qkv_bias=False if gpt2 else config.qkv_bias,
                   out_bias=False if gpt2 else config.out_bias, mlp_bias=False if gpt2 else config.mlp_bias,
                   head_dim=config.head_dim, dropout=config.dropout, assumed=f"read from {name}")


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
            raise UsageError(f"model config {name_or_path} does not exist; pass a config.json path or a preset "
                             f"({', '.join(preset_names())})")
        return path
    preset = MODELS_DIR / f"{name_or_path}.json"
    if not preset.is_file():
        raise UsageError(f"unknown model preset {name_or_path!r}; known presets: {', '.join(preset_names())}")
    return preset


def preset_names() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def _known(name: str, *, seq_len: int) -> ModelSpec:
    family, layers, hidden, heads, kv_heads, ffn, vocab, tie = KNOWN_SHAPES[name]
    return ModelSpec(name=name, family=family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads,
                     ffn=ffn, vocab=vocab, seq_len=seq_len, max_positions=seq_len, tie_embeddings=tie,
                     dropout=0.1 if family == "gpt2" else 0.0)


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
