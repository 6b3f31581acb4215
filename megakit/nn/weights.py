"""Deterministic, sharded initialisation: the same full weights for every TP/PP layout.

A parameter's values are a function of ``(seed, global name, global index along its
TP-split dimension)`` only. Each index along that dimension (a row of a
column-parallel weight, a column of a row-parallel one, a vocab row) has its own
generator, seeded from a hash of the three, and fills that slice with
``N(0, std^2)`` drawn on the CPU in fp32. So a rank builds exactly its shard -- never
a neighbour's rows and never the full parameter -- and the result does not depend
on TP, PP, the device, the order of construction, or anything else in the model.
Replicated parameters use the same scheme along dim 0. MoE experts (``param.ep_dim``, stacked along
dim 0 and split over EP ranks) use it along that dimension with the global expert index, so
every expert starts the same at EP 1, 2 or 4.

Cost: one ``torch.Generator`` seeding per slice (microseconds), negligible next to
drawing the numbers; slices are staged in CPU blocks and copied to the device.
"""

from __future__ import annotations

import hashlib

import torch

BLOCK = 1024  # slices staged on the CPU per copy to the parameter's device


def index_seed(seed: int, name: str, index: int) -> int:
    """A 63-bit seed for slice ``index`` of parameter ``name`` (stable across Python runs)."""
    digest = hashlib.blake2b(f"{seed}:{name}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def init_shard_(param: torch.Tensor, *, name: str, seed: int, tp_rank: int, rule: tuple, ep_rank: int = 0) -> None:
    """Fill this rank's shard of ``param`` by ``rule``: ``("normal", std)``, ``("uniform", bound)`` (in
    ``[-bound, bound)``), ``("zeros",)``, ``("ones",)``, ``("fill", value)``, ``("log_index",)``.

    Reads ``param.tp_dim`` (split dimension or None) and ``param.tp_unpadded`` (global size
    without padding: padded slices are zero) as set by ``megakit.nn.tensor_parallel.layers.mark``.
    """
    kind = rule[0]
    if param.is_meta:  # shapes only (e.g. counting parameters): nothing to draw
        return
    if kind == "zeros":
        param.zero_()
        return
    if kind == "ones":
        param.fill_(1.0)
        return
    if kind == "fill":  # a constant (Mamba-2's dt_bias)
        param.fill_(float(rule[1]))
        return
    if kind == "log_index":  # log(1 + global index along dim 0): Mamba-2's A_log, A = -1, -2, ..., -heads
        start = tp_rank * param.shape[0] if getattr(param, "tp_dim", None) == 0 else 0
        param.copy_(torch.arange(start + 1, start + 1 + param.shape[0], dtype=torch.float32).log())
        return
    assert kind in ("normal", "uniform"), rule
    scale = float(rule[1])
    split, rank = getattr(param, "tp_dim", None), tp_rank
    if getattr(param, "ep_dim", None) is not None:
        split, rank = param.ep_dim, ep_rank
    dim = 0 if split is None else split
    local = param.shape[dim]
    start = 0 if split is None else rank * local
    unpadded = getattr(param, "tp_unpadded", None)
    slice_shape = param.shape[:dim] + param.shape[dim + 1 :]
    for lo in range(0, local, BLOCK):
        hi = min(lo + BLOCK, local)
        block = torch.zeros((hi - lo, *slice_shape), dtype=torch.float32)
        for i in range(lo, hi):
            index = start + i
            if unpadded is not None and index >= unpadded:
                continue  # padding rows stay zero
            gen = torch.Generator().manual_seed(index_seed(seed, name, index))
            if kind == "normal":
                block[i - lo] = torch.randn(slice_shape, generator=gen) * scale
            else:
                block[i - lo] = (torch.rand(slice_shape, generator=gen) * 2 - 1) * scale
        param.narrow(dim, lo, hi - lo).copy_(block.movedim(0, dim))
