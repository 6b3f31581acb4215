"""The short causal depthwise convolution of the linear-attention mixers (Gated DeltaNet, Mamba-2), sequence-first.

Token ``t`` of channel ``c`` is ``sum_j w[c, j] x[t - (K - 1) + j, c]`` (+ bias): transformers' ``causal_conv1d_fn``
(``F.conv1d`` with ``K - 1`` zeros of left padding). With packed documents (``megakit.nn.attention.masks``:
``documents`` ``(B, S)`` numbers them along each row) the window restarts at each document's first token, as if each
document were its own sequence: a tap reading another document reads zero. That needs the whole sequence in order,
so under context parallelism the caller first gathers it (``megakit.nn.linear_attention.context_parallel``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """``(S, B, C)`` out: the causal depthwise convolution of ``x`` ``(S, B, C)`` by ``weight`` ``(C, K)``; with
    ``documents`` ``(B, S)`` it restarts at each document (taps across a boundary read zeros). No activation."""
    s, _, c = x.shape
    k = weight.shape[1]
    if documents is None:  # one fused depthwise conv: (B, C, S) with K - 1 zeros on the left
        y = F.conv1d(x.permute(1, 2, 0), weight.unsqueeze(1), bias, padding=k - 1, groups=c)[..., :s]
        return y.permute(2, 0, 1)
    doc = documents.t()  # (S, B)
    y = x * weight[:, k - 1]
    for shift in range(1, min(k, s)):  # tap k - 1 - shift reads token t - shift, if it is in t's document
        same = (doc[shift:] == doc[:-shift]).unsqueeze(-1).to(x.dtype)  # (S - shift, B, 1)
        y = y + F.pad(x[:-shift] * same * weight[:, k - 1 - shift], (0, 0, 0, 0, shift, 0))
    return y if bias is None else y + bias
