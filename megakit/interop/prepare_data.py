"""``prepare-data``: text files, directories, JSONL, Parquet and saved data sets to token shards, a validation
split and the tokenizer.

- A text file is one document; a ``.jsonl`` file holds one document per line (its ``field``), a ``.parquet``
  or ``.arrow`` file (a ``datasets.save_to_disk`` directory gives its own, ``megakit.interop.columnar``) one
  per row, or one chat or instruction record per line or row (``messages``, ShareGPT ``conversations``, ``prompt``/``completion``,
  Alpaca): those are rendered with the tokenizer's chat template and written with a loss mask beside the
  shards (``megakit.interop.chat_data``), the tokens ``--loss-on`` names counted, the rest context only.
  A file that is not UTF-8 text (or holds a NUL byte) is skipped with a counted warning: one
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
"""

from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from megakit.errors import UsageError
from megakit.interop import chat_data as chat
from megakit.interop import columnar, packing
from megakit.interop import tokenizer as tok
from megakit.interop.token_shards import (
    INDEX,
    ShardWriter,
    looks_prepared,
    open_shards,
    read_index,
    token_dtype,
    write_index,
)

TASK_BYTES = 1 << 19  # files are handed to workers in batches of about this much text
MIN_SPAN = 1024  # validation tokens held out at once (a 1024-token evaluation window reads one span)


@dataclass(frozen=True, kw_only=True)
class PrepareConfig:
    inputs: list[str]
    out: str
    vocab_size: int = 4096
    tokenizer: str | None = None  # a tokenizer.json / transformers directory instead of training one
    field: str = "text"  # the JSONL key holding the text
    val_fraction: float = 0.01
    workers: int = 1
    shard_tokens: int = 1 << 26
    max_train_bytes: int = 1 << 28  # text the BPE is trained on (the first files, in order)
    loss_on: str = "auto"  # chat data: which tokens the loss counts (chat_data.LOSS_ON)
    chat_template: str | None = None  # a Jinja file used instead of the tokenizer's own template
    pack: int | None = None  # examples packed into windows of this many tokens (best-fit decreasing; packing.py)
    pad: int | None = None  # one example per window of this many tokens, padded
    too_long: str = "truncate"  # an example longer than the window: truncate | refuse
    progress: bool = True

    def __post_init__(self) -> None:
        if self.pack is not None and self.pad is not None:
            raise UsageError("give one of --pack N (several examples per window) and --pad N (one, padded)")
        if self.window is not None and self.window < 2:
            raise UsageError(f"--pack/--pad {self.window}: a window needs at least 2 tokens, e.g. 2048")
        if self.too_long not in packing.TOO_LONG:
            raise UsageError(f"--too-long {self.too_long} is not one of {', '.join(packing.TOO_LONG)}")
        if self.loss_on not in chat.LOSS_ON:
            raise UsageError(f"--loss-on {self.loss_on} is not one of {', '.join(chat.LOSS_ON)}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise UsageError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.workers < 1 or self.shard_tokens < 1:
            raise UsageError("--workers and --shard-tokens must be at least 1")

    @property
    def window(self) -> int | None:
        """The tokens of a window that --pack or --pad fills (None: the documents stream as they are)."""
        return self.pack if self.pack is not None else self.pad


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


def list_inputs(inputs: list[str], *, exclude: Path | None = None) -> list[Path]:
    """Every file the inputs name, directories walked in sorted order (hidden files and ``exclude``, the
    output directory, left out); a ``datasets.save_to_disk`` directory gives its Arrow files, in its order."""
    if not inputs:
        raise UsageError("give at least one input file or directory")
    skip = exclude.resolve() if exclude is not None else None

    def walk(path: Path) -> list[Path]:
        try:
            saved = columnar.saved_dataset(path)
        except (ValueError, OSError) as error:
            raise UsageError(f"input {path}: {error}") from None
        if saved is not None:
            return saved
        return [
            f
            for child in sorted(path.iterdir())
            if not child.name.startswith(".") and child.resolve() != skip
            for f in (walk(child) if child.is_dir() else [child] if child.is_file() else [])
        ]

    files = []
    for item in inputs:
        path = Path(item)
        if not path.exists():
            raise UsageError(f"input {path}: no such file or directory")
        files += [path] if path.is_file() else walk(path)
    if not files:
        raise UsageError(
            f"the inputs ({', '.join(inputs)}) hold no files; give text files, directories of them or JSONL"
        )
    return files


def read_documents(
    path: Path, text_field: str | None, start: int = 0, end: int | None = None
) -> tuple[list, str | None, tuple[int, str | None, int]]:
    """``(documents, why the file is skipped, (bad records, the first named and why, empty records))`` of the
    file, or of bytes ``start:end`` of a JSONL file (whole lines: see ``pieces``), or of pieces ``start:end`` of a
    Parquet or Arrow file (a record named by its row group and row). ``text_field`` None: chat data, each
    document a ``(record, where)`` pair."""
    if columnar.is_columnar(path):
        try:
            rows = columnar.records(path, start, end)
        except Exception as error:  # noqa: BLE001 (pyarrow raises its own kinds): one unreadable file is skipped
            return [], f"unreadable as {path.suffix[1:]} ({str(error).splitlines()[0]})", (0, None, 0)
        return _documents(rows, text_field)
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read() if end is None else f.read(end - start)
    except OSError as error:
        return [], f"unreadable ({error.strerror})", (0, None, 0)
    if path.suffix == ".jsonl":
        return _documents(_lines(data, start, path), text_field)
    if b"\0" in data:
        return [], "binary (holds a NUL byte)", (0, None, 0)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        return [], f"not UTF-8 (byte {error.start})", (0, None, 0)
    return ([text] if text else []), None, (0, None, 0)


_NOT_JSON = object()  # what ``_lines`` gives for a line that is not UTF-8 JSON (a line holding ``null`` gives None)


def _lines(data: bytes, offset: int, path: Path):
    """``(record, where)`` of each JSONL line: ``_NOT_JSON`` for one that is not UTF-8 JSON."""
    for line in data.split(b"\n"):
        if line.strip():
            try:
                yield json.loads(line.decode("utf-8")), f"{path}, the line at byte {offset}"
            except (UnicodeDecodeError, json.JSONDecodeError):
                yield _NOT_JSON, f"{path}, the line at byte {offset}"
        offset += len(line) + 1


def _documents(rows, text_field: str | None) -> tuple[list, None, tuple[int, str | None, int]]:
    """The documents of ``(record, where)`` rows: each one's ``text_field`` string, or with ``text_field`` None the
    chat records themselves as ``(record, where)``; anything else counted as bad, the first one named with why,
    and an empty string counted as empty (it holds no document, but it is not lost without a word)."""
    docs, bad, first, empty = [], 0, None, 0
    for record, where in rows:
        try:
            value = record[text_field] if text_field is not None else record if chat.is_chat(record) else None
        except (TypeError, KeyError, IndexError):
            value = None
        if isinstance(value, dict):
            docs.append((value, where))
        elif isinstance(value, str):
            docs += [value] if value else []
            empty += not value
        else:
            bad += 1
            first = first or f"{where} ({_why_bad(record, text_field)})"
    return docs, None, (bad, first, empty)


def _why_bad(record, text_field: str | None) -> str:
    if record is _NOT_JSON:
        return "not UTF-8 JSON"
    if not isinstance(record, dict):
        return "null" if record is None else f"a JSON {type(record).__name__}, not an object"
    if text_field is None:
        return "not a chat or instruction record"
    if text_field not in record:
        return f"no {text_field!r} field"
    value = record[text_field]
    return f"{text_field!r} is null" if value is None else f"{text_field!r} is a {type(value).__name__}, not a string"


def pieces(path: Path) -> list[tuple[str, int, int | None, int]]:
    """``(path, start, end, bytes)`` ranges that together cover the file: a JSONL file larger than ``TASK_BYTES``
    cut after the first newline past every multiple of it (reading one line per cut); a Parquet or Arrow file
    by its row groups or record batches (``start:end`` count those, ``bytes`` is their share of the file);
    anything else whole."""
    size = path.stat().st_size
    if columnar.is_columnar(path):
        try:
            rows = columnar.piece_rows(path)
        except Exception:  # noqa: BLE001 - read (and skipped, with the reason) as one piece
            return [(str(path), 0, None, size)]
        total = max(sum(rows), 1)
        return [(str(path), i, i + 1, size * n // total) for i, n in enumerate(rows)] or [(str(path), 0, None, size)]
    if path.suffix != ".jsonl" or size <= TASK_BYTES:
        return [(str(path), 0, None, size)]
    cuts = [0]
    with open(path, "rb") as f:
        for nominal in range(TASK_BYTES, size, TASK_BYTES):
            if nominal > cuts[-1]:
                f.seek(nominal - 1)
                f.readline()  # to the end of the line holding byte nominal - 1
                cuts.append(f.tell())
    cuts = [c for c in cuts if c < size] + [size]  # increasing: each cut is past the one before
    return [(str(path), a, b, b - a) for a, b in itertools.pairwise(cuts)]


def fingerprint(files: list[Path], settings: dict) -> str:
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# -- the workers ----------------------------------------------------------------------------------
_WORKER: dict = {}


def _init_worker(
    tokenizer_json: str, text_field: str | None, eos: int | None, dtype: str, chat_args: tuple | None = None
) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the pool is the parallelism
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    renderer = chat.ChatRenderer(tokenizer, *chat_args, eos=eos) if chat_args else None
    _WORKER.update(tokenizer=tokenizer, field=text_field, eos=eos, dtype=np.dtype(dtype), chat=renderer)


def _encode_chat(task) -> list[tuple[list, int, str | None, tuple]]:
    """``_encode_pieces`` for chat data: each record's ids and loss mask; a record that renders to nothing to
    train on (no assistant turn, a malformed message) is counted with the bad lines."""
    renderer, dtype, out = _WORKER["chat"], _WORKER["dtype"], []
    for path, start, end, size in task:
        records, skipped, (bad, first, empty) = read_documents(Path(path), None, start, end)
        arrays = []
        for (record, where), rendered in zip(records, renderer.many(records)):
            if isinstance(rendered, ValueError):
                bad, first = bad + 1, first or f"{where} ({rendered})"
                continue
            ids, mask = rendered
            arrays.append((np.array(ids, dtype=dtype), np.array(mask, dtype=np.uint8)))
        out.append((arrays, size, skipped, (bad, first, empty)))
    return out


def _encode_pieces(
    task: list[tuple[str, int, int | None, int]],
) -> list[tuple[list[np.ndarray], int, str | None, tuple]]:
    """Per piece: its documents' ids (end-of-text appended), its size in bytes, why its file was skipped (or
    None), its bad and empty records (``read_documents``)."""
    if _WORKER["chat"] is not None:
        return _encode_chat(task)
    tokenizer, eos, dtype = _WORKER["tokenizer"], _WORKER["eos"], _WORKER["dtype"]
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets computed
    read = [read_documents(Path(path), _WORKER["field"], start, end) for path, start, end, _ in task]
    texts = [doc for docs, _, _ in read for doc in docs]
    encoded = iter(encode(texts, add_special_tokens=False)) if texts else iter(())
    tail = [] if eos is None else [eos]
    out = []
    for (_, _, _, size), (docs, skipped, bad) in zip(task, read):
        arrays = [np.array(next(encoded).ids + tail, dtype=dtype) for _ in docs]
        out.append((arrays, size, skipped, bad))
    return out


def _context():
    """Workers forked from a fork server, a fresh interpreter that has imported this module and nothing else.
    Forked from this process instead, they would inherit its heap (after training a tokenizer, or anything a
    caller did before), and every page a worker writes would first be copied: measured, 10-30 % more CPU."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _tasks(files: list[Path]) -> list[list[tuple[str, int, int | None, int]]]:
    """The files' pieces in order, in tasks of about ``TASK_BYTES``."""
    tasks, size = [[]], 0
    for path in files:
        for piece in pieces(path):
            if tasks[-1] and size >= TASK_BYTES:
                tasks.append([])
                size = 0
            tasks[-1].append(piece)
            size += piece[3]
    return tasks


# -- the run ----------------------------------------------------------------------------------------
def _tokenizer(cfg: PrepareConfig, files: list[Path], say):
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
        summary = _write(cfg, files, tmp, stamp, say)
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


def first_record(files: list[Path]) -> dict | None:
    """The first record of the first JSONL, Parquet or Arrow file (what decides between text and chat data), or None."""
    for path in files:
        if columnar.is_columnar(path):
            for _, start, end, _ in pieces(path):
                try:
                    rows = columnar.records(path, start, end)
                except Exception:  # noqa: BLE001 - skipped with the reason when read
                    break
                if rows:
                    return rows[0][0]
            continue
        if path.suffix != ".jsonl":
            continue
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (UnicodeDecodeError, json.JSONDecodeError):
                    continue
                if isinstance(record, dict):
                    return record
    return None


def chat_template(cfg: PrepareConfig) -> str | None:
    """``--chat-template FILE``, else the template of the ``--tokenizer`` directory (its config or its .jinja file)."""
    if cfg.chat_template:
        try:
            return Path(cfg.chat_template).read_text()
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"cannot read --chat-template {cfg.chat_template}: {error}; give a Jinja file") from None
    source = Path(cfg.tokenizer) if cfg.tokenizer else None
    if source is None or not source.is_dir():
        return None
    if (source / "chat_template.jinja").is_file():
        return (source / "chat_template.jinja").read_text()
    try:
        template = json.loads((source / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, json.JSONDecodeError):
        return None
    return template if isinstance(template, str) else None


def _chat_args(cfg: PrepareConfig, files: list[Path]) -> tuple | None:
    """``(template, loss_on, special tokens, the template's source)`` for chat data (None for text)."""
    record = first_record(files)
    if record is None or not chat.is_chat(record):
        return None
    if not cfg.tokenizer:
        raise UsageError(
            "chat and instruction data is tokenized with the model's own tokenizer: pass --tokenizer DIR "
            "(a transformers tokenizer directory, with its chat template)"
        )
    template = chat_template(cfg)
    if template is None and ("messages" in record or "conversations" in record):
        raise UsageError(
            f"conversations are rendered with a chat template, and --tokenizer {cfg.tokenizer} has none; "
            "pass --chat-template FILE (a Jinja template)"
        )
    source = (
        f"--chat-template {cfg.chat_template}"
        if cfg.chat_template
        else f"the chat template of --tokenizer {cfg.tokenizer}"
    )
    return template, cfg.loss_on, tok.special_tokens(cfg.tokenizer), source


def _write(cfg: PrepareConfig, files: list[Path], tmp: Path, stamp: str, say) -> dict:
    from tqdm.auto import tqdm

    from megakit.interop import preference_data

    if preference_data.is_preference(first_record(files)):  # chosen/rejected rows: pairs for DPO, IPO, SimPO
        return preference_data.write_pairs(cfg, files, tmp, stamp, say)
    chat_args = _chat_args(cfg, files)
    tokenizer = _tokenizer(cfg, files, say)
    if cfg.tokenizer and Path(cfg.tokenizer).is_dir():
        tok.check_stop_tokens(tokenizer, cfg.tokenizer, source=f"--tokenizer {cfg.tokenizer}")
    vocab, eos = tok.vocab_size(tokenizer), tok.end_of_text_id(tokenizer)
    dtype = token_dtype(vocab)
    window = cfg.window
    shard_tokens = cfg.shard_tokens if not window else 1 << 62  # packed: one shard a split, its windows its bins
    writers = {
        split: ShardWriter(tmp, split, dtype, shard_tokens=shard_tokens, masks=chat_args is not None or bool(window))
        for split in ("train", "validation")
    }
    examples, truncated = [], 0  # with --pack/--pad: every example, packed at the end
    example = None  # the first chat example (ids, mask), shown with its counted tokens marked
    counts = {
        "documents": {"train": 0, "validation": 0},
        "tokens": {"train": 0, "validation": 0},
        "loss_tokens": {"train": 0, "validation": 0},
    }
    skipped, bad, first_bad, empty, total_bytes, docs = [], 0, None, 0, sum(p.stat().st_size for p in files), 0
    split, cut, held_back = TokenSplit(fraction=cfg.val_fraction), 0, None

    def add(doc, last: bool) -> None:  # one document, its end held out when the split owes tokens
        nonlocal cut
        ids, mask = doc if isinstance(doc, tuple) else (doc, None)
        held = split.cut(len(ids), last=last, whole=chat_args is not None)
        cut += 0 < held < len(ids)
        keep = len(ids) - held
        for name, part, bits in (
            ("train", ids[:keep], None if mask is None else mask[:keep]),
            ("validation", ids[keep:], None if mask is None else mask[keep:]),
        ):
            if len(part):
                writers[name].add(part, bits)
                counts["documents"][name] += 1
                counts["tokens"][name] += len(part)
                counts["loss_tokens"][name] += len(part) if bits is None else int(bits.sum())

    args = (tokenizer.to_str(), None if chat_args else cfg.field, eos, dtype.str, chat_args)
    tasks = _tasks(files)
    bar = tqdm(
        total=total_bytes,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        desc="prepare-data",
        disable=not cfg.progress,
        dynamic_ncols=True,
    )
    workers = min(cfg.workers, len(tasks))
    pool = _context().Pool(workers, _init_worker, args) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(*args)
        results = pool.imap(_encode_pieces, tasks) if pool else map(_encode_pieces, tasks)
        for batch, task in zip(results, tasks):
            for (arrays, size, why, (bad_lines, first, empty_lines)), (path, *_) in zip(batch, task):
                if why:
                    skipped.append(f"{path}: {why}")
                bad, first_bad, empty = bad + bad_lines, first_bad or first, empty + empty_lines
                for ids in arrays:  # one document behind, so the last one is known
                    example = example if example is not None or not chat_args else ids
                    if window:
                        ids, mask = ids if isinstance(ids, tuple) else (ids, np.ones(len(ids), dtype=np.uint8))
                        truncated += len(ids) > window
                        examples.append(packing.fit(ids, mask, window, cfg.too_long, f"{path}: example {docs + 1}"))
                        docs += 1
                        continue
                    if held_back is not None:
                        add(held_back, last=False)
                    held_back, docs = ids, docs + 1
                bar.update(size)
        if held_back is not None:
            add(held_back, last=True)
    finally:
        bar.close()
        if pool is not None:
            pool.terminate()
    packed = _write_bins(examples, writers, counts, cfg, pad_id=eos if eos is not None else 0) if window else None
    splits = {split: writer.close() for split, writer in writers.items()}
    if not counts["tokens"]["train"]:
        why = (
            f" ({skipped[0]})"
            if len(skipped) == 1
            else f" ({len(skipped)} skipped, e.g. {skipped[0]})"
            if skipped
            else ""
        )
        if chat_args and bad:  # every chat record malformed: name one, and why
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
    records = _record_kinds(files)
    if bad:
        what = (
            "chat records that are malformed or leave no token to train on"
            if chat_args
            else f"{records} that are not {'UTF-8 JSON ' if records == 'JSONL lines' else ''}objects with a "
            f"{cfg.field!r} string (--field)"
        )
        say(f"prepare-data: warning: skipped {bad:,} {what}, e.g. {first_bad}")
    if empty:
        say(f"prepare-data: warning: skipped {empty:,} {records} whose {cfg.field!r} is an empty string (no text)")
    _say_validation(cfg.val_fraction, counts["tokens"], say)
    # the tokenizer, its template and the model's stop ids travel with the data, into checkpoints and the export
    tok.save_tokenizer(
        tokenizer, tmp, source=cfg.tokenizer, chat_template=chat_args[0] if chat_args and cfg.chat_template else None
    )
    summary = {
        "files": len(files),
        "skipped": len(skipped),
        "bad_records": bad,
        "empty_records": empty,
        "bytes": total_bytes,
        "vocab_size": vocab,
        "input_documents": docs,
        "cut_documents": cut,
        "chat": chat_args is not None,
        "loss_on": chat_args[1] if chat_args else "all",
        **counts,
        **({"packed": dict(packed, truncated=truncated)} if packed else {}),
        **({"example": chat.marked(tokenizer, *example)} if example is not None else {}),
    }
    write_index(
        tmp,
        {
            "dtype": dtype.name,
            "vocab_size": vocab,
            "eos_id": eos,
            **({"packed": {"seq_len": window, "strategy": "bfd" if cfg.pack else "pad"}} if window else {}),
            "source": {"fingerprint": stamp, "inputs": [str(i) for i in cfg.inputs], "skipped": skipped},
            "splits": splits,
            "summary": summary,
        },
    )
    return summary


def _record_kinds(files: list[Path]) -> str:
    """What the inputs' records are called: JSONL lines, Parquet/Arrow rows, or both."""
    kinds = [
        name
        for name, there in (
            ("JSONL lines", any(p.suffix == ".jsonl" for p in files)),
            ("Parquet/Arrow rows", any(columnar.is_columnar(p) for p in files)),
        )
        if there
    ]
    return " and ".join(kinds) or "records"


def _write_bins(examples, writers, counts, cfg: PrepareConfig, *, pad_id: int) -> dict:
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


def _say_validation(fraction: float, tokens: dict, say) -> None:
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
