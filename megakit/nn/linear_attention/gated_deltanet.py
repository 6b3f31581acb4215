"""The Gated DeltaNet mixer (Qwen3-Next, Qwen3.5), its heads split over TP and, by an all-to-all, over CP.

q, k, v, the output gate z, and the per-value-head ``b`` (beta) and ``a`` (decay) are column-parallel projections of
this rank's heads; q, k and v pass the short causal conv and SiLU; ``beta = sigmoid(b)``, the log-decay
``g = -exp(A_log) softplus(a + dt_bias)``; the chunked gated delta rule (``delta_rule``) mixes the sequence; each
head's output is RMS-normed and gated by ``silu(z)`` (one norm weight shared by the heads), and the out projection
is row-parallel. TP splits the key heads, and the value heads and conv channels with them, so each rank's heads are
whole groups. With CP (``context_parallel``) the conv and the recurrence run on the whole sequence of ``1/cp`` of
the rank's heads, so documents restart exactly as in one process; the norm and gate run on the rank's own tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megakit.core.linear_attention_config import LinearAttentionConfig
from megakit.nn import comm as C
from megakit.nn.linear_attention.context_parallel import to_own_tokens, to_whole_sequence
from megakit.nn.linear_attention.kernels import conv_silu, gated_delta_rule
from megakit.nn.tensor_parallel.collectives import copy_to_tp
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark
from megakit.nn.tensor_parallel.overlapped_linear import column_parallel


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(gate)`` over the last dimension, in fp32, cast back (``Qwen3NextRMSNormGated``)."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(dtype)
    return (h * F.silu(gate.float())).to(dtype)


class GatedNorm(nn.Module):
    """``gated_rms_norm`` of every head's ``d_v`` channels; one weight shared by the heads of every TP rank, so its
    gradient is partial per rank: summed over TP in backward."""

    def __init__(self, dim: int, eps: float, dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = mark(nn.Parameter(torch.empty(dim, dtype=dtype, device=device)), None)

    def forward(self, x: torch.Tensor, gate: torch.Tensor, group) -> torch.Tensor:
        """``(..., d_v)`` in and out."""
        return gated_rms_norm(x, gate, copy_to_tp(self.weight, group), self.eps)


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet over ``(S', B, H)`` (the sequence shard under SP), ``(S', B, H)`` out.

    forward: the projections' TP entry (all-gather under SP), with CP one all-to-all of q/k/v/b/a to head groups of
    the whole sequence and one of the output back, the out projection's TP exit. ``documents`` ``(B, S)``: the
    whole sequence's document numbers (also under CP); the conv and the state restart at each document."""

    def __init__(
        self,
        config: LinearAttentionConfig,
        hidden: int,
        *,
        eps: float,
        group,
        sequence_parallel: bool,
        dtype,
        device,
        cp_group=None,
        selective: bool = False,
    ) -> None:
        super().__init__()
        tp, cp = C.size(group), C.size(cp_group)
        config.check_parallel(tp=tp, cp=cp)
        self.group, self.sequence_parallel, self.cp_group, self.eps = group, sequence_parallel, cp_group, eps
        self.selective = selective  # in training, keep the core's inputs only and recompute it in backward
        self.linear_kernels = "auto"  # fla's and causal-conv1d's kernels on CUDA where installed (kernels.py)
        self.cp, self.cp_rank, self.chunk = cp, C.rank(cp_group), config.chunk
        self.key_heads, self.value_heads = config.key_heads // tp, config.value_heads // tp
        self.dk, self.dv = config.key_head_dim, config.value_head_dim
        nk, nv = config.key_heads * self.dk, config.value_heads * self.dv
        col = dict(group=group, sequence_parallel=sequence_parallel, enter_region=False, dtype=dtype, device=device)
        self.in_q, self.in_k = (ColumnParallelLinear(hidden, nk, bias=False, **col) for _ in "qk")
        self.in_v, self.in_z = (ColumnParallelLinear(hidden, nv, bias=False, **col) for _ in "vz")
        self.in_b, self.in_a = (ColumnParallelLinear(hidden, config.value_heads, bias=False, **col) for _ in "ba")
        k = config.conv_kernel

        def param(*shape, tp_dim):
            return mark(nn.Parameter(torch.empty(*shape, dtype=dtype, device=device)), tp_dim)

        self.conv_q, self.conv_k = param(nk // tp, k, tp_dim=0), param(nk // tp, k, tp_dim=0)
        self.conv_v = param(nv // tp, k, tp_dim=0)
        self.A_log, self.dt_bias = param(self.value_heads, tp_dim=0), param(self.value_heads, tp_dim=0)
        self.gated_norm = GatedNorm(self.dv, eps, dtype, device)
        self.out_proj = RowParallelLinear(
            nv, hidden, bias=False, group=group, sequence_parallel=sequence_parallel, dtype=dtype, device=device
        )

    def _mine(self, t: torch.Tensor, heads: int) -> torch.Tensor:
        """The rows of a per-head parameter ``t`` (``heads`` of this TP rank) that this CP rank's head group uses."""
        return t.view(heads, -1)[self.cp_rank * heads // self.cp :][: heads // self.cp].reshape(-1, *t.shape[1:])

    def _core(self, q, k, v, b, a, documents: torch.Tensor | None) -> torch.Tensor:
        """The mixer's core on the whole sequence of this rank's head group: the conv and SiLU, the gates, the chunked
        delta rule; ``(S, B, heads x d)`` in (q, k, v; b and a per value head), ``(S, B, n_v/(tp cp), d_v)`` out.
        What ``selective`` recomputes (Megatron-Core's selective recompute of a core, Korthikanti et al. 2022)."""
        nk, nv, bsz = self.key_heads, self.value_heads, q.shape[1]
        weight = torch.cat([self._mine(w, n) for w, n in ((self.conv_q, nk), (self.conv_k, nk), (self.conv_v, nv))])
        qkv = conv_silu(torch.cat([q, k, v], dim=-1), weight, documents=documents, choice=self.linear_kernels)
        q, k, v = qkv.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=-1)
        seq = q.shape[0]
        beta = b.sigmoid()
        g = -self._mine(self.A_log, nv).float().exp() * F.softplus(a.float() + self._mine(self.dt_bias, nv))
        return gated_delta_rule(
            q.view(seq, bsz, -1, self.dk),
            k.view(seq, bsz, -1, self.dk),
            v.view(seq, bsz, -1, self.dv),
            g,
            beta,
            chunk=self.chunk,
            documents=documents,
            choice=self.linear_kernels,
        )

    def forward(self, x: torch.Tensor, documents: torch.Tensor | None = None) -> torch.Tensor:
        """``(S', B, H)`` in and out; ``documents`` ``(B, S)`` the whole sequence's (see the class)."""
        projections = (self.in_q, self.in_k, self.in_v, self.in_z, self.in_b, self.in_a)
        q, k, v, z, b, a = column_parallel(x, projections, self.group, self.sequence_parallel)  # (S, B, heads/tp ...)
        s, bsz = q.shape[:2]
        cp, nv = self.cp, self.value_heads
        mixed = [q, k, v, b, a]
        if cp > 1:  # one all-to-all: this rank's tokens of every head -> the whole sequence of head group cp_rank
            widths = [t.shape[-1] // cp for t in mixed]
            packed = torch.cat([t.view(s, bsz, cp, -1) for t in mixed], dim=-1)  # (S/cp, B, cp, sum widths)
            mixed = list(to_whole_sequence(packed, self.cp_group).squeeze(2).split(widths, dim=-1))
        q, k, v, b, a = mixed  # (S, B, heads/(tp cp) x d)
        if self.selective and self.training:  # no collective inside the core: the all-to-alls stay outside
            o = torch.utils.checkpoint.checkpoint(self._core, q, k, v, b, a, documents, use_reentrant=False)
        else:
            o = self._core(q, k, v, b, a, documents)  # (S, B, n_v/(tp cp), d_v)
        if cp > 1:
            o = to_own_tokens(o, self.cp_group)  # (S/cp, B, n_v/tp, d_v)
        o = self.gated_norm(o, z.view(s, bsz, nv, self.dv), self.group)
        return self.out_proj(o.reshape(s, bsz, -1))  # (S', B, H)
