"""Dropout whose masks do not depend on the layout: the same units drop at any TP x PP x DP, with or without SP.

megakit's weights are a function of ``(seed, parameter name, index)`` only (``init.py``), so
a run at any layout starts as the single process does. Dropout keeps that promise: a mask
is a function of ``(seed, site, sample)`` only, where the *site* is the dropout's global
name (``layers.3.mlp_residual``) and the *sample* is the row's number in the run's data
stream (step x global batch + its place in the step's batch). Each such key seeds its own
generator, which draws the mask of the *whole* per-sample tensor (``S x H`` of the residual stream,
``heads x S x S`` of the attention probabilities), and the rank keeps the part it holds:

- TP without SP: the residual stream is replicated, so every TP rank draws the same mask
  (bit-identical replicas); attention heads are split, so each rank keeps its own heads;
- SP: each TP rank keeps its ``S/tp`` rows of the sequence;
- CP: each CP rank keeps the rows at its global positions (two chunks), and of the attention
  probabilities its query rows against every key;
- PP and DP: a rank sees only its micro-batch's samples, under their global numbers.

No generator is shared, nothing depends on the order work runs in (recompute draws the
same mask again), and nothing touches torch's default generator. Cost: one uniform draw
per element, as ``F.dropout``, where a rank holds the whole tensor; with SP each rank draws
the whole sequence's residual mask and keeps ``1/tp`` of it, under TP all heads' attention
masks and keeps its own. The mask is kept for backward as one byte per element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megakit.nn.weights import index_seed


@dataclass(frozen=True)
class DropoutKeys:
    """What decides one forward pass's masks: the run's seed and each batch row's sample number."""

    seed: int
    samples: tuple[int, ...]

    @classmethod
    def of(cls, seed: int, samples: Sequence[int] | torch.Tensor) -> "DropoutKeys":
        """The keys of a micro-batch's samples (global sample numbers), from a list or a tensor."""
        values = samples.tolist() if isinstance(samples, torch.Tensor) else samples
        return cls(seed, tuple(int(n) for n in values))


@torch.compiler.disable  # per-sample generators cannot live in a graph: under --compile the draw stays eager
def keep_mask(
    p: float,
    keys: DropoutKeys,
    *,
    site: str,
    streams: Sequence[int],
    full_shape: tuple[int, ...],
    rows: slice | torch.Tensor = slice(None),
    device=None,
) -> torch.Tensor:
    """``(len(streams), *local)`` bool, True where a unit is kept (probability ``1 - p``).

    Stream ``i`` draws the whole ``full_shape`` from the generator of ``(keys.seed, site,
    streams[i])`` and keeps ``[rows]`` of its first dimension.
    """
    device = torch.device("cpu") if device is None else torch.device(device)
    generator = torch.Generator(device=device)
    draw = torch.empty(full_shape, device=device)
    out = torch.empty((len(streams), *draw[rows].shape), dtype=torch.bool, device=device)
    for i, stream in enumerate(streams):
        generator.manual_seed(index_seed(keys.seed, f"dropout/{site}", stream))
        draw.uniform_(generator=generator)
        torch.ge(draw[rows], p, out=out[i])
    return out


def apply_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """``x`` with dropped units zeroed and the rest scaled by ``1 / (1 - p)`` (as ``F.dropout``)."""
    return x.masked_fill(~keep, 0.0) * (1.0 / (1.0 - p))


def residual_dropout(
    x: torch.Tensor,
    p: float,
    keys: DropoutKeys,
    *,
    site: str,
    seq_start: int = 0,
    seq_len: int | None = None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dropout on the residual stream ``x`` ``(S', B, H)``: rows ``seq_start .. seq_start + S'`` of a
    sequence of ``seq_len`` (default ``S'``), or the ``S'`` positions ``rows`` (context parallelism
    holds two chunks apart); batch row ``b`` is sample ``keys.samples[b]``."""
    s, b, h = x.shape
    if len(keys.samples) != b:
        raise ValueError(f"{len(keys.samples)} sample numbers for a batch of {b}")
    rows = slice(seq_start, seq_start + s) if rows is None else rows
    keep = keep_mask(
        p, keys, site=site, streams=keys.samples, full_shape=(seq_len or s, h), rows=rows, device=x.device
    )  # (B, S', H)
    return apply_mask(x, keep.transpose(0, 1), p)


def attention_dropout(
    probs: torch.Tensor, p: float, keys: DropoutKeys, *, site: str, head_start: int, heads: int
) -> torch.Tensor:
    """Dropout on attention probabilities ``(B, n, S, S)`` of global heads ``head_start .. head_start + n``
    out of ``heads``.

    One draw per sample covers every head and the rank keeps its own: under TP that is
    ``tp`` times the random numbers it needs, but ``B`` generator launches instead of
    ``B x heads/tp`` (on a GPU, each draw is far cheaper than its launch).
    """
    b, n, s, t = probs.shape
    if len(keys.samples) != b:
        raise ValueError(f"{len(keys.samples)} sample numbers for a batch of {b}")
    keep = keep_mask(
        p,
        keys,
        site=site,
        streams=keys.samples,
        full_shape=(heads, s, t),
        rows=slice(head_start, head_start + n),
        device=probs.device,
    )  # (B, n, S, S)
    return apply_mask(probs, keep, p)
