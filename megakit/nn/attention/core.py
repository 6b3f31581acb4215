"""Causal self-attention with heads split over TP, and over CP as ring attention; rotary positions.

RoPE's variants (llama3, linear, yarn, dynamic) are ``megakit.core.rope``'s frequencies, and a block may have none
(``ModelConfig.block_uses_rope``: q and k go to the core unrotated, on every path alike); a sliding
window (Mistral, Qwen2) masks keys more than ``window - 1`` positions back, and packed documents
(``megakit.nn.attention.masks``) mask keys of other documents, in every path.

q/k/v are column-parallel and the output row-parallel (Megatron). Without context parallelism
the core is PyTorch's fused ``scaled_dot_product_attention`` (or, with dropout in training,
the same written out so the mask is megakit's layout-free one; with gpt-oss's sinks, ``blocks.block_attention``);
with it, the rank holds ``S/cp`` rows of the sequence and the core is ``ring.ring_attention``, or with
``cp_mode`` "a2a" the whole sequence of ``heads/cp`` heads after an all-to-all (``ulysses``), or with
"hybrid" an all-to-all inside groups of CP ranks and a ring across them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megakit.core.model_config import ModelConfig
from megakit.core.rope import inv_freq
from megakit.nn import comm as C
from megakit.nn.attention.blocks import attention_keep, block_attention
from megakit.nn.attention.masks import allowed_keys, flex_document_attention
from megakit.nn.attention.ring import ring_attention
from megakit.nn.attention.ulysses import ulysses_attention
from megakit.nn.dropout import DropoutKeys, attention_dropout
from megakit.nn.sequence import positions
from megakit.nn.tensor_parallel.collectives import copy_to_tp
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark
from megakit.nn.tensor_parallel.overlapped_linear import column_parallel


@torch.no_grad()
def _max_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Each head's largest attention logit ``(n,)`` over the batch and the allowed (causal) keys: ``q``
    ``(B, n, S, d)``, ``k`` ``(B, n_kv, S, d)``; a second ``q k^T``, which only QK-clip asks for."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)).float() * scale  # (B, n, S, S)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3))


def rope_tables(config: ModelConfig, device, index: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, ``(max_seq_len, head_dim)`` in fp32, in Hugging Face Llama's half-split layout, times
    the variant's attention factor (yarn's mscale) as transformers multiplies them; ``index``: block ``index``'s
    RoPE (``ModelConfig.block_rope``; default: the model's)."""
    theta, scaling = (config.rope_theta, config.rope_scaling) if index is None else config.block_rope(index)
    dim = config.mla.qk_rope_head_dim if config.mla else int(config.head_dim * config.rotary_fraction)  # MLA: its
    # RoPE part only; Qwen3-Next: the first quarter of each head
    freqs, factor = inv_freq(theta, dim, scaling, config.max_seq_len)
    freqs = torch.tensor(freqs, dtype=torch.float64, device=device)
    angles = torch.outer(torch.arange(config.max_seq_len, dtype=torch.float64, device=device), freqs)
    angles = torch.cat([angles, angles], dim=-1)
    return (angles.cos() * factor).float(), (angles.sin() * factor).float()


CP_MODES = ("ring", "a2a", "hybrid")  # --cp-mode: K/V blocks around a ring, Ulysses' all-to-all of heads, or both


def use_cp_mode(model: nn.Module, mode: str, topo=None) -> None:
    """Run every attention layer of ``model`` with context parallelism ``mode`` (``CP_MODES``); "hybrid" takes its
    all-to-all and ring groups from ``topo`` (a ``Topology`` whose layout has ``cp_a2a``)."""
    assert mode in CP_MODES, mode
    groups = (topo.cp_a2a_group, topo.cp_ring_group) if mode == "hybrid" else (None, None)
    assert mode != "hybrid" or None not in groups, "hybrid CP needs a Topology with 1 < cp_a2a < cp"
    for module in model.modules():
        if isinstance(module, Attention):
            module.cp_mode, (module.a2a_group, module.ring_group) = mode, groups


def rope_at(rope: tuple, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin shaped for ``apply_rope`` on ``(B, n, S, d)``: each row's own ``(B, S, d)`` tables, or the first
    ``s`` rows of one ``(S, d)`` table."""
    cos, sin = rope
    return (cos[:, None], sin[:, None]) if cos.dim() == 3 else (cos[:s], sin[:s])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``(B, n, S, d)`` by position; ``cos``/``sin`` are ``(S, r)``: the first ``r`` channels rotate, the
    rest pass (partial rotary)."""
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: bool) -> torch.Tensor:
    """RMSNorm over the last dimension: times ``weight`` (Llama), or with ``offset`` times ``1 + weight``, computed
    in fp32 and cast back after the product (Gemma's, transformers' ``Gemma3RMSNorm``)."""
    if not offset:
        return F.rms_norm(x, x.shape[-1:], weight, eps)
    return (F.rms_norm(x.float(), x.shape[-1:], None, eps) * (1.0 + weight.float())).type_as(x)


class HeadNorm(nn.Module):
    """RMSNorm of every head's ``d`` channels (``(S, B, n * d)`` in and out); the weight is shared by the
    heads of every TP rank, so its gradient is partial per rank: summed over TP in backward."""

    def __init__(self, head_dim: int, eps: float, dtype, device, offset: bool = False) -> None:
        super().__init__()
        self.eps, self.offset = eps, offset
        self.weight = mark(nn.Parameter(torch.empty(head_dim, dtype=dtype, device=device)), None)

    def forward(self, x: torch.Tensor, group) -> torch.Tensor:
        """Normalizes each head on its own (QK-norm), with the weight copied into the TP region for its gradient."""
        d = self.weight.shape[0]
        y = rms_norm(x.view(*x.shape[:-1], -1, d), copy_to_tp(self.weight, group), self.eps, self.offset)
        return y.view(x.shape)


class Attention(nn.Module):
    """Causal self-attention, heads split over TP: q/k/v column-parallel, output row-parallel.

    With dropout in training the attention is written out (scores, softmax, dropout, values)
    so that the probabilities' mask is megakit's layout-free one; otherwise it is PyTorch's
    fused ``scaled_dot_product_attention``. ``selective``: in training, keep only q, k and v of the attention
    core (rotary, scores, softmax, dropout, values) and recompute it in backward (Korthikanti et al. 2022,
    Sec. 4.2); its dropout mask is keyed, so the recompute redraws it. ``cp_group``: context
    parallelism, the core is ring attention, which keeps q, k, v, its output and the
    log-sum-exp and recomputes the scores in backward by itself (so ``selective`` changes nothing).
    """

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
        super().__init__()
        self._setup(
            config,
            group=group,
            sequence_parallel=sequence_parallel,
            site=site,
            selective=selective,
            cp_group=cp_group,
            index=index,
        )
        q, kv = config.heads * config.head_dim, config.kv_heads * config.head_dim
        col = dict(group=group, sequence_parallel=sequence_parallel, enter_region=False, dtype=dtype, device=device)
        self.output_gate = config.attn_output_gate  # Qwen3-Next: q_proj gives each head's q, then its gate
        self.q_proj = ColumnParallelLinear(config.hidden, q * (1 + self.output_gate), bias=config.qkv_bias, **col)
        self.k_proj = ColumnParallelLinear(config.hidden, kv, bias=config.qkv_bias, **col)
        self.v_proj = ColumnParallelLinear(config.hidden, kv, bias=config.qkv_bias, **col)
        self.o_proj = RowParallelLinear(
            q,
            config.hidden,
            bias=config.out_bias,
            group=group,
            sequence_parallel=sequence_parallel,
            dtype=dtype,
            device=device,
        )
        if config.attention_sinks:  # gpt-oss: one logit per head, split over TP with the heads
            self.sinks = mark(nn.Parameter(torch.empty(self.heads, dtype=dtype, device=device)), 0)
        if config.qk_norm:  # Qwen3: RMSNorm over each head's q and k before RoPE, one weight for all heads
            self.q_norm, self.k_norm = (
                HeadNorm(config.head_dim, config.norm_eps, dtype, device, config.norm_offset) for _ in "qk"
            )

    def _setup(
        self, config: ModelConfig, *, group, sequence_parallel: bool, site: str, selective: bool, cp_group, index: int
    ) -> None:
        """The state every attention variant keeps: its groups and heads, the CP mode, kernels, scale and window."""
        tp = C.size(group)
        self.cp_group, self.cp, self.cp_rank = cp_group, C.size(cp_group), C.rank(cp_group)
        self.group, self.sequence_parallel, self.site, self.selective = group, sequence_parallel, site, selective
        self.heads, self.kv_heads, self.head_dim = config.heads // tp, config.kv_heads // tp, config.head_dim
        self.total_heads, self.head_start = config.heads, C.rank(group) * self.heads
        self.dropout, self.rope = config.dropout, config.block_uses_rope(index)  # SmolLM3's NoPE blocks: no rotation
        self.expand_kv = False  # set by megakit.nn.attention.kernels.use_kernel for kernels that need it
        self.flex_documents = False  # packed documents through FlexAttention (use_kernel sets it on a GPU)
        self.cp_mode = "ring"  # with CP: ring attention, "a2a" (Ulysses: attention.ulysses) or "hybrid"; use_cp_mode
        self.a2a_group = self.ring_group = None  # hybrid's groups (use_cp_mode sets them)
        self.scale, self.window = config.attention_scale(index), config.attention_window(index)  # block ``index``'s
        self.sdpa_scale = None if self.scale == self.head_dim**-0.5 else self.scale  # None: SDPA's own 1/sqrt(d)
        self.max_logits = None  # (heads/tp,) with QK-clip: the largest logit of each head since the last step

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim).permute(1, 2, 0, 3)  # (S, B, n*d) -> (B, n, S, d)

    def forward(
        self, x: torch.Tensor, rope: tuple | None, keys: DropoutKeys | None, documents: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Self-attention on the TP rank's heads; the sequence arrives and leaves split when sequence parallel."""
        projections = (self.q_proj, self.k_proj, self.v_proj)  # (S', B, H) -> (S, B, nh/tp * d), (S, B, nkv/tp * d) x 2
        q, k, v = column_parallel(x, projections, self.group, self.sequence_parallel)
        gate = None
        if self.output_gate:  # (S, B, n (q, gate) d) -> q and gate, (S, B, n d) each
            q, gate = q.view(*q.shape[:2], self.heads, 2, self.head_dim).unbind(3)
            q, gate = q.reshape(*q.shape[:2], -1), gate.reshape(*gate.shape[:2], -1)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q, self.group), self.k_norm(k, self.group)
        if self.selective and self.training and self.cp == 1:  # no collective inside the core: none is recomputed
            y, logits = torch.utils.checkpoint.checkpoint(
                self._core, q, k, v, rope, keys, documents, use_reentrant=False
            )
        else:
            y, logits = self._core(q, k, v, rope, keys, documents)
        if logits is not None:  # QK-clip (megakit.train.engine.muon): each head's largest logit since the last step,
            # kept here, outside the checkpointed core, whose recompute would replay it and which torch.compile
            # cannot trace a module's mutation inside (a graph break)
            self.max_logits = torch.maximum(self.max_logits, logits)
        if gate is not None:
            y = y * torch.sigmoid(gate)
        return self.o_proj(y)  # (S', B, H)

    def _core(
        self, q, k, v, rope: tuple | None, keys: DropoutKeys | None, documents: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The attention core: projections in, ``(S, B, nh/tp * d)`` out (what ``o_proj`` takes), and with QK-clip
        each head's largest logit ``(nh/tp,)`` (else None). ``documents`` ``(B, S)`` (the whole sequence's, also
        under CP): attention stays inside each document."""
        s, b, _ = q.shape
        q, k, v = self._heads(q, self.heads), self._heads(k, self.kv_heads), self._heads(v, self.kv_heads)
        if self.rope:
            cos, sin = rope_at(rope, s)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        logits = None
        if self.max_logits is not None and self.training and self.cp == 1:  # QK-clip's (no CP: check_qk_clip)
            logits = _max_logits(q, k, allowed_keys(s, self.window, documents, q.device), self.scale)
        y = self._dispatch(q, k, v, keys, documents)
        return y.permute(2, 0, 1, 3).reshape(s, b, -1), logits  # (S, B, nh/tp * d)

    def _dispatch(self, q, k, v, keys: DropoutKeys | None, documents: torch.Tensor | None) -> torch.Tensor:
        """Attention of this rank's heads ``(B, n, S', d)`` (rotated) by the CP mode: Ulysses, hybrid, the ring,
        or over the whole sequence without CP; ``(B, n, S', d_v)`` out."""
        if self.cp > 1 and self.cp_mode == "a2a":
            heads = self.heads // self.cp  # this rank's head group of the whole sequence
            start = self.head_start + self.cp_rank * heads
            return ulysses_attention(
                q, k, v, self.cp_group, lambda q, k, v: self._attend(q, k, v, keys, documents, head_start=start)
            )
        if self.cp > 1 and self.cp_mode == "hybrid":  # a2a inside the run of CP ranks, a ring across the runs
            a, place = C.size(self.a2a_group), C.rank(self.a2a_group)
            start = self.head_start + place * self.heads // a

            def ring(q, k, v):
                return self._ring(q, k, v, keys, documents, group=self.ring_group, head_start=start)

            return ulysses_attention(q, k, v, self.a2a_group, ring, cp=self.cp, first=self.cp_rank - place)
        if self.cp > 1:
            return self._ring(q, k, v, keys, documents, group=self.cp_group, head_start=self.head_start)
        return self._attend(q, k, v, keys, documents, head_start=self.head_start)

    def _attend(
        self, q, k, v, keys: DropoutKeys | None, documents: torch.Tensor | None, *, head_start: int
    ) -> torch.Tensor:
        """Attention over the whole sequence of ``q``'s heads ``(B, n, S, d)`` (global heads from ``head_start``).
        With sinks, ``block_attention`` on the rank's own block: SDPA's kernels return no log-sum-exp."""
        if hasattr(self, "sinks"):
            return self._ring(q, k, v, keys, documents, group=None, head_start=head_start)
        if self.training and self.dropout > 0:
            return self._attend_with_dropout(q, k, v, keys, documents, head_start=head_start)
        if documents is not None and self.flex_documents:
            return flex_document_attention(q, k, v, documents, window=self.window, scale=self.scale)
        mask = allowed_keys(q.shape[2], self.window, documents, q.device)
        gqa = q.shape[1] != k.shape[1]
        if gqa and self.expand_kv:  # kernels without GQA broadcast (cuDNN, efficient): one K/V per query head
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.sdpa_scale,
            enable_gqa=gqa and not self.expand_kv,
        )  # (B, n, S, d)

    def _attend_with_dropout(
        self, q, k, v, keys: DropoutKeys, documents: torch.Tensor | None = None, *, head_start: int
    ) -> torch.Tensor:
        """``softmax(q k^T * scale + causal) -> dropout -> @ v``, as SDPA's math path, with megakit's masks."""
        if k.shape[1] != q.shape[1]:  # GQA: each KV head serves a run of query heads (SDPA's enable_gqa)
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        s = q.shape[2]
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale  # (B, nh/tp, S, S)
        allowed = allowed_keys(s, self.window, documents, q.device)
        if allowed is None:
            causal = torch.full((s, s), float("-inf"), dtype=scores.dtype, device=q.device).triu_(1)
        else:
            causal = torch.zeros(allowed.shape, dtype=scores.dtype, device=q.device).masked_fill_(
                ~allowed, float("-inf")
            )
        probs = (scores + causal).softmax(dim=-1)  # an added constant: nothing more saved for backward
        probs = attention_dropout(
            probs, self.dropout, keys, site=self.site, head_start=head_start, heads=self.total_heads
        )
        return torch.matmul(probs, v)  # (B, nh/tp, S, d)

    def _ring(
        self, q, k, v, keys: DropoutKeys | None, documents: torch.Tensor | None, *, group, head_start: int
    ) -> torch.Tensor:
        """Ring attention over ``group`` of ``q``'s heads (global heads from ``head_start``); ``group`` None: the whole
        sequence on this rank, over the same blocks (``block_attention``). The dropout mask is this rank's rows of the
        whole draw."""
        keep, ring, r = None, C.size(group), C.rank(group)
        seq_len = q.shape[2] * ring
        if self.training and self.dropout > 0:
            keep = attention_keep(
                self.dropout,
                keys,
                site=self.site,
                head_start=head_start,
                heads_local=q.shape[1],
                heads=self.total_heads,
                seq_len=seq_len,
                device=q.device,
                rows=positions(seq_len, ring, r, device=q.device),
            )
        sinks = self.sinks[head_start - self.head_start :][: q.shape[1]] if hasattr(self, "sinks") else None
        options = dict(keep=keep, p=self.dropout, scale=self.scale, window=self.window, documents=documents)
        if group is None:
            return block_attention(q, k, v, sinks=sinks, **options)  # (B, n, S, d)
        return ring_attention(q, k, v, group, sinks=sinks, **options)  # (B, n, S/ring, d)
