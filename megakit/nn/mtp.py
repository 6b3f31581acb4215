"""Multi-Token Prediction (DeepSeek-V3 §2.2): D modules after the last block, module k predicting token i + k + 1.

Module k (1-based) at position i reads the previous depth's normed hidden state ``g^{k-1}_i`` (``g^0``: the
main model's output after its final norm) and the embedding of token ``t_{i+k}``::

    g^k_i = norm_k( Block_k( eh_proj([enorm(Emb(t_{i+k})); hnorm(g^{k-1}_i)]) ) )      logits^k_i = head(g^k_i)

with the main model's embedding and head (shared: under PP the last stage holds a copy of the embedding whose
gradient is summed with the first stage's, as for tied embeddings). The chain of normed states and the
embedding-first concatenation are Megatron-Core's ``MultiTokenPredictionLayer`` and transformers'
``MtpLayer``. The loss is ``L_main + lambda / D x sum_k L_k``, each ``L_k`` the mean cross-entropy over its own
valid targets, weighted by tokens across micro-batches and ranks like the main loss.

The shifted ids and labels are cut from the whole sequence before any CP split (NeMo Automodel #3543 found that
rank-local rolling reads wrong tokens at the shard boundaries): every CP rank holds the whole ``(B, S)`` ids and
labels, so depth k's are ``ids[:, k:]`` and ``labels[:, k:]``, padded at the tail. A target across a packed
document's end is masked (``-100``): position i of one document may not learn the next document's tokens. The
blocks keep the positions of the main model (torchtitan's choice; under RoPE a uniform shift changes nothing).
"""

from __future__ import annotations

import torch
from torch import nn

from megakit.nn.block import Block, Norm
from megakit.nn.tensor_parallel.collectives import scatter_to_tp
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear

IGNORE = -100


def shifted(t: torch.Tensor, depth: int, fill: int) -> torch.Tensor:
    """``t`` ``(B, S)`` moved ``depth`` places left, its last ``depth`` columns ``fill``."""
    out = torch.full_like(t, fill)
    if depth < t.shape[1]:
        out[:, : t.shape[1] - depth] = t[:, depth:]
    return out


def depth_labels(labels: torch.Tensor, depth: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Depth ``depth``'s targets ``(B, S)``: ``labels[i + depth]`` (token ``i + depth + 1``), ``-100`` past the
    window's end and, with packed ``documents``, where ``i + depth`` lies in another document than ``i``; depth 0:
    ``labels`` themselves (the main loss's)."""
    if depth == 0:
        return labels
    out = shifted(labels, depth, IGNORE)
    if documents is not None:
        out = out.masked_fill(shifted(documents, depth, -1) != documents, IGNORE)
    return out


def depth_token_counts(labels: torch.Tensor, depths: int, documents: torch.Tensor | None = None) -> torch.Tensor:
    """``(1 + depths,)``: the valid targets of the main loss and of each MTP depth in ``labels`` ``(B, S)``."""
    return torch.stack([(depth_labels(labels, k, documents) != IGNORE).sum() for k in range(depths + 1)])


class PredictionModule(nn.Module):
    """Depth ``depth``'s module (1-based): the two input norms, ``eh_proj`` (2H -> H, column-parallel and gathered
    as Megatron's, then scattered again under SP), its decoder block (block ``layers + depth - 1`` of the
    checkpoint, DeepSeek's numbering) and the norm before the shared head."""

    def __init__(self, config, *, depth: int, group, sequence_parallel: bool, dtype, device, **block) -> None:
        super().__init__()
        kw = dict(group=group, sequence_parallel=sequence_parallel, dtype=dtype, device=device)
        self.group, self.sequence_parallel = group, sequence_parallel
        self.enorm, self.hnorm = Norm(config, **kw), Norm(config, **kw)
        self.eh_proj = ColumnParallelLinear(2 * config.hidden, config.hidden, bias=False, gather_output=True, **kw)
        self.block = Block(config, index=config.layers + depth - 1, **kw, **block)
        self.norm = Norm(config, **kw)

    def forward(self, previous: torch.Tensor, embedded: torch.Tensor, rope, keys, documents) -> torch.Tensor:
        """``previous``: ``g^{k-1}`` ``(S', B, H)``; ``embedded``: ``Emb(t_{i+k})`` at the same rows.
        Returns ``g^k``."""
        x = torch.cat([self.enorm(embedded), self.hnorm(previous)], dim=-1)  # (S', B, 2H): the embedding first
        x = self.eh_proj(x)  # (S, B, H), whole on every TP rank
        if self.sequence_parallel:
            x = scatter_to_tp(x, self.group, 0)  # (S/tp, B, H)
        return self.norm(self.block(x, rope, keys, documents))
