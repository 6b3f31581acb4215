"""The Mamba-2 mixer (Dao and Gu 2024, "Transformers are SSMs"), heads split over TP and over CP.

Per token: ``z, x, B, C, dt = in_proj(h)``; ``x, B, C = silu(conv(x, B, C))`` (a causal depthwise conv);
``dt = clamp(softplus(dt + dt_bias), dt_min, dt_max)``; per head the state ``S_t = exp(dt_t A) S_{t-1} +
dt_t x_t B_t^T`` (``A = -exp(A_log)``) is read out as ``y_t = S_t C_t + D x_t``; then the gated RMSNorm per group,
``norm(y * silu(z))``, and ``out_proj``. The scan is SSD's chunked form in torch (``ssd_scan``): quadratic inside
chunks of ``chunk`` tokens, a recurrence over the chunks' states, linear in the sequence; it is transformers'
``mamba2_chunk_scan`` with packed documents added: the state and the conv restart at each document's first token
(masks on the decays, never a subtraction of ``-inf``).

TP: z, x, B, C, dt are column-parallel (the HF ``in_proj`` in its five parts, so each splits by its own rows), the
conv channels, ``A_log``, ``dt_bias``, ``D`` and the norm's weight split with the heads, B and C by group (TP must
divide the groups: each rank's heads read only their own groups), ``out_proj`` row-parallel. CP: an all-to-all of
heads, as Ulysses does (``context_parallel``, shared with Gated DeltaNet): each rank gets the whole sequence of
``heads / cp`` heads before the conv, runs conv and scan there, and sends the output back. That is exact, with no
state passed along a ring, and the conv needs no halo, so its kernel may be any length (no shard-length limit).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megakit.core.mamba_config import Mamba2Config
from megakit.nn import comm as C
from megakit.nn.linear_attention.context_parallel import to_own_tokens, to_whole_sequence
from megakit.nn.linear_attention.kernels import conv_silu, kernel, mamba_chunk_scan
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark
from megakit.nn.tensor_parallel.overlapped_linear import column_parallel

__all__ = ["GatedNorm", "Mamba2", "ssd_scan"]


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """``(..., Q)`` -> ``(..., Q, Q)``: ``sum(a[j+1 .. i])`` at ``[i, j]`` for ``j <= i``, else ``-inf`` (a masked
    cumulative sum, as transformers' ``segment_sum``: no difference of two cumulative sums)."""
    q = a.shape[-1]
    a = a[..., None].expand(*a.shape, q)
    lower = torch.ones(q, q, device=a.device, dtype=torch.bool)
    a = a.masked_fill(~lower.tril(-1), 0).cumsum(dim=-2)
    return a.masked_fill(~lower.tril(0), -torch.inf)


def _chunks(t: torch.Tensor, pad: int, q: int) -> torch.Tensor:
    """``(b, s, ...)`` -> ``(b, c, q, ...)``, zero-padded to ``c q`` tokens."""
    t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    return t.view(t.shape[0], -1, q, *t.shape[2:])


def ssd_scan(x, dt, A, B, Cm, D, *, chunk: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """``y`` ``(b, s, h, p)`` of the scan over ``x`` ``(b, s, h, p)``, ``dt`` ``(b, s, h)`` (after softplus and
    clamp), ``A`` ``(h,)`` (negative), ``B``/``Cm`` ``(b, s, g, n)``, ``D`` ``(h,)``; in fp32. ``documents``
    ``(b, s)`` nondecreasing: no state crosses from one document to the next."""
    b, s, h, p = x.shape
    g = B.shape[2]
    x, B, Cm = x.float(), B.float().repeat_interleave(h // g, dim=2), Cm.float().repeat_interleave(h // g, dim=2)
    pad = (chunk - s % chunk) % chunk
    skip = D[:, None].float() * x
    x = x * dt[..., None].float()
    a = A.float() * dt.float()  # (b, s, h)
    x, a, B, Cm = (_chunks(t, pad, chunk) for t in (x, a, B, Cm))  # (b, c, q, h, ...)
    a = a.permute(0, 3, 1, 2)  # (b, h, c, q)
    a_cum = a.cumsum(dim=-1)
    inside = mine = ends = None
    if documents is not None:
        doc = _chunks(F.pad(documents, (0, pad), value=-1)[..., None], 0, chunk)[..., 0]  # (b, c, q); pad: none
        doc = torch.where(doc < 0, documents[:, -1:, None], doc)
        inside = (doc[:, :, :, None] == doc[:, :, None, :])[:, None]  # (b, 1, c, l, s): one document
        ends = torch.cat([doc[:, :1, 0], doc[:, :, -1]], dim=1)  # (b, c + 1): the document of each chunk boundary
        mine = doc == doc[:, :, -1:]  # (b, c, l): token l still in the document its chunk ends in
    # 1. inside each chunk: y_l = sum_s C_l . B_s exp(a_{s+1} + .. + a_l) x_s
    decay = torch.exp(_segment_sum(a))  # (b, h, c, l, s)
    if inside is not None:
        decay = decay * inside
    scores = torch.einsum("bclhn,bcshn->bclsh", Cm, B) * decay.permute(0, 2, 3, 4, 1)
    y = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    # 2. each chunk's own state at its end
    to_end = torch.exp(a_cum[..., -1:] - a_cum)  # (b, h, c, l)
    if mine is not None:
        to_end = to_end * mine[:, None]
    states = torch.einsum("bclhn,bclhp->bchpn", B * to_end.permute(0, 2, 3, 1)[..., None], x)
    # 3. the recurrence over chunks: the state at each chunk's start
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)  # (b, c + 1, h, p, n)
    carry = torch.exp(_segment_sum(F.pad(a_cum[..., -1], (1, 0)))).transpose(1, 3)  # (b, z, c, h): from z to c
    if ends is not None:
        carry = carry * (ends[:, :, None] == ends[:, None, :])[..., None]
    states = torch.einsum("bzch,bzhpn->bchpn", carry, states)[:, :-1]
    # 4. the start states read out inside each chunk
    from_start = torch.exp(a_cum).permute(0, 2, 3, 1)  # (b, c, l, h)
    if ends is not None:
        from_start = from_start * (doc == ends[:, :-1, None])[..., None]
    y = y + torch.einsum("bclhn,bchpn->bclhp", Cm, states) * from_start[..., None]
    return y.reshape(b, -1, h, p)[:, :s] + skip


class GatedNorm(nn.Module):
    """RMSNorm of ``y * silu(z)`` over each group of channels (Mamba-2's ``RMSNormGated`` with its n_groups, the norm
    after the gate), in fp32; the weight is split over TP with the channels (``(S, B, inner/tp)`` in and out)."""

    def __init__(self, channels: int, group_size: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = mark(nn.Parameter(torch.empty(channels, dtype=dtype, device=device)), 0)

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """``weight * norm(y * silu(z))`` per group, the norm in fp32 (transformers' order)."""
        dtype = y.dtype
        y = y.float() * F.silu(z.float())
        y = y.view(*y.shape[:-1], -1, self.group_size)
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.view(*y.shape[:-2], -1).to(dtype)


class CausalConv(nn.Module):
    """A depthwise conv's taps ``(channels/tp, kernel)`` and bias, split over TP with the channels."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = mark(nn.Parameter(torch.empty(channels, kernel, dtype=dtype, device=device)), 0)
        self.bias = mark(nn.Parameter(torch.empty(channels, dtype=dtype, device=device)), 0) if bias else None

    def forward(self, x: torch.Tensor, documents, rows: slice, choice: str = "auto") -> torch.Tensor:
        """``silu(conv(x))`` of ``x`` ``(S, B, c)``, the whole sequence of channels ``rows`` of this rank's;
        ``choice``: ``kernels.KERNELS``."""
        bias = None if self.bias is None else self.bias[rows]
        return conv_silu(x, self.weight[rows], bias, documents=documents, choice=choice)


class Mamba2(nn.Module):
    """The Mamba-2 mixer on ``(S', B, H)``: this rank's heads (TP) of this rank's tokens (CP), ``(S', B, H)`` out.

    ``documents`` ``(B, S)``, the whole sequence's on every rank: the state and conv restart at each document."""

    def __init__(
        self,
        mamba: Mamba2Config,
        hidden: int,
        *,
        eps: float,
        group,
        sequence_parallel: bool,
        dtype,
        device,
        cp_group,
        selective: bool = False,
    ) -> None:
        super().__init__()
        self.selective = selective  # in training, keep the core's inputs only and recompute it in backward
        self.linear_kernels = "auto"  # causal-conv1d's and mamba-ssm's kernels on CUDA where installed (kernels.py)
        tp = C.size(group)
        self.cp_group, self.cp, self.cp_rank = cp_group, C.size(cp_group), C.rank(cp_group)
        mamba.check_split(tp, self.cp)
        self.group, self.sequence_parallel, self.m = group, sequence_parallel, mamba
        self.heads, self.groups = mamba.heads // tp, mamba.groups // tp  # this TP rank's
        col = dict(group=group, sequence_parallel=sequence_parallel, enter_region=False, dtype=dtype, device=device)
        bc = mamba.groups * mamba.state
        self.z_proj = ColumnParallelLinear(hidden, mamba.inner, bias=mamba.bias, **col)
        self.x_proj = ColumnParallelLinear(hidden, mamba.inner, bias=mamba.bias, **col)
        self.b_proj = ColumnParallelLinear(hidden, bc, bias=mamba.bias, **col)
        self.c_proj = ColumnParallelLinear(hidden, bc, bias=mamba.bias, **col)
        self.dt_proj = ColumnParallelLinear(hidden, mamba.heads, bias=mamba.bias, **col)
        conv = dict(kernel=mamba.conv_kernel, bias=mamba.conv_bias, dtype=dtype, device=device)
        self.conv_x = CausalConv(mamba.inner // tp, **conv)
        self.conv_b, self.conv_c = CausalConv(bc // tp, **conv), CausalConv(bc // tp, **conv)
        vector = dict(dtype=dtype, device=device)
        self.dt_bias = mark(nn.Parameter(torch.empty(self.heads, **vector)), 0)
        self.A_log = mark(nn.Parameter(torch.empty(self.heads, **vector)), 0)
        self.D = mark(nn.Parameter(torch.empty(self.heads, **vector)), 0)
        self.norm = GatedNorm(mamba.inner // tp, mamba.inner // mamba.groups, eps, dtype, device)
        self.out_proj = RowParallelLinear(
            mamba.inner, hidden, bias=mamba.bias, group=group, sequence_parallel=sequence_parallel, **vector
        )

    def _core(self, x, b, c, dt, documents: torch.Tensor | None) -> torch.Tensor:
        """The mixer's core on the whole sequence of this rank's heads: the conv and SiLU of x, B and C, dt's softplus
        and clamp, the SSD scan; ``(S, B, n, d)`` in (dt ``(S, B, heads, 1)``), ``(S, B, heads, head_dim)`` out. What
        ``selective`` recomputes (Megatron-Core's selective recompute of a core, Korthikanti et al. 2022)."""
        m, batch = self.m, x.shape[1]
        heads, groups = self.heads // self.cp, self.groups // self.cp  # this rank's share of the whole sequence's
        own = slice(self.cp_rank * heads, (self.cp_rank + 1) * heads)  # this rank's heads among the TP rank's
        rows = lambda n, d: slice(self.cp_rank * n * d, (self.cp_rank + 1) * n * d)  # noqa: E731
        full, choice = x.shape[0], self.linear_kernels
        x = self.conv_x(x.reshape(full, batch, -1), documents, rows(heads, m.head_dim), choice)
        b = self.conv_b(b.reshape(full, batch, -1), documents, rows(groups, m.state), choice)
        c = self.conv_c(c.reshape(full, batch, -1), documents, rows(groups, m.state), choice)
        seq_first = lambda t, d: t.view(full, batch, -1, d).transpose(0, 1)  # noqa: E731  (B, S, n, d)
        x, b, c, A = (
            seq_first(x, m.head_dim),
            seq_first(b, m.state),
            seq_first(c, m.state),
            -self.A_log[own].float().exp(),
        )
        scan = kernel("mamba-ssm", choice, x)
        if scan is not None:  # softplus, bias and clamp of dt in the kernel
            y = mamba_chunk_scan(
                scan,
                x,
                dt[..., 0].transpose(0, 1),
                A,
                b,
                c,
                self.D[own],
                dt_bias=self.dt_bias[own],
                dt_limit=(m.dt_min, m.dt_max),
                chunk=m.chunk,
                documents=documents,
            )
            return y.transpose(0, 1)  # (S, B, heads, head_dim)
        dt = F.softplus(dt[..., 0] + self.dt_bias[own]).clamp(m.dt_min, m.dt_max)  # (S, B, heads)
        y = ssd_scan(x, dt.transpose(0, 1), A, b, c, self.D[own], chunk=m.chunk, documents=documents)
        return y.transpose(0, 1)  # (S, B, heads, head_dim)

    def forward(self, h: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """Forward: the projections' TP all-gather (SP), with CP an all-to-all of heads each way; backward: the
        same in reverse. ``out_proj``'s all-reduce (reduce-scatter with SP)."""
        m, cp = self.m, self.cp
        projections = (self.z_proj, self.x_proj, self.b_proj, self.c_proj, self.dt_proj)
        z, x, b, c, dt = column_parallel(h, projections, self.group, self.sequence_parallel)  # (S/cp, B, ./tp)
        s, batch = x.shape[:2]
        x, b, c = x.view(s, batch, -1, m.head_dim), b.view(s, batch, -1, m.state), c.view(s, batch, -1, m.state)
        dt = dt.unsqueeze(-1)
        if cp > 1:  # (S/cp, B, n, d) -> (S, B, n/cp, d): every token, in sequence order, of this rank's heads
            x, b, c, dt = (to_whole_sequence(t, self.cp_group) for t in (x, b, c, dt))
        if self.selective and self.training:  # no collective inside the core: the all-to-alls stay outside
            y = torch.utils.checkpoint.checkpoint(self._core, x, b, c, dt, documents, use_reentrant=False)
        else:
            y = self._core(x, b, c, dt, documents)  # (S, B, heads, head_dim)
        if cp > 1:
            y = to_own_tokens(y, self.cp_group)  # (S/cp, B, heads x cp, head_dim)
        y = self.norm(y.reshape(s, batch, -1), z)  # (S/cp, B, inner/tp)
        return self.out_proj(y.to(h.dtype))  # (S', B, H)
