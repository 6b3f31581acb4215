"""Nemotron-H's weights in and out of transformers' layout (``NemotronHForCausalLM``): each Mamba-2 mixer's packed
``in_proj`` (z, x, B, C, dt) and ``conv1d`` (x, B, C) split into megakit's separate parameters, which TP splits by
their own rows, and packed back; every other tensor keeps its name (``layers.i.norm``, ``layers.i.mixer.*``), but
an 'E' block's shared expert (transformers' ``shared_experts``). Its routed experts leave stacked, as transformers 5
holds them (``experts.up_proj`` ``(E, F, H)``), and come in stacked or one matrix per expert (NVIDIA's files)."""

from __future__ import annotations

import torch

from megakit.core.families.nemotron_h import PATTERN
from megakit.errors import UsageError


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


def experts_from_hf(state: dict, moe) -> dict:
    """megakit's parameters of one 'E' block from transformers' ``NemotronHMoE`` state (names relative to the
    mixer): the experts stacked as transformers 5 holds them, or one matrix per expert as NVIDIA's files do."""
    out = {k.replace("shared_experts.", "shared_expert."): v for k, v in state.items() if ".experts." not in f".{k}"}
    for name in ("up_proj", "down_proj"):
        stacked = state.get(f"experts.{name}")
        if stacked is None:
            stacked = torch.stack([_get(state, f"experts.{j}.{name}.weight") for j in range(moe.experts)])
        out[f"experts.{name}"] = stacked
    return out


def _get(state: dict, name: str):
    if name not in state:
        raise UsageError(f"weights lack the MoE tensor {name!r}; they are not a complete Nemotron-3 checkpoint")
    return state[name]


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
        elif PATTERN[c] == "moe":
            mixer = experts_from_hf(mixer, config.moe)
        out |= {f"layers.{i}.mixer.{k}": v for k, v in mixer.items()}
    return out


def state_to_hf(state: dict, config) -> dict:
    """Inverse of ``state_from_hf``: transformers' ``NemotronHForCausalLM`` names. Each block's kind is read from its
    keys, not the pattern: the export converts one block at a time as block 0 (``megakit.interop.hf_export``)."""
    out = {"model.embeddings.weight": state["embed.weight"], "model.norm_f.weight": state["norm.weight"]}
    out["lm_head.weight"] = state["embed.weight" if config.tie_embeddings else "lm_head.weight"]
    for i in sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.")}):
        out[f"model.layers.{i}.norm.weight"] = state[f"layers.{i}.norm.weight"]
        head = f"layers.{i}.mixer."
        mixer = {k[len(head) :]: v for k, v in state.items() if k.startswith(head)}
        if "conv_x.weight" in mixer:  # a Mamba-2 mixer
            mixer = mixer_to_hf(mixer)
        mixer = {k.replace("shared_expert.", "shared_experts."): v for k, v in mixer.items()}  # an 'E' block's
        out |= {f"model.layers.{i}.mixer.{k}": v for k, v in mixer.items()}
    return out
