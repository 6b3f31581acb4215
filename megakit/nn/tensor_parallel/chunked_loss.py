"""The LM head and vocab-parallel cross-entropy over chunks of the tokens (``--loss-chunks K``).

Unchunked, the last stage holds the logits shard ``(tokens, V/tp)`` and the loss keeps its fp32
softmax for backward: 2-4 GB per micro-batch at an 8B model's seq 8192 and vocab 128k. Here
the tokens are cut into ``K`` chunks and, for each, forward computes the logits, the loss
(``vocab_parallel_softmax``: the same two all-reduces per chunk) and at once the loss's
gradients wrt the head input and the head weight, as Liger's fused linear cross-entropy does
(Hsu et al. 2024, arXiv:2410.10989). Only one chunk's logits exist at a time, in forward and
backward; kept for backward are the input's gradient (in place of the input itself, which the
unchunked head keeps) and the weight's, in fp32. The GEMMs are those of the unchunked head, so
FLOPs do not change; backward only scales the two by the incoming gradient, which is why the
function returns the loss *summed* over the tokens (a scalar): every caller's mean divides it
afterwards. Zero bubble's deferred W runs this backward a second time: it is cheap and repeats.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakit.nn import comm as C
from megakit.nn.tensor_parallel.cross_entropy import softmax_grad_, vocab_parallel_softmax


class _ChunkedHeadLoss(torch.autograd.Function):
    """forward: summed cross-entropy of ``h @ W^T`` over ``chunks`` token chunks, and its gradients;
    backward: those gradients times the incoming scalar (no communication in either beyond the loss's)."""

    @staticmethod
    def forward(ctx, h, weight, target, group, start, vocab_size, ignore_index, chunks, grad_enabled):
        # needs_input_grad does not know about no_grad (evaluation): the caller says whether grad mode is on
        need_h, need_w = (grad_enabled and ctx.needs_input_grad[0]), (grad_enabled and ctx.needs_input_grad[1])
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h) if need_h else None  # (N, H)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_w else None  # (V/tp, H)
        n = h.shape[0]
        for a, b in ((n * i // chunks, n * (i + 1) // chunks) for i in range(chunks)):
            if a == b:
                continue
            h_c = h[a:b]
            logits = F.linear(h_c, weight)  # (N/K, V/tp): the only logits there are
            softmax, loss, mine, idx, valid = vocab_parallel_softmax(
                logits, target[a:b], group, start, vocab_size, ignore_index
            )
            del logits
            total += loss.sum()
            if not (need_h or need_w):
                continue
            g = softmax_grad_(softmax, mine, idx, valid.to(softmax.dtype)).to(h.dtype)  # (N/K, V/tp)
            if need_h:
                torch.mm(g, weight, out=grad_h[a:b])
            if need_w:
                grad_w.add_(g.t() @ h_c)
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors  # not modified: zero bubble's W calls this again
        dh = None if grad_h is None else grad_h * grad.to(grad_h.dtype)
        dw = None if grad_w is None else (grad_w * grad).to(ctx.weight_dtype)
        return dh, dw, None, None, None, None, None, None, None


def chunked_head_loss(
    h: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    group=None,
    *,
    chunks: int,
    vocab_size: int,
    ignore_index: int = -100,
) -> torch.Tensor:
    """Sum over the non-ignored tokens of the cross-entropy of ``target`` under ``h @ weight^T``.

    ``h``: the head's input ``(..., H)``, replicated over TP (after ``enter_tp_region``); ``weight``:
    this rank's vocab shard ``(V/tp, H)`` (padded rows past ``vocab_size`` do not count); ``target``
    ``(...)``: global ids. Equals ``vocab_parallel_cross_entropy(F.linear(h, weight), target,
    reduction="sum")`` without the whole logits shard ever existing.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    start = C.rank(group) * weight.shape[0]
    flat = h.reshape(-1, h.shape[-1])
    return _ChunkedHeadLoss.apply(
        flat, weight, target.reshape(-1).long(), group, start, vocab_size, ignore_index, chunks, torch.is_grad_enabled()
    )
