"""RoPE's variants as transformers defines them: read from either form of config.json, written back in
both, and their inverse frequencies.

transformers 4 writes ``rope_theta`` and ``rope_scaling`` (``{"rope_type": "llama3", "factor": 8, ...}``;
older files say ``"type"``) at the top of config.json; transformers 5 writes one ``rope_parameters``
dict holding ``rope_theta``, ``rope_type`` and the variant's fields. A variant changes the model's
math (Llama 3.1-3.3 all ship ``llama3``), so each is either computed here formula for formula after
transformers' ``ROPE_INIT_FUNCTIONS`` (``modeling_rope_utils.py``) or refused in one line naming it.
Pure Python in float64, so the core imports no torch; ``megakit.nn.attention.core`` builds the tables.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from megakit.errors import UsageError

# rope_type -> (fields its formula needs, fields it may read); transformers' own names
VARIANTS = {
    "linear": (("factor",), ()),
    # NTK-dynamic rescales theta only for sequences longer than max_position_embeddings, which megakit
    # never runs (``check_seq_len``): inside them transformers uses the plain frequencies, as here
    "dynamic": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE variant other than the plain one: its ``type`` and the fields its formula reads, as
    config.json names them (sorted pairs, so the config stays hashable and JSON round-trips)."""

    type: str
    params: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:  # a checkpoint manifest gives lists back
        object.__setattr__(self, "params", tuple(sorted((str(k), v) for k, v in self.params)))

    def get(self, key: str, default=None):
        """A scaling parameter by name, like ``dict.get``: the params are a tuple so the dataclass stays hashable."""
        return dict(self.params).get(key, default)


def read_rope(data: dict, *, source: str) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, variant)`` of a Llama-family config.json in either form (None: plain RoPE).

    transformers' precedence: ``rope_scaling`` over ``rope_parameters``; a field inside the dict over
    the same field at the top; a top-level ``original_max_position_embeddings`` over both."""
    params = data.get("rope_scaling") or data.get("rope_parameters") or {}
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise UsageError(
            f"model config {source} gives rope parameters per layer type or not as a JSON object; "
            "megakit implements one RoPE for all blocks: give one flat rope_parameters dict"
        )
    theta = params.get("rope_theta", data.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 1:
        raise UsageError(f"model config {source} has rope_theta {theta!r}; give a number above 1")
    partial = params.get("partial_rotary_factor", data.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise UsageError(
            f"model config {source} sets partial_rotary_factor {partial!r} (rotary on part of each "
            "head), which megakit does not implement; remove it (transformers' Llama rotates whole heads)"
        )
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind not in VARIANTS:
        raise UsageError(
            f"model config {source} uses rope_type {kind!r}, which megakit does not implement; "
            f"supported: default, {', '.join(VARIANTS)}"
        )
    needed, optional = VARIANTS[kind]
    fields = {k: params[k] for k in (*needed, *optional) if k in params}
    if "original_max_position_embeddings" in needed:
        fields["original_max_position_embeddings"] = data.get(
            "original_max_position_embeddings",
            fields.get("original_max_position_embeddings", data.get("max_position_embeddings", 2048)),
        )
    for key in needed:
        value = fields.get(key)
        if not (kind == "yarn" and key == "factor" and key in fields and value is None) and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
        ):
            raise UsageError(
                f"model config {source}'s {kind} rope parameters have {key} {value!r}; "
                f"give a positive number, as transformers requires"
            )
    return float(theta), RopeScaling(kind, tuple(fields.items()))


def write_rope(theta: float, scaling: RopeScaling | None) -> dict:
    """The config.json fields of both forms: transformers 4 reads ``rope_theta`` and ``rope_scaling``,
    transformers 5 ``rope_parameters`` (and both agree, whichever it prefers)."""
    kind = scaling.type if scaling else "default"
    fields = dict(scaling.params) if scaling else {}
    out = {"rope_theta": theta, "rope_parameters": {"rope_type": kind, "rope_theta": theta, **fields}}
    if scaling:
        out["rope_scaling"] = {"rope_type": kind, **fields}
    return out


def inv_freq(theta: float, head_dim: int, scaling: RopeScaling | None, max_positions: int) -> tuple[list[float], float]:
    """transformers' ``(inv_freq, attention_factor)``: ``head_dim / 2`` angular frequencies, and the factor
    both cos and sin are multiplied by (yarn's mscale; 1 otherwise)."""
    d = head_dim
    plain = [1.0 / theta ** (i / d) for i in range(0, d, 2)]
    kind = scaling.type if scaling else "default"
    if kind in ("default", "dynamic"):
        return plain, 1.0
    assert scaling is not None  # kind came from it
    factor = scaling.get("factor")
    if kind == "linear":
        return [f / factor for f in plain], 1.0
    old = scaling.get("original_max_position_embeddings")
    if kind == "llama3":  # Llama 3.1: long wavelengths slowed by ``factor``, short kept, a smooth ramp between
        low, high = scaling.get("low_freq_factor"), scaling.get("high_freq_factor")
        out = []
        for f in plain:
            wavelen = 2 * math.pi / f
            if wavelen < old / high:
                out.append(f)
            elif wavelen > old / low:
                out.append(f / factor)
            else:
                smooth = (old / wavelen - low) / (high - low)
                out.append((1 - smooth) * f / factor + smooth * f)
        return out, 1.0
    return _yarn(theta, d, scaling, factor if factor is not None else max_positions / old, old)


def _yarn(theta: float, d: int, scaling: RopeScaling, factor: float, old: int) -> tuple[list[float], float]:
    """YaRN (Peng et al. 2023): interpolate the slow channels by ``factor``, keep the fast ones, ramp
    between (``beta_fast``/``beta_slow`` rotations in ``old`` positions); scale cos and sin by mscale."""

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def channel(rotations):  # the channel that turns ``rotations`` times in ``old`` positions
        return d * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel(scaling.get("beta_fast") or 32), channel(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    out = []
    for j, i in enumerate(range(0, d, 2)):
        keep = 1 - min(max((j - low) / (high - low), 0.0), 1.0)  # 1: extrapolate (fast), 0: interpolate
        pos = theta ** (i / d)
        out.append(1.0 / (factor * pos) * (1 - keep) + 1.0 / pos * keep)
    return out, float(attention)
