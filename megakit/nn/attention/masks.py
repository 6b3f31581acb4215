"""Which keys a query sees: causal, inside a sliding window, inside its packed document; and positions that restart
at each document.

Every path masks keys later than the query (causal) and, with a sliding window (Mistral, Qwen2, gpt-oss), keys
``window`` or more positions back (``causal_mask``, as transformers does).

A training window of the token stream holds the end of one document, some whole ones and the start of another.
``documents`` ``(B, S)`` numbers them along each row (0, 0, 1, 1, 1, 2, ...: nondecreasing), on
every rank alike (the loader computes it from the shards' document starts; nothing is broadcast). Query
``i`` then sees key ``j`` only if ``j <= i`` and both are in one document (Llama 3's pretraining mask,
Megatron's ``--reset-attention-mask``), and ``position_ids`` restart at 0 at each document's first token
(``--reset-position-ids``; what transformers reads as a packed batch). Under CP the mask compares the
document numbers of global positions, so no document needs padding to a multiple of 2 x CP. On a GPU the
plain path runs FlexAttention (below), which skips the blocks of other documents instead of masking them.
"""

from __future__ import annotations

import functools

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
    return doc_q[:, None, :, None] == doc_k[:, None, None, :]


def causal_mask(s: int, window: int, device) -> torch.Tensor | None:
    """``(S, S)`` bool, True where query ``i`` may see key ``j``: ``i - window < j <= i`` (transformers'
    sliding window); None when plain causal attention is the same (no window, or one not shorter than S)."""
    if not window or window >= s:
        return None
    pos = torch.arange(s, device=device)
    gap = pos[:, None] - pos[None, :]
    return (gap >= 0) & (gap < window)


def allowed_keys(s: int, window: int, documents: torch.Tensor | None, device) -> torch.Tensor | None:
    """``causal_mask``, and with ``documents`` ``(B, S)`` only keys of the query's own document: ``(B, 1, S, S)``."""
    mask = causal_mask(s, window, device)
    if documents is None:
        return mask
    causal = torch.ones((s, s), dtype=torch.bool, device=device).tril_() if mask is None else mask
    return same_document(documents, documents) & causal


# -- the block-sparse kernel (FlexAttention) ------------------------------------------------------------
# SDPA with a boolean mask computes every block of the S x S scores and reads a (B, S, S) mask: a packed window of
# short documents wastes most of that work, and no fused CUDA kernel of SDPA takes the mask (flash and cuDNN take
# none, so it falls to the memory-efficient or the math kernel). FlexAttention skips the blocks the mask removes
# (the ``BlockMask`` lists, per block row, the blocks with any allowed pair), compiled into one Triton kernel on the
# GPU. Its backward has no CPU implementation in torch, so the CPU keeps SDPA (the reference), and the tests check
# FlexAttention's forward against it there.
_BLOCK_MASKS: dict = {}  # per window, the last (documents, block mask): every layer of a forward shares it


@functools.cache
def _flex(cuda: bool) -> tuple:
    """``(create_block_mask, flex_attention)``: compiled once on the GPU (eager FlexAttention is a reference loop)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if cuda:
        return torch.compile(create_block_mask), torch.compile(flex_attention, dynamic=False)
    return create_block_mask, flex_attention


def document_block_mask(documents: torch.Tensor, window: int):
    """The ``BlockMask`` of causal attention inside each document of ``documents`` ``(B, S)`` (and inside the sliding
    ``window``, if any): built once per micro-batch, then reused by every layer."""
    cached = _BLOCK_MASKS.get(window)
    if cached is None or cached[0] is not documents:  # held, so no later tensor can take its place (and its id)

        def allowed(b, h, q, k):
            inside = (documents[b, q] == documents[b, k]) & (q >= k)
            return inside & (q - k < window) if window else inside

        b, s = documents.shape
        cached = _BLOCK_MASKS[window] = (
            documents,
            _flex(documents.is_cuda)[0](allowed, b, None, s, s, device=documents.device),
        )
    return cached[1]


def flex_document_attention(q, k, v, documents: torch.Tensor, *, window: int, scale: float) -> torch.Tensor:
    """``(B, n, S, d)``: attention of ``q`` over ``k``/``v`` (GQA broadcast) inside each document, by FlexAttention."""
    return _flex(q.is_cuda)[1](
        q, k, v, block_mask=document_block_mask(documents, window), scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )
