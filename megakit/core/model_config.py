"""``ModelConfig``: a decoder-only transformer's shape, read from a Hugging Face config.json.

Pure Python (no torch), so the planner and the CLI can read model files cheaply.
Two families: ``gpt2`` (LayerNorm, GELU, learned positions, tied embeddings) and
``llama`` (RMSNorm, SwiGLU, RoPE, grouped-query attention; also mistral and
qwen2 files, which share the architecture).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megakit.errors import UsageError

PRESETS = Path(__file__).resolve().parents[2] / "models"
LLAMA_LIKE = ("llama", "mistral", "qwen2")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    family: str  # "gpt2" | "llama"
    vocab_size: int
    max_seq_len: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0
    head_dim: int = 0  # 0: hidden // heads
    rope_theta: float = 10000.0
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        if self.family not in ("gpt2", "llama"):
            raise UsageError(f"model family must be 'gpt2' or 'llama', got {self.family!r}")
        for field in ("vocab_size", "max_seq_len", "hidden", "layers", "heads", "kv_heads", "ffn"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"model config field {field} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise UsageError(f"attention heads {self.heads} must be a multiple of KV heads {self.kv_heads}")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise UsageError(f"hidden size {self.hidden} is not divisible by {self.heads} heads; "
                                 "set head_dim in the config")
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"dropout must be in [0, 1), got {self.dropout}")

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | Path) -> "ModelConfig":
        """A preset name from ``models/`` (e.g. "gpt-tiny") or a path to an HF config.json."""
        path = Path(name_or_path)
        if not path.suffix and not path.exists():
            path = PRESETS / f"{name_or_path}.json"
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            known = sorted(p.stem for p in PRESETS.glob("*.json"))
            raise UsageError(f"model config {name_or_path!s} not found; give a path to a config.json "
                             f"or one of the presets: {', '.join(known)}")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read model config {path}: {exc}; give a valid HF config.json") from exc
        if not isinstance(data, dict):
            raise UsageError(f"model config {path} is not a JSON object; give a valid HF config.json")
        return cls.from_hf(data, source=str(path))

    @classmethod
    def from_hf(cls, data: dict, *, source: str = "config") -> "ModelConfig":
        """Translate a Hugging Face config dict (model_type gpt2, llama, mistral or qwen2)."""
        kind = data.get("model_type")
        act = data.get("activation_function" if kind == "gpt2" else "hidden_act")
        if kind in ("gpt2", *LLAMA_LIKE) and act is not None and act not in (("gelu_new", "gelu_pytorch_tanh") if kind == "gpt2" else ("silu",)):
            raise UsageError(f"model config {source} uses activation {act!r}, which megakit does not implement; "
                             f"the {kind} family here uses {'gelu_new' if kind == 'gpt2' else 'silu'}")
        try:
            if kind == "gpt2":
                hidden = data["n_embd"]
                return cls(
                    family="gpt2", vocab_size=data["vocab_size"], max_seq_len=data["n_positions"],
                    hidden=hidden, layers=data["n_layer"], heads=data["n_head"], kv_heads=data["n_head"],
                    ffn=data.get("n_inner") or 4 * hidden, norm_eps=data.get("layer_norm_epsilon", 1e-5),
                    tie_embeddings=data.get("tie_word_embeddings", True),
                    dropout=data.get("resid_pdrop", 0.1), qkv_bias=True, out_bias=True, mlp_bias=True,
                    init_std=data.get("initializer_range", 0.02),
                )
            if kind in LLAMA_LIKE:
                heads = data["num_attention_heads"]
                bias = data.get("attention_bias", kind == "qwen2")
                return cls(
                    family="llama", vocab_size=data["vocab_size"],
                    max_seq_len=data.get("max_position_embeddings", 2048),
                    hidden=data["hidden_size"], layers=data["num_hidden_layers"], heads=heads,
                    kv_heads=data.get("num_key_value_heads") or heads, ffn=data["intermediate_size"],
                    norm_eps=data.get("rms_norm_eps", 1e-6), tie_embeddings=data.get("tie_word_embeddings", False),
                    dropout=data.get("attention_dropout", 0.0), head_dim=data.get("head_dim") or 0,
                    rope_theta=data.get("rope_theta", 10000.0), qkv_bias=bool(bias),
                    out_bias=bool(bias) and kind != "qwen2", mlp_bias=bool(data.get("mlp_bias", False)),
                    init_std=data.get("initializer_range", 0.02),
                )
        except KeyError as exc:
            raise UsageError(f"model config {source} lacks the field {exc.args[0]!r}; "
                             "give a complete HF config.json") from exc
        raise UsageError(f"model config {source} has model_type {kind!r}; supported: gpt2, "
                         f"{', '.join(LLAMA_LIKE)}")

    # -- derived sizes -----------------------------------------------------------------------
    def padded_vocab(self, tp: int) -> int:
        """Vocab rows held in total under TP: rounded up to a multiple of TP (extra rows are zero
        and masked out of logits and loss), so each rank holds ``padded_vocab(tp) // tp`` rows."""
        return -(-self.vocab_size // tp) * tp

    def check_tp(self, tp: int) -> None:
        """UsageError unless TP divides heads, KV heads, hidden size and FFN size."""
        bad = [f"{what} {n}" for what, n in (("attention heads", self.heads), ("KV heads", self.kv_heads),
                                              ("hidden size", self.hidden), ("FFN size", self.ffn))
               if n % tp]
        if bad:
            raise UsageError(f"TP {tp} does not divide {', '.join(bad)}; choose a TP that divides "
                             f"all of heads {self.heads}, KV heads {self.kv_heads}, hidden {self.hidden} "
                             f"and FFN {self.ffn}")

    def layer_params(self) -> int:
        """Parameters of one transformer block."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        attn = h * (q + 2 * kv) + q * h + self.qkv_bias * (q + 2 * kv) + self.out_bias * h
        mats = 2 if self.family == "gpt2" else 3
        mlp = mats * h * self.ffn + self.mlp_bias * ((mats - 1) * self.ffn + h)
        norms = (4 if self.family == "gpt2" else 2) * h
        return attn + mlp + norms

    def num_params(self) -> int:
        """Total parameters (tied embeddings counted once)."""
        embed = self.vocab_size * self.hidden
        pos = self.max_seq_len * self.hidden if self.family == "gpt2" else 0
        final_norm = (2 if self.family == "gpt2" else 1) * self.hidden
        head = 0 if self.tie_embeddings else embed
        return embed + pos + self.layers * self.layer_params() + final_norm + head

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


def model_flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward), for MFU: ``6N + 12 L q S``.

    N counts the matrices that do matmuls -- every block plus the LM head (``V x H``, paid
    even when tied); the lookup tables (token, position) are free. ``12 L q S`` is
    attention's score and value products (q = heads x head_dim), PaLM's convention, not
    halved for the causal mask.
    """
    n = config.layers * config.layer_params() + config.vocab_size * config.hidden
    return 6.0 * n + 12.0 * config.layers * config.heads * config.head_dim * seq_len


def check_seq_len(config: ModelConfig, seq_len: int) -> None:
    if seq_len > config.max_seq_len:
        raise UsageError(f"sequence length {seq_len} exceeds the model's max_seq_len {config.max_seq_len}; "
                         "use shorter sequences or a config with more positions")
