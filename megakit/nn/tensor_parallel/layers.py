"""Megatron's tensor-parallel layers: column- and row-parallel linear, vocab-parallel embedding.

Built on the differentiable collectives (``megakit.nn.tensor_parallel.collectives``); the vocab-parallel loss is
``cross_entropy``. Each layer takes the TP process group explicitly; ``None`` or a group of one means no
communication. Layers allocate their shards uninitialised: ``megakit.nn.weights.init_shard_``
(what ``megakit.nn.model.Transformer`` does) or ``load_full_state_dict`` fills them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakit.core.model_config import padded_vocab
from megakit.nn import comm as C
from megakit.nn.tensor_parallel.collectives import enter_tp_region, gather_from_tp, leave_tp_region, replicated
from megakit.nn.tensor_parallel.lora import column_delta, row_delta


def mark(param: nn.Parameter, tp_dim: int | None, *, unpadded: int | None = None) -> nn.Parameter:
    """Record how ``param`` is split over TP (read by init, checkpoints and DeepSpeed).

    ``tp_dim`` is the split dimension (None: replicated); ``unpadded`` is the global size
    along it without the padding added to make it divide by TP (vocab rows).
    """
    param.tp_dim = tp_dim
    param.tensor_model_parallel = tp_dim is not None
    param.partition_dim = tp_dim if tp_dim is not None else -1
    param.tp_unpadded = unpadded
    return param


def _empty(*shape, dtype, device) -> nn.Parameter:
    # Values are written later by megakit.nn.weights from the parameter's global name.
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device))


def _divide(total: int, tp: int, what: str) -> int:
    assert total % tp == 0, f"{what} {total} is not divisible by TP {tp}"  # validated by the model
    return total // tp


# -- the layers ---------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """``Y = X W^T + b`` with W split by output rows: each rank computes ``out/tp`` features.

    Input ``(S', B, in)``; ``enter_region=True`` applies ``enter_tp_region`` first (see there
    for the collectives), ``False`` when the caller already did. Output ``(S, B, out/tp)``,
    or ``(S, B, out)`` with ``gather_output`` (forward: all-gather last dim, backward: split).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group=None,
        bias: bool = True,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        enter_region: bool = True,
        dtype=torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gather_output, self.enter_region = gather_output, enter_region
        local = _divide(out_features, C.size(group), "output features")
        self.weight = mark(_empty(local, in_features, dtype=dtype, device=device), 0)
        self.bias = mark(_empty(local, dtype=dtype, device=device), 0) if bias else None
        self.matmul = F.linear  # megakit.nn.tensor_parallel.fp8 swaps in a float8 matmul (same weight, same names)
        self.lora_scaling = None  # megakit.nn.lora adds lora_A, lora_B and sets it (tensor_parallel.lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter_region:
            x = enter_tp_region(x, self.group, self.sequence_parallel)  # (S, B, in)
        y = self.matmul(x, self.weight, self.bias)  # (S, B, out/tp)
        if self.lora_scaling is not None:
            y = y + column_delta(self, x)
        return gather_from_tp(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """``Y = X W^T + b`` with W split by input columns; the input arrives already split.

    Input ``(S, B, in/tp)``; each rank's product is partial and ``leave_tp_region`` sums it
    (all-reduce, or reduce-scatter to ``(S/tp, B, out)`` with SP). The bias is replicated
    and added once, after the sum.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group=None,
        bias: bool = True,
        sequence_parallel: bool = False,
        dtype=torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        local = _divide(in_features, C.size(group), "input features")
        self.weight = mark(_empty(out_features, local, dtype=dtype, device=device), 1)
        self.bias = mark(_empty(out_features, dtype=dtype, device=device), None) if bias else None
        self.matmul = F.linear  # megakit.nn.tensor_parallel.fp8 swaps in a float8 matmul (same weight, same names)
        self.lora_scaling = None  # megakit.nn.lora adds lora_A, lora_B and sets it (tensor_parallel.lora)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.matmul(x, self.weight)  # (S, B, out), partial over TP
        if self.lora_scaling is not None:
            y = y + row_delta(self, x)  # the adapter's partial sum joins the base's: one collective for both
        y = leave_tp_region(y, self.group, self.sequence_parallel)  # (S', B, out)
        if self.bias is not None:
            y = y + replicated(self.bias, self.group, self.sequence_parallel)
        return y


class VocabParallelEmbedding(nn.Module):
    """Token embedding split by vocab rows: rank r holds rows ``[r*V/tp, (r+1)*V/tp)``.

    The vocab is padded with ``padded_vocab``. Each rank looks up the ids it owns (zeros
    elsewhere) and ``leave_tp_region`` sums: forward all-reduce (or reduce-scatter over the
    sequence with SP), backward identity (or all-gather). Ids ``(S, B)`` -> ``(S', B, H)``.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        *,
        group=None,
        sequence_parallel: bool = False,
        dtype=torch.float32,
        device=None,
    ) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        tp = C.size(group)
        self.vocab_size, self.local = vocab_size, padded_vocab(vocab_size, tp) // tp
        self.start = C.rank(group) * self.local
        self.weight = mark(_empty(self.local, dim, dtype=dtype, device=device), 0, unpadded=vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if C.size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.start) | (ids >= self.start + self.local)
        local_ids = (ids - self.start).masked_fill(outside, 0)
        y = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)  # (S, B, H)
        return leave_tp_region(y, self.group, self.sequence_parallel)
