"""Writing the shards: the validation split by tokens (``TokenSplit``), the documents or packed windows into
the two splits' shards, the warnings on what was skipped, the tokenizer and, last, the index."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from megakit.errors import UsageError
from megakit.interop import chat_data as chat
from megakit.interop import packing
from megakit.interop import tokenizer as tok
from megakit.interop.prepare_data.config import PrepareConfig
from megakit.interop.prepare_data.inputs import record_kinds, tasks
from megakit.interop.prepare_data.workers import encode_pieces, init_worker, worker_context
from megakit.interop.token_shards import ShardWriter, token_dtype, write_index

MIN_SPAN = 1024  # validation tokens held out at once (a 1024-token evaluation window reads one span)


@dataclass(kw_only=True)
class TokenSplit:
    """Holds out ``fraction`` of a token stream for validation, document by document.

    After a document, the split owes ``round(fraction x tokens seen) - tokens held``; it takes that
    many from the document's end once the debt reaches ``MIN_SPAN`` (or the document is the last),
    at most the whole document, never the stream's only training token. ``cut`` says how many."""

    fraction: float
    seen: int = 0
    held: int = 0

    def cut(self, tokens: int, *, last: bool, whole: bool = False) -> int:
        """``whole``: the document goes to one side, never cut (a chat example: half of one would validate on a
        reply without its prompt); to validation once the debt is half of it or more."""
        self.seen += tokens
        owed = int(self.fraction * self.seen + 0.5) - self.held
        if whole:
            take = tokens if 2 * owed >= tokens > 0 and self.seen - self.held - tokens >= 1 else 0
        elif owed <= 0 or (owed < MIN_SPAN and not last):
            return 0
        else:
            take = max(0, min(owed, tokens, self.seen - self.held - 1))
        self.held += take
        return take


@dataclass(kw_only=True)
class _Shards:
    """The two splits' writers and counts, fed the tokenized documents in corpus order: one document is held back
    until the next comes, so the split knows the last; with --pack/--pad the examples are kept, packed at the end."""

    writers: dict
    split: TokenSplit
    chat: bool
    window: int | None
    too_long: str
    counts: dict = field(
        default_factory=lambda: {
            "documents": {"train": 0, "validation": 0},
            "tokens": {"train": 0, "validation": 0},
            "loss_tokens": {"train": 0, "validation": 0},
        }
    )
    examples: list = field(default_factory=list)  # with --pack/--pad: every example, packed at the end
    truncated: int = 0
    example: object = None  # the first chat example (ids, mask), shown with its counted tokens marked
    docs: int = 0
    cut: int = 0
    held_back: object = None

    def take(self, ids, path: str) -> None:
        """One tokenized document (ids, or ``(ids, mask)``) of ``path``."""
        self.example = self.example if self.example is not None or not self.chat else ids
        if self.window:
            ids, mask = ids if isinstance(ids, tuple) else (ids, np.ones(len(ids), dtype=np.uint8))
            self.truncated += len(ids) > self.window
            self.examples.append(packing.fit(ids, mask, self.window, self.too_long, f"{path}: example {self.docs + 1}"))
            self.docs += 1
            return
        if self.held_back is not None:
            self.add(self.held_back, last=False)
        self.held_back, self.docs = ids, self.docs + 1

    def finish(self) -> None:
        """The document held back, now known to be the last."""
        if self.held_back is not None:
            self.add(self.held_back, last=True)

    def add(self, doc, last: bool) -> None:
        """One document, its end held out when the split owes tokens."""
        ids, mask = doc if isinstance(doc, tuple) else (doc, None)
        held = self.split.cut(len(ids), last=last, whole=self.chat)
        self.cut += 0 < held < len(ids)
        keep = len(ids) - held
        for name, part, bits in (
            ("train", ids[:keep], None if mask is None else mask[:keep]),
            ("validation", ids[keep:], None if mask is None else mask[keep:]),
        ):
            if len(part):
                self.writers[name].add(part, bits)
                self.counts["documents"][name] += 1
                self.counts["tokens"][name] += len(part)
                self.counts["loss_tokens"][name] += len(part) if bits is None else int(bits.sum())


@dataclass
class _Skips:
    """What reading left out: files skipped (with why), bad records (the first named) and empty ones."""

    files: list = field(default_factory=list)
    bad: int = 0
    first_bad: str | None = None
    empty: int = 0


def write(cfg: PrepareConfig, files: list[Path], tmp: Path, stamp: str, say, *, tokenizer, chat_args) -> dict:
    """Tokenize ``files`` into shards, the tokenizer and the index in ``tmp`` (renamed into place by the caller);
    returns the summary the index records."""
    if cfg.tokenizer and Path(cfg.tokenizer).is_dir():
        tok.check_stop_tokens(tokenizer, cfg.tokenizer, source=f"--tokenizer {cfg.tokenizer}")
    vocab, eos = tok.vocab_size(tokenizer), tok.end_of_text_id(tokenizer)
    dtype = token_dtype(vocab)
    window = cfg.window
    shard_tokens = cfg.shard_tokens if not window else 1 << 62  # packed: one shard a split, its windows its bins
    shards = _Shards(
        writers={
            split: ShardWriter(
                tmp, split, dtype, shard_tokens=shard_tokens, masks=chat_args is not None or bool(window)
            )
            for split in ("train", "validation")
        },
        split=TokenSplit(fraction=cfg.val_fraction),
        chat=chat_args is not None,
        window=window,
        too_long=cfg.too_long,
    )
    total_bytes = sum(p.stat().st_size for p in files)
    args = (tokenizer.to_str(), None if chat_args else cfg.field, eos, dtype.str, chat_args)
    skips = _tokenize(cfg, files, args, shards, total_bytes)
    counts = shards.counts
    packed = (
        write_bins(shards.examples, shards.writers, counts, cfg, pad_id=eos if eos is not None else 0)
        if window
        else None
    )
    splits = {split: writer.close() for split, writer in shards.writers.items()}
    _refuse_or_warn(cfg, files, skips, counts, chat=chat_args is not None, say=say)
    # the tokenizer, its template and the model's stop ids travel with the data, into checkpoints and the export
    tok.save_tokenizer(
        tokenizer, tmp, source=cfg.tokenizer, chat_template=chat_args[0] if chat_args and cfg.chat_template else None
    )
    summary = {
        "files": len(files),
        "skipped": len(skips.files),
        "bad_records": skips.bad,
        "empty_records": skips.empty,
        "bytes": total_bytes,
        "vocab_size": vocab,
        "input_documents": shards.docs,
        "cut_documents": shards.cut,
        "chat": chat_args is not None,
        "loss_on": chat_args[1] if chat_args else "all",
        **counts,
        **({"packed": dict(packed, truncated=shards.truncated)} if packed else {}),
        **({"example": chat.marked(tokenizer, *shards.example)} if shards.example is not None else {}),
    }
    write_index(
        tmp,
        {
            "dtype": dtype.name,
            "vocab_size": vocab,
            "eos_id": eos,
            **({"packed": {"seq_len": window, "strategy": "bfd" if cfg.pack else "pad"}} if window else {}),
            "source": {"fingerprint": stamp, "inputs": [str(i) for i in cfg.inputs], "skipped": skips.files},
            "splits": splits,
            "summary": summary,
        },
    )
    return summary


def _tokenize(cfg: PrepareConfig, files: list[Path], args: tuple, shards: _Shards, total_bytes: int) -> _Skips:
    """Run the workers over the inputs' pieces (in this process with one worker) and feed their documents to
    ``shards`` in order, with a progress bar by bytes; returns what reading skipped."""
    from tqdm.auto import tqdm

    skips = _Skips()
    pieces = tasks(files)
    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="prepare-data",
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    workers = min(cfg.workers, len(pieces))
    pool = worker_context().Pool(workers, init_worker, args) if workers > 1 else None
    try:
        if pool is None:
            init_worker(*args)
        results = pool.imap(encode_pieces, pieces) if pool else map(encode_pieces, pieces)
        for batch, task in zip(results, pieces):
            for (arrays, size, why, (bad_lines, first, empty_lines)), (path, *_) in zip(batch, task):
                if why:
                    skips.files.append(f"{path}: {why}")
                skips.bad, skips.first_bad = skips.bad + bad_lines, skips.first_bad or first
                skips.empty += empty_lines
                for ids in arrays:  # one document behind, so the last one is known
                    shards.take(ids, path)
                bar.update(size)
        shards.finish()
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    return skips


def _refuse_or_warn(cfg: PrepareConfig, files: list[Path], skips: _Skips, counts: dict, *, chat: bool, say) -> None:
    """No training token at all is an error naming a skipped file or bad record; skipped files, bad and empty
    records and a small validation split are warnings, so one bad file among thousands does not stop a run."""
    skipped, bad, first_bad = skips.files, skips.bad, skips.first_bad
    if not counts["tokens"]["train"]:
        why = (
            f" ({skipped[0]})"
            if len(skipped) == 1
            else f" ({len(skipped)} skipped, e.g. {skipped[0]})"
            if skipped
            else ""
        )
        if chat and bad:  # every chat record malformed: name one, and why
            raise UsageError(
                f"the inputs hold no chat record to train on: all {bad:,} are malformed or leave no "
                f"token to train on, e.g. {first_bad}"
            )
        raise UsageError(f"the inputs hold no text to train on{why}; give UTF-8 text files or JSONL")
    if skipped:
        say(
            f"prepare-data: warning: skipped {len(skipped)} of {len(files)} files that are not UTF-8 text or "
            f"readable Parquet/Arrow, e.g. {skipped[0]}"
        )
    records = record_kinds(files)
    if bad:
        what = (
            "chat records that are malformed or leave no token to train on"
            if chat
            else f"{records} that are not {'UTF-8 JSON ' if records == 'JSONL lines' else ''}objects with a "
            f"{cfg.field!r} string (--field)"
        )
        say(f"prepare-data: warning: skipped {bad:,} {what}, e.g. {first_bad}")
    if skips.empty:
        say(
            f"prepare-data: warning: skipped {skips.empty:,} {records} whose {cfg.field!r} is an empty string (no text)"
        )
    say_validation(cfg.val_fraction, counts["tokens"], say)


def write_bins(examples, writers, counts, cfg: PrepareConfig, *, pad_id: int) -> dict:
    """``--pack``/``--pad``: whole examples to validation by ``--val-fraction`` (every k-th), each split in bins of the
    window, each example (and each pad run) a document; one more token ends each split so its last bin is a window."""
    window, f = cfg.window, cfg.val_fraction
    held = [int((i + 1) * f) > int(i * f) for i in range(len(examples))]
    used = total = 0
    for name, writer in writers.items():
        mine = [e for e, h in zip(examples, held) if h == (name == "validation")]
        if not mine:
            continue
        for ids, mask, starts in packing.bins(mine, window, pack=bool(cfg.pack), pad_id=pad_id):
            for a, b in zip(starts, [*starts[1:], window]):
                writer.add(ids[a:b], mask[a:b])
                counts["documents"][name] += 1
            counts["tokens"][name] += window
            counts["loss_tokens"][name] += int(mask.sum())
            total += window
        writer.add(np.full(1, pad_id, dtype=mine[0][0].dtype), np.zeros(1, dtype=np.uint8))
        counts["tokens"][name] += 1
        used += sum(len(ids) for ids, _ in mine)
    return {"window": window, "bins": total // window, "examples": len(examples), "fill": used / max(total, 1)}


def say_validation(fraction: float, tokens: dict, say) -> None:
    """Why the validation split is empty or too small to evaluate on, now rather than at --eval-every."""
    total, held = tokens["train"] + tokens["validation"], tokens["validation"]
    if fraction > 0 and held == 0:
        say(
            f"prepare-data: warning: no validation split: {total:,} tokens x --val-fraction {fraction:g} = "
            f"{total * fraction:.2f} rounds to none; raise --val-fraction or add text (--eval-every needs one)"
        )
    elif 0 < held < MIN_SPAN:
        say(
            f"prepare-data: warning: the validation split holds only {held:,} tokens ({total:,} x --val-fraction "
            f"{fraction:g}); --eval-every needs at least a global batch x (seq-len + 1): raise --val-fraction or add "
            "text"
        )
