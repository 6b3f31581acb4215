"""Nemotron-H's weights in and out of transformers' layout (``NemotronHForCausalLM``): each Mamba-2 mixer's packed
``in_proj`` (z, x, B, C, dt) and ``conv1d`` (x, B, C) split into megakit's separate parameters, which TP splits by
their own rows, and packed back; every other tensor keeps its name (``layers.i.norm``, ``layers.i.mixer.*``)."""

from __future__ import annotations

import torch

from megakit.core.families.nemotron_h import PATTERN


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


def state_from_hf(hf: dict, config) -> dict:
    """megakit's full state dict from a ``NemotronHForCausalLM`` one (``model.`` or NVIDIA's ``backbone.``)."""
    prefix = "backbone." if any(k.startswith("backbone.") for k in hf) else "model."
    out = {"embed.weight": hf[f"{prefix}embeddings.weight"], "norm.weight": hf[f"{prefix}norm_f.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = hf["lm_head.weight"]
    for i, c in enumerate(config.layer_pattern):
        layer = f"{prefix}layers.{i}."
        out[f"layers.{i}.norm.weight"] = hf[f"{layer}norm.weight"]
        mixer = {k[len(layer) + 6 :]: v for k, v in hf.items() if k.startswith(f"{layer}mixer.")}
        if PATTERN[c] == "mamba":
            mixer = mixer_from_hf(mixer, config.mamba)
        out |= {f"layers.{i}.mixer.{k}": v for k, v in mixer.items()}
    return out


def state_to_hf(state: dict, config) -> dict:
    """Inverse of ``state_from_hf``: transformers' ``NemotronHForCausalLM`` names."""
    out = {"model.embeddings.weight": state["embed.weight"], "model.norm_f.weight": state["norm.weight"]}
    out["lm_head.weight"] = state["embed.weight" if config.tie_embeddings else "lm_head.weight"]
    for i, c in enumerate(config.layer_pattern):
        out[f"model.layers.{i}.norm.weight"] = state[f"layers.{i}.norm.weight"]
        head = f"layers.{i}.mixer."
        mixer = {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}
        if PATTERN[c] == "mamba":
            mixer = mixer_to_hf(mixer)
        out |= {f"model.layers.{i}.mixer.{k}": v for k, v in mixer.items()}
    return out
