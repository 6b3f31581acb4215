"""How each checkpointed tensor is split over the grid, and which rank writes which piece.

- A TP-split parameter (``param.tp_dim``) is cut along that dimension over the TP group:
  manifest field ``tp_dim``, one slice per TP rank, in ``model-ppXX-tpYY`` files.
- A routed expert's weights (``layers.N.mlp.experts.*``, ``param.ep_dim`` 0: stacked experts) are
  cut along that dimension over the EP group: manifest field ``ep_dim`` 0, one slice per EP rank,
  in ``experts-ppXX-epYY`` files written by the first rank of each expert-data-parallel group
  (TP rank 0: experts are whole on every TP rank). The checkpoint so holds all the experts
  whatever the EP degree, and any EP reads its own rows back; at EP 1 the one slice is all of them.
- Anything else (norms, the router, persistent buffers such as the expert bias) is whole,
  written once by TP rank 0 of DP replica 0.

DP (and CP) replicas hold the same weights, so only DP replica 0 writes dense tensors. The
same split applies to the optimizer state saved beside a parameter. ``write_shard`` writes a
rank's pieces to one file and returns their manifest entries.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from megakit.interop.checkpoint_format import write_tensors


class Split(NamedTuple):
    """How this rank holds a tensor: ``key`` is the manifest field (``tp_dim``, ``ep_dim``; None: whole),
    cut along ``dim`` into ``parts``, of which this rank holds number ``index``."""

    key: str | None
    dim: int | None
    parts: int
    index: int


def is_expert(tensor) -> bool:
    """A routed expert's stacked weights (``param.ep_dim``, set by ``megakit.nn.moe.layer``): split over EP along that dim.
    The router (``mlp.gate``) and the shared expert are dense."""
    return getattr(tensor, "ep_dim", None) is not None


def base_name(name: str) -> str:
    """The parameter a stored tensor belongs to (``state/exp_avg/layers.0.x`` -> ``layers.0.x``)."""
    return name.rsplit("/", 1)[-1]


def ep_place(topo) -> tuple[int, int, bool]:
    """``(EP, this rank's EP rank, first of its expert-data-parallel group)``; ``(1, 0, DP replica 0)`` without EP."""
    if topo is None:
        return 1, 0, True
    if getattr(topo, "ep", 1) == 1:
        return 1, 0, topo.dp_rank == 0 and getattr(topo, "cp_rank", 0) == 0
    return topo.ep, topo.ep_rank, topo.edp_rank == 0


def split_of(name: str, tensor: torch.Tensor, topo) -> Split:
    """How this rank holds ``tensor`` (a parameter, or a buffer) called ``name``."""
    if is_expert(tensor):
        ep, ep_rank, _ = ep_place(topo)
        return Split("ep_dim", tensor.ep_dim, ep, ep_rank)
    dim = getattr(tensor, "tp_dim", None)
    if dim is not None:
        return Split("tp_dim", dim, 1 if topo is None else topo.tp, 0 if topo is None else topo.tp_rank)
    return Split(None, None, 1, 0)


def writes(name: str, tensor: torch.Tensor, topo) -> bool:
    """Whether this rank writes its piece of ``tensor`` (within a stage; the stage itself is decided by the caller)."""
    tp_rank = 0 if topo is None else topo.tp_rank
    _, _, edp_first = ep_place(topo)
    if is_expert(tensor):  # EP > 1: EP ranks of any TP rank hold their own experts (folded over TP x CP x DP)
        return edp_first and (getattr(topo, "ep", 1) > 1 or tp_rank == 0)
    dp_first = topo is None or (topo.dp_rank == 0 and getattr(topo, "cp_rank", 0) == 0)
    return dp_first and (getattr(tensor, "tp_dim", None) is not None or tp_rank == 0)


def is_adapter(name: str) -> bool:
    """Whether the tensor called ``name`` is a LoRA adapter's (``megakit.nn.lora``)."""
    return name.endswith((".lora_A", ".lora_B"))


def adapted(modules: list[nn.Module]) -> bool:
    """Whether the stage carries LoRA adapters (``megakit.nn.lora.add_lora`` marks each chunk it adapts)."""
    return any(getattr(module, "lora_spec", None) is not None for module in modules)


def named_tensors(modules: list[nn.Module], *, base: bool = False) -> dict[str, torch.Tensor]:
    """Name -> parameter or persistent buffer (the expert bias) over a stage's module(s), by the model's
    layout-independent names; non-persistent buffers (RoPE tables) are derived, not saved. A stage with LoRA
    adapters: its adapters only (what trains and what its checkpoints hold), or with ``base`` all but them."""
    out: dict[str, torch.Tensor] = {}
    for module in modules:
        tensors = dict(module.named_parameters())
        for prefix, owner in module.named_modules():
            for name, buffer in owner.named_buffers(recurse=False):
                if name not in owner._non_persistent_buffers_set:  # noqa: SLF001 (what state_dict leaves out)
                    tensors[f"{prefix}.{name}" if prefix else name] = buffer
        for name, tensor in tensors.items():
            assert name not in out, f"tensor {name} appears in two chunks"
            out[name] = tensor
    if base or adapted(modules):
        return {name: t for name, t in out.items() if is_adapter(name) != base}
    return out


def row_range(split: Split, local: int, full: int) -> tuple[int, int]:
    """``[start, stop)`` of the full tensor's ``split.dim`` that this rank's ``local`` rows cover (padding cut)."""
    start = split.index * local
    return start, min(start + local, full)


def write_shard(tmp: Path, params: dict, owned: dict, topo, fname: str, **where) -> dict:
    """Write the owned tensors (each trimmed to the rows it adds: vocab padding cut) to one safetensors file;
    its record (``where``: the writer's grid coordinates)."""
    tensors, entries = {}, {}
    for name, t in owned.items():
        param = params[base_name(name)]
        split = split_of(base_name(name), param, topo)
        shape, part = list(t.shape), {}
        fields = {"tp_dim": split.dim if split.key == "tp_dim" else None}
        if split.key == "ep_dim":
            fields["ep_dim"] = split.dim
        if split.key is not None:
            dim, local = split.dim, t.shape[split.dim]
            full = (getattr(param, "tp_unpadded", None) if split.key == "tp_dim" else None) or local * split.parts
            start, stop = row_range(split, local, full)
            shape[dim] = full
            part = {"start": start, "stop": max(start, stop)}
            if stop <= start:  # this rank holds only vocab padding
                entries[name] = {"shape": shape, "dtype": str(t.dtype).removeprefix("torch."), **fields, "slice": None}
                continue
            t = t.narrow(dim, 0, stop - start)
        tensors[name] = t.to("cpu").contiguous()
        entries[name] = {"shape": shape, "dtype": str(t.dtype).removeprefix("torch."), **fields, "slice": part}
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / fname
    for name, value in write_tensors(path, tensors).items():
        entries[name]["slice"]["xxh3"] = value
    return {"file": fname, "bytes": path.stat().st_size, **where, "params": entries}
