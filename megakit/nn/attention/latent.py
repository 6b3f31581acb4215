"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2; transformers' ``DeepseekV3Attention``), heads over TP.

Queries through a low-rank latent (``q_a_proj``, its RMSNorm, ``q_b_proj``) or a plain ``q_proj``; keys and
values through one compressed latent (``kv_a_proj_with_mqa``'s first ``kv_lora_rank`` outputs, normed, then
``kv_b_proj`` to each head's ``[k_nope | v]``) and one RoPE key (its last ``qk_rope_head_dim`` outputs) shared by
every head. Each head's query and key are ``[nope | rope]``, ``qk_head_dim`` wide; its value ``v_head_dim``.

Under TP (Megatron-Core's and torchtitan's plan) the down-projections and the latent norms are replicated and the
up-projections and ``o_proj`` split by heads. The gradients that reach the replicated part:

- the latents feed column-parallel up-projections, which all-reduce their input's gradient (``enter_tp_region``),
  so ``q_a_proj``, ``kv_a_proj_with_mqa``'s latent rows and the norms get the whole gradient on every rank;
- the RoPE key bypasses ``kv_b_proj``: each rank reads it for its own heads only, so it enters the TP region by
  itself (all-reduced in backward; with SP all-gathered, reduce-scattered in backward) -- the gradient that
  Megatron-LM#1699 left partial;
- with SP the down-projections run on the rank's ``S/tp`` tokens, so their weights' gradients are partial and
  summed over TP (``replicated``), as the norms' are.

The core is ``Attention``'s (``_dispatch``): SDPA, the ring (values carried at their own width), Ulysses or
hybrid, dropout, windows and documents alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megakit.core.model_config import ModelConfig
from megakit.nn.attention.core import Attention, apply_rope, rope_at
from megakit.nn.dropout import DropoutKeys
from megakit.nn.tensor_parallel.collectives import enter_tp_region, replicated
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark


def _replicated(*shape, dtype, device) -> nn.Parameter:
    return mark(nn.Parameter(torch.empty(*shape, dtype=dtype, device=device)), None)


class _Down(nn.Module):
    """A down-projection every TP rank holds whole (``weight`` ``(out, in)``, optional ``bias``)."""

    def __init__(self, rows: int, cols: int, *, bias: bool, dtype, device) -> None:
        super().__init__()
        self.weight = _replicated(rows, cols, dtype=dtype, device=device)
        self.bias = _replicated(rows, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
        bias = None if self.bias is None else replicated(self.bias, group, sequence_parallel)
        return F.linear(x, replicated(self.weight, group, sequence_parallel), bias)


class _LatentNorm(nn.Module):
    """RMSNorm of a latent, replicated over TP."""

    def __init__(self, width: int, eps: float, *, dtype, device) -> None:
        super().__init__()
        self.eps, self.weight = eps, _replicated(width, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, group, sequence_parallel: bool) -> torch.Tensor:
        return F.rms_norm(x, x.shape[-1:], replicated(self.weight, group, sequence_parallel), self.eps)


class LatentAttention(Attention):
    """MLA with ``Attention``'s core; see the module docstring."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        group,
        sequence_parallel: bool,
        site: str,
        dtype,
        device,
        selective: bool = False,
        cp_group=None,
        index: int = 0,
    ) -> None:
        nn.Module.__init__(self)  # Attention's state, not its q/k/v projections
        self._setup(
            config,
            group=group,
            sequence_parallel=sequence_parallel,
            site=site,
            selective=selective,
            cp_group=cp_group,
            index=index,
        )
        m, h, n = config.mla, config.hidden, config.heads
        self.mla = m
        kw = dict(dtype=dtype, device=device)
        col = dict(group=group, sequence_parallel=sequence_parallel, bias=False, **kw)
        if m.q_lora_rank:
            self.q_a_proj = _Down(m.q_lora_rank, h, bias=config.qkv_bias, **kw)
            self.q_a_layernorm = _LatentNorm(m.q_lora_rank, config.norm_eps, **kw)
            self.q_b_proj = ColumnParallelLinear(m.q_lora_rank, n * m.qk_head_dim, **col)
        else:
            self.q_proj = ColumnParallelLinear(h, n * m.qk_head_dim, **col)
        self.kv_a_proj_with_mqa = _Down(m.kv_lora_rank + m.qk_rope_head_dim, h, bias=config.qkv_bias, **kw)
        self.kv_a_layernorm = _LatentNorm(m.kv_lora_rank, config.norm_eps, **kw)
        self.kv_b_proj = ColumnParallelLinear(m.kv_lora_rank, n * (m.qk_nope_head_dim + m.v_head_dim), **col)
        self.o_proj = RowParallelLinear(
            n * m.v_head_dim, h, bias=config.out_bias, group=group, sequence_parallel=sequence_parallel, **kw
        )

    def forward(
        self, x: torch.Tensor, rope: tuple | None, keys: DropoutKeys | None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``(S', B, H)`` in and out (``S' = S/tp`` with SP)."""
        m, g, sp = self.mla, self.group, self.sequence_parallel
        if m.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x, g, sp), g, sp))  # (S, B, n/tp * d_qk)
        else:
            q = self.q_proj(x)
        latent, k_rope = self.kv_a_proj_with_mqa(x, g, sp).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent, g, sp))  # (S, B, n/tp * (d_nope + d_v))
        k_rope = enter_tp_region(k_rope.contiguous(), g, sp)  # (S, B, d_rope): each rank's heads read it all
        s, b, _ = q.shape
        q = q.view(s, b, self.heads, m.qk_head_dim).permute(1, 2, 0, 3)  # (B, n, S, d_qk)
        kv = kv.view(s, b, self.heads, m.qk_nope_head_dim + m.v_head_dim).permute(1, 2, 0, 3)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        q_nope, q_rope = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        k_rope = k_rope.permute(1, 0, 2)[:, None]  # (B, 1, S, d_rope)
        if m.rope_interleave:  # pairs (x0, x1), (x2, x3)... as evens then odds, then rotate-half (transformers')
            q_rope, k_rope = (t.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2) for t in (q_rope, k_rope))
        cos, sin = rope_at(rope, s)
        q_rope, k_rope = apply_rope(q_rope, cos, sin), apply_rope(k_rope, cos, sin)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(-1, self.heads, -1, -1)], dim=-1)
        v = v.contiguous()  # its own storage: a view would keep kv_b_proj's whole output (k_nope too) for backward
        if self.selective and self.training and self.cp == 1:
            y = torch.utils.checkpoint.checkpoint(self._dispatch, q, k, v, keys, documents, use_reentrant=False)
        else:
            y = self._dispatch(q, k, v, keys, documents)  # (B, n, S, d_v)
        return self.o_proj(y.permute(2, 0, 1, 3).reshape(s, b, self.heads * m.v_head_dim))
