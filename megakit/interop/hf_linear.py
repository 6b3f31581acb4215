"""Gated DeltaNet weights to and from transformers' layouts (Qwen3-Next's fused projections, Qwen3.5's apart).

megakit keeps one column-parallel projection per part (``attn.in_q`` ... ``attn.in_a``: TP splits each by heads)
and one conv weight per q, k and v (``attn.conv_q`` ...). transformers' Qwen3-Next fuses q, k, v and z into
``in_proj_qkvz`` grouped per key head (``[q_g, k_g, v_g, z_g]`` for each key head ``g``, with the ``r`` value heads
of the group) and b and a into ``in_proj_ba`` likewise; Qwen3.5 stores ``in_proj_qkv`` as q, k, v one after the
other, and z, b, a apart. Both keep the conv as one ``(q + k + v channels, 1, K)`` tensor. The rest renames
(``LINEAR_BLOCK``).
"""

from __future__ import annotations

import torch

from megakit.core.linear_attention_config import LinearAttentionConfig

LINEAR_BLOCK = (  # our suffix under layers.{i}. -> theirs under the layer prefix, as they are
    ("attn.A_log", "linear_attn.A_log"),
    ("attn.dt_bias", "linear_attn.dt_bias"),
    ("attn.gated_norm.weight", "linear_attn.norm.weight"),
    ("attn.out_proj.weight", "linear_attn.out_proj.weight"),
)
FUSED_TYPES = ("qwen3_next",)  # q/k/v/z and b/a fused per key head group; the others: Qwen3.5's layout


def _widths(linear: LinearAttentionConfig) -> tuple[int, int, int]:
    """(q or k channels, v channels, value heads per key head)."""
    return (
        linear.key_heads * linear.key_head_dim,
        linear.value_heads * linear.value_head_dim,
        linear.value_heads // linear.key_heads,
    )


def linear_to_hf(linear: LinearAttentionConfig, kind: str, ours: str, theirs: str, state: dict) -> dict:
    """Our Gated DeltaNet block under ``ours`` as transformers' ``theirs`` + ``linear_attn.*`` of ``kind``."""
    out = {theirs + hf: state[ours + name] for name, hf in LINEAR_BLOCK}
    p = {x: state[f"{ours}attn.in_{x}.weight"] for x in "qkvzba"}
    hidden = p["q"].shape[1]
    nq, _, r = _widths(linear)
    conv = torch.cat([state[ours + f"attn.conv_{x}"] for x in "qkv"]).unsqueeze(1)
    out[theirs + "linear_attn.conv1d.weight"] = conv
    if kind in FUSED_TYPES:
        g, dk, dv = linear.key_heads, linear.key_head_dim, linear.value_head_dim
        groups = [p["q"].view(g, dk, hidden), p["k"].view(g, dk, hidden)]
        groups += [p[x].view(g, r * dv, hidden) for x in "vz"]
        out[theirs + "linear_attn.in_proj_qkvz.weight"] = torch.cat(groups, dim=1).reshape(-1, hidden)
        ba = torch.cat([p[x].view(g, r, hidden) for x in "ba"], dim=1)
        out[theirs + "linear_attn.in_proj_ba.weight"] = ba.reshape(-1, hidden)
    else:
        out[theirs + "linear_attn.in_proj_qkv.weight"] = torch.cat([p["q"], p["k"], p["v"]])
        out.update({theirs + f"linear_attn.in_proj_{x}.weight": p[x] for x in "zba"})
    return out


def linear_from_hf(linear: LinearAttentionConfig, kind: str, ours: str, theirs: str, hf) -> dict:
    """``linear_to_hf``'s inverse: transformers' ``theirs`` + ``linear_attn.*`` as our names under ``ours``."""
    out = {ours + name: hf[theirs + hf_name] for name, hf_name in LINEAR_BLOCK}
    nq, nv, r = _widths(linear)
    conv = hf[theirs + "linear_attn.conv1d.weight"].squeeze(1)
    for x, part in zip("qkv", conv.split([nq, nq, nv])):
        out[ours + f"attn.conv_{x}"] = part.contiguous()
    if kind in FUSED_TYPES:
        g, dk, dv = linear.key_heads, linear.key_head_dim, linear.value_head_dim
        qkvz = hf[theirs + "linear_attn.in_proj_qkvz.weight"]
        hidden = qkvz.shape[1]
        parts = qkvz.view(g, 2 * dk + 2 * r * dv, hidden).split([dk, dk, r * dv, r * dv], dim=1)
        parts += hf[theirs + "linear_attn.in_proj_ba.weight"].view(g, 2 * r, hidden).split([r, r], dim=1)
        out.update({f"{ours}attn.in_{x}.weight": t.reshape(-1, hidden).contiguous() for x, t in zip("qkvzba", parts)})
    else:
        qkv = hf[theirs + "linear_attn.in_proj_qkv.weight"].split([nq, nq, nv])
        out.update({f"{ours}attn.in_{x}.weight": t.contiguous() for x, t in zip("qkv", qkv)})
        out.update({f"{ours}attn.in_{x}.weight": hf[theirs + f"linear_attn.in_proj_{x}.weight"] for x in "zba"})
    return out
