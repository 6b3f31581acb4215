"""The gated delta rule in chunks (Yang et al. 2024, "Gated Delta Networks", arXiv:2412.06464), in torch.

Per head the state ``S`` (``d_k x d_v``) decays and is corrected towards each token's value:
``S_t = exp(g_t) S_{t-1} (I - beta_t k_t k_t^T) + beta_t k_t v_t^T``, and token ``t`` reads ``q_t^T S_t``. The
chunked form (transformers' ``torch_chunk_gated_delta_rule``, the same operations in the same order, so it agrees
with it to rounding) solves each chunk's updates at once with the UT transform (a unit lower-triangular solve), and
scans only over the ``S / chunk`` chunks: work linear in the sequence.

Packed documents (``documents`` ``(B, S)``, nondecreasing along each row): the state restarts at each document's
first token, as if each document were its own sequence. Inside a chunk, pairs of tokens of two documents are masked
out of the decays; a token reads the state carried into its chunk only if its document continues from the chunk
before, and only the chunk's last document writes the state carried out.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum x^2 + eps)`` over the last dimension (flash-linear-attention's and transformers')."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _document_masks(documents: torch.Tensor, pad: int, chunk: int) -> tuple[torch.Tensor, ...]:
    """``(same, carried, last)`` for ``(B, 1, n, C, ...)`` chunks: pairs in one document; tokens whose document
    continues from the chunk before; tokens in the chunk's last document."""
    b = documents.shape[0]
    doc = torch.cat([documents, documents[:, -1:].expand(b, pad)], dim=1).view(b, 1, -1, chunk)  # (B, 1, n, C)
    same = doc.unsqueeze(-1) == doc.unsqueeze(-2)  # (B, 1, n, C, C)
    before = torch.cat([doc[:, :, :1, :1], doc[:, :, :-1, -1:]], dim=2)  # the document each chunk is entered in
    return same, doc == before, doc == doc[..., -1:]


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    chunk: int = 64,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(S, B, n_v, d_v)`` out, in ``v``'s dtype, from ``q``, ``k`` ``(S, B, n_k, d_k)`` (l2-normalised here, ``q``
    scaled by ``d_k^-1/2``; each serves ``n_v / n_k`` consecutive value heads), ``v`` ``(S, B, n_v, d_v)``, the
    log-decay ``g`` and ``beta`` ``(S, B, n_v)``. The state starts at zero (and at each document); fp32 inside."""
    s, dtype = q.shape[0], v.dtype
    rep = v.shape[2] // q.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    q, k, v = (t.permute(1, 2, 0, 3).float().contiguous() for t in (q, k, v))  # (B, n, S, d)
    beta, g = (t.permute(1, 2, 0).float().contiguous() for t in (beta, g))  # (B, n, S)
    q, k = l2norm(q), l2norm(k)
    q = q * q.shape[-1] ** -0.5
    pad = (chunk - s % chunk) % chunk
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, g = (F.pad(t, (0, pad)) for t in (beta, g))
    v_beta, k_beta = v * beta.unsqueeze(-1), k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (t.reshape(*t.shape[:2], -1, chunk, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    g = g.reshape(*g.shape[:2], -1, chunk)  # (B, n, chunks, C)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # (B, n, chunks, C, C)
    carried = last = None
    if documents is not None:
        same, carried, last = _document_masks(documents, pad, chunk)
        decay = decay * same
    ut = (k_beta @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    read_decay, write_decay = cum.exp(), (cum[..., -1:] - cum).exp()
    chunk_decay = cum[..., -1].exp()
    if documents is not None:  # the state carried in reaches only its own document; only the last one is carried out
        decayed_k_beta = decayed_k_beta * carried.unsqueeze(-1)
        read_decay, write_decay = read_decay * carried, write_decay * last
        chunk_decay = chunk_decay * carried[..., -1]
    new_values = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cumdecay = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    q, k = q * read_decay.unsqueeze(-1), k * write_decay.unsqueeze(-1)
    chunk_decay = chunk_decay[..., None, None]
    state = q.new_zeros(*q.shape[:2], q.shape[-1], v.shape[-1])  # (B, n, d_k, d_v)
    out = []
    # unbind, not index: the backward of each ``t[:, :, i]`` would write a zero tensor of the whole ``t`` (quadratic)
    chunks = zip(*(t.unbind(2) for t in (new_values, k_cumdecay, q, intra, k, chunk_decay)))
    for values, k_decayed, q_i, intra_i, k_i, decay_i in chunks:  # the scan over chunks
        v_new = values - k_decayed @ state
        out.append(q_i @ state + intra_i @ v_new)
        state = state * decay_i + k_i.transpose(-1, -2) @ v_new
    y = torch.stack(out, dim=2).flatten(2, 3)[:, :, :s]  # (B, n, S, d_v)
    return y.permute(2, 0, 1, 3).to(dtype)
