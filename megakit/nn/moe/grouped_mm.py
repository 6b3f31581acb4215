"""``grouped_mm(a, b, offs)``: ``torch._grouped_mm`` that ``torch.compile`` can trace in every dtype the kernel runs.

The kernel multiplies row groups of ``a`` ``(M, K)`` by the matrices of ``b`` ``(G, K, N)``, the groups ending at the
device offsets ``offs`` ``(G,)`` int32 (no host sync: the MoE experts, ``moe.layer``). Its eager forms run fp32,
bf16 and fp16 on the CPU and CUDA, but torch 2.13's fake (meta) kernel, which Dynamo traces with, accepts bf16
only. In bf16 the op is called as it is (Inductor may pick its own kernel); in the other dtypes it goes through the
custom op below, whose fake kernel only gives the output's shape, and whose gradient is two more grouped products
(forward: ``a_g @ b_g``; backward: ``grad_g @ b_g^T`` for ``a`` and ``a_g^T @ grad_g`` for ``b``, the form
``torch._grouped_mm``'s own backward takes). Rows of ``a`` past ``offs[-1]`` belong to no group: their output
and gradient rows are left unwritten, the caller masks them.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("megakit::grouped_mm", mutates_args=())
def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(a, b, offs=offs)


@_grouped_mm.register_fake
def _(a, b, offs):
    if a.dim() == 2 and b.dim() == 2:  # (K, M) x (M, N) -> (G, K, N): the weight's gradient
        return a.new_empty(offs.shape[0], a.shape[0], b.shape[1])
    return a.new_empty(a.shape[0], b.shape[-1])  # (M, K) x (G, K, N) -> (M, N)


def _setup(ctx, inputs, output) -> None:
    a, b, offs = inputs
    ctx.save_for_backward(a, b, offs)


def _backward(ctx, grad):
    a, b, offs = ctx.saved_tensors
    grad = grad.contiguous()
    grad_a = _grouped_mm(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = _grouped_mm(a.transpose(0, 1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


_grouped_mm.register_autograd(_backward, setup_context=_setup)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``a`` ``(M, K)`` by ``b`` ``(G, K, N)`` per group of rows (``offs`` int32, cumulative) -> ``(M, N)``."""
    return torch._grouped_mm(a, b, offs=offs) if a.dtype == torch.bfloat16 else _grouped_mm(a, b, offs)
