"""Stand-ins for the gdn branch's ``conv`` and ``context_parallel`` until it lands (then removed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakit.nn import comm as C
from megakit.nn.attention.ulysses import _heads_to_sequence, _sequence_order, _sequence_to_heads


def causal_conv(x: torch.Tensor, weight: torch.Tensor, bias, documents) -> torch.Tensor:
    """Causal depthwise conv of ``x`` ``(S, B, c)`` with taps ``(c, K)``; restarts at each document of ``(B, S)``."""
    s, k = x.shape[0], weight.shape[1]
    out = x * weight[:, k - 1]
    for j in range(1, k):
        shifted = F.pad(x, (0, 0, 0, 0, j, 0))[:s]  # x[t - j]
        if documents is not None:
            doc = documents.t()  # (S, B)
            same = torch.zeros_like(doc, dtype=torch.bool)
            same[j:] = doc[j:] == doc[:-j]
            shifted = shifted * same[..., None]
        out = out + shifted * weight[:, k - 1 - j]
    return out if bias is None else out + bias


def heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``(S/cp, B, n, d)`` -> ``(S, B, n/cp, d)``: head group j to CP rank j, the tokens in sequence order."""
    cp = C.size(group)
    _, inverse = _sequence_order(x.shape[0] * cp, cp, range(cp), x.device)
    return _heads_to_sequence(x.permute(1, 2, 0, 3), group, cp, inverse).permute(2, 0, 1, 3)


def sequence_to_heads(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of ``heads_to_sequence``: ``(S, B, n/cp, d)`` -> ``(S/cp, B, n, d)``."""
    cp = C.size(group)
    order, _ = _sequence_order(y.shape[0], cp, range(cp), y.device)
    return _sequence_to_heads(y.permute(1, 2, 0, 3), group, cp, order).permute(2, 0, 1, 3)
