"""Context parallelism (CP): the sequence split over a ring of ranks, attention as ring attention.

The load-balanced causal split (Megatron-Core's, Liu et al. 2023 "Ring Attention" with the
zig-zag order of Brandon et al. 2023): the sequence is cut into ``2 x CP`` equal chunks and
CP rank ``i`` holds chunks ``i`` and ``2 CP - 1 - i``, side by side. Under a causal mask
every rank then has the same amount of attention work (an early chunk sees little, its
late partner sees much). Everything in a block except attention is per token, so it runs
on the rank's own rows; only attention needs the other ranks' keys and values:

- forward: each rank's K/V block travels once around the ring (P2P ``isend``/``irecv``
  through ``megakit.nn.comm``, the next block posted before the current one is used, so
  the transfer overlaps the block's attention); the partial results are merged with the
  online softmax (running max, running sum: the log-sum-exp), and the causal mask compares
  *global* token positions, so it is exact at every chunk boundary;
- backward: the block scores are recomputed from the saved ``q``, ``k``, ``v``, output and
  log-sum-exp (nothing ``S x S`` is kept); K/V ring around again, and the gradients of each
  K/V block travel with it and arrive back at its owner after one full turn;
- a sliding window no longer than a chunk (``S / (2 CP)`` tokens; gpt-oss's 128, Gemma 3's local layers at long
  sequences): query chunk ``i`` then needs keys of chunks ``i`` and ``i - 1`` only, which the zig-zag split puts on
  this rank and its two ring neighbours, so each rank swaps one chunk's K/V with each neighbour (and, in backward,
  their gradients) instead of passing every block around the ring (``_Halo``; the ring is ``_Ring``).

Each block runs as chunk pairs on a fused kernel (``_FusedRingAttention``: the pairs the causal mask or a window
rules out skipped, so the zig-zag split halves the off-diagonal work), or, with dropout, as explicit fp32 blocks
(``_RingAttention``, also the reference the tests hold the fused one to).

The loss is the sum over the whole sequence's valid tokens over their count, or over the trainer's token
count (``sequence_mean``). Positions (RoPE, learned
position embeddings) and dropout masks use the global positions (``positions``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from megakit.nn import comm as C
from megakit.nn.attention.masks import same_document
from megakit.nn.dropout import DropoutKeys, keep_mask

_KV_TAG, _GRAD_TAG = 71, 72  # P2P tags of the ring (its peers are never pipeline peers)


def positions(seq_len: int, cp: int, cp_rank: int, device=None) -> torch.Tensor:
    """The global token positions CP rank ``cp_rank`` holds, in its order: chunk ``cp_rank``, then
    chunk ``2 cp - 1 - cp_rank`` (each ``seq_len / (2 cp)`` long). ``(seq_len / cp,)`` int64."""
    assert seq_len % (2 * cp) == 0, (seq_len, cp)
    n = seq_len // (2 * cp)
    first, second = cp_rank * n, (2 * cp - 1 - cp_rank) * n
    return torch.cat([torch.arange(first, first + n, device=device), torch.arange(second, second + n, device=device)])


def split_sequence(x: torch.Tensor, cp: int, cp_rank: int, *, dim: int) -> torch.Tensor:
    """This rank's rows of ``x`` along its sequence dimension ``dim`` (no communication)."""
    if cp == 1:
        return x
    return x.index_select(dim, positions(x.shape[dim], cp, cp_rank, device=x.device))


@torch.no_grad()
def gather_sequence(x: torch.Tensor, group, *, dim: int) -> torch.Tensor:
    """Inverse of ``split_sequence`` over the CP group: every rank's rows, in sequence order.

    forward only (a collective: every CP rank calls it); for logits and tests, not training.
    """
    cp = C.size(group)
    if cp == 1:
        return x
    parts = C.all_gather(x.movedim(dim, 0).contiguous(), group, dim=0).chunk(cp, dim=0)
    seq_len = x.shape[dim] * cp
    order = torch.cat([positions(seq_len, cp, r, device=x.device) for r in range(cp)])
    out = torch.empty_like(torch.cat(parts, dim=0))
    out[order] = torch.cat(parts, dim=0)
    return out.movedim(0, dim)


class _SequenceMean(torch.autograd.Function):
    """forward: all-reduce (sum) of [loss sum, token count] over CP, then the sum over ``tokens`` (or over
    the count): the same on every CP rank. backward: ``grad x CP / tokens`` on each rank, the adjoint of
    the all-reduce when every rank's copy of the loss is counted: DeepSpeed averages gradients over
    DP x CP, which divides the CP back out."""

    @staticmethod
    def forward(ctx, local_sum, local_count, group, tokens):
        totals = C.all_reduce(torch.stack([local_sum.detach().float(), local_count.float()]), group)
        divisor = totals[1].clamp(min=1) if tokens is None else tokens  # a tensor or a float: no device sync
        ctx.scale = C.size(group) / divisor
        ctx.dtype = local_sum.dtype
        return (totals[0] / divisor).to(local_sum.dtype)

    @staticmethod
    def backward(ctx, grad):
        return (grad * ctx.scale).to(ctx.dtype), None, None, None


def sequence_mean(token_losses: torch.Tensor, valid: torch.Tensor, group, tokens: float | None = None) -> torch.Tensor:
    """The sum of ``token_losses`` over the valid tokens of the whole sequence (every CP rank's rows), divided by
    ``tokens`` (the trainer's share of the step's token count, ``Transformer.loss_tokens``) or else by their count:
    the sequence's mean."""
    return _SequenceMean.apply(token_losses.sum(), valid.sum(), group, tokens)


def attention_keep(p: float, keys: DropoutKeys, *, site: str, head_start: int, heads_local: int, heads: int,
                   rows: torch.Tensor, seq_len: int, device) -> torch.Tensor:
    """The attention-probability dropout mask of this rank's query rows against every key:
    ``(B, heads_local, S/cp, S)`` bool, cut from the same ``(heads, S, S)`` draw per sample as
    ``megakit.nn.dropout.attention_dropout`` (so the same units drop at any layout)."""
    keep = keep_mask(p, keys, site=site, streams=keys.samples, full_shape=(heads, seq_len, seq_len),
                     rows=slice(head_start, head_start + heads_local), device=device)
    return keep.index_select(2, rows)


class _RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against the whole sequence's keys (see module docstring).

    forward: CP - 1 K/V transfers around the ring (each posted before the previous block is
    used); backward: CP - 1 K/V transfers and CP transfers of K/V gradients around the ring. A window within a
    chunk: one half block to and from each neighbour instead, each way (``_transport``).
    """

    @staticmethod
    def forward(ctx, q, k, v, keep, p, group, ranks, scale, window, documents, sinks):
        cp, r = len(ranks), C.rank(group)
        b, n, s, _ = q.shape
        pos = positions(s * cp, cp, r, device=q.device)
        m = q.new_full((b, n, s, 1), float("-inf"), dtype=torch.float32)
        total = torch.zeros((b, n, s, 1), dtype=torch.float32, device=q.device)
        acc = torch.zeros((b, n, s, v.shape[-1]), dtype=torch.float32, device=q.device)  # v's width (MLA: d_v)
        for (kb, vb), chunks in _transport(ranks, r, s // 2, window).blocks(k, v):
            scores, keep_j = _block_scores(q, kb, pos, _chunk_positions(chunks, s // 2, q.device), keep, scale,
                                           window, documents)
            m_new = torch.maximum(m, scores.amax(dim=-1, keepdim=True))  # finite: step 0 is the own block
            alpha, e = (m - m_new).exp(), (scores - m_new).exp()
            total = total * alpha + e.sum(dim=-1, keepdim=True)
            if keep_j is not None:
                e = e * keep_j
            acc = acc * alpha + torch.matmul(e, _repeat_kv(vb, n).float())
            m = m_new
        out = acc / total
        if keep is not None:
            out = out / (1.0 - p)
        out = out.to(q.dtype)  # kept in the training dtype, as flash attention keeps it
        lse = (m + total.log()).squeeze(-1)  # the log-sum-exp in fp32
        ctx.save_for_backward(q, k, v, out, lse, keep, sinks)
        ctx.p, ctx.group, ctx.ranks, ctx.scale, ctx.window, ctx.documents = p, group, ranks, scale, window, documents
        return _sink_forward(out, lse, sinks)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, keep, sinks = ctx.saved_tensors
        grad_out, out, grad_sinks = _sink_backward(grad_out, out, lse, sinks)
        lse = lse[..., None]
        ranks, scale, p = ctx.ranks, ctx.scale, ctx.p
        cp, r = len(ranks), C.rank(ctx.group)
        b, n, s, d = q.shape
        pos = positions(s * cp, cp, r, device=q.device)
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dP * P), dropout included
        dq = torch.zeros((b, n, s, d), dtype=torch.float32, device=q.device)
        transport = _transport(ranks, r, s // 2, ctx.window)
        for (kb, vb), chunks in transport.blocks(k, v):
            kj, vj = _repeat_kv(kb, n).float(), _repeat_kv(vb, n).float()
            scores, keep_j = _block_scores(q, kb, pos, _chunk_positions(chunks, s // 2, q.device), keep, scale,
                                           ctx.window, ctx.documents)
            probs = (scores - lse).exp()  # masked entries: exp(-inf) = 0
            dropped = probs if keep_j is None else probs * keep_j / (1.0 - p)
            grad_v = torch.matmul(dropped.transpose(-2, -1), grad_out)  # (B, n, S_k, d_v)
            grad_p = torch.matmul(grad_out, vj.transpose(-2, -1))
            if keep_j is not None:
                grad_p = grad_p * keep_j / (1.0 - p)
            grad_s = probs * (grad_p - delta)
            dq += torch.matmul(grad_s, kj) * scale
            grad_k = torch.matmul(grad_s.transpose(-2, -1), q.float()) * scale
            transport.give_back(grad_k, grad_v, k.shape[1])
        dk, dv = transport.own_gradients()  # this rank's K/V gradients, home
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, None,
                grad_sinks)


# -- the ring on a fused kernel ---------------------------------------------------------------------------------
# Each block is four chunk pairs (this rank's two query chunks against the block's two key chunks): under the causal
# mask an earlier key chunk is seen whole, the same chunk causally, a later one not at all, so about half of the
# off-diagonal work is skipped, and a window rules out more. Each pair runs one fused attention call that returns
# its log-sum-exp (the pairs merge by it), so nothing (S/cp)^2 is kept in fp32: at most one pair's additive mask, for
# windows that cut a pair or documents. The kernels (``_pair_forward``, ``_pair_backward``): on CPU
# ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; on CUDA the memory-efficient kernel
# (``aten._scaled_dot_product_efficient_attention``, as torch's own ``context_parallel`` calls it), the one of
# SDPA's fused kernels that takes an additive mask and fp32, its mask padded to 16 columns and its LSE to 32 rows as
# SDPA pads them. Dropout needs megakit's keyed masks inside the softmax, which no fused kernel takes: with it the
# explicit ``_RingAttention`` runs (also the reference the tests hold this one to).
_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention
_EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward


def _cuda_bias(mask: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """The memory-efficient kernel's additive mask: expanded to ``(B, n, S_q, S_k)`` over a row stride padded to 16
    elements (its alignment; SDPA's ``preprocess_mask`` does the same)."""
    if mask is None:
        return None
    cols = -(-mask.shape[-1] // 16) * 16
    padded = mask.new_zeros((*mask.shape[:-1], cols))
    padded[..., :mask.shape[-1]] = mask
    return padded[..., :mask.shape[-1]].expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` with zero columns up to ``width``: torch's CPU flash kernel takes q, k and v of one head width, and MLA's
    v is narrower. Added here, on this rank, so that the ring carries v at its own width. (SDPA's checks let the
    memory-efficient kernel take a narrower v; it is padded too until a GPU run checks that.)"""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _pair_forward(q, k, v, causal: bool, mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk pair's attention ``(B, n, S_q, d_v)`` and its log-sum-exp ``(B, n, S_q)`` on this device's fused
    kernel."""
    width, v = v.shape[-1], _widen(v, q.shape[-1])
    if q.device.type != "cuda":
        out, lse = _FLASH(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)[:2]
        return out[..., :width], lse
    out, lse, _, _ = _EFFICIENT(q, k, v, _cuda_bias(mask, q, k), True, 0.0, causal, scale=scale)
    return out[..., :width], lse[..., :q.shape[2]]  # the kernel pads the LSE's rows to a multiple of 32


def _pair_backward(grad_out, q, k, v, out, lse, causal: bool, mask, scale: float):
    """``(dq, dk, dv)`` of one chunk pair, given the whole output and LSE (each pair's share of dS = P (dP - D)); v,
    the output and its gradient widened as ``_pair_forward`` widens v (zero columns: D unchanged), dv cut back."""
    d, width = q.shape[-1], v.shape[-1]
    grad_out, v, out = _widen(grad_out, d), _widen(v, d), _widen(out, d)
    if q.device.type != "cuda":
        gq, gk, gv = _FLASH_BACKWARD(grad_out, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)
        return gq, gk, gv[..., :width]
    rows = lse.shape[-1]
    padded = torch.nn.functional.pad(lse, (0, -rows % 32))  # the layout its forward returned
    no_dropout = torch.zeros((), dtype=torch.int64, device=q.device)  # philox seed and offset, unread at p = 0
    gq, gk, gv, _ = _EFFICIENT_BACKWARD(grad_out, q, k, v, _cuda_bias(mask, q, k), out, padded, no_dropout,
                                        no_dropout, 0.0, [True, True, True, False], causal, scale=scale)
    return gq, gk, gv[..., :width]


def _pairs(q_chunks, k_chunks, half: int, window: int, documents, pos_q, pos_k, dtype):
    """The chunk pairs of this rank's query chunks against a block's key chunks (chunk numbers, side by side) that
    have an allowed key: ``(query slice, key slice, is_causal, additive mask or None, rows with no allowed key or
    None)``."""
    out = []
    for qa, a in enumerate(q_chunks):
        for kc, c in enumerate(k_chunks):
            qs, ks = slice(qa * half, (qa + 1) * half), slice(kc * half, (kc + 1) * half)
            low, high = (a - c) * half - (half - 1), (a - c) * half + (half - 1)  # the pair's query-key gaps
            if high < 0 or (window and low >= window):
                continue  # every key later than every query, or out of the window
            if not window and documents is None:
                out.append((qs, ks, a == c, None, None))
                continue
            gap = pos_q[qs, None] - pos_k[None, ks]
            allowed = (gap >= 0) & (gap < window) if window else gap >= 0
            allowed = allowed[None, None]  # (1, 1, half, half)
            if documents is not None:
                allowed = allowed & same_document(documents[:, pos_q[qs]], documents[:, pos_k[ks]])
                some, every = bool(allowed.any()), not bool((~allowed.any(-1)).any())
            else:  # a window over two whole chunks: the rows that see a key follow from the gaps, with no wait
                first, last = max(0, (c - a) * half), min(half - 1, half - 2 + window - (a - c) * half)
                some, every = first <= last, (first, last) == (0, half - 1)
            if not some:
                continue
            none = None if every else ~allowed.any(-1)  # (B|1, 1, half): rows the kernel gives lse 0 for, not -inf
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
            out.append((qs, ks, False, mask, none))
    return out


class _FusedRingAttention(torch.autograd.Function):
    """``_RingAttention`` without dropout, each block's chunk pairs on the fused kernel (see above)."""

    @staticmethod
    def forward(ctx, q, k, v, group, ranks, scale, window, documents, sinks):
        cp, r = len(ranks), C.rank(group)
        b, n, s, _ = q.shape
        half = s // 2
        pos = positions(s * cp, cp, r, device=q.device)
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 in the fp64 tests (the kernel's LSE dtype)
        out = torch.zeros((b, n, s, v.shape[-1]), dtype=acc, device=q.device)  # v's width (MLA: d_v)
        lse = torch.full((b, n, s), float("-inf"), dtype=acc, device=q.device)
        for (kb, vb), chunks in _transport(ranks, r, half, window).blocks(k, v):
            kj, vj = _repeat_kv(kb, n), _repeat_kv(vb, n)
            for qs, ks, causal, mask, none in _pairs((r, 2 * cp - 1 - r), chunks, half, window, documents, pos,
                                                      _chunk_positions(chunks, half, q.device), q.dtype):
                o, l = _pair_forward(q[:, :, qs], kj[:, :, ks], vj[:, :, ks], causal, mask, scale)
                if none is not None:  # rows with no allowed key: nothing (a kernel may give lse 0 or o NaN there)
                    l = l.masked_fill(none.expand(b, n, -1), float("-inf"))
                    o = o.masked_fill(none.expand(b, n, -1)[..., None], 0.0)
                merged = torch.logaddexp(lse[:, :, qs], l)
                safe = merged.masked_fill(merged == float("-inf"), 0.0)
                out[:, :, qs] = (out[:, :, qs] * (lse[:, :, qs] - safe).exp()[..., None]
                                 + o.to(acc) * (l - safe).exp()[..., None])
                lse[:, :, qs] = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.group, ctx.ranks, ctx.scale, ctx.window, ctx.documents = group, ranks, scale, window, documents
        return _sink_forward(out, lse, sinks)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad_out, out, grad_sinks = _sink_backward(grad_out, out, lse, sinks)
        ranks, scale = ctx.ranks, ctx.scale
        cp, r = len(ranks), C.rank(ctx.group)
        b, n, s, d = q.shape
        half = s // 2
        pos = positions(s * cp, cp, r, device=q.device)
        grad_out = grad_out.to(q.dtype).contiguous()
        acc = lse.dtype
        dq = torch.zeros((b, n, s, d), dtype=acc, device=q.device)
        transport = _transport(ranks, r, half, ctx.window)
        for (kb, vb), chunks in transport.blocks(k, v):
            kj, vj = _repeat_kv(kb, n), _repeat_kv(vb, n)
            dk = torch.zeros(kj.shape, dtype=acc, device=q.device)
            dv = torch.zeros(vj.shape, dtype=acc, device=q.device)
            for qs, ks, causal, mask, _ in _pairs((r, 2 * cp - 1 - r), chunks, half, ctx.window, ctx.documents, pos,
                                                   _chunk_positions(chunks, half, q.device), q.dtype):
                # the final output and log-sum-exp: each pair's share of dS = P (dP - rowsum(dO O))
                gq, gk, gv = _pair_backward(grad_out[:, :, qs], q[:, :, qs], kj[:, :, ks], vj[:, :, ks],
                                            out[:, :, qs], lse[:, :, qs].contiguous(), causal, mask, scale)
                dq[:, :, qs] += gq.to(acc)
                dk[:, :, ks] += gk.to(acc)
                dv[:, :, ks] += gv.to(acc)
            transport.give_back(dk, dv, k.shape[1])
        dk, dv = transport.own_gradients()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, grad_sinks


def _sink_forward(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """gpt-oss's attention sinks: a learned logit per head in every row's softmax denominator, which is the merged
    output times ``sigmoid(lse - sink)`` (exp(lse) / (exp(lse) + exp(sink))); ``out`` unchanged without sinks."""
    if sinks is None:
        return out
    acc = torch.promote_types(out.dtype, torch.float32)  # fp32, or fp64 in the fp64 tests
    sigma = torch.sigmoid(lse.to(acc) - sinks.to(acc)[None, :, None])  # (B, n, S)
    return (out.to(acc) * sigma[..., None]).to(out.dtype)


def _sink_backward(grad, out, lse, sinks):
    """``(grad_out, out, d sinks)`` for the attention backward under sinks: with ``s = sigmoid(lse - sink)`` the
    kernels take ``grad x s`` as the output's gradient and ``out x s`` as the output, so that their
    ``D = rowsum(dO o)`` is ``s^2 rowsum(grad out)``, which folds the LSE's gradient ``rowsum(grad out) s (1 - s)``
    in; ``d sink = -sum rowsum(grad out) s (1 - s)`` over the batch and rows. Without sinks: as given, None."""
    if sinks is None:
        return grad, out, None
    acc = torch.promote_types(out.dtype, torch.float32)
    sigma = torch.sigmoid(lse.to(acc) - sinks.to(acc)[None, :, None])[..., None]  # (B, n, S, 1)
    g, o = grad.to(acc), out.to(acc)
    d_sinks = -((g * o).sum(-1, keepdim=True) * sigma * (1 - sigma)).sum(dim=(0, 2, 3))
    return (g * sigma).to(grad.dtype), (o * sigma).to(out.dtype), d_sinks.to(sinks.dtype)


def _block_scores(q, k_block, pos_q, pos_k, keep, scale, window=0, documents=None):
    """Scaled scores ``(B, n, S_q, S_k)`` in fp32 with the causal mask on global positions (and a sliding
    ``window``: keys ``window`` or more positions back masked too; with ``documents`` ``(B, S)``, keys of
    another document), and the block's dropout mask (or None). Every query sees at least itself, in its
    own block: the running max is finite from the first step."""
    scores = torch.matmul(q.float(), _repeat_kv(k_block, q.shape[1]).float().transpose(-2, -1)) * scale
    gap = pos_q[:, None] - pos_k[None, :]
    masked = (gap < 0) | (gap >= window) if window else gap < 0
    if documents is not None:  # one more term on the same global positions: no padding of documents to 2 x CP
        masked = masked | ~same_document(documents[:, pos_q], documents[:, pos_k])
    scores = scores.masked_fill(masked, float("-inf"))
    return scores, None if keep is None else keep.index_select(-1, pos_k)


def _repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """GQA: each K/V head serves a run of ``heads / kv_heads`` query heads (SDPA's ``enable_gqa``)."""
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _sum_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """Adjoint of ``_repeat_kv``: sum the gradients of the query heads that shared a K/V head."""
    b, n, s, d = grad.shape
    return grad if n == kv_heads else grad.view(b, kv_heads, n // kv_heads, s, d).sum(dim=2)


def _pass_on(x: torch.Tensor, ranks: list[int], r: int, tag: int):
    """Send ``x`` to the next rank of the ring and receive the previous rank's block, posted as one
    batch (``comm.exchange``); ``_arrived`` waits for it. With one rank, ``x`` comes back to itself."""
    cp = len(ranks)
    if cp == 1:
        return x, x, C.Handle(None)
    buf = torch.empty_like(x)
    return x, buf, C.exchange([(x, ranks[(r + 1) % cp], tag)], [(buf, ranks[(r - 1) % cp], tag)])


def _arrived(posted) -> torch.Tensor:
    """Wait for a transfer ``_pass_on`` (or ``_Halo``) posted (its send too); returns what was received."""
    _, buf, handle = posted
    handle.wait()
    return buf


def _chunk_positions(chunks, half: int, device) -> torch.Tensor:
    """The global positions of zig-zag chunks ``chunks`` (each ``half`` long), side by side as a block holds them."""
    return torch.cat([torch.arange(c * half, (c + 1) * half, device=device) for c in chunks])


def _transport(ranks: list[int], r: int, half: int, window: int):
    """How the K/V blocks reach this rank: from its two zig-zag neighbours alone when the window fits in a chunk
    (``half`` tokens: query chunk ``i`` then needs keys of chunks ``i`` and ``i - 1`` only), else around the ring."""
    if len(ranks) > 1 and 0 < window <= half:
        return _Halo(ranks, r, half)
    return _Ring(ranks, r)


def _pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V (or their gradients) flattened into one buffer, each at its own width (MLA: d_qk and d_v), so that a
    transfer stays one message and carries no padding."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def _unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``_pack``: K and V as views of ``buf``, given their shapes (the same on every rank of the ring)."""
    split = math.prod(k_shape)
    return buf[:split].view(k_shape), buf[split:].view(v_shape)


class _Ring:
    """The full ring: each K/V block travels once around the CP ranks (the next block posted before the one in hand
    is used), and in backward its gradients travel with it, home after one full turn. K and V go as one flat
    buffer (``_pack``)."""

    def __init__(self, ranks: list[int], r: int) -> None:
        self.ranks, self.r, self.incoming, self.shapes = ranks, r, None, None

    def blocks(self, k: torch.Tensor, v: torch.Tensor):
        """``((K, V) of a block, its chunk numbers)`` for this rank's block, then each one arriving, ``CP`` in all."""
        cp, r = len(self.ranks), self.r
        self.shapes = (k.shape, v.shape)
        kv = _pack(k, v)
        for t in range(cp):
            j = (r - t) % cp
            nxt = _pass_on(kv, self.ranks, r, _KV_TAG) if t < cp - 1 else None
            yield _unpack(kv, *self.shapes), (j, 2 * cp - 1 - j)
            if nxt is not None:
                kv = _arrived(nxt)

    def give_back(self, grad_k, grad_v, kv_heads: int) -> None:
        """Add this rank's gradients of the block in hand (GQA heads summed) to what arrived with it, and pass them on
        with the block."""
        grads = _pack(_sum_kv(grad_k, kv_heads), _sum_kv(grad_v, kv_heads))
        if self.incoming is not None:
            grads += _arrived(self.incoming)
        self.incoming = _pass_on(grads, self.ranks, self.r, _GRAD_TAG)

    def own_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V gradients ``(B, n_kv, S/cp, d_k|d_v)``, home after the last ``give_back``'s turn."""
        return _unpack(_arrived(self.incoming), *self.shapes)


class _Halo:
    """A window within a chunk: rank ``r`` needs the keys of chunk ``r - 1`` (rank ``r - 1``'s first) and of chunk
    ``2 CP - 2 - r`` (rank ``r + 1``'s second) besides its own, so its first chunk goes to rank ``r + 1`` and its
    second to rank ``r - 1``: two half blocks each way instead of ``CP - 1`` blocks around the ring. Rank 0's first
    chunk has no chunk before it, and rank ``CP - 1``'s chunks ``CP - 1`` and ``CP`` are adjacent: the ends exchange
    with one neighbour. In backward the neighbours' chunk gradients go back the same way. Each half block's K and V
    go as one flat buffer (``_pack``)."""

    def __init__(self, ranks: list[int], r: int, half: int) -> None:
        self.ranks, self.r, self.half, self.own, self.posted, self.shapes = ranks, r, half, None, None, None
        cp = len(ranks)
        self.before = ranks[r - 1] if r > 0 else None  # holds chunk r - 1 first
        self.after = ranks[r + 1] if r < cp - 1 else None  # holds chunk 2 CP - 2 - r second
        self.chunks = ((r - 1,) if r > 0 else ()) + ((2 * cp - 2 - r,) if r < cp - 1 else ())

    def _swap(self, to_before, to_after, tag: int):
        """Send each neighbour its half block's K and V (pairs, or None for a missing neighbour) and receive one from
        each (one batch): ``(sent, received, handle)``, the halves from before and after as ``self.chunks`` orders
        them (``sent`` kept until the wait). The ends send and receive one."""
        peers = [peer for peer in (self.before, self.after) if peer is not None]
        sends = [(_pack(*x), peer, tag) for x, peer in ((to_before, self.before), (to_after, self.after))
                 if peer is not None]
        received = [torch.empty_like(sends[0][0]) for _ in peers]
        return sends, received, C.exchange(sends, [(buf, peer, tag) for buf, peer in zip(received, peers)])

    def _received(self, posted) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Wait for a ``_swap``; the ``(K, V)`` halves it received."""
        _, received, handle = posted
        handle.wait()
        return [_unpack(buf, *self.shapes) for buf in received]

    def blocks(self, k: torch.Tensor, v: torch.Tensor):
        """This rank's block (its chunks' K/V on their way meanwhile), then the neighbours' chunks side by side."""
        cp, r, h = len(self.ranks), self.r, self.half
        self.shapes = (k[..., :h, :].shape, v[..., :h, :].shape)
        posted = self._swap((k[..., h:, :], v[..., h:, :]), (k[..., :h, :], v[..., :h, :]), _KV_TAG)
        yield (k, v), (r, 2 * cp - 1 - r)
        halves = self._received(posted)
        yield (torch.cat([kh for kh, _ in halves], dim=-2), torch.cat([vh for _, vh in halves], dim=-2)), self.chunks

    def give_back(self, grad_k, grad_v, kv_heads: int) -> None:
        """The own block's gradients stay; the neighbours' chunks' go back to their owners."""
        grads = (_sum_kv(grad_k, kv_heads), _sum_kv(grad_v, kv_heads))
        if self.own is None:
            self.own = grads
            return
        parts = list(zip(*(g.split(self.half, dim=-2) for g in grads)))
        to_before = parts.pop(0) if self.before is not None else None
        to_after = parts.pop(0) if self.after is not None else None
        self.posted = self._swap(to_before, to_after, _GRAD_TAG)

    def own_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V gradients: its own block's, plus its first chunk's from rank ``r + 1`` and its second
        chunk's from rank ``r - 1``."""
        halves = self._received(self.posted)
        h, (dk, dv) = self.half, self.own
        if self.before is not None:
            gk, gv = halves.pop(0)
            dk[..., h:, :] += gk
            dv[..., h:, :] += gv
        if self.after is not None:
            gk, gv = halves.pop(0)
            dk[..., :h, :] += gk
            dv[..., :h, :] += gv
        return dk, dv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, *, keep: torch.Tensor | None = None,
                   p: float = 0.0, scale: float | None = None, window: int = 0,
                   documents: torch.Tensor | None = None, fused: bool | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over the whole sequence held by the CP ``group`` (load-balanced split).

    ``q``/``k`` ``(B, n, S/cp, d)``/``(B, n_kv, S/cp, d)``, ``v`` ``(B, n_kv, S/cp, d_v)`` (GQA when ``n_kv < n``;
    MLA's ``d_v`` narrower than ``d``: the ring carries v at its own width, ``_pack``), already
    rotated at their global positions; ``keep``: ``attention_keep``'s dropout mask with
    probability ``p``, or None; ``scale``: the scores' factor (default ``1/sqrt(d)``); ``window``: a
    sliding window (0: none); ``documents``: the whole sequence's ``(B, S)`` document numbers, attention then
    stays inside each document (``megakit.nn.attention.masks``). ``fused``: each block's chunk pairs on the fused kernel
    (``_FusedRingAttention``); default: without dropout. ``sinks`` ``(n,)``: gpt-oss's learned logit per head in
    each softmax denominator (``_sink_forward``). ``group`` None: a ring of one, the whole sequence in order (how
    attention with sinks runs without CP: SDPA returns no log-sum-exp). Returns ``(B, n, S/cp, d_v)``, this rank's
    rows.
    """
    ranks = C.group_ranks(group)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if fused is None:
        fused = keep is None
    if fused:
        return _FusedRingAttention.apply(q, k, v, group, ranks, scale, window, documents, sinks)
    return _RingAttention.apply(q, k, v, keep, p, group, ranks, scale, window, documents, sinks)
