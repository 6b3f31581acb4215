"""``prepare-data``: text files, directories, JSONL, Parquet and saved data sets to token shards, a validation
split and the tokenizer.

- A text file is one document; a ``.jsonl`` file holds one document per line (its ``field``), a ``.parquet``
  or ``.arrow`` file (a ``datasets.save_to_disk`` directory gives its own, ``megakit.interop.columnar``) one
  per row, or one chat or instruction record per line or row (``messages``, ShareGPT ``conversations``,
  ``prompt``/``completion``, Alpaca): those are rendered with the tokenizer's chat template and written with a
  loss mask beside the shards (``megakit.interop.chat_data``), the tokens ``--loss-on`` names counted, the
  rest context only. A file that is not UTF-8 text (or holds a NUL byte) is skipped with a counted warning: one
  bad file among thousands should not stop a run, and a corpus of nothing but bad files is
  an error that names one. Likewise a record (a JSONL line, a Parquet or Arrow row) that is not a (UTF-8 JSON)
  object with that field: one bad record among millions is counted and skipped, not fatal, the first named (its
  file and byte offset, or row group and row) with why; an empty text is counted apart.
- A JSONL file larger than a task is cut at line boundaries into pieces of about
  ``TASK_BYTES``, so one big file (the usual shape of a corpus) is read piece by piece and
  tokenized on every core, never held in memory whole.
- Documents are tokenized in parallel: batches of files go to a pool of processes (forked
  from a clean fork server), each with its own copy of the tokenizer, and come back in
  order, so the output does not depend on the number of workers. Each worker encodes a
  batch at once (``encode_batch_fast``: no offsets).
- The validation split is about ``f`` (``--val-fraction``) of the *tokens*, not of the documents
  (a corpus of 78 plays has no 1 % of its documents to give): ``TokenSplit`` holds out, at the end
  of a document, what the split owes so far, once that is at least ``MIN_SPAN`` tokens (or at the
  last document), cutting the document in two when it is longer. So any corpus of more than
  ``0.5 / f`` tokens gets a validation split, spread over the corpus in contiguous spans long
  enough for evaluation windows, the same on every run and for any number of workers. Chat examples are held
  out whole (``--pack``/``--pad``: every k-th), never a reply cut from its prompt.
- Everything is written to a temporary directory beside ``--out`` and renamed into place
  with the index written last, so an interrupted run leaves nothing a later run (or the
  trainer) takes for finished. The index records a fingerprint of the inputs (path, size and
  modification time of every file) and the settings; a second run with the same fingerprint
  and intact shards does nothing.

The package's modules: ``config`` (the settings), ``inputs`` (files, their documents and records, pieces),
``chat`` (text or chat data, and the chat template), ``workers`` (the pool that tokenizes) and ``writing`` (the
split, the shards and the index); ``prepare`` here runs them and renames the result into place.
"""

from __future__ import annotations

import hashlib
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from megakit.errors import UsageError
from megakit.interop import tokenizer as tok
from megakit.interop.prepare_data.chat import chat_args, chat_template, first_record
from megakit.interop.prepare_data.config import PrepareConfig
from megakit.interop.prepare_data.inputs import TASK_BYTES, fingerprint, list_inputs, pieces, read_documents
from megakit.interop.prepare_data.writing import MIN_SPAN, TokenSplit, write
from megakit.interop.token_shards import INDEX, looks_prepared, open_shards, read_index

__all__ = [
    "MIN_SPAN",
    "TASK_BYTES",
    "PrepareConfig",
    "TokenSplit",
    "chat_template",
    "first_record",
    "fingerprint",
    "list_inputs",
    "pieces",
    "prepare",
    "read_documents",
]


def _tokenizer(cfg: PrepareConfig, files: list[Path], say):
    """``--tokenizer``'s, else a byte-level BPE trained on the first ``--max-train-bytes`` of text, in order."""
    if cfg.tokenizer:
        return tok.load_tokenizer(cfg.tokenizer)

    def texts():
        seen = 0
        for path in files:
            for _, start, end, _ in pieces(path):
                docs, _, _ = read_documents(path, cfg.field, start, end)
                for doc in docs:
                    yield doc
                    seen += len(doc)
                if seen >= cfg.max_train_bytes:
                    return

    say(f"prepare-data: training a byte-level BPE tokenizer of {cfg.vocab_size} tokens")
    return tok.train_bpe(texts(), cfg.vocab_size)


def _settings(cfg: PrepareConfig) -> dict:
    """What the output depends on besides the inputs' files (the tokenizer's and template's bytes included)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("inputs", "out", "workers", "progress")}
    settings["split"] = f"tokens, spans of {MIN_SPAN}"  # a directory split by documents (before) is made again
    if cfg.chat_template:
        settings["chat_template"] = hashlib.sha256(chat_template(cfg).encode()).hexdigest()
    if cfg.tokenizer:
        source = Path(cfg.tokenizer)
        file = source / "tokenizer.json" if source.is_dir() else source
        settings["vocab_size"] = None
        settings["tokenizer"] = (
            hashlib.sha256(file.read_bytes()).hexdigest() if file.is_file() else str(source.resolve())
        )
        if source.is_dir():  # its special tokens, template and the model's stop ids travel with the data
            settings["tokenizer_files"] = {
                name: hashlib.sha256((source / name).read_bytes()).hexdigest()
                for name in (*tok.FILES, tok.GENERATION_CONFIG, "config.json")
                if (source / name).is_file()
            }
    return settings


def prepare(cfg: PrepareConfig, *, say=print) -> dict:
    """Run ``cfg``; returns a summary (``unchanged`` when the output was already up to date)."""
    out = Path(cfg.out)
    if out.exists() and not looks_prepared(out) and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"--out {out} exists and is not a megakit data directory; choose another or remove it")
    files = list_inputs(cfg.inputs, exclude=out)
    stamp = fingerprint(files, _settings(cfg))
    if (out / INDEX).is_file():
        try:
            if read_index(out)["source"]["fingerprint"] == stamp:
                open_shards(out)  # sizes as indexed
                return {"unchanged": True, "out": str(out), **read_index(out)["summary"]}
        except (UsageError, KeyError):
            pass  # damaged or older: make it again
    started = time.perf_counter()
    tmp = out.with_name(f".{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        chats = chat_args(cfg, files)
        summary = write(cfg, files, tmp, stamp, say, chat_args=chats, tokenizer=_tokenizer(cfg, files, say))
        summary["seconds"] = time.perf_counter() - started
        if out.exists():
            old = out.with_name(f".{out.name}.old-{uuid.uuid4().hex[:8]}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"unchanged": False, "out": str(out), **summary}
