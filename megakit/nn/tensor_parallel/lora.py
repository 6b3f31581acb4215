"""LoRA on a tensor-parallel linear layer: ``y = x W^T + scaling * (x A^T) B^T`` with ``W`` frozen.

The adapter's two matrices sit on the layer as ``lora_A`` ``(rank, in)`` and ``lora_B`` ``(out, rank)`` (peft's
``lora_A.weight`` and ``lora_B.weight``), split as the layer's weight is:

- column-parallel (``W`` split by output rows): ``A`` whole on every rank, ``B`` split by output rows. The input is
  the layer's whole ``(S, B, in)`` and each rank computes its ``out/tp`` features, as the base does. ``A``'s
  gradient is partial on each rank (each sees its ``B`` rows only): ``copy_to_tp`` sums it over TP in backward;
- row-parallel (``W`` split by input columns): ``A`` split by input columns, ``B`` whole. ``(x A_r^T) B^T`` is this
  rank's partial sum of the adapter's output, added to the base's partial product before the layer's own
  all-reduce (reduce-scatter with SP): one collective for both. ``B``'s gradient is partial (each rank's rank-``r``
  activations are partial): ``copy_to_tp`` sums it over TP in backward;
- replicated (MoE's shared experts): both whole, both through ``copy_to_tp`` as the layer's weights are.

So the adapters' values and gradients equal one process's at every TP, with or without SP. The scaling multiplies
the rank-``r`` intermediate, not the layer-wide output: the same product, a pass over ``r`` columns instead of
``out``. The base weight is
frozen (``requires_grad`` False) by ``megakit.nn.lora``, which attaches the adapters and draws them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakit.nn.tensor_parallel.collectives import copy_to_tp


def column_delta(layer, x: torch.Tensor) -> torch.Tensor:
    """The adapter's output ``(S, B, out/tp)`` of a column-parallel ``layer`` on its whole input ``(S, B, in)``.

    forward: no collective; backward: all-reduce of ``A``'s gradient over TP."""
    a = copy_to_tp(layer.lora_A, layer.group)  # (r, in)
    return F.linear(F.linear(x, a) * layer.lora_scaling, layer.lora_B)  # (S, B, out/tp); scaled at rank r: cheaper


def row_delta(layer, x: torch.Tensor) -> torch.Tensor:
    """This rank's partial adapter output ``(S, B, out)`` of a row-parallel ``layer`` on its input shard
    ``(S, B, in/tp)``; the layer's own sum over TP completes it.

    forward: no collective (the layer's); backward: all-reduce of ``B``'s gradient over TP."""
    b = copy_to_tp(layer.lora_B, layer.group)  # (out, r)
    return F.linear(F.linear(x, layer.lora_A) * layer.lora_scaling, b)  # (S, B, out), partial over TP


def replicated_delta(layer, x: torch.Tensor, group) -> torch.Tensor:
    """The adapter's output of a linear layer every TP rank holds whole and applies to its own tokens.

    forward: no collective; backward: all-reduce of both matrices' gradients over TP."""
    a, b = copy_to_tp(layer.lora_A, group), copy_to_tp(layer.lora_B, group)
    return F.linear(F.linear(x, a) * layer.lora_scaling, b)
