"""The decoder block and its parts: the norm, the MLP, residual dropout, all holding this rank's TP shard.

``Block(config, index=i)`` is block ``i`` of the model wherever it sits: in a pipeline stage
(``megakit.nn.model``) or inside a Multi-Token Prediction module (``megakit.nn.mtp``). Activations are
sequence-first, ``(S', B, H)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakit.core.model_config import ModelConfig
from megakit.nn import comm as C
from megakit.nn.attention.core import Attention, rms_norm
from megakit.nn.attention.latent import LatentAttention
from megakit.nn.dropout import DropoutKeys, residual_dropout
from megakit.nn.linear_attention.gated_deltanet import GatedDeltaNet
from megakit.nn.linear_attention.mamba2 import Mamba2
from megakit.nn.moe.layer import MoE
from megakit.nn.sequence import positions
from megakit.nn.tensor_parallel.collectives import replicated
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark
from megakit.nn.tensor_parallel.overlapped_linear import column_parallel

__all__ = ["Block", "MLP", "Norm", "ResidualDropout"]


class Norm(nn.Module):
    """LayerNorm (gpt2: weight and bias) or RMSNorm (llama: weight; Gemma's times 1 + weight), replicated over TP."""

    def __init__(self, config: ModelConfig, *, group, sequence_parallel: bool, dtype, device) -> None:
        super().__init__()
        self.group, self.sequence_parallel, self.eps = group, sequence_parallel, config.norm_eps
        self.rms, self.offset = config.family == "llama", config.norm_offset
        h = config.hidden
        self.weight = mark(nn.Parameter(torch.empty(h, dtype=dtype, device=device)), None)
        self.bias = None if self.rms else mark(nn.Parameter(torch.empty(h, dtype=dtype, device=device)), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalizes the hidden state; the weight is replicated over TP, its gradient summed when sequence parallel."""
        w = replicated(self.weight, self.group, self.sequence_parallel)
        if self.rms:
            return rms_norm(x, w, self.eps, self.offset)
        b = replicated(self.bias, self.group, self.sequence_parallel)
        return F.layer_norm(x, x.shape[-1:], w, b, self.eps)


class MLP(nn.Module):
    """GELU MLP (gpt2) or SwiGLU (llama; GeGLU with Gemma's tanh GELU): up/gate column-parallel, down row-parallel."""

    def __init__(self, config: ModelConfig, *, group, sequence_parallel: bool, dtype, device) -> None:
        super().__init__()
        self.group, self.sequence_parallel = group, sequence_parallel
        self.gated, self.geglu = config.gated_mlp, config.mlp_act == "gelu_tanh"
        self.relu2 = config.mlp_act == "relu2"  # Nemotron-H: relu(x)^2, not gated
        col = dict(
            group=group,
            sequence_parallel=sequence_parallel,
            enter_region=False,
            bias=config.mlp_bias,
            dtype=dtype,
            device=device,
        )
        if self.gated:
            self.gate_proj = ColumnParallelLinear(config.hidden, config.ffn, **col)
        self.up_proj = ColumnParallelLinear(config.hidden, config.ffn, **col)
        self.down_proj = RowParallelLinear(
            config.ffn,
            config.hidden,
            bias=config.mlp_bias,
            group=group,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
            device=device,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP on this TP rank's share of the ffn width, reduced over TP by the down projection."""
        if self.gated:
            gate, up = column_parallel(x, (self.gate_proj, self.up_proj), self.group, self.sequence_parallel)
            h = (F.gelu(gate, approximate="tanh") if self.geglu else F.silu(gate)) * up  # (S, B, ffn/tp)
        else:
            (up,) = column_parallel(x, (self.up_proj,), self.group, self.sequence_parallel)
            h = F.relu(up).square() if self.relu2 else F.gelu(up, approximate="tanh")  # (S, B, ffn/tp)
        return self.down_proj(h)  # (S', B, H)


class Block(nn.Module):
    """Pre-norm residual block: ``x + drop(attn(norm(x)))``, then ``x + drop(mlp(norm(x)))``; with Gemma's sandwich
    norms each branch's output is normed too: ``x + drop(post_norm(attn(norm(x))))``."""

    def __init__(
        self,
        config: ModelConfig,
        *,
        index: int,
        group,
        sequence_parallel: bool,
        dtype,
        device,
        selective: bool = False,
        cp_group=None,
        ep_group=None,
    ) -> None:
        super().__init__()
        kw = dict(group=group, sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        site = f"layers.{index}"
        drop = dict(group=group, sequence_parallel=sequence_parallel, cp_group=cp_group)
        self.local_rope = False
        part = config.block_part(index)  # a hybrid model's one part; None: attention, then the MLP
        if part is not None:
            self._one_part(
                config, part, site=site, selective=selective, cp_group=cp_group, ep_group=ep_group, index=index, **kw
            )
            self.dropout = ResidualDropout(config.dropout, f"{site}.residual", **drop)
            return
        self.attn_norm = Norm(config, **kw)
        self.linear = bool(config.linear and config.linear.is_linear(index))  # Gated DeltaNet in place of attention
        if self.linear:
            self.attn = GatedDeltaNet(
                config.linear, config.hidden, eps=config.norm_eps, cp_group=cp_group, selective=selective, **kw
            )
        else:
            attention = LatentAttention if config.mla else Attention  # DeepSeek-V3's MLA, or q/k/v heads
            self.attn = attention(
                config, site=f"{site}.attn_probs", selective=selective, cp_group=cp_group, index=index, **kw
            )
        self.mlp_norm = Norm(config, **kw)
        if config.sandwich_norms:
            self.attn_post_norm, self.mlp_post_norm = Norm(config, **kw), Norm(config, **kw)
        self.local_rope = bool(config.sliding_rope_theta and config.attention_window(index))  # Gemma's sliding RoPE
        if config.moe is not None and config.moe.is_moe_layer(index):
            self.mlp = MoE(config.moe, config.hidden, cp_group=cp_group, ep_group=ep_group, **kw)
        else:
            self.mlp = MLP(config, **kw)
        self.attn_dropout = ResidualDropout(config.dropout, f"{site}.attn_residual", **drop)
        self.mlp_dropout = ResidualDropout(config.dropout, f"{site}.mlp_residual", **drop)

    def _one_part(
        self, config: ModelConfig, part: str, *, site: str, selective: bool, cp_group, ep_group, index: int, **kw
    ):
        """A hybrid model's block (Nemotron-H): ``x + drop(part(norm(x)))`` with one part, a Mamba-2 mixer,
        attention, an MLP or the experts (Nemotron-3's 'E')."""
        self.norm = Norm(config, **kw)
        if part == "mamba":
            self.mixer = Mamba2(
                config.mamba, config.hidden, eps=config.norm_eps, cp_group=cp_group, selective=selective, **kw
            )
        elif part == "attention":
            self.mixer = Attention(
                config, site=f"{site}.attn_probs", selective=selective, cp_group=cp_group, index=index, **kw
            )
        elif part == "moe":
            self.mixer = MoE(config.moe, config.hidden, cp_group=cp_group, ep_group=ep_group, **kw)
        else:
            self.mixer = MLP(config, **kw)

    def forward(
        self, x: torch.Tensor, rope: tuple | None, keys: DropoutKeys | None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:  # (S', B, H)
        """One pre-norm block: attention (or Gated DeltaNet) then the MLP, each added back to the residual stream;
        a Nemotron-H block has one part (Mamba-2, attention, the MLP or the experts)."""
        if hasattr(self, "mixer"):  # a hybrid model's block
            h = self.norm(x)
            if isinstance(self.mixer, Mamba2):
                h = self.mixer(h, documents)
            elif isinstance(self.mixer, Attention):
                h = self.mixer(h, rope, keys, documents)
            else:
                h = self.mixer(h)
            return x + self.dropout(h, keys)
        h = self.attn_norm(x)
        a = self.attn(h, documents) if self.linear else self.attn(h, rope, keys, documents)
        x = x + self.attn_dropout(self.attn_post_norm(a) if hasattr(self, "attn_post_norm") else a, keys)
        m = self.mlp(self.mlp_norm(x))
        return x + self.mlp_dropout(self.mlp_post_norm(m) if hasattr(self, "mlp_post_norm") else m, keys)


class ResidualDropout(nn.Module):
    """Dropout on the residual stream ``(S', B, H)`` at the site called ``site``, with layout-free masks
    (``megakit.nn.dropout``): replicated over TP, or this rank's ``S/tp`` rows with SP; with CP, the
    rows at this rank's global positions (``megakit.nn.attention.ring.positions``)."""

    def __init__(self, p: float, site: str, group, sequence_parallel: bool, cp_group=None) -> None:
        super().__init__()
        self.p, self.site = p, site
        self.tp, self.tp_rank = (C.size(group), C.rank(group)) if sequence_parallel else (1, 0)
        self.cp, self.cp_rank = C.size(cp_group), C.rank(cp_group)

    def forward(self, x: torch.Tensor, keys: DropoutKeys | None) -> torch.Tensor:
        """Dropout on the residual, its mask set by each token's global position, so any TP/CP split agrees."""
        if not self.training or self.p == 0.0:
            return x
        s = x.shape[0]
        if self.cp == 1:
            return residual_dropout(x, self.p, keys, site=self.site, seq_start=self.tp_rank * s, seq_len=self.tp * s)
        held = positions(s * self.tp * self.cp, self.cp, self.cp_rank, device=x.device)
        return residual_dropout(
            x,
            self.p,
            keys,
            site=self.site,
            rows=held[self.tp_rank * s : (self.tp_rank + 1) * s],
            seq_len=s * self.tp * self.cp,
        )
