"""Packed documents: attention that stays inside each document, and positions that restart at each.

A training window of the token stream holds the end of one document, some whole ones and the start of
another. ``documents`` ``(B, S)`` numbers them along each row (0, 0, 1, 1, 1, 2, ...: nondecreasing), on
every rank alike (the loader computes it from the shards' document starts; nothing is broadcast). Query
``i`` then sees key ``j`` only if ``j <= i`` and both are in one document (Llama 3's pretraining mask,
Megatron's ``--reset-attention-mask``), and ``position_ids`` restart at 0 at each document's first token
(``--reset-position-ids``; what transformers reads as a packed batch). Under CP the mask compares the
document numbers of global positions, so no document needs padding to a multiple of 2 x CP.
"""

from __future__ import annotations

import torch


def position_ids(documents: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` int64: each token's offset from its document's first token in the window."""
    s = documents.shape[-1]
    j = torch.arange(s, device=documents.device).expand_as(documents)
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[..., 1:] = documents[..., 1:] != documents[..., :-1]
    return j - torch.where(starts, j, torch.zeros_like(j)).cummax(dim=-1).values


def same_document(doc_q: torch.Tensor, doc_k: torch.Tensor) -> torch.Tensor:
    """``(B, 1, S_q, S_k)`` bool, True where query and key are in one document (broadcast over heads)."""
    return (doc_q[:, None, :, None] == doc_k[:, None, None, :])
