"""Exact attention computed over K/V blocks with an online softmax: the algorithm of ring attention, apart from how
the blocks travel (``megakit.nn.attention.transport``), and of attention with sinks without CP.

A rank's queries meet the K/V blocks one at a time, and the partial results merge by their log-sum-exp (running
max, running sum), so nothing ``S x S`` is kept; the causal mask compares *global* token positions
(``megakit.nn.sequence.positions``), exact at every chunk boundary. Backward recomputes the block scores from the
saved ``q``, ``k``, ``v``, output and log-sum-exp, and hands each block's K/V gradients back to its transport.

Each block runs as chunk pairs on a fused kernel (``_FusedBlockAttention``: the pairs the causal mask or a window
rules out skipped, so the zig-zag split halves the off-diagonal work), or, with dropout, as explicit fp32 blocks
(``_BlockAttention``, also the reference the tests hold the fused one to). gpt-oss's attention sinks fold into the
merged output through the log-sum-exp (``_sink_forward``), which SDPA's kernels do not return: without CP,
attention with sinks runs here on the rank's own block (``block_attention`` with the ``Own`` transport).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megakit.nn.attention.masks import same_document
from megakit.nn.dropout import DropoutKeys, keep_mask
from megakit.nn.sequence import positions


def chunk_positions(chunks, half: int, device) -> torch.Tensor:
    """The global positions of zig-zag chunks ``chunks`` (each ``half`` long), side by side as a block holds them."""
    return torch.cat([torch.arange(c * half, (c + 1) * half, device=device) for c in chunks])


def attention_keep(
    p: float,
    keys: DropoutKeys,
    *,
    site: str,
    head_start: int,
    heads_local: int,
    heads: int,
    rows: torch.Tensor,
    seq_len: int,
    device,
) -> torch.Tensor:
    """The attention-probability dropout mask of this rank's query rows against every key:
    ``(B, heads_local, S/cp, S)`` bool, cut from the same ``(heads, S, S)`` draw per sample as
    ``megakit.nn.dropout.attention_dropout`` (so the same units drop at any layout)."""
    keep = keep_mask(
        p,
        keys,
        site=site,
        streams=keys.samples,
        full_shape=(heads, seq_len, seq_len),
        rows=slice(head_start, head_start + heads_local),
        device=device,
    )
    return keep.index_select(2, rows)


class _BlockAttention(torch.autograd.Function):
    """Causal attention of this rank's queries against the whole sequence's keys, explicit fp32 blocks (dropout).

    The K/V blocks come from ``transport`` (the ring: CP - 1 K/V transfers in forward; CP - 1 K/V transfers and CP
    transfers of K/V gradients in backward; a window within a chunk: one half block to and from each neighbour
    instead, each way), or, without CP, the rank's own block alone (``Own``).
    """

    @staticmethod
    def forward(ctx, q, k, v, keep, p, cp, r, transport, scale, window, documents, sinks):
        b, n, s, _ = q.shape
        pos = positions(s * cp, cp, r, device=q.device)
        m = q.new_full((b, n, s, 1), float("-inf"), dtype=torch.float32)
        total = torch.zeros((b, n, s, 1), dtype=torch.float32, device=q.device)
        acc = torch.zeros((b, n, s, v.shape[-1]), dtype=torch.float32, device=q.device)  # v's width (MLA: d_v)
        for (kb, vb), chunks in transport(s // 2, window).blocks(k, v):
            scores, keep_j = _block_scores(
                q, kb, pos, chunk_positions(chunks, s // 2, q.device), keep, scale, window, documents
            )
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
        ctx.p, ctx.cp, ctx.r, ctx.transport = p, cp, r, transport
        ctx.scale, ctx.window, ctx.documents = scale, window, documents
        return _sink_forward(out, lse, sinks)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, keep, sinks = ctx.saved_tensors
        grad_out, out, grad_sinks = _sink_backward(grad_out, out, lse, sinks)
        lse = lse[..., None]
        cp, r, scale, p = ctx.cp, ctx.r, ctx.scale, ctx.p
        b, n, s, d = q.shape
        pos = positions(s * cp, cp, r, device=q.device)
        grad_out = grad_out.float()
        delta = (grad_out * out.float()).sum(dim=-1, keepdim=True)  # rowsum(dP * P), dropout included
        dq = torch.zeros((b, n, s, d), dtype=torch.float32, device=q.device)
        transport = ctx.transport(s // 2, ctx.window)
        for (kb, vb), chunks in transport.blocks(k, v):
            kj, vj = _repeat_kv(kb, n).float(), _repeat_kv(vb, n).float()
            scores, keep_j = _block_scores(
                q, kb, pos, chunk_positions(chunks, s // 2, q.device), keep, scale, ctx.window, ctx.documents
            )
            probs = (scores - lse).exp()  # masked entries: exp(-inf) = 0
            dropped = probs if keep_j is None else probs * keep_j / (1.0 - p)
            grad_v = torch.matmul(dropped.transpose(-2, -1), grad_out)  # (B, n, S_k, d_v)
            grad_p = torch.matmul(grad_out, vj.transpose(-2, -1))
            if keep_j is not None:
                grad_p = grad_p * keep_j / (1.0 - p)
            grad_s = probs * (grad_p - delta)
            dq += torch.matmul(grad_s, kj) * scale
            grad_k = torch.matmul(grad_s.transpose(-2, -1), q.float()) * scale
            transport.give_back(_sum_kv(grad_k, k.shape[1]), _sum_kv(grad_v, k.shape[1]))
        dk, dv = transport.own_gradients()  # this rank's K/V gradients, home
        return (
            dq.to(q.dtype),
            dk.to(k.dtype),
            dv.to(v.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            grad_sinks,
        )


# -- the blocks on a fused kernel ------------------------------------------------------------------------------
# Each block is four chunk pairs (this rank's two query chunks against the block's two key chunks): under the causal
# mask an earlier key chunk is seen whole, the same chunk causally, a later one not at all, so about half of the
# off-diagonal work is skipped, and a window rules out more. Each pair runs one fused attention call that returns
# its log-sum-exp (the pairs merge by it), so nothing (S/cp)^2 is kept in fp32: at most one pair's additive mask, for
# windows that cut a pair or documents. The kernels (``_pair_forward``, ``_pair_backward``): on CPU
# ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward; on CUDA the memory-efficient kernel
# (``aten._scaled_dot_product_efficient_attention``, as torch's own ``context_parallel`` calls it), the one of
# SDPA's fused kernels that takes an additive mask and fp32, its mask padded to 16 columns and its LSE to 32 rows as
# SDPA pads them. Dropout needs megakit's keyed masks inside the softmax, which no fused kernel takes: with it the
# explicit ``_BlockAttention`` runs (also the reference the tests hold this one to).
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
    padded[..., : mask.shape[-1]] = mask
    return padded[..., : mask.shape[-1]].expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])


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
    return out[..., :width], lse[..., : q.shape[2]]  # the kernel pads the LSE's rows to a multiple of 32


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
    gq, gk, gv, _ = _EFFICIENT_BACKWARD(
        grad_out,
        q,
        k,
        v,
        _cuda_bias(mask, q, k),
        out,
        padded,
        no_dropout,
        no_dropout,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
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


class _FusedBlockAttention(torch.autograd.Function):
    """``_BlockAttention`` without dropout, each block's chunk pairs on the fused kernel (see above)."""

    @staticmethod
    def forward(ctx, q, k, v, cp, r, transport, scale, window, documents, sinks):
        b, n, s, _ = q.shape
        half = s // 2
        pos = positions(s * cp, cp, r, device=q.device)
        acc = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 in the fp64 tests (the kernel's LSE dtype)
        out = torch.zeros((b, n, s, v.shape[-1]), dtype=acc, device=q.device)  # v's width (MLA: d_v)
        lse = torch.full((b, n, s), float("-inf"), dtype=acc, device=q.device)
        for (kb, vb), chunks in transport(half, window).blocks(k, v):
            kj, vj = _repeat_kv(kb, n), _repeat_kv(vb, n)
            for qs, ks, causal, mask, none in _pairs(
                (r, 2 * cp - 1 - r),
                chunks,
                half,
                window,
                documents,
                pos,
                chunk_positions(chunks, half, q.device),
                q.dtype,
            ):
                o, pair_lse = _pair_forward(q[:, :, qs], kj[:, :, ks], vj[:, :, ks], causal, mask, scale)
                if none is not None:  # rows with no allowed key: nothing (a kernel may give lse 0 or o NaN there)
                    pair_lse = pair_lse.masked_fill(none.expand(b, n, -1), float("-inf"))
                    o = o.masked_fill(none.expand(b, n, -1)[..., None], 0.0)
                merged = torch.logaddexp(lse[:, :, qs], pair_lse)
                safe = merged.masked_fill(merged == float("-inf"), 0.0)
                out[:, :, qs] = (
                    out[:, :, qs] * (lse[:, :, qs] - safe).exp()[..., None]
                    + o.to(acc) * (pair_lse - safe).exp()[..., None]
                )
                lse[:, :, qs] = merged
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.cp, ctx.r, ctx.transport = cp, r, transport
        ctx.scale, ctx.window, ctx.documents = scale, window, documents
        return _sink_forward(out, lse, sinks)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        grad_out, out, grad_sinks = _sink_backward(grad_out, out, lse, sinks)
        cp, r, scale = ctx.cp, ctx.r, ctx.scale
        b, n, s, d = q.shape
        half = s // 2
        pos = positions(s * cp, cp, r, device=q.device)
        grad_out = grad_out.to(q.dtype).contiguous()
        acc = lse.dtype
        dq = torch.zeros((b, n, s, d), dtype=acc, device=q.device)
        transport = ctx.transport(half, ctx.window)
        for (kb, vb), chunks in transport.blocks(k, v):
            kj, vj = _repeat_kv(kb, n), _repeat_kv(vb, n)
            dk = torch.zeros(kj.shape, dtype=acc, device=q.device)
            dv = torch.zeros(vj.shape, dtype=acc, device=q.device)
            for qs, ks, causal, mask, _ in _pairs(
                (r, 2 * cp - 1 - r),
                chunks,
                half,
                ctx.window,
                ctx.documents,
                pos,
                chunk_positions(chunks, half, q.device),
                q.dtype,
            ):
                # the final output and log-sum-exp: each pair's share of dS = P (dP - rowsum(dO O))
                gq, gk, gv = _pair_backward(
                    grad_out[:, :, qs],
                    q[:, :, qs],
                    kj[:, :, ks],
                    vj[:, :, ks],
                    out[:, :, qs],
                    lse[:, :, qs].contiguous(),
                    causal,
                    mask,
                    scale,
                )
                dq[:, :, qs] += gq.to(acc)
                dk[:, :, ks] += gk.to(acc)
                dv[:, :, ks] += gv.to(acc)
            transport.give_back(_sum_kv(dk, k.shape[1]), _sum_kv(dv, k.shape[1]))
        dk, dv = transport.own_gradients()
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None, grad_sinks


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


class Own:
    """The transport of a rank that holds the whole sequence (no CP): its own block, nothing sent; the gradients stay
    (``megakit.nn.attention.transport.Ring``'s interface, for a ring of one)."""

    def __init__(self, half: int, window: int) -> None:
        self.grads = None

    def blocks(self, k: torch.Tensor, v: torch.Tensor):
        """This rank's block, chunks 0 and 1 of a ring of one."""
        yield (k, v), (0, 1)

    def give_back(self, grad_k, grad_v) -> None:
        """Keeps the K/V gradients, since a ring of one has no neighbour to send them to."""
        self.grads = grad_k, grad_v

    def own_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K/V gradients kept by ``give_back``, this rank's whole share."""
        return self.grads


def block_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    cp: int = 1,
    r: int = 0,
    transport=Own,
    keep: torch.Tensor | None = None,
    p: float = 0.0,
    scale: float | None = None,
    window: int = 0,
    documents: torch.Tensor | None = None,
    fused: bool | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of CP rank ``r`` of ``cp``'s queries over the whole sequence, its K/V blocks brought by
    ``transport(half, window)`` (default ``Own``: no CP, the whole sequence here); see ``ring_attention`` for the
    arguments. ``fused``: each block's chunk pairs on the fused kernel (``_FusedBlockAttention``); default: without
    dropout. Returns ``(B, n, S/cp, d_v)``, this rank's rows."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if fused is None:
        fused = keep is None
    if fused:
        return _FusedBlockAttention.apply(q, k, v, cp, r, transport, scale, window, documents, sinks)
    return _BlockAttention.apply(q, k, v, keep, p, cp, r, transport, scale, window, documents, sinks)
