"""What ``--data`` names, opened once: token shards from ``prepare-data``, or raw text as bytes.

Both come out as one ``Corpus`` -- a list of 1-D token arrays per split and a vocabulary --
which ``TokenBatches`` samples alike, so the default run (the Python standard library as
bytes, vocabulary 256), a text file and a prepared directory go through the same loader.
A prepared directory also brings its tokenizer, which sets the model's vocabulary and
travels into checkpoints (and from there into ``convert --to-hf``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError
from megakit.train.data.batches import DEFAULT_MAX_BYTES, BatchPlan, TokenBatches, load_tokens

BYTE_VOCAB = 256


@dataclass(frozen=True)
class Corpus:
    """The training data as loaded, with what checkpoints and messages need to name it."""

    train: list  # 1-D token arrays (memory-mapped shards) or one byte tensor
    validation: list | None  # None: raw text has no held-out split
    vocab_size: int
    tokenizer_dir: Path | None  # where tokenizer.json is (None: bytes)
    fingerprint: str  # names the data, recorded with the position in checkpoints
    source: str  # for messages
    train_masks: list | None = None  # per train shard, the loss mask (1: a target the loss counts); None: all count
    validation_masks: list | None = None
    train_documents: list | None = None  # per shard, each document's first token (None: raw text has none)
    validation_documents: list | None = None
    eos_id: int | None = None  # the token that ends each document
    packed: int | None = None  # prepare-data --pack/--pad: the window its bins are (train at --seq-len of it)
    sources: list | None = None  # a mixture: its data sets' corpora, with their weights as ``weights``
    weights: list | None = None
    pairs: int | None = None  # preference pairs (prepare-data on chosen/rejected rows): documents a window holds

    @property
    def parts(self) -> list["Corpus"]:
        """Each data set on its own: a mixture's, or this one (validation and packing are per data set)."""
        return self.sources or [self]

    def check_packed(self, cfg, seq_len: int) -> None:
        """Packed examples train as they would alone only in their own windows, with the document mask."""
        for part in self.parts:
            if part.packed is None:
                continue
            if seq_len != part.packed:
                raise UsageError(
                    f"{part.source} is packed into windows of {part.packed} tokens; train it with "
                    f"--seq-len {part.packed} (got {seq_len}), or prepare it again with --pack {seq_len}"
                )
            if not (cfg.reset_attention_mask and cfg.reset_position_ids):
                raise UsageError(
                    f"{part.source} holds packed examples; pass --reset-attention-mask "
                    "--reset-position-ids so that each trains as it would alone"
                )

    def loader_options(self, cfg, split: str = "train") -> dict:
        """``TokenBatches`` keywords for ``split``: its loss masks and, as ``cfg`` asks, packed-document options."""
        wants = cfg.reset_attention_mask or cfg.reset_position_ids or cfg.eod_mask_loss
        starts = self.train_documents if split == "train" else self.validation_documents
        if wants and (starts is None or self.eos_id is None):
            flags = [
                f
                for f, on in (
                    ("--reset-attention-mask", cfg.reset_attention_mask),
                    ("--reset-position-ids", cfg.reset_position_ids),
                    ("--eod-mask-loss", cfg.eod_mask_loss),
                )
                if on
            ]
            raise UsageError(
                f"{' and '.join(flags)} {'need' if len(flags) > 1 else 'needs'} each document's start, "
                f"which {self.source} does not record; prepare the text with megakit prepare-data and "
                "pass --data DIR"
            )
        sources = (
            None
            if self.sources is None or split != "train"
            else [(w, len(c.train)) for w, c in zip(self.weights, self.sources)]
        )
        return dict(
            masks=self.train_masks if split == "train" else self.validation_masks,
            starts=starts,
            document_attention=cfg.reset_attention_mask,
            reset_positions=cfg.reset_position_ids,
            eod=self.eos_id if cfg.eod_mask_loss else None,
            sources=sources,
            vocab_size=self.vocab_size,
        )


def parse_mixture(data) -> list[tuple[float, str]] | None:
    """``--data 0.7 A 0.3 B`` (Megatron's ``--data-path``) as ``[(0.7, "A"), (0.3, "B")]``; None for one data set."""
    if data is None or isinstance(data, str) or len(data) == 1:
        return None
    items = list(data)
    try:
        weights = [float(w) for w in items[0::2]]
    except ValueError:
        weights = None
    if weights is None or len(items) % 2:
        raise UsageError(f"--data {' '.join(items)}: a mixture is WEIGHT DIR pairs, e.g. --data 0.7 web/ 0.3 code/")
    bad = [w for w in weights if not 0 < w < float("inf")]
    if bad:
        raise UsageError(
            f"--data: mixture weight {bad[0]:g} must be a positive number (a data set's share of the "
            "samples; drop a data set rather than weigh it 0)"
        )
    return list(zip(weights, items[1::2]))


def open_corpus(data, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The corpus of ``--data``: a prepared directory (it has ``index.json``), else raw text (default: the stdlib);
    or a mixture (``parse_mixture``) of several, their shards one after another."""
    from megakit.interop.token_shards import looks_prepared, open_shards

    mixture = parse_mixture(data)
    if mixture is not None:
        return _mix([(w, open_corpus(path, max_bytes=max_bytes)) for w, path in mixture])
    if isinstance(data, (list, tuple)):
        data = data[0]

    if data is not None and looks_prepared(Path(data)):
        shards = open_shards(data)  # one clear line when the index is missing or a shard is truncated
        return Corpus(
            train=shards.tokens("train"),
            validation=shards.tokens("validation") or None,
            vocab_size=shards.vocab_size,
            tokenizer_dir=Path(data).resolve(),
            fingerprint=shards.fingerprint,
            source=f"--data {data}",
            train_masks=shards.masks("train"),
            validation_masks=shards.masks("validation"),
            train_documents=shards.documents("train"),
            validation_documents=shards.documents("validation") or None,
            eos_id=shards.index.get("eos_id"),
            packed=shards.index.get("packed", {}).get("seq_len"),
            pairs=shards.index.get("packed", {}).get("pairs"),
        )
    tokens = load_tokens(data, max_bytes=max_bytes)
    return Corpus(
        train=[tokens],
        validation=None,
        vocab_size=BYTE_VOCAB,
        tokenizer_dir=None,
        fingerprint=f"bytes:{data or 'stdlib'}:{len(tokens)}",
        source="the standard library" if data is None else f"--data {data}",
    )


def verify_corpus(data) -> None:
    """Check every shard of ``--data`` (each data set of a mixture) against its sha256 in ``index.json``: a
    UsageError naming the first that differs. It reads all of them, so ``train.py --check`` runs it, not a start."""
    from megakit.interop.token_shards import looks_prepared, open_shards

    mixture = parse_mixture(data)
    paths = [path for _, path in mixture] if mixture else [data[0] if isinstance(data, (list, tuple)) else data]
    for path in paths:
        if path is not None and looks_prepared(Path(path)):
            open_shards(path, verify=True)


def _mix(parts: list[tuple[float, Corpus]]) -> Corpus:
    """One corpus of the data sets' training shards, in order (``TokenBatches`` deals them out by weight); each
    data set keeps its own validation split (``Corpus.parts``)."""
    import numpy as np

    first = parts[0][1]
    for _, c in parts[1:]:
        if c.vocab_size != first.vocab_size or _tokenizer_file(c) != _tokenizer_file(first):
            raise UsageError(
                f"{c.source} and {first.source} were tokenized differently; a mixture needs one tokenizer "
                "(prepare every data set with the same --tokenizer)"
            )

    def joined(field: str, fill=None) -> list | None:
        lists = [getattr(c, field) for _, c in parts]
        if all(x is None for x in lists):
            return None
        if fill is None and any(x is None for x in lists):
            return None
        return [a for x, (_, c) in zip(lists, parts) for a in (x if x is not None else fill(c))]

    def ones(c):  # a data set without a loss mask counts every token: a view, nothing allocated
        return [np.broadcast_to(np.uint8(1), (len(t),)) for t in c.train]

    return Corpus(
        train=[t for _, c in parts for t in c.train],
        validation=None,
        vocab_size=first.vocab_size,
        tokenizer_dir=first.tokenizer_dir,
        fingerprint="mixture:" + ",".join(f"{w:g}:{c.fingerprint}" for w, c in parts),
        source="--data " + " ".join(f"{w:g} {c.source.removeprefix('--data ')}" for w, c in parts),
        train_masks=joined("train_masks", ones),
        train_documents=joined("train_documents"),
        eos_id=first.eos_id,
        sources=[c for _, c in parts],
        weights=[w for w, _ in parts],
    )


def _tokenizer_file(corpus: Corpus) -> bytes | None:
    if corpus.tokenizer_dir is None:
        return None
    return (corpus.tokenizer_dir / "tokenizer.json").read_bytes()


def model_for_corpus(model: ModelConfig, name: str, corpus: Corpus) -> ModelConfig:
    """The model with the corpus's vocabulary: a preset takes the tokenizer's; a config of its own must hold it."""
    if corpus.tokenizer_dir is None:
        if model.vocab_size < BYTE_VOCAB:
            raise UsageError(f"model {name} has a vocabulary of {model.vocab_size}; byte-level training needs 256")
        return model
    preset = not Path(name).suffix and not Path(name).exists()
    if preset:
        return model.replace(vocab_size=corpus.vocab_size)
    if model.vocab_size < corpus.vocab_size:
        raise UsageError(
            f"model {name} has a vocabulary of {model.vocab_size} but the tokenizer of {corpus.source} "
            f"has {corpus.vocab_size} tokens; set vocab_size to {corpus.vocab_size} in the model config "
            "(or use a preset, which takes the tokenizer's)"
        )
    return model


class ValidationBatches(TokenBatches):
    """The validation split in a fixed order (never shuffled): eval batch ``k`` is what step ``k`` of the
    training loader would be, split over DP ranks the same way."""

    def __init__(self, corpus: Corpus, plan: BatchPlan, batches: int, options: dict | None = None) -> None:
        if corpus.validation is None:
            raise UsageError(
                f"--eval-every needs a validation split, which {corpus.source} does not have; prepare "
                "the text with megakit prepare-data and pass --data DIR"
            )
        try:
            super().__init__(corpus.validation, plan, **(options or {"masks": corpus.validation_masks}))
        except UsageError:
            raise UsageError(
                f"the validation split of {corpus.source} holds fewer samples than one global batch of "
                f"{plan.global_batch}; prepare the data with a larger --val-fraction"
            ) from None
        self.batches = min(batches, self.steps_per_epoch)

    def _order(self, epoch: int) -> torch.Tensor:
        return torch.arange(self.num_samples)
