"""NVIDIA's Nemotron-H (``nemotron_h``): a hybrid of Mamba-2, attention, MLP and MoE layers, one mixer per layer.

Its ``hybrid_override_pattern`` names each layer by one character: ``M`` Mamba-2, ``*`` attention (no RoPE),
``-`` a squared-ReLU MLP (not gated), ``E`` an MoE block (Nemotron-3). Each HF layer is one megakit block with that
one part (``ModelConfig.layer_pattern``). HF's ``in_proj`` of a mixer packs z, x, B, C and dt, and its ``conv1d``
x, B and C: megakit keeps them as separate parameters, so that each splits over TP by its own rows.
"""

from __future__ import annotations

PATTERN = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}  # hybrid_override_pattern's characters


def mixer_from_hf(state: dict, mamba) -> dict:
    """megakit's parameters of one Mamba-2 mixer from transformers' ``NemotronHMamba2Mixer`` state (names relative
    to the mixer)."""
    inner, bc, heads = mamba.inner, mamba.groups * mamba.state, mamba.heads
    out = {}
    for suffix in ("weight", "bias"):
        if f"in_proj.{suffix}" in state:
            parts = state[f"in_proj.{suffix}"].split([inner, inner, bc, bc, heads])
            out.update({f"{n}_proj.{suffix}": t for n, t in zip("zxbc", parts[:4], strict=True)})
            out[f"dt_proj.{suffix}"] = parts[4]
    conv = state["conv1d.weight"][:, 0].split([inner, bc, bc])
    out.update({f"conv_{n}.weight": t for n, t in zip("xbc", conv, strict=True)})
    if "conv1d.bias" in state:
        out.update(
            {f"conv_{n}.bias": t for n, t in zip("xbc", state["conv1d.bias"].split([inner, bc, bc]), strict=True)}
        )
    for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight", "out_proj.bias"):
        if name in state:
            out[name] = state[name]
    return out


def mixer_to_hf(state: dict) -> dict:
    """Inverse of ``mixer_from_hf``: transformers' names and packing."""
    import torch

    out = {}
    for suffix in ("weight", "bias"):
        if f"z_proj.{suffix}" in state:
            out[f"in_proj.{suffix}"] = torch.cat([state[f"{n}_proj.{suffix}"] for n in ("z", "x", "b", "c", "dt")])
    out["conv1d.weight"] = torch.cat([state[f"conv_{n}.weight"] for n in "xbc"])[:, None]
    if "conv_x.bias" in state:
        out["conv1d.bias"] = torch.cat([state[f"conv_{n}.bias"] for n in "xbc"])
    for name in ("dt_bias", "A_log", "D", "norm.weight", "out_proj.weight", "out_proj.bias"):
        if name in state:
            out[name] = state[name]
    return out
