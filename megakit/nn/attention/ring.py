"""Ring attention: context parallelism's attention, each rank's K/V block passed around the CP ranks.

The sequence is split over CP in the load-balanced zig-zag order (``megakit.nn.sequence``: CP rank ``i`` holds
chunks ``i`` and ``2 CP - 1 - i`` of ``2 CP``, the same causal work on every rank). Everything in a block except
attention is per token and runs on the rank's own rows; only attention needs the other ranks' keys and values:

- forward: each rank's K/V block travels once around the ring (P2P ``isend``/``irecv`` through ``megakit.nn.comm``,
  ``megakit.nn.attention.transport``; the next block posted before the current one is used, so the transfer
  overlaps the block's attention); the partial results are merged with the online softmax (running max, running
  sum: the log-sum-exp) on *global* token positions, exact at every chunk boundary
  (``megakit.nn.attention.blocks``);
- backward: the block scores are recomputed from the saved ``q``, ``k``, ``v``, output and log-sum-exp (nothing
  ``S x S`` is kept); K/V ring around again, and the gradients of each K/V block travel with it and arrive back at
  its owner after one full turn;
- a sliding window no longer than a chunk (``S / (2 CP)`` tokens; gpt-oss's 128, Gemma 3's local layers at long
  sequences): query chunk ``i`` then needs keys of chunks ``i`` and ``i - 1`` only, which the zig-zag split puts on
  this rank and its two ring neighbours, so each rank swaps one chunk's K/V with each neighbour (and, in backward,
  their gradients) instead of passing every block around the ring (``transport.Halo``; the ring is
  ``transport.Ring``).

Each block runs as chunk pairs on a fused kernel (``blocks._FusedBlockAttention``: the pairs the causal mask or a
window rules out skipped, so the zig-zag split halves the off-diagonal work), or, with dropout, as explicit fp32
blocks (``blocks._BlockAttention``, also the reference the tests hold the fused one to).
"""

from __future__ import annotations

import functools

import torch

from megakit.nn import comm as C
from megakit.nn.attention.blocks import block_attention
from megakit.nn.attention.transport import ring_transport


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group,
    *,
    keep: torch.Tensor | None = None,
    p: float = 0.0,
    scale: float | None = None,
    window: int = 0,
    documents: torch.Tensor | None = None,
    fused: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over the whole sequence held by the CP ``group`` (load-balanced split).

    ``q``/``k`` ``(B, n, S/cp, d)``/``(B, n_kv, S/cp, d)``, ``v`` ``(B, n_kv, S/cp, d_v)`` (GQA when ``n_kv < n``;
    MLA's ``d_v`` narrower than ``d``: the ring carries v at its own width, ``transport.pack``), already
    rotated at their global positions; ``keep``: ``blocks.attention_keep``'s dropout mask with
    probability ``p``, or None; ``scale``: the scores' factor (default ``1/sqrt(d)``); ``window``: a
    sliding window (0: none); ``documents``: the whole sequence's ``(B, S)`` document numbers, attention then
    stays inside each document (``megakit.nn.attention.masks``). ``fused``: each block's chunk pairs on the fused kernel
    (``blocks._FusedBlockAttention``); default: without dropout. ``sinks`` ``(n,)``: gpt-oss's learned logit per head in
    each softmax denominator (``blocks._sink_forward``). ``group`` None: a ring of one, the whole sequence in order (as
    ``blocks.block_attention`` runs it without CP). Returns ``(B, n, S/cp, d_v)``, this rank's
    rows.
    """
    ranks, r = C.group_ranks(group), C.rank(group)
    return block_attention(
        q,
        k,
        v,
        cp=len(ranks),
        r=r,
        transport=functools.partial(ring_transport, ranks, r),
        keep=keep,
        p=p,
        scale=scale,
        window=window,
        documents=documents,
        fused=fused,
        sinks=sinks,
    )
