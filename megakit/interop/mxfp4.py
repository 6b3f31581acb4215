"""gpt-oss's released expert weights: MXFP4 (OCP Microscaling, 4-bit E2M1 values in blocks of 32 sharing an 8-bit
power-of-two scale), dequantized on import to bf16.

The checkpoints store each stacked expert matrix ``W`` as ``W_blocks`` ``(E, rows, cols / 32, 16)`` uint8 (two 4-bit
codes a byte, the low nibble first) and ``W_scales`` ``(E, rows, cols / 32)`` uint8 (exponent + 127), rows being
the matrix's output dimension; the dequantized ``(E, rows, cols)`` is transposed to transformers' in-memory
``x @ W`` layout, ``(E, cols, rows)`` (``transformers.integrations.mxfp4.convert_moe_packed_tensors``, the same
arithmetic). Every MXFP4 value times its scale is exact in bf16, so the import loses nothing the file holds.
"""

from __future__ import annotations

import torch

from megakit.errors import UsageError

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # the 16 codes


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(E, rows, groups, 16)`` codes and ``(E, rows, groups)`` scales -> ``(E, groups x 32, rows)`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UsageError(f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} do not "
                         "match gpt-oss's layout (uint8 blocks of 16 bytes, one scale per block)")
    lut = torch.tensor(E2M1, dtype=dtype)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1).flatten(-2)  # (..., 32)
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).transpose(1, 2).contiguous()


def dequantize_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with every ``X_blocks`` / ``X_scales`` pair replaced by ``X`` in bf16 (nothing else changes)."""
    out = {k: v for k, v in tensors.items() if not k.endswith(("_blocks", "_scales"))}
    for key in (k for k in tensors if k.endswith("_blocks")):
        name = key.removesuffix("_blocks")
        if name + "_scales" not in tensors:
            raise UsageError(f"the checkpoint has {key} but no {name}_scales; it is not a complete MXFP4 checkpoint")
        out[name] = dequantize(tensors[key], tensors[name + "_scales"])
    return out
