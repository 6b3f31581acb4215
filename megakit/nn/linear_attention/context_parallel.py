"""Context parallelism for the linear-attention mixers: an all-to-all of heads (Ulysses' exchange, sequence-first).

A CP rank holds ``S/cp`` tokens, the load-balanced zig-zag chunks of ``megakit.nn.sequence.positions`` (chunks ``i``
and ``2 cp - 1 - i``). A recurrence (the delta rule, the SSD scan) and its short conv need the whole sequence in
order, so ``to_whole_sequence`` trades tokens for heads: afterwards the rank holds all ``S`` tokens, sorted, of
``1/cp`` of the heads (or conv channels), and runs the mixer exactly as one process would, documents included;
``to_own_tokens`` trades back. Per mixer that moves each of its activations once each way per direction.

Why not pass the recurrent state along the ring (Megatron's ``mamba_context_parallel`` alternative): with the
zig-zag layout a rank's second chunk needs the state at the end of every earlier chunk, which serialises the ranks
(each waits for the state from all before it) unless the chunk's contribution is recomputed as a state-to-state
map, and the conv needs ``K - 1`` halo tokens from the neighbouring chunk of another rank. The all-to-all is exact,
has no serial chain, needs no halo, reuses the kernel unchanged, and costs what Ulysses costs; it needs the heads to
divide by CP.
"""

from __future__ import annotations

import torch

from megakit.nn import comm as C
from megakit.nn.sequence import positions
from megakit.nn.tensor_parallel.collectives import all_to_all


def _sorting(seq_len: int, cp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, inverse)``: ``inverse`` sorts the tokens of ranks ``0 .. cp-1`` concatenated in rank order into
    sequence order; ``order`` takes the sorted sequence back to rank order."""
    held = torch.cat([positions(seq_len, cp, r, device=device) for r in range(cp)])
    inverse = torch.argsort(held)
    return torch.argsort(inverse), inverse


def to_whole_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """``(S/cp, B, n, ...)`` -> ``(S, B, n/cp, ...)``: this rank's tokens of every head in, every token (in sequence
    order) of head group ``C.rank(group)`` (heads ``[r n/cp, (r+1) n/cp)``) out.

    forward: all-to-all over ``group``; backward: the reverse all-to-all. ``n`` must divide by CP (checked by the
    model's config)."""
    cp = C.size(group)
    if cp == 1:
        return x
    s, b, n = x.shape[:3]
    rest = x.shape[3:]
    parts = x.reshape(s, b, cp, n // cp, *rest).movedim(2, 0).reshape(cp, -1)  # part j: head group j, to rank j
    got = all_to_all(parts.contiguous(), group, [1] * cp, [1] * cp)  # part r: rank r's tokens of my head group
    got = got.view(cp * s, b, n // cp, *rest)
    return got.index_select(0, _sorting(cp * s, cp, x.device)[1])


def to_own_tokens(y: torch.Tensor, group) -> torch.Tensor:
    """Inverse of ``to_whole_sequence``: ``(S, B, n/cp, ...)`` -> ``(S/cp, B, n, ...)``.

    forward: all-to-all over ``group``; backward: the reverse all-to-all."""
    cp = C.size(group)
    if cp == 1:
        return y
    s, b, m = y.shape[:3]
    rest = y.shape[3:]
    y = y.index_select(0, _sorting(s, cp, y.device)[0]).reshape(cp, -1)  # part r: rank r's tokens
    got = all_to_all(y.contiguous(), group, [1] * cp, [1] * cp)  # part j: my tokens of head group j
    return got.view(cp, s // cp, b, m, *rest).movedim(0, 2).reshape(s // cp, b, cp * m, *rest)
