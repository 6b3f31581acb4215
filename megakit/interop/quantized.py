"""Released checkpoints whose weights are stored quantized, dequantized to bf16 on import (``dequantize``).

gpt-oss's experts: MXFP4 (OCP Microscaling, 4-bit E2M1 values in blocks of 32 sharing an 8-bit power-of-two
scale). The checkpoints store each stacked expert matrix ``W`` as ``W_blocks`` ``(E, rows, cols / 32, 16)``
uint8 (two 4-bit codes a byte, the low nibble first) and ``W_scales`` ``(E, rows, cols / 32)`` uint8
(exponent + 127), rows being the matrix's output dimension; the dequantized ``(E, rows, cols)`` is transposed
to transformers' in-memory ``x @ W`` layout, ``(E, cols, rows)``
(``transformers.integrations.mxfp4.convert_moe_packed_tensors``, the same arithmetic). Every MXFP4 value times
its scale is exact in bf16, so the import loses nothing the file holds.

DeepSeek-V3's (and Kimi K2's) linear weights: FP8 (E4M3) with one fp32 ``weight_scale_inv`` per 128 x 128 block
(``(ceil(rows/128), ceil(cols/128))``): ``W = W_fp8 x scale`` blockwise (Megatron-Bridge's and DeepSeek's own
``weight_dequant``; without it the logits are random-looking, Bridge's docstring says), rounded once to bf16.
"""

from __future__ import annotations

import torch

from megakit.errors import UsageError

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # the 16 codes


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``(E, rows, groups, 16)`` codes and ``(E, rows, groups)`` scales -> ``(E, groups x 32, rows)`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise UsageError(
            f"MXFP4 blocks {tuple(blocks.shape)} {blocks.dtype} and scales {tuple(scales.shape)} do not "
            "match gpt-oss's layout (uint8 blocks of 16 bytes, one scale per block)"
        )
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
        out[name] = dequantize_mxfp4(tensors[key], tensors[name + "_scales"])
    return out


BLOCK = 128  # DeepSeek's FP8 block edge


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype=torch.bfloat16) -> torch.Tensor:
    """An FP8 ``(rows, cols)`` weight times its ``(ceil(rows/128), ceil(cols/128))`` block scales, in ``dtype``."""
    rows, cols = weight.shape
    if scale_inv.shape != (-(-rows // BLOCK), -(-cols // BLOCK)):
        raise UsageError(
            f"an FP8 weight of {rows} x {cols} has block scales {tuple(scale_inv.shape)}, not one per "
            f"{BLOCK} x {BLOCK} block; the checkpoint is not DeepSeek's FP8 layout"
        )
    scale = scale_inv.float().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantize(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``tensors`` with MXFP4 experts and FP8 block-quantised weights in bf16; a checkpoint of neither unchanged."""
    tensors = dequantize_experts(tensors)
    scaled = [k for k in tensors if k.endswith(".weight_scale_inv")]
    if not scaled:
        return tensors
    out = {k: v for k, v in tensors.items() if not k.endswith(".weight_scale_inv")}
    for key in scaled:
        name = key.removesuffix("_scale_inv")
        if name not in tensors:
            raise UsageError(f"the checkpoint has {key} but no {name}; it is not a complete FP8 checkpoint")
        out[name] = dequantize_fp8_blocks(tensors[name], tensors[key])
    return out
