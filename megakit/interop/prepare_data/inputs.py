"""Reading the inputs: the files they name, each file's documents or records (text, JSONL, Parquet, Arrow), the
pieces a big file is cut into for the workers, and the fingerprint that says whether they changed."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

from megakit.errors import UsageError
from megakit.interop import chat_data as chat
from megakit.interop import columnar

TASK_BYTES = 1 << 19  # files are handed to workers in batches of about this much text


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


def tasks(files: list[Path]) -> list[list[tuple[str, int, int | None, int]]]:
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


def fingerprint(files: list[Path], settings: dict) -> str:
    """A digest of ``settings`` and every file's path, size and modification time: equal, the output is current."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    for path in files:
        stat = path.stat()
        digest.update(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def record_kinds(files: list[Path]) -> str:
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
