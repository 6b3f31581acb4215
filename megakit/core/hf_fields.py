"""The types of a Hugging Face config.json's fields, checked before megakit reads any of them.

A config written by hand or by a script can hold ``"rms_norm_eps": "1e-5"`` (a string) or
``"num_hidden_layers": true`` (JSON's bool, which Python takes for the int 1). Read as they are, the first fails
as a TypeError deep in the first forward, the second trains a one-block model without a word. So every field the
readers (``ModelConfig.from_hf``, ``MoEConfig.from_hf``, ``MLAConfig.from_hf``) take a number or a flag from is
checked here first, by its own name in the file: the message names the file and that key, not megakit's field.
``rope_theta`` and the RoPE variants' fields are ``megakit.core.rope.read_rope``'s to check.
"""

from __future__ import annotations

import json
import math

from megakit.errors import UsageError

# key -> (kind, lowest, highest, null allowed): kind "int" (a JSON integer, never a bool), "number" (an integer or
# a finite float, never a bool) or "bool"; the bounds inclusive for ints, "lowest <= x < highest" for numbers
_POSITIVE = ("int", 1, None, False)
_COUNT = ("int", 0, None, False)
_OPTIONAL = ("int", 0, None, True)  # read as ``data.get(key) or default``: null and 0 mean "the default"
_FLAG = ("bool", None, None, False)
_RATE = ("number", 0, 1, False)
_SCALE = ("number", 0, None, False)
FIELDS = {
    **dict.fromkeys(
        (
            "vocab_size",
            "n_positions",
            "n_embd",
            "n_layer",
            "n_head",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "num_experts_per_tok",
            "num_local_experts",
            "num_experts",
            "n_routed_experts",
            "moe_intermediate_size",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "sliding_window_pattern",
            "_sliding_window_pattern",
        ),
        _POSITIVE,
    ),
    **dict.fromkeys(
        (
            "first_k_dense_replace",
            "n_shared_experts",
            "shared_expert_intermediate_size",
            "moe_shared_expert_intermediate_size",
            "max_window_layers",
            "num_nextn_predict_layers",
        ),
        _COUNT,
    ),
    **dict.fromkeys(
        (
            "n_inner",
            "num_key_value_heads",
            "head_dim",
            "q_lora_rank",
            "n_group",
            "topk_group",
            "decoder_sparse_step",
            "sliding_window",
        ),
        _OPTIONAL,
    ),
    **dict.fromkeys(("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"), _RATE),
    **dict.fromkeys(("initializer_range", "router_aux_loss_coef", "swiglu_limit"), _SCALE),
    **dict.fromkeys(
        (
            "layer_norm_epsilon",
            "rms_norm_eps",
            "routed_scaling_factor",
            "query_pre_attn_scalar",
            "rope_local_base_freq",
            "swiglu_alpha",
        ),
        ("number", 0, None, False),
    ),  # above 0: checked apart
    **dict.fromkeys(
        (
            "tie_word_embeddings",
            "attention_bias",
            "mlp_bias",
            "qkv_bias",
            "scale_attn_weights",
            "scale_attn_by_inverse_layer_idx",
            "use_sliding_window",
            "norm_topk_prob",
            "output_router_logits",
            "rope_interleave",
        ),
        _FLAG,
    ),
    **dict.fromkeys(("add_cross_attention", "use_bidirectional_attention"), ("bool", None, None, True)),
}
_ABOVE_ZERO = (
    "layer_norm_epsilon",
    "rms_norm_eps",
    "routed_scaling_factor",
    "query_pre_attn_scalar",
    "rope_local_base_freq",
    "swiglu_alpha",
)


def check_hf_fields(data: dict, source: str) -> None:
    """UsageError naming ``source`` and the first key of ``FIELDS`` whose value has the wrong type or range."""
    for key, (kind, low, high, nullable) in FIELDS.items():
        if key not in data or (data[key] is None and nullable):
            continue
        value = data[key]
        if kind == "bool":
            ok, want = isinstance(value, bool), "true or false"
        elif kind == "int":
            assert low is not None  # only flags have no lower bound
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            want = "a positive integer" if low == 1 else "an integer >= 0"
        else:
            assert low is not None  # only flags have no lower bound
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
                and (value > low if key in _ABOVE_ZERO else value >= low)
                and (high is None or value < high)
            )
            want = (
                "a number above 0"
                if key in _ABOVE_ZERO
                else f"a number in [{low}, {high})"
                if high is not None
                else "a number >= 0"
            )
        if not ok:
            raise UsageError(
                f"model config {source} has {key} {json.dumps(value)}; give {want}"
                f"{' or null' if nullable else ''}{_bool_note(value, kind)}"
            )


def _bool_note(value, kind: str) -> str:
    """Why ``true`` is refused where a number goes (Python would take it for 1)."""
    return " (true and false are not numbers)" if isinstance(value, bool) and kind != "bool" else ""
