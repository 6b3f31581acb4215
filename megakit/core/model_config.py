"""``ModelConfig``: the one description of a decoder-only transformer.

Read from (``from_hf``) and written to (``to_hf``) a Hugging Face config.json; the model,
the pipeline partition, the planner (``ModelSpec`` wraps one), checkpoints and the HF
export all read this object, and its one count of parameters (per TP rank, split into
sharded and replicated parts), padded vocab and FLOPs formula. Pure Python (no torch),
so the planner and the CLI can read model files cheaply.
Two families: ``gpt2`` (LayerNorm, GELU, learned positions, tied embeddings) and
``llama`` (RMSNorm, SwiGLU, RoPE, grouped-query attention; also mistral, qwen2 and qwen3
files, which share the architecture, qwen3 with a per-head RMSNorm on q and k; and Gemma 3's text
model, ``gemma3_text``: (1 + w) RMSNorms in fp32, norms after attention and the MLP too, GeGLU, a scaled
embedding, QK-norm, its own score scale, and local and global RoPE on its sliding and full blocks). ``moe``
(``core.moe_config``) makes it a Mixture-of-Experts model: mixtral, qwen2_moe, qwen3_moe, gpt_oss (its
router and expert biases, clamped SwiGLU, attention biases and sinks, alternating 128-token windows), and
deepseek_v3 (with ``kimi_k2`` its alias), whose attention is ``mla`` (``core.mla_config``). SmolLM3 (``smollm3``) is
Llama with some blocks that do not rotate q and k (``nope_layers``, its ``no_rope_layers``).

The attention schedule is per block (``attention_window``): ``layer_types`` as transformers 5 writes it
(``full_attention`` or ``sliding_attention`` per block, any pattern), or, without it, Qwen's run of last
blocks (``sliding_window_from``); and each block's RoPE (``block_rope``) or none (``block_uses_rope``).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import NamedTuple

from megakit.core.hf_fields import check_hf_fields
from megakit.core.linear_attention_config import LinearAttentionConfig
from megakit.core.mamba_config import Mamba2Config
from megakit.core.mla_config import MLAConfig
from megakit.core.moe_config import MoEConfig
from megakit.core.rope import RopeScaling, read_rope, write_rope
from megakit.errors import UsageError

PRESETS = Path(__file__).resolve().parents[2] / "models"
LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "smollm3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # of transformers' ALLOWED_ATTN_LAYER_TYPES, what megakit runs
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "gpt_oss", "deepseek_v3", "kimi_k2")
MLA_TYPES = ("deepseek_v3", "kimi_k2")  # Kimi K2's config is DeepSeek-V3's under another name
HF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_k2": "DeepseekV3ForCausalLM",
}


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
    # Mamba-2 mixer, "*": attention, "-": an MLP); "": every block is attention then MLP
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
        self._check_pattern()
        if isinstance(self.moe, dict):  # read back from a checkpoint manifest (``to_dict``)
            object.__setattr__(
                self, "moe", MoEConfig(**{k: tuple(v) if k == "dense_layers" else v for k, v in self.moe.items()})
            )
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
        unknown = sorted(set(self.layer_pattern) - {c for c, part in PATTERN.items() if part != "moe"})
        if unknown:
            names = ", ".join(f"{c!r} ({PATTERN.get(c, 'unknown')})" for c in unknown)
            raise UsageError(
                f"layer_pattern has layer type {names}, which megakit does not build; it builds "
                "'M' (Mamba-2), '*' (attention) and '-' (MLP)"
            )
        if ("M" in self.layer_pattern) != (self.mamba is not None):
            raise UsageError("layer_pattern's 'M' blocks and the Mamba-2 config (mamba) go together; give both")

    def block_part(self, index: int) -> str | None:
        """The one part of block ``index`` of a hybrid model ("mamba", "attention" or "mlp"); None: attention then
        the MLP (every other model)."""
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
        """Translate a Hugging Face config dict (the model types of the module docstring). Every field
        transformers' model of that type reads is mapped, or refused in one line naming it."""
        kind = data.get("model_type")
        check_hf_fields(data, source)  # "1e-5" or true where a number goes: one line naming the file and the key
        act = data.get({"gpt2": "activation_function", "gemma3_text": "hidden_activation"}.get(kind, "hidden_act"))
        allowed = {"gpt2": ("gelu_new", "gelu_pytorch_tanh"), "gemma3_text": ("gelu_pytorch_tanh",)}.get(
            kind, ("silu",)
        )
        if kind in ("gpt2", *LLAMA_LIKE, *MOE_TYPES) and act is not None and act not in allowed:
            raise UsageError(
                f"model config {source} uses activation {act!r}, which megakit does not implement; "
                f"the {kind} family here uses {allowed[0]}"
            )
        if kind == "nemotron_h":
            from megakit.core.families.nemotron_h import config_from_hf  # noqa: PLC0415

            return config_from_hf(cls, data, source)
        try:
            if kind == "gpt2":
                hidden, dropout = data["n_embd"], _gpt2_dropout(data, source)
                return cls(
                    family="gpt2",
                    vocab_size=data["vocab_size"],
                    max_seq_len=data["n_positions"],
                    hidden=hidden,
                    layers=data["n_layer"],
                    heads=data["n_head"],
                    kv_heads=data["n_head"],
                    ffn=data.get("n_inner") or 4 * hidden,
                    norm_eps=data.get("layer_norm_epsilon", 1e-5),
                    tie_embeddings=data.get("tie_word_embeddings", True),
                    dropout=dropout,
                    qkv_bias=True,
                    out_bias=True,
                    mlp_bias=True,
                    init_std=data.get("initializer_range", 0.02),
                    scale_attn_weights=bool(data.get("scale_attn_weights", True)),
                    scale_attn_by_inverse_layer_idx=bool(data.get("scale_attn_by_inverse_layer_idx", False)),
                )
            if kind in LLAMA_LIKE or kind in MOE_TYPES:
                heads = data["num_attention_heads"]
                qwen = kind in ("qwen2", "qwen2_moe")
                bias = data.get("attention_bias", qwen) if kind != "qwen2_moe" else data.get("qkv_bias", True)
                if kind in ("qwen2", "mistral", "mixtral"):  # transformers fixes these: q/k/v biases (Qwen2) or none
                    bias = kind == "qwen2"
                layers = data["num_hidden_layers"]
                moe = (
                    MoEConfig.from_hf(
                        {**data, "model_type": "deepseek_v3" if kind in MLA_TYPES else kind},
                        layers=layers,
                        source=source,
                    )
                    if kind in MOE_TYPES
                    else None
                )
                mla = MLAConfig.from_hf(data) if kind in MLA_TYPES else None
                if kind == "gemma3_text":
                    return cls._from_gemma3(data, source)
                if kind == "smollm3":
                    return cls._from_smollm3(data, source)
                theta, scaling = read_rope(data, source=source)
                window, window_from, types = _sliding_window(data, kind, source)
                return cls(
                    family="llama",
                    vocab_size=data["vocab_size"],
                    max_seq_len=data.get("max_position_embeddings", 2048),
                    hidden=data["hidden_size"],
                    layers=layers,
                    heads=heads,
                    kv_heads=heads if mla else data.get("num_key_value_heads") or heads,
                    ffn=data["intermediate_size"],
                    norm_eps=data.get("rms_norm_eps", 1e-6),
                    tie_embeddings=data.get("tie_word_embeddings", False),
                    dropout=data.get("attention_dropout", 0.0),
                    head_dim=mla.qk_head_dim if mla else data.get("head_dim") or 0,
                    mla=mla,
                    mtp_layers=data.get("num_nextn_predict_layers", 0) if mla else 0,
                    rope_theta=theta,
                    rope_scaling=scaling,
                    sliding_window=window,
                    sliding_window_from=window_from,
                    layer_types=types,
                    qkv_bias=bool(bias),
                    out_bias=bool(bias) and not qwen,
                    mlp_bias=kind == "llama" and bool(data.get("mlp_bias", False)),  # only Llama reads it
                    init_std=data.get("initializer_range", 0.02),
                    qk_norm=kind in ("qwen3", "qwen3_moe"),
                    moe=moe,
                    hf_type=kind if kind in (*MOE_TYPES, "qwen3") else "",
                    attention_sinks=kind == "gpt_oss",
                )
        except KeyError as exc:
            raise UsageError(
                f"model config {source} lacks the field {exc.args[0]!r}; give a complete HF config.json"
            ) from exc
        raise UsageError(
            f"model config {source} has model_type {kind!r}; supported: gpt2, {', '.join((*LLAMA_LIKE, *MOE_TYPES))}, "
            "nemotron_h"
        )

    @classmethod
    def _from_gemma3(cls, data: dict, source: str) -> "ModelConfig":
        """Gemma 3's text model (``Gemma3ForCausalLM``), transformers 5's defaults where a field is absent."""
        for field in ("attn_logit_softcapping", "final_logit_softcapping"):
            if data.get(field) is not None:
                raise UsageError(
                    f"model config {source} sets {field} {data[field]!r} (Gemma 2's soft-capping), "
                    "which megakit does not implement; set it null as Gemma 3 does"
                )
        if data.get("use_bidirectional_attention"):
            raise UsageError(
                f"model config {source} sets use_bidirectional_attention, which megakit (causal "
                "language models) does not implement; set it false"
            )
        layers, heads = data["num_hidden_layers"], data["num_attention_heads"]
        pattern = data.get("sliding_window_pattern", data.get("_sliding_window_pattern", 6))
        types = data.get("layer_types") or [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        params = data.get("rope_parameters")
        if isinstance(params, dict) and set(params) <= set(LAYER_TYPES) and params:
            per_type = {
                t: read_rope({**data, "rope_scaling": None, "rope_parameters": p}, source=source)
                for t, p in params.items()
            }
        else:  # transformers 4's fields: rope_theta (global), rope_local_base_freq, rope_scaling (global)
            per_type = {
                "full_attention": read_rope({"rope_theta": 1e6, **data}, source=source),
                "sliding_attention": (float(data.get("rope_local_base_freq", 10000.0)), None),
            }
        full = per_type.get("full_attention", (1e6, None))
        sliding = per_type.get("sliding_attention", full)
        bias = bool(data.get("attention_bias", False))
        return cls(
            family="llama",
            vocab_size=data["vocab_size"],
            max_seq_len=data.get("max_position_embeddings", 131072),
            hidden=data["hidden_size"],
            layers=layers,
            heads=heads,
            kv_heads=data.get("num_key_value_heads") or heads,
            ffn=data["intermediate_size"],
            norm_eps=data.get("rms_norm_eps", 1e-6),
            tie_embeddings=data.get("tie_word_embeddings", True),
            dropout=data.get("attention_dropout", 0.0),
            head_dim=data.get("head_dim") or 256,
            rope_theta=full[0],
            rope_scaling=full[1],
            sliding_window=data.get("sliding_window") or 4096,
            layer_types=tuple(types),
            qkv_bias=bias,
            out_bias=bias,
            init_std=data.get("initializer_range", 0.02),
            qk_norm=True,
            norm_offset=True,
            sandwich_norms=True,
            mlp_act="gelu_tanh",
            embed_scale=data["hidden_size"] ** 0.5,
            query_pre_attn_scalar=float(data.get("query_pre_attn_scalar", 256)),
            sliding_rope_theta=sliding[0],
            sliding_rope_scaling=sliding[1],
            hf_type="gemma3_text",
        )

    @classmethod
    def _from_smollm3(cls, data: dict, source: str) -> "ModelConfig":
        """SmolLM3 (``SmolLM3ForCausalLM``): Llama with ``no_rope_layers`` and an optional window on its NoPE blocks,
        transformers 5's defaults (``SmolLM3Config``) where a field is absent."""
        layers, heads = data["num_hidden_layers"], data["num_attention_heads"]
        theta, scaling = read_rope({"rope_theta": 2e6, **data}, source=source)  # SmolLM3Config.default_theta
        window, types = _smollm3_windows(data, source)
        bias = bool(data.get("attention_bias", False))
        return cls(
            family="llama",
            vocab_size=data["vocab_size"],
            max_seq_len=data.get("max_position_embeddings", 32768),
            hidden=data["hidden_size"],
            layers=layers,
            heads=heads,
            kv_heads=data.get("num_key_value_heads") or heads,
            ffn=data["intermediate_size"],
            norm_eps=data.get("rms_norm_eps", 1e-6),
            tie_embeddings=data.get("tie_word_embeddings", True),
            dropout=data.get("attention_dropout", 0.0),
            head_dim=data.get("head_dim") or 0,
            rope_theta=theta,
            rope_scaling=scaling,
            sliding_window=window,
            layer_types=types,
            nope_layers=_smollm3_nope_layers(data, source),
            qkv_bias=bias,
            out_bias=bias,
            mlp_bias=bool(data.get("mlp_bias", False)),
            init_std=data.get("initializer_range", 0.02),
            hf_type="smollm3",
        )

    def _smollm3_to_hf(self) -> dict:
        """``_from_smollm3``'s inverse: the fields transformers' ``SmolLM3Config.to_dict`` writes and its model reads
        (``head_dim`` only where it is not ``hidden / heads``, as transformers derives it)."""
        out = {
            "model_type": "smollm3",
            "architectures": [HF_ARCHITECTURES["smollm3"]],
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            "rope_parameters": write_rope(self.rope_theta, self.rope_scaling)["rope_parameters"],
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "attention_dropout": self.dropout,
            "initializer_range": self.init_std,
            "use_sliding_window": "sliding_attention" in self.layer_types,
            "sliding_window": self.sliding_window if "sliding_attention" in self.layer_types else None,
            "layer_types": list(self.layer_types or ("full_attention",) * self.layers),
            "no_rope_layers": [int(self.block_uses_rope(i)) for i in range(self.layers)],
            "pad_token_id": None,
        }  # megakit trains every embedding row; transformers' default 128004 freezes one
        if self.head_dim != self.hidden // self.heads:
            out["head_dim"] = self.head_dim
        return out

    def _gemma3_to_hf(self) -> dict:
        """``_from_gemma3``'s inverse."""
        rope = {
            "full_attention": write_rope(self.rope_theta, self.rope_scaling)["rope_parameters"],
            "sliding_attention": write_rope(self.sliding_rope_theta or self.rope_theta, self.sliding_rope_scaling)[
                "rope_parameters"
            ],
        }
        return {
            "model_type": "gemma3_text",
            "architectures": [HF_ARCHITECTURES["gemma3_text"]],
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_activation": "gelu_pytorch_tanh",
            "rms_norm_eps": self.norm_eps,
            "tie_word_embeddings": self.tie_embeddings,
            "rope_parameters": rope,
            "attention_bias": self.qkv_bias,
            "attention_dropout": self.dropout,
            "query_pre_attn_scalar": _number(self.query_pre_attn_scalar),
            "sliding_window": self.sliding_window,
            "layer_types": list(self.layer_types),
            "attn_logit_softcapping": None,
            "final_logit_softcapping": None,
            "use_bidirectional_attention": False,
            "initializer_range": self.init_std,
        }

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
        shared = (("shared-expert FFN size", self.moe.shared_ffn),) if self.moe and self.moe.shared_ffn else ()
        shared += (("Mamba heads", self.mamba.heads), ("Mamba groups", self.mamba.groups)) if self.mamba else ()
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
        """One transformer block's parameters on one TP rank, split as tensor parallelism splits them.

        ``moe``: an MoE block (default: whenever the model has experts) or a dense one. An MoE block
        has, in place of the MLP, a router (E x H, replicated over TP), the routed experts (E x 3 x H x F,
        sharded over EP, never over TP: ETP = 1), and shared experts TP-sharded like a dense MLP of
        width ``shared_ffn`` (plus Qwen2-MoE's H x 1 shared gate, replicated)."""
        moe = self.moe is not None if moe is None else (moe and self.moe is not None)
        h, hd = self.hidden, self.head_dim
        q, kv = self.heads // tp * hd, self.kv_heads_per_rank(tp) * hd
        f = (self.moe.shared_ffn if moe else self.ffn) // tp
        mats = 3 if self.gated_mlp else 2
        matmul = h * (q + 2 * kv) + q * h + mats * h * f
        if self.mla:  # latent attention in place of q, k, v, o
            matmul, latent_norms = self.mla.attention_params(h, self.heads, tp)
            matmul += mats * h * f
        column_bias = self.qkv_bias * (q + 2 * kv) + self.mlp_bias * (mats - 1) * f + self.attention_sinks * q // hd
        norms = (4 if self.family == "gpt2" else 4 if self.sandwich_norms else 2) * h + 2 * self.qk_norm * hd  # + q, k
        replicated = norms + self.out_bias * h + self.mlp_bias * h + (latent_norms if self.mla else 0)
        if not moe:
            return BlockParams(matmul, column_bias, replicated)
        m = self.moe
        router = m.experts * h + (h if m.shared_gate else 0) + (m.experts if m.router_bias else 0)
        expert = 3 * h * m.ffn + (2 * m.ffn + h if m.expert_biases else 0)  # gpt-oss: biases on both matrices
        return BlockParams(
            matmul,
            column_bias,
            replicated + router,
            experts=m.experts * expert,
            active_experts=m.top_k * expert,
            router=router,
        )

    def layer_params(self, layer: int | None = None) -> int:
        """Parameters of one transformer block (``layer``: that one, dense or MoE; default: a typical one)."""
        return self.block_params(1, moe=None if layer is None else self.is_moe_layer(layer)).total

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.is_moe_layer(layer)

    @property
    def moe_layers(self) -> int:
        """How many blocks have routed experts (0 for a dense model)."""
        return sum(self.is_moe_layer(i) for i in range(self.layers))

    def _blocks(self) -> list[tuple[int, bool]]:
        """(count, is MoE) of the two kinds of block, skipping an absent kind."""
        n = self.moe_layers
        return [(c, moe) for c, moe in ((n, True), (self.layers - n, False)) if c]

    def embedding_params(self, tp: int = 1) -> int:
        """Token embedding rows one TP rank holds (padded vocab), plus GPT-2's learned positions (replicated)."""
        positions = self.max_seq_len * self.hidden if self.family == "gpt2" else 0
        return self.padded_vocab(tp) // tp * self.hidden + positions

    def head_params(self, tp: int = 1, *, separate: bool = True) -> int:
        """Final norm + the LM head's rows on one TP rank; ``separate``: the head is its own matrix
        (untied, or tied but held by another pipeline stage than the embedding)."""
        norm = (2 if self.family == "gpt2" else 1) * self.hidden
        return norm + (self.padded_vocab(tp) // tp * self.hidden if separate else 0)

    def num_params(self) -> int:
        """Total parameters (tied embeddings counted once, vocab unpadded; every expert)."""
        return (
            sum(n * self.block_params(moe=moe).total for n, moe in self._blocks())
            + self.embedding_params()
            + self.head_params(separate=not self.tie_embeddings)
        )

    def active_params(self) -> int:
        """Parameters one token uses: ``num_params`` with each MoE block's top-k experts only."""
        return self.num_params() - self.moe_layers * (self.block_params().experts - self.block_params().active_experts)

    def block_flops(
        self, seq_len: int, tp: int = 1, *, convention: str = "palm", moe: bool | None = None
    ) -> tuple[float, float]:
        """(forward FLOPs per token of one block on one TP rank, of which core attention).

        2 FLOPs per weight the ``convention`` counts (``FLOPS_CONVENTIONS``; of the routed experts only
        the top-k a token uses, and the router in every convention), plus attention's score and value
        products, 2 x 2 x ``seq_len`` per channel of its width (full S x S, not halved for the causal mask)."""
        if convention not in FLOPS_CONVENTIONS:
            raise ValueError(f"unknown FLOPs convention {convention!r}; use one of {', '.join(FLOPS_CONVENTIONS)}")
        weights, width = FLOPS_CONVENTIONS[convention]
        attn = 4 * seq_len * (self.heads // tp * self.head_dim) if width == "q" else 4 * seq_len * self.hidden / tp
        return 2 * self.block_params(tp, moe=moe).flop_weights(weights) + attn, attn

    def attention_context(self, index: int, seq_len: int) -> float:
        """The keys a query of block ``index`` attends to on average under the causal mask and its window ``w``:
        ``w - w (w - 1) / (2 s)`` (query ``i`` sees ``min(i + 1, w)``; Megatron-Bridge's ``calculate_swa_context``),
        ``(s + 1) / 2`` without a window."""
        w = min(self.attention_window(index) or seq_len, seq_len)
        return w - w * (w - 1) / (2 * seq_len)

    def attention_share(self, seq_len: int) -> float:
        """The blocks' mean causal attention work over what it would be without windows (1.0: no windows)."""
        if not self.sliding_window:  # the planner's search asks for every candidate: no loop where nothing slides
            return 1.0
        full = (seq_len + 1) / 2
        return sum(self.attention_context(i, seq_len) for i in range(self.layers)) / (self.layers * full)

    def causal_flops_per_token(self, seq_len: int, *, windows: bool = True, mtp: bool = False) -> float:
        """Training FLOPs per token as Megatron's formula counts them, with causal and window-aware attention
        (Megatron-Bridge's ``flop_utils``, the convention its published throughputs use): 6 x the weight matrices
        a token runs through (attention, the MLP or its top-k experts, the LM head; norms, biases and the router's
        small E x H aside), plus ``12 x q x`` the keys each query attends to (``attention_context``; ``windows``
        False: as if there were none); MLA's scores and values at their own widths. ``mtp``: with DeepSeek-V3's
        prediction modules, each a block like the last, its ``2H x H`` projection and the LM head again."""
        total = 3.0 * self.head_flops()
        widths = self.heads * self.head_dim + self.heads * (self.mla.v_head_dim if self.mla else self.head_dim)
        for i in range(self.layers):
            block = self.block_params(moe=self.is_moe_layer(i))
            context = self.attention_context(i, seq_len) if windows else (seq_len + 1) / 2
            total += 6 * (block.matmul + block.active_experts) + 6 * widths * context  # scores, then values
        for k in range(1, self.mtp_layers + 1 if mtp else 1):  # block L + k - 1 of DeepSeek's checkpoints
            block = self.block_params(moe=self.is_moe_layer(self.layers + k - 1))
            total += (
                6 * (block.matmul + block.active_experts + 2 * self.hidden**2)
                + 6 * widths * (seq_len + 1) / 2
                + 3 * self.head_flops()
            )
        return total

    def mtp_depth(self, mtp: bool) -> int:
        """The MTP modules trained with ``--mtp`` (``mtp``): the config's, refused where it has none, as the trainer
        refuses it (``megakit.nn.model.trained_mtp_depth``); 0 without ``--mtp``."""
        if mtp and not self.mtp_layers:
            raise UsageError(
                "MTP asked of a model without prediction modules: only DeepSeek-V3's configs (deepseek_v3, "
                "kimi_k2) have them, in num_nextn_predict_layers (DeepSeek-V3: 1); drop --mtp"
            )
        return self.mtp_layers if mtp else 0

    def mtp_module_params(self, depth: int, tp: int = 1) -> BlockParams:
        """MTP module ``depth``'s (1-based) parameters on one TP rank (``megakit.nn.mtp.PredictionModule``): its block,
        numbered ``layers + depth - 1`` as DeepSeek's checkpoint numbers it (MoE or dense by that index), ``eh_proj``
        (2H x H, column-parallel) and three norms (enorm, hnorm and the one before the shared head), replicated.
        The embedding copy and the head it shares are not its own."""
        block = self.block_params(tp, moe=self.is_moe_layer(self.layers + depth - 1))
        norm = (2 if self.family == "gpt2" else 1) * self.hidden
        return block._replace(
            matmul=block.matmul + 2 * self.hidden * self.hidden // tp, replicated=block.replicated + 3 * norm
        )

    def head_flops(self) -> int:
        """Forward FLOPs per token of the LM head (``V x H``, paid even when tied; the lookups are free)."""
        return 2 * self.hidden * self.vocab_size

    def flops_per_token(
        self,
        seq_len: int,
        *,
        convention: str = "palm",
        recompute: str = "none",
        flash_attention: bool = False,
        mtp: int = 0,
    ) -> float:
        """Training FLOPs per token: 3 x forward (blocks and LM head), plus what ``recompute`` and
        flash attention run again (``recompute_flops``; the defaults: none, the model FLOPs). ``mtp``: the MTP
        modules trained (``mtp_depth``), each a block (numbered ``layers + k - 1``), ``eh_proj``'s 2H x H and one
        more head product, as ``causal_flops_per_token(mtp=True)`` counts them (Megatron's: one extra layer,
        ``6 (2h^2)`` and ``6 h V`` per depth)."""
        total = 3.0 * self.head_flops()
        for n, moe in self._blocks():
            fwd, attn = self.block_flops(seq_len, convention=convention, moe=moe)
            total += n * (3 * fwd + recompute_flops(fwd, attn, recompute, flash_attention))
        for k in range(1, mtp + 1):
            fwd, attn = self.block_flops(seq_len, convention=convention, moe=self.is_moe_layer(self.layers + k - 1))
            total += (
                3 * fwd
                + recompute_flops(fwd, attn, recompute, flash_attention)
                + 6 * 2 * self.hidden**2
                + 3 * self.head_flops()
            )
        return float(total)

    # -- writing -----------------------------------------------------------------------------
    def to_hf(self) -> dict:
        """A transformers config.json dict of this model (``from_hf`` reads it back unchanged)."""
        if self.family == "gpt2":
            return {
                "model_type": "gpt2",
                "architectures": ["GPT2LMHeadModel"],
                "vocab_size": self.vocab_size,
                "n_positions": self.max_seq_len,
                "n_embd": self.hidden,
                "n_layer": self.layers,
                "n_head": self.heads,
                "n_inner": self.ffn,
                "activation_function": "gelu_new",
                "layer_norm_epsilon": self.norm_eps,
                "tie_word_embeddings": self.tie_embeddings,
                "resid_pdrop": self.dropout,
                "embd_pdrop": self.dropout,
                "attn_pdrop": self.dropout,
                "initializer_range": self.init_std,
                "scale_attn_weights": self.scale_attn_weights,
                "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            }
        if self.hf_type == "gemma3_text":
            return self._gemma3_to_hf()
        if self.hf_type == "smollm3":
            return self._smollm3_to_hf()
        if self.hf_type == "nemotron_h":
            from megakit.core.families.nemotron_h import config_to_hf  # noqa: PLC0415

            return config_to_hf(self)
        if self.nope_layers:
            raise UsageError(
                f"blocks without RoPE (nope_layers {list(self.nope_layers)}) cannot be written as a "
                f"transformers {self.hf_type or 'llama'} config; SmolLM3's (smollm3) has them"
            )
        qwen2 = self.qkv_bias and not self.out_bias  # Llama's attention_bias covers o_proj too
        kind = self.hf_type or ("qwen2" if qwen2 else "mistral" if self.sliding_window else "llama")
        if kind == "mistral" and (self.qkv_bias or self.mlp_bias):
            raise UsageError(
                "a sliding window with Llama's biases cannot be written as a transformers config "
                "(Mistral has no biases, Llama no window)"
            )
        out = {
            "model_type": kind,
            "architectures": [HF_ARCHITECTURES[kind]],
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_seq_len,
            "hidden_size": self.hidden,
            "intermediate_size": self.ffn,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.norm_eps,
            **write_rope(self.rope_theta, self.rope_scaling),
            "tie_word_embeddings": self.tie_embeddings,
            "attention_bias": self.qkv_bias,
            "mlp_bias": self.mlp_bias,
            "attention_dropout": self.dropout,
            "initializer_range": self.init_std,
        }
        if kind in ("qwen2", "qwen2_moe"):
            del out["attention_bias"]
        types = self.layer_types or (("full_attention",) * self.layers if kind == "gpt_oss" else ())
        out |= _window_to_hf(kind, self.sliding_window, self.sliding_window_from, types)
        if self.moe:
            out |= self.moe.to_hf(kind, layers=self.layers)
        if self.mla:  # transformers derives head_dim (the RoPE's) from the MLA widths itself
            del out["head_dim"], out["mlp_bias"]
            out |= self.mla.to_hf() | {"num_nextn_predict_layers": self.mtp_layers}
        return out

    def to_dict(self) -> dict:
        return asdict(self)

    def replace(self, **changes) -> "ModelConfig":
        return replace(self, **changes)


class BlockParams(NamedTuple):
    """One block's parameters on one TP rank."""

    matmul: int  # weight matrices (TP-sharded; in an MoE block, attention and the shared experts)
    column_bias: int  # biases of the column-parallel layers (q/k/v, up/gate), sharded with them
    replicated: int  # norms, the row-parallel layers' biases (o_proj, down), the router: every TP rank holds them
    experts: int = 0  # the routed experts' weights, all E of them (EP shards them, TP does not)
    active_experts: int = 0  # the top-k experts' weights one token runs through
    router: int = 0  # the router's (and shared gate's) matrix, part of ``replicated``

    @property
    def sharded(self) -> int:
        return self.matmul + self.column_bias

    @property
    def total(self) -> int:
        return self.sharded + self.replicated + self.experts

    def flop_weights(self, kind: str) -> int:
        """The weights a FLOPs convention counts (``FLOPS_CONVENTIONS``): of the routed experts the
        active ones, and the router as a matmul in each convention."""
        if kind == "total":
            return self.sharded + self.replicated + self.active_experts
        return getattr(self, kind) + self.router + self.active_experts


# The weights 2 FLOPs/token each are counted for (``BlockParams.flop_weights``) and attention's width:
FLOPS_CONVENTIONS = {
    # model FLOPs for MFU, PaLM's 6N + 12 L q S (Chowdhery et al. 2022, App. B): every block parameter
    "palm": ("total", "q"),
    # the planner's, Megatron's Eq. 3 (Narayanan et al. 2021) plus column biases: TP-sharded weights, width H
    "megatron": ("sharded", "hidden"),
    # the pipeline partition's time balance: weight matrices only
    "matmul": ("matmul", "q"),
}


def padded_vocab(vocab_size: int, tp: int) -> int:
    """The vocab rounded up to a multiple of TP, so every rank holds ``padded_vocab // tp`` rows.

    Rows past ``vocab_size`` are zero, never looked up, and masked out of the loss and logits.
    """
    return -(-vocab_size // tp) * tp


def recompute_flops(block_fwd: float, attn_fwd: float, recompute: str = "none", flash_attention: bool = False) -> float:
    """Forward FLOPs per token of one block that training runs a second time: the whole block
    (``recompute="full"``), its core attention ("selective"), and flash attention's scores in backward."""
    if recompute == "full":
        return block_fwd + (attn_fwd / 2 if flash_attention else 0)
    if recompute == "selective" and not flash_attention:
        return attn_fwd
    return attn_fwd / 2 if flash_attention else 0.0


def model_flops_per_token(config: ModelConfig, seq_len: int, *, mtp: int = 0) -> float:
    """Training FLOPs per token (forward + backward), for MFU: ``6N + 12 L q S``.

    N counts the matrices that do matmuls -- every block plus the LM head (``V x H``, paid
    even when tied); the lookup tables (token, position) are free. ``12 L q S`` is
    attention's score and value products (q = heads x head_dim), PaLM's convention, not
    halved for the causal mask. (``ModelConfig.flops_per_token``'s default convention.) ``mtp``: the MTP
    modules trained, their blocks, ``eh_proj`` and head products too.
    """
    return config.flops_per_token(seq_len, mtp=mtp)


def _gpt2_dropout(data: dict, source: str) -> float:
    """GPT-2's one dropout rate: megakit drops embeddings, attention and residuals alike (transformers: 0.1 each)."""
    rates = {k: data.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    if len(set(rates.values())) > 1:
        raise UsageError(
            f"model config {source} sets {', '.join(f'{k} {v}' for k, v in rates.items())}; megakit uses "
            "one dropout rate for all three: set them equal"
        )
    if data.get("add_cross_attention"):
        raise UsageError(
            f"model config {source} sets add_cross_attention (blocks that attend to an encoder), which "
            "megakit does not implement; set it false"
        )
    return rates["resid_pdrop"]


def _number(x: float) -> int | float:
    """``x`` as an int where it is whole (transformers' config classes type some of these fields int)."""
    return int(x) if float(x).is_integer() else x


def check_layer_types(types) -> None:
    """UsageError naming the ``layer_types`` entries megakit does not run (``LAYER_TYPES``)."""
    unknown = sorted(set(types or ()) - set(LAYER_TYPES))
    if unknown:
        raise UsageError(
            f"layer_types has {', '.join(map(repr, unknown))}, which megakit does not implement; it runs "
            f"{' and '.join(LAYER_TYPES)} (chunked, linear and other attention types are refused)"
        )


def _smollm3_nope_layers(data: dict, source: str) -> tuple[int, ...]:
    """The blocks SmolLM3 does not rotate: the 0s of ``no_rope_layers`` (1: RoPE), or, without the list, every
    ``no_rope_layer_interval``-th block (transformers' ``SmolLM3Config.__post_init__``: ``(i + 1) % interval == 0``)."""
    n, flags = data["num_hidden_layers"], data.get("no_rope_layers")
    if flags is None:
        interval = data.get("no_rope_layer_interval", 4)
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise UsageError(f"model config {source} has no_rope_layer_interval {interval!r}; give a positive integer")
        return tuple(i for i in range(n) if (i + 1) % interval == 0)
    if not isinstance(flags, list) or len(flags) < n or any(f not in (0, 1) for f in flags):
        raise UsageError(f"model config {source} has no_rope_layers {flags!r}; give a 1 (RoPE) or 0 (none) per block")
    return tuple(i for i in range(n) if not flags[i])


def _smollm3_windows(data: dict, source: str) -> tuple[int, tuple[str, ...]]:
    """``(window, layer_types)`` as SmolLM3 reads them: a block slides only where ``use_sliding_window`` is set and
    its ``layer_types`` entry says so (by default its NoPE blocks, when ``sliding_window`` is set too)."""
    types, window = data.get("layer_types"), data.get("sliding_window")
    check_layer_types(types)
    sliding = "sliding_attention" in (types or ())
    if not data.get("use_sliding_window", False):
        if sliding:  # transformers' eager mask would slide, its flash path would not
            raise UsageError(
                f"model config {source} has sliding_attention in layer_types but use_sliding_window "
                "false, which transformers' attention paths read differently; set one of them"
            )
        return 0, ()
    if types is None and window is not None:
        nope = _smollm3_nope_layers(data, source)
        types = ["sliding_attention" if i in nope else "full_attention" for i in range(data["num_hidden_layers"])]
    if not types or "sliding_attention" not in types:
        return 0, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UsageError(f"model config {source} has sliding_window {window!r}; give a positive integer")
    return window, tuple(types)


def _sliding_window(data: dict, kind: str, source: str) -> tuple[int, int, tuple[str, ...]]:
    """``(window, first block using it, layer_types)`` as transformers reads them: Mistral and Mixtral slide every
    block (Mistral 4096 unless null), the Qwens only with ``use_sliding_window`` (Qwen2/3 from ``max_window_layers``
    on, Qwen2-MoE its even blocks below it, Qwen3-MoE all; or as ``layer_types`` says: transformers 5.24's
    rules); gpt-oss its even blocks. A run of last blocks is kept as its first block (``layer_types`` empty, as
    Qwen writes it), any other pattern as ``layer_types``.
    ``(0, 0, ())``: none."""
    n = data.get("num_hidden_layers", 0)
    if kind == "gpt_oss":  # transformers' default: its even blocks slide
        types = data.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
        check_layer_types(types)
        window = data.get("sliding_window", 128)
        return (window, 0, tuple(types)) if window else (0, 0, ())
    if kind in ("mistral", "mixtral"):
        window, sliding = data.get("sliding_window", 4096 if kind == "mistral" else None), [True] * n
    elif kind in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and data.get("use_sliding_window", False):
        window, last, types = (
            data.get(k, d) for k, d in (("sliding_window", 4096), ("max_window_layers", 28), ("layer_types", None))
        )
        check_layer_types(types)
        sliding = (
            [t == "sliding_attention" for t in types]
            if types and kind != "qwen3_moe"
            else [True] * n
            if kind == "qwen3_moe"
            else [i % 2 == 0 and i < last for i in range(n)]
            if kind == "qwen2_moe"
            else [i >= last for i in range(n)]
        )
    else:
        return 0, 0, ()
    if window is None or not any(sliding):
        return 0, 0, ()
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise UsageError(f"model config {source} has sliding_window {window!r}; give a positive integer or null")
    start = sliding.index(True)
    if sliding != [i >= start for i in range(len(sliding))]:
        return window, 0, tuple("sliding_attention" if x else "full_attention" for x in sliding)
    return window, start, ()


def _window_to_hf(kind: str, window: int, start: int, types: tuple[str, ...] = ()) -> dict:
    """The config.json fields that give transformers' ``kind`` this window (``_sliding_window``'s inverse)."""
    if kind in ("qwen2", "qwen3", "qwen2_moe") and types:
        return {
            "use_sliding_window": True,
            "sliding_window": window,
            "max_window_layers": 0,
            "layer_types": list(types),
        }
    if kind == "gpt_oss":
        return {"sliding_window": window or None, "layer_types": list(types)}
    if types:
        raise UsageError(f"a per-block layer_types schedule cannot be written as a transformers {kind} config")
    if kind in ("qwen2", "qwen3"):
        return {"use_sliding_window": bool(window), "sliding_window": window or None, "max_window_layers": start}
    if window and (start or kind not in ("mistral", "mixtral", "qwen3_moe")):
        raise UsageError(f"a sliding window from block {start} cannot be written as a transformers {kind} config")
    if kind == "qwen3_moe":
        return {"use_sliding_window": bool(window), "sliding_window": window or None}
    return {"sliding_window": window or None} if kind in ("mistral", "mixtral") else {}


def check_seq_len(config: ModelConfig, seq_len: int) -> None:
    if seq_len > config.max_seq_len:
        raise UsageError(
            f"sequence length {seq_len} exceeds the model's max_seq_len {config.max_seq_len}; "
            "use shorter sequences or a config with more positions"
        )
