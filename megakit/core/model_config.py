"""``ModelConfig``: the one description of a decoder-only transformer.

Read from (``from_hf``) and written to (``to_hf``) a Hugging Face config.json through the model's family
(``megakit.core.families``: one module per family, and the registry from ``model_type`` to it); the model, the
pipeline partition, the planner (``ModelSpec`` wraps one), checkpoints and the HF export all read this object, and
its one count of parameters and FLOPs (``megakit.core.counting``, delegated to from here). Pure Python (no torch),
so the planner and the CLI can read model files cheaply.
Two block families: ``gpt2`` (LayerNorm, GELU, learned positions, tied embeddings) and ``llama`` (RMSNorm,
SwiGLU, RoPE, grouped-query attention), which every other Hugging Face family here refines: Gemma 3's norms and
GeGLU, SmolLM3's NoPE blocks (``nope_layers``), gpt-oss's sinks, ``moe`` (``core.moe_config``) for
Mixture-of-Experts models and ``mla`` (``core.mla_config``) for DeepSeek-V3's attention.

The attention schedule is per block (``attention_window``): ``layer_types`` as transformers 5 writes it
(``full_attention`` or ``sliding_attention`` per block, any pattern), or, without it, Qwen's run of last
blocks (``sliding_window_from``); and each block's RoPE (``block_rope``) or none (``block_uses_rope``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from megakit.core import counting
from megakit.core.counting import (  # noqa: F401 (API)
    FLOPS_CONVENTIONS,
    BlockParams,
    model_flops_per_token,
    padded_vocab,
    recompute_flops,
)
from megakit.core.families import FAMILIES, family_for, family_of
from megakit.core.families.windows import LAYER_TYPES, check_layer_types  # noqa: F401 (API)
from megakit.core.hf_fields import check_hf_fields
from megakit.core.linear_attention_config import LinearAttentionConfig
from megakit.core.mamba_config import Mamba2Config
from megakit.core.mla_config import MLAConfig
from megakit.core.moe_config import MoEConfig
from megakit.core.rope import RopeScaling
from megakit.errors import UsageError

PRESETS = Path(__file__).resolve().parents[2] / "models"
HF_ARCHITECTURES = {t: a for f in FAMILIES for t, a in f.architectures.items()}  # model_type -> transformers class


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder-only transformer, validated on construction (the module docstring says what it covers)."""

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
    rope_scaling: RopeScaling | None = None  # llama3, linear, yarn, dynamic (megakit.core.rope); None: plain RoPE
    sliding_window: int = 0  # blocks from sliding_window_from on see only the latest this many positions; 0: all
    sliding_window_from: int = 0  # Qwen2's max_window_layers
    scale_attn_weights: bool = True  # GPT-2: scores times 1/sqrt(head_dim) (False: not scaled)
    scale_attn_by_inverse_layer_idx: bool = False  # GPT-2: scores also times 1/(block index + 1)
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    init_std: float = 0.02
    qk_norm: bool = False  # Qwen3: RMSNorm over each head's q and k, before RoPE
    # the per-block schedule: "full_attention" or "sliding_attention" (sliding_window) per block; (): Qwen's rule
    layer_types: tuple[str, ...] = ()
    # Gemma 3: RMSNorm times (1 + w) in fp32 (weights start at 0), norms on the attention's and the MLP's outputs
    # too ("sandwich"), GeGLU (tanh GELU on the gate), the embedding times sqrt(hidden), scores times
    # query_pre_attn_scalar^-1/2, and its sliding blocks' own RoPE (theta, variant)
    norm_offset: bool = False
    sandwich_norms: bool = False
    mlp_act: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    embed_scale: float = 1.0
    query_pre_attn_scalar: float = 0.0  # 0: head_dim
    sliding_rope_theta: float = 0.0  # 0: rope_theta and rope_scaling on every block
    sliding_rope_scaling: RopeScaling | None = None
    nope_layers: tuple[int, ...] = ()  # blocks that do not rotate q and k (SmolLM3's NoPE blocks); (): all rotate
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax denominator
    mla: MLAConfig | None = None  # DeepSeek-V3's Multi-head Latent Attention in place of q/k/v heads
    mtp_layers: int = 0  # DeepSeek-V3's Multi-Token Prediction depth (megakit.nn.mtp; trained with --mtp)
    moe: MoEConfig | None = None  # None: a dense model
    # Qwen3-Next, Qwen3.5: Gated DeltaNet in the blocks ``linear.layer_types`` names; their full-attention blocks
    # gate the attention output by sigmoid of a second half of q_proj, and rotate part of each head
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    rotary_fraction: float = 1.0  # RoPE on the first head_dim x this channels of q and k (partial_rotary_factor)
    hf_type: str = ""  # the config.json's model_type, kept for the export ("": gpt2, llama or qwen2)
    # Hybrid models (Nemotron-H): one part per block, by ``core.families.nemotron_h.PATTERN``'s characters ("M": a
    # Mamba-2 mixer, "*": attention, "-": an MLP, "E": ``moe``'s experts); "": every block is attention then MLP
    layer_pattern: str = ""
    mamba: Mamba2Config | None = None  # the Mamba-2 mixers' shape (core.mamba_config)

    def __post_init__(self) -> None:
        if isinstance(self.linear, dict):  # read back from a checkpoint manifest
            linear = {k: tuple(v) if k == "layer_types" else v for k, v in self.linear.items()}
            object.__setattr__(self, "linear", LinearAttentionConfig(**linear))
        if self.linear and self.linear.layer_types and len(self.linear.layer_types) != self.layers:
            raise UsageError(
                f"layer_types has {len(self.linear.layer_types)} entries for {self.layers} blocks; give one per block"
            )
        if isinstance(self.mla, dict):
            object.__setattr__(self, "mla", MLAConfig(**self.mla))
        if isinstance(self.mamba, dict):
            object.__setattr__(self, "mamba", Mamba2Config(**self.mamba))
        if isinstance(self.moe, dict):  # read back from a checkpoint manifest (``to_dict``)
            object.__setattr__(
                self, "moe", MoEConfig(**{k: tuple(v) if k == "dense_layers" else v for k, v in self.moe.items()})
            )
        self._check_pattern()
        if self.family not in ("gpt2", "llama"):
            raise UsageError(f"model family must be 'gpt2' or 'llama', got {self.family!r}")
        for field in ("vocab_size", "max_seq_len", "hidden", "layers", "heads", "kv_heads", "ffn"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"model config field {field} must be a positive integer, got {value!r}")
        self._check_types()
        if self.heads % self.kv_heads:
            raise UsageError(f"attention heads {self.heads} must be a multiple of KV heads {self.kv_heads}")
        if not self.head_dim:
            if self.hidden % self.heads:
                raise UsageError(
                    f"hidden size {self.hidden} is not divisible by {self.heads} heads; set head_dim in the config"
                )
            object.__setattr__(self, "head_dim", self.hidden // self.heads)
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"dropout must be in [0, 1), got {self.dropout}")
        if (self.moe or self.qk_norm) and self.family != "llama":
            raise UsageError("experts and q/k norms need the llama family (RMSNorm, SwiGLU, RoPE)")
        for field in ("rope_scaling", "sliding_rope_scaling"):  # read back from a checkpoint manifest
            if isinstance(getattr(self, field), dict):
                object.__setattr__(self, field, RopeScaling(**getattr(self, field)))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.layer_types and len(self.layer_types) != self.layers:
            raise UsageError(
                f"layer_types has {len(self.layer_types)} entries for {self.layers} blocks; give one per block"
            )
        check_layer_types(self.layer_types)
        self._check_nope_layers()
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise UsageError("layer_types has sliding_attention blocks but sliding_window is not set; give the window")
        if self.mlp_act not in ("silu", "gelu_tanh", "relu2"):
            raise UsageError(f"mlp_act {self.mlp_act!r} is not silu, gelu_tanh or relu2 (squared ReLU, not gated)")
        if self.sliding_window < 0 or self.sliding_window_from < 0:
            raise UsageError(
                f"sliding_window {self.sliding_window} and sliding_window_from {self.sliding_window_from} "
                "must not be negative"
            )

    def _check_types(self) -> None:
        """Every other number a number (never a bool: Python takes true for 1) and every flag a bool."""
        for field in ("head_dim", "sliding_window", "sliding_window_from", "mtp_layers"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UsageError(f"model config field {field} must be an integer, got {value!r}")
        for field in (
            "norm_eps",
            "dropout",
            "rope_theta",
            "init_std",
            "embed_scale",
            "query_pre_attn_scalar",
            "sliding_rope_theta",
        ):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise UsageError(f"model config field {field} must be a finite number, got {value!r}")
        for field in (
            "tie_embeddings",
            "scale_attn_weights",
            "scale_attn_by_inverse_layer_idx",
            "qkv_bias",
            "out_bias",
            "mlp_bias",
            "qk_norm",
            "norm_offset",
            "sandwich_norms",
            "attention_sinks",
        ):
            if not isinstance(getattr(self, field), bool):
                raise UsageError(f"model config field {field} must be true or false, got {getattr(self, field)!r}")

    def _check_pattern(self) -> None:
        """A ``layer_pattern`` of one known character per block, with ``mamba`` exactly when it has mixers."""
        if not self.layer_pattern:
            if self.mamba is not None:
                raise UsageError("a Mamba-2 config (mamba) needs a layer_pattern naming the blocks that are mixers")
            return
        from megakit.core.families.nemotron_h import PATTERN  # noqa: PLC0415 (the family's own characters)

        if len(self.layer_pattern) != self.layers:
            raise UsageError(
                f"layer_pattern has {len(self.layer_pattern)} characters for {self.layers} blocks; give one per block"
            )
        unknown = sorted(set(self.layer_pattern) - set(PATTERN))
        if unknown:
            names = ", ".join(f"{c!r} ({PATTERN.get(c, 'unknown')})" for c in unknown)
            raise UsageError(
                f"layer_pattern has layer type {names}, which megakit does not build; it builds "
                "'M' (Mamba-2), '*' (attention), '-' (MLP) and 'E' (MoE)"
            )
        if ("M" in self.layer_pattern) != (self.mamba is not None):
            raise UsageError("layer_pattern's 'M' blocks and the Mamba-2 config (mamba) go together; give both")
        moe = self.moe
        if ("E" in self.layer_pattern) != (moe is not None) or (
            moe and any(moe.is_moe_layer(i) != (c == "E") for i, c in enumerate(self.layer_pattern))
        ):
            raise UsageError(
                "layer_pattern's 'E' blocks and the experts (moe) go together: give moe exactly when the pattern has "
                "'E', with every other block in its dense_layers"
            )

    def block_part(self, index: int) -> str | None:
        """The one part of block ``index`` of a hybrid model ("mamba", "attention", "mlp" or "moe"); None: attention
        then the MLP (every other model)."""
        if not self.layer_pattern:
            return None
        from megakit.core.families.nemotron_h import PATTERN  # noqa: PLC0415

        return PATTERN[self.layer_pattern[index]]

    def _check_nope_layers(self) -> None:
        """``nope_layers`` as a sorted tuple of block indices, only where the blocks rotate q and k at all."""
        object.__setattr__(self, "nope_layers", tuple(sorted(set(self.nope_layers))))
        if not self.nope_layers:
            return
        if self.family != "llama" or self.mla:
            raise UsageError(
                "nope_layers (blocks without RoPE) needs the llama family's q/k heads (not GPT-2's "
                "learned positions, not MLA's shared RoPE key)"
            )
        if not all(isinstance(i, int) and 0 <= i < self.layers for i in self.nope_layers):
            raise UsageError(f"nope_layers {list(self.nope_layers)} has entries outside blocks 0..{self.layers - 1}")

    # -- loading -----------------------------------------------------------------------------
    @classmethod
    def load(cls, name_or_path: str | Path) -> "ModelConfig":
        """A preset name from ``models/`` (e.g. "gpt-tiny") or a path to an HF config.json."""
        path = Path(name_or_path)
        preset = PRESETS / f"{name_or_path}.json"
        if not path.exists() and path.suffix != ".json" and preset.is_file():  # "llama-3.1-405b" has a dot, no suffix
            path = preset
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            known = sorted(p.stem for p in PRESETS.glob("*.json"))
            raise UsageError(
                f"model config {name_or_path!s} not found; give a path to a config.json "
                f"or one of the presets: {', '.join(known)}"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"cannot read model config {path}: {exc}; give a valid HF config.json") from exc
        if not isinstance(data, dict):
            raise UsageError(f"model config {path} is not a JSON object; give a valid HF config.json")
        return cls.from_hf(data, source=str(path))

    @classmethod
    def from_hf(cls, data: dict, *, source: str = "config") -> "ModelConfig":
        """Translate a Hugging Face config dict through its family (``megakit.core.families``). Every field
        transformers' model of that type reads is mapped, or refused in one line naming it."""
        kind = data.get("model_type")
        check_hf_fields(data, source)  # "1e-5" or true where a number goes: one line naming the file and the key
        family = family_for(kind, source=source)
        assert isinstance(kind, str)  # family_for refused any other
        act = data.get(family.activation_key)
        if act is not None and act not in family.activations:
            raise UsageError(
                f"model config {source} uses activation {act!r}, which megakit does not implement; "
                f"the {kind} family here uses {family.activations[0]}"
            )
        try:
            return cls(**family.read(data, kind, source))
        except KeyError as exc:
            raise UsageError(
                f"model config {source} lacks the field {exc.args[0]!r}; give a complete HF config.json"
            ) from exc

    def attention_scale(self, index: int) -> float:
        """What block ``index`` multiplies its attention scores by: 1/sqrt(head_dim), Gemma's
        1/sqrt(query_pre_attn_scalar), or GPT-2's variants."""
        scale = (self.query_pre_attn_scalar or self.head_dim) ** -0.5 if self.scale_attn_weights else 1.0
        if self.mla and self.rope_scaling and self.rope_scaling.type == "yarn":  # DeepSeek's softmax mscale, squared
            fields = dict(self.rope_scaling.params)
            if fields.get("mscale_all_dim") and fields["factor"] > 1:
                scale *= (0.1 * fields["mscale_all_dim"] * math.log(fields["factor"]) + 1) ** 2
        return scale / (index + 1) if self.scale_attn_by_inverse_layer_idx else scale

    def attention_window(self, index: int) -> int:
        """How many of the latest positions (itself included) block ``index`` attends to; 0: all before it."""
        if self.layer_types:
            return self.sliding_window if self.layer_types[index] == "sliding_attention" else 0
        return self.sliding_window if index >= self.sliding_window_from else 0

    def block_rope(self, index: int) -> tuple[float, RopeScaling | None]:
        """``(theta, variant)`` of block ``index``'s RoPE: Gemma 3's sliding blocks have their own."""
        if self.sliding_rope_theta and self.attention_window(index):
            return self.sliding_rope_theta, self.sliding_rope_scaling
        return self.rope_theta, self.rope_scaling

    def block_uses_rope(self, index: int) -> bool:
        """Whether block ``index`` rotates q and k: the llama family's blocks, less SmolLM3's NoPE ones."""
        return self.family == "llama" and index not in self.nope_layers

    # -- derived sizes: the one count of parameters and FLOPs (model, planner, partition) -----------
    def padded_vocab(self, tp: int) -> int:
        """Vocab rows held in total under TP (``padded_vocab(vocab_size, tp)``)."""
        return padded_vocab(self.vocab_size, tp)

    def tp_conflicts(self, tp: int) -> list[str]:
        """What TP does not divide, e.g. ``["attention heads 14"]`` (empty: ``tp`` shards this model;
        KV heads are never replicated)."""
        shared: tuple[tuple[str, int], ...] = (
            (("shared-expert FFN size", self.moe.shared_ffn),) if self.moe and self.moe.shared_ffn else ()
        )
        if self.linear:  # Gated DeltaNet's heads: whole key-head groups per rank
            shared += (("linear attention key heads", self.linear.key_heads),)
        if self.mamba:  # Mamba-2's heads and its B/C groups split over TP
            shared += (("Mamba heads", self.mamba.heads), ("Mamba groups", self.mamba.groups))
        return [
            f"{what} {n}"
            for what, n in (
                ("attention heads", self.heads),
                ("KV heads", self.kv_heads),
                ("hidden size", self.hidden),
                ("FFN size", self.ffn),
                *shared,
            )
            if n % tp
        ]

    def check_tp(self, tp: int) -> None:
        """UsageError unless TP divides heads, KV heads, hidden size and FFN size."""
        bad = self.tp_conflicts(tp)
        if bad:
            raise UsageError(
                f"TP {tp} does not divide {', '.join(bad)}; choose a TP that divides "
                f"all of heads {self.heads}, KV heads {self.kv_heads}, hidden {self.hidden} "
                f"and FFN {self.ffn}"
            )

    @property
    def gated_mlp(self) -> bool:
        """SwiGLU (gate, up and down matrices) rather than GPT-2's two-matrix GELU MLP."""
        return self.family == "llama" and self.mlp_act != "relu2"

    def kv_heads_per_rank(self, tp: int) -> int:
        """Key/value heads a TP rank holds: split when they divide, else one replicated head."""
        return max(self.kv_heads // tp, 1)

    def block_params(self, tp: int = 1, *, moe: bool | None = None) -> BlockParams:
        """``megakit.core.counting.block_params``."""
        return counting.block_params(self, tp, moe=moe)

    def layer_params(self, layer: int | None = None) -> int:
        """``megakit.core.counting.layer_params``."""
        return counting.layer_params(self, layer)

    def own_block_params(self, layer: int, tp: int = 1) -> BlockParams:
        """``megakit.core.counting.own_block_params``."""
        return counting.own_block_params(self, layer, tp)

    def own_block_flops(self, layer: int, seq_len: int, tp: int = 1) -> float:
        """``megakit.core.counting.own_block_flops``."""
        return counting.own_block_flops(self, layer, seq_len, tp)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has routed experts."""
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def moe_layers(self) -> int:
        """How many blocks have routed experts (0 for a dense model)."""
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def embedding_params(self, tp: int = 1) -> int:
        """``megakit.core.counting.embedding_params``."""
        return counting.embedding_params(self, tp)

    def head_params(self, tp: int = 1, *, separate: bool = True) -> int:
        """``megakit.core.counting.head_params``."""
        return counting.head_params(self, tp, separate=separate)

    def num_params(self) -> int:
        """``megakit.core.counting.num_params``."""
        return counting.num_params(self)

    def active_params(self) -> int:
        """``megakit.core.counting.active_params``."""
        return counting.active_params(self)

    def block_flops(
        self, seq_len: int, tp: int = 1, *, convention: str = "palm", moe: bool | None = None
    ) -> tuple[float, float]:
        """``megakit.core.counting.block_flops``."""
        return counting.block_flops(self, seq_len, tp, convention=convention, moe=moe)

    def attention_context(self, index: int, seq_len: int) -> float:
        """``megakit.core.counting.attention_context``."""
        return counting.attention_context(self, index, seq_len)

    def attention_share(self, seq_len: int) -> float:
        """``megakit.core.counting.attention_share``."""
        return counting.attention_share(self, seq_len)

    def causal_flops_per_token(self, seq_len: int, *, windows: bool = True, mtp: bool = False) -> float:
        """``megakit.core.counting.causal_flops_per_token``."""
        return counting.causal_flops_per_token(self, seq_len, windows=windows, mtp=mtp)

    def mtp_depth(self, mtp: bool) -> int:
        """The MTP modules trained with ``--mtp`` (``mtp``): the config's, refused where it has none, as the trainer
        refuses it (``megakit.nn.model.trained_mtp_depth``); 0 without ``--mtp``."""
        if mtp and not self.mtp_layers:
            types = ", ".join(t for f in FAMILIES if f.weights.mtp for t in f.model_types)
            raise UsageError(
                f"MTP asked of a model without prediction modules: only DeepSeek-V3's configs ({types}) have them, "
                "in num_nextn_predict_layers (DeepSeek-V3: 1); drop --mtp"
            )
        return self.mtp_layers if mtp else 0

    def mtp_module_params(self, depth: int, tp: int = 1) -> BlockParams:
        """``megakit.core.counting.mtp_module_params``."""
        return counting.mtp_module_params(self, depth, tp)

    def head_flops(self) -> int:
        """``megakit.core.counting.head_flops``."""
        return counting.head_flops(self)

    def flops_per_token(
        self,
        seq_len: int,
        *,
        convention: str = "palm",
        recompute: str = "none",
        flash_attention: bool = False,
        mtp: int = 0,
    ) -> float:
        """``megakit.core.counting.flops_per_token``."""
        return counting.flops_per_token(
            self, seq_len, convention=convention, recompute=recompute, flash_attention=flash_attention, mtp=mtp
        )

    # -- writing -----------------------------------------------------------------------------
    def to_hf(self) -> dict:
        """A transformers config.json dict of this model (``from_hf`` reads it back unchanged)."""
        return family_of(self).write(self)

    def to_dict(self) -> dict:
        """The fields as plain data (a checkpoint manifest's; the constructor reads it back)."""
        return asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        """A copy with ``changes``, validated again."""
        return replace(self, **changes)


def check_seq_len(config: ModelConfig, seq_len: int) -> None:
    """UsageError unless ``seq_len`` fits the model's positions."""
    if seq_len > config.max_seq_len:
        raise UsageError(
            f"sequence length {seq_len} exceeds the model's max_seq_len {config.max_seq_len}; "
            "use shorter sequences or a config with more positions"
        )
