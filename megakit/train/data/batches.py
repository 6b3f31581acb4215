"""Training text as byte-level tokens, cut into samples and dealt out to DP ranks deterministically.

Why bytes: every byte is a token (vocabulary 256), so any text trains any megakit model
without a tokenizer to download. Why the standard library: it is real text (Python
source) that every machine running megakit already has, so the default run needs
nothing from the network.

The corpus is cut into non-overlapping windows of ``seq_len + 1`` tokens (input and
next-token labels). Each epoch shuffles the windows with ``seed + epoch``; step ``s``
of an epoch takes the ``s``-th block of ``global_batch`` windows, and DP rank ``r``
takes the ``r``-th equal slice of that block. So every DP rank gets the same number of
distinct samples, no sample is seen twice within an epoch, and the union over ranks
is exactly the batch a single process would train on (the equivalence tests use it).
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megakit.errors import UsageError
from megakit.nn.attention.masks import position_ids

DEFAULT_MAX_BYTES = 8 * 2**20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idlelib"}


def stdlib_files() -> list[Path]:
    """The Python standard library's own ``.py`` sources, sorted (tests and installed packages left out).

    The walk prunes the skipped folders rather than filtering after ``rglob``: site-packages (torch, DeepSpeed,
    transformers) sits inside the standard library's folder, and listing it cost every rank 1-2 s at start."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in _SKIP_DIRS]
        found += [Path(folder, name) for name in names if name.endswith(".py")]
    return sorted(found)


def _user_files(path: Path) -> list[Path]:
    if not path.exists():
        raise UsageError(f"--data {path}: no such file or directory; give a text file or a directory of text files")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
    if not files:
        raise UsageError(f"--data {path}: the directory holds no files; put text files in it or point --data at one")
    return files


def load_tokens(path: str | Path | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES) -> torch.Tensor:
    """Byte tokens (uint8 tensor) of the files under ``path``, or of the standard library if ``None``.

    Files are read in sorted order until ``max_bytes``; binary files (holding a NUL byte)
    are skipped, so pointing ``--data`` at a mixed directory still trains on its text.
    """
    files = stdlib_files() if path is None else _user_files(Path(path))
    chunks, total = [], 0
    for file in files:
        try:
            data = file.read_bytes()
        except OSError as error:
            if path is None:
                continue
            raise UsageError(
                f"--data: cannot read {file} ({error.strerror}); fix its permissions or remove it"
            ) from None
        if not data or b"\0" in data:
            continue
        data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        where = "the standard library" if path is None else f"--data {path}"
        raise UsageError(f"{where} holds no text (every file is empty or binary); point --data at text files")
    return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)


@dataclass(frozen=True, kw_only=True)
class BatchPlan:
    """How many samples one optimizer step takes, and how they split.

    ``global_batch = micro_batch * accumulation * dp`` (DeepSpeed's train_batch_size).
    """

    seq_len: int
    micro_batch: int
    accumulation: int = 1
    dp: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("seq_len", "micro_batch", "accumulation", "dp"):
            if getattr(self, name) < 1:
                raise UsageError(f"{name} must be at least 1, got {getattr(self, name)}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp


class TokenBatches:
    """Deterministic batches of ``(inputs, labels)``, each ``(batch, seq_len)`` int64, from a token stream.

    ``tokens``: one 1-D tensor (the byte corpus) or a list of 1-D arrays (memory-mapped shards,
    ``Corpus.train``). Each shard is cut into its own windows, so none spans two shards; with one
    shard the samples are those of the single stream. ``masks``: per shard, one 0/1 per token (a
    prepared directory's loss mask); a label whose token has mask 0 becomes -100, which the loss
    leaves out, so how many tokens a window trains varies and the trainer weights the loss by them.
    ``vocab_size``: a window holding an id at or above it (a shard damaged in place) is one line naming the
    shard, checked on the host's copy of the batch (no device sync), not a crash in the embedding steps later.
    """

    def __init__(
        self,
        tokens,
        plan: BatchPlan,
        masks: list | None = None,
        *,
        starts: list | None = None,
        document_attention: bool = False,
        reset_positions: bool = False,
        eod: int | None = None,
        sources: list[tuple[float, int]] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.shards = [
            t.numpy() if isinstance(t, torch.Tensor) else t
            for t in (tokens if isinstance(tokens, (list, tuple)) else [tokens])
        ]
        self.masks = masks
        assert masks is None or [len(m) for m in masks] == [len(t) for t in self.shards]
        # packed documents (``megakit.nn.attention.masks``): each shard's document starts, and what is made of them
        self.starts, self.document_attention, self.reset_positions = starts, document_attention, reset_positions
        self.eod = eod  # --eod-mask-loss: no loss where the input is the end-of-document token (Megatron's)
        assert starts is not None or not (document_attention or reset_positions)
        self.sources = sources  # a mixture: (weight, shards) per data set, their shards in that order in ``tokens``
        self.plan, self.vocab_size = plan, vocab_size
        counts = [max(len(t) - 1, 0) // plan.seq_len for t in self.shards]
        self._first = np.cumsum([0, *counts])  # the first sample of each shard
        self.num_samples = int(self._first[-1])
        self.steps_per_epoch = self.num_samples // plan.global_batch
        if sources is not None:
            self._mixture = Mixture(
                [w for w, _ in sources], np.cumsum([0, *(n for _, n in sources)]), self._first, plan.seed
            )
            self.steps_per_epoch = max(self.steps_per_epoch, 1)  # each data set wraps around on its own
        if self.steps_per_epoch < 1:
            raise UsageError(
                f"the corpus has {sum(len(t) for t in self.shards)} tokens, {self.num_samples} samples of "
                f"{plan.seq_len + 1} tokens, fewer than one global batch of {plan.global_batch}; give more text "
                "with --data or lower the batch size"
            )

    def _order(self, epoch: int) -> torch.Tensor:
        if getattr(self, "_epoch", None) != epoch:  # drawn once per epoch, not once per step
            generator = torch.Generator().manual_seed(self.plan.seed + epoch)
            self._epoch, self._permutation = epoch, torch.randperm(self.num_samples, generator=generator)
        return self._permutation

    def _windows(self, indices: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Each sample's shard and the offset of its first token there."""
        indices = np.asarray(indices.tolist(), dtype=np.int64)
        shard = np.searchsorted(self._first, indices, side="right") - 1
        return shard, (indices - self._first[shard]) * self.plan.seq_len

    def _samples(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        seq = self.plan.seq_len
        shard, starts = self._windows(indices)
        stacked = np.stack([self.shards[k][s : s + seq + 1] for k, s in zip(shard, starts)])
        if self.vocab_size is not None and stacked.size and stacked.max() >= self.vocab_size:
            self._out_of_vocabulary(stacked, shard, starts)
        windows = torch.from_numpy(stacked.astype(np.int64))
        inputs, labels = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()  # (B, S), (B, S)
        if self.masks is not None:  # the mask of the token each label names
            counted = np.stack([self.masks[k][s + 1 : s + seq + 1] for k, s in zip(shard, starts)])
            labels[torch.from_numpy(counted == 0)] = -100
        if self.eod is not None:  # the end-of-document token predicts the next document, which it cannot see
            labels[inputs == self.eod] = -100
        return inputs, labels

    def _out_of_vocabulary(self, stacked: np.ndarray, shard: np.ndarray, starts: np.ndarray) -> None:
        row, column = np.argwhere(stacked >= self.vocab_size)[0]
        k = int(shard[row])
        name = getattr(self.shards[k], "filename", None) or f"shard {k} of the data"
        raise UsageError(
            f"{name} holds token id {int(stacked[row, column])} at token {int(starts[row]) + column}, "
            f"outside the vocabulary of {self.vocab_size}: the shard is damaged; run train.py --check "
            "(it verifies the sha256 of every shard) and prepare the data again"
        )

    def _documents(self, indices: torch.Tensor) -> torch.Tensor:
        """``(B, S)`` int64: each input token's document, numbered from 0 in its window."""
        offsets = np.arange(self.plan.seq_len)
        rows = [np.searchsorted(self.starts[k], s + offsets, side="right") for k, s in zip(*self._windows(indices))]
        docs = torch.from_numpy(np.stack(rows).astype(np.int64))
        return docs - docs[:, :1]

    def forward_extras(self, step: int, dp_rank: int) -> list[dict]:
        """Per micro-batch, what the model's forward takes beside the ids: ``documents`` (attention inside each
        document) and ``position_ids`` (restarting at each), as asked; empty dicts for plain windows."""
        if not (self.document_attention or self.reset_positions):
            return [{} for _ in range(self.plan.accumulation)]
        docs = self._documents(self.rank_indices(step, dp_rank)).split(self.plan.micro_batch)
        return [
            {
                **({"documents": d} if self.document_attention else {}),
                **({"position_ids": position_ids(d)} if self.reset_positions else {}),
            }
            for d in docs
        ]

    def global_indices(self, step: int) -> torch.Tensor:
        """Sample indices of optimizer step ``step``, DP rank 0's slice first."""
        if self.sources is not None:
            return self._mixture.step_samples(step, self.plan.global_batch)
        epoch, index = divmod(step, self.steps_per_epoch)
        batch = self.plan.global_batch
        return self._order(epoch)[index * batch : (index + 1) * batch]

    def rank_indices(self, step: int, dp_rank: int) -> torch.Tensor:
        """The sample indices DP rank ``dp_rank`` trains on at step ``step``: its equal slice of the step's batch."""
        plan = self.plan
        assert 0 <= dp_rank < plan.dp, (dp_rank, plan.dp)
        per_rank = plan.micro_batch * plan.accumulation
        return self.global_indices(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every sample of step ``step`` (what a single process trains on)."""
        return self._samples(self.global_indices(step))

    def sample_numbers(self, step: int, dp_rank: int) -> list[range]:
        """The stream numbers of DP rank ``dp_rank``'s micro-batch rows at step ``step``, one range per
        micro-batch: ``step * global_batch`` plus the row's place in the step's batch (rank 0's first).

        They do not depend on the layout (a single process numbers the same sample alike), so
        they key the dropout masks (``megakit.nn.dropout``).
        """
        plan = self.plan
        first = step * plan.global_batch + dp_rank * plan.micro_batch * plan.accumulation
        return [
            range(first + i * plan.micro_batch, first + (i + 1) * plan.micro_batch) for i in range(plan.accumulation)
        ]

    def micro_batches(self, step: int, dp_rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """DP rank ``dp_rank``'s ``accumulation`` micro-batches of step ``step``."""
        inputs, labels = self._samples(self.rank_indices(step, dp_rank))
        return list(zip(inputs.split(self.plan.micro_batch), labels.split(self.plan.micro_batch)))


class Mixture:
    """Which samples of which data set step ``s`` trains on, for weights ``w`` (Megatron's ``--data-path 0.7 A 0.3
    B``: shares of the samples, so of the tokens, every window having ``seq_len`` of them).

    Data set ``d`` has taken ``K_d(s) = floor(W_d G s) - floor(W_(d-1) G s)`` samples before step ``s`` (``W`` the
    cumulative weights, ``G`` the global batch): the counts of every step add up to ``G``, and each share is exact
    to one sample at every step, so the realised shares converge as fast as they can. Within a data set the
    samples follow its own shuffle per pass (seeded by the run's seed, the data set and the pass), and a step's
    batch is shuffled (seed and step) so every DP rank gets every data set. All of it is arithmetic on the step:
    a resume at any layout reads the same samples.
    """

    def __init__(self, weights: list[float], shard_bounds, first_sample, seed: int) -> None:
        total = float(sum(weights))
        self.cumulative = np.cumsum([0.0, *(w / total for w in weights)])
        self.cumulative[-1] = 1.0
        self.first = [int(first_sample[a]) for a in shard_bounds[:-1]]  # each data set's first sample
        self.count = [int(first_sample[b]) - f for b, f in zip(shard_bounds[1:], self.first)]
        self.seed, self._orders = seed, {}
        for d, n in enumerate(self.count):
            if n < 1:
                raise UsageError(
                    f"data set {d + 1} of the mixture holds no whole sample (seq_len + 1 tokens); give it "
                    "more text or drop it"
                )

    def taken(self, step: int, global_batch: int) -> np.ndarray:
        """``K_d(step)``: samples each data set gave before ``step``."""
        edges = np.floor(self.cumulative * global_batch * step + 1e-9).astype(np.int64)
        return np.diff(edges)

    def _order(self, d: int, epoch: int) -> torch.Tensor:
        """Data set ``d``'s shuffle in pass ``epoch`` (the latest pass of each data set kept)."""
        kept = self._orders.get(d)
        if kept is None or kept[0] != epoch:
            generator = torch.Generator().manual_seed(self.seed + 1_000_003 * (d + 1) + epoch)
            kept = self._orders[d] = (epoch, torch.randperm(self.count[d], generator=generator))
        return kept[1]

    def step_samples(self, step: int, global_batch: int) -> torch.Tensor:
        """Step ``step``'s sample indices, each data set's in its own shuffled order, so a resume repeats them."""
        before, after = self.taken(step, global_batch), self.taken(step + 1, global_batch)
        picks = []
        for d, (a, b) in enumerate(zip(before.tolist(), after.tolist())):
            for n in range(a, b):
                epoch, k = divmod(n, self.count[d])
                picks.append(self.first[d] + int(self._order(d, epoch)[k]))
        generator = torch.Generator().manual_seed(self.seed * 7_919 + step)
        return torch.tensor(picks, dtype=torch.int64)[torch.randperm(len(picks), generator=generator)]
