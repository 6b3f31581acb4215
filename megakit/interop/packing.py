"""Fine-tuning examples packed offline into training windows, so that short examples do not pay for padding.

``prepare-data --pack N`` lays the examples into bins of exactly ``N`` tokens (the ``--seq-len`` the data is
trained at) by best-fit decreasing (TRL's ``bfd``, Megatron-Bridge's packed sequences): longest first, each
into the bin it fills most tightly, a new bin when none has room. ``--pad N`` puts one example in each bin
instead, the alternative to compare with. What a bin does not fill is end-of-text padding that the loss never
counts, each pad run a document of its own. An example longer than ``N`` is cut to ``N`` (``--too-long
truncate``, the default) or refused (``refuse``), counted either way.

The trainer reads a packed directory in windows that are its bins (the loader's windows are ``N`` tokens at a
stride of ``N``; the label of a bin's last token is the next bin's first, which is never counted), and with
``--reset-attention-mask --reset-position-ids`` each example then trains exactly as it would alone.
"""

from __future__ import annotations

import bisect

import numpy as np

from megakit.errors import UsageError

TOO_LONG = ("truncate", "refuse")


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Bins of example indices, each summing to at most ``capacity`` tokens; deterministic (ties by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    room: list[tuple[int, int]] = []  # (space left, bin), sorted
    bins: list[list[int]] = []
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))  # the tightest bin with room
        if at == len(room):
            bins.append([i])
            left, b = capacity - lengths[i], len(bins) - 1
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            left -= lengths[i]
        if left > 0:
            bisect.insort(room, (left, b))
    return bins


def fit(ids: np.ndarray, mask: np.ndarray, capacity: int, too_long: str, where: str) -> tuple[np.ndarray, np.ndarray]:
    """An example cut to ``capacity`` tokens, or a refusal naming it."""
    if len(ids) <= capacity:
        return ids, mask
    if too_long == "refuse":
        raise UsageError(
            f"{where}: an example of {len(ids)} tokens does not fit the --pack/--pad window of {capacity}; "
            "raise the window, or pass --too-long truncate to cut such examples (counted)"
        )
    return ids[:capacity], mask[:capacity]


def bins(examples: list[tuple[np.ndarray, np.ndarray]], capacity: int, *, pack: bool, pad_id: int):
    """``(ids, mask, document starts)`` of each bin of exactly ``capacity`` tokens, in order of the bins."""
    groups = (
        best_fit_decreasing([len(ids) for ids, _ in examples], capacity)
        if pack
        else [[i] for i in range(len(examples))]
    )
    for group in sorted(groups, key=min):  # the bins in the order of their first example: stable and readable
        parts = [examples[i] for i in sorted(group)]
        used = sum(len(ids) for ids, _ in parts)
        ids = np.concatenate([p[0] for p in parts] + [np.full(capacity - used, pad_id, dtype=parts[0][0].dtype)])
        mask = np.concatenate([p[1] for p in parts] + [np.zeros(capacity - used, dtype=np.uint8)])
        starts = np.cumsum([0] + [len(p[0]) for p in parts])[: len(parts) + (used < capacity)]
        mask[starts] = 0  # an example's first token is predicted by nothing of its own (a bin's: by the previous bin)
        yield ids, mask, starts
