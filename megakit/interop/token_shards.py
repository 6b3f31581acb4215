"""Token shards on disk: flat numpy arrays the trainer memory-maps, described by one small JSON index.

Why this format (nanoGPT's ``np.memmap`` bins, Megatron's indexed dataset made readable):
a shard is the raw little-endian ``uint16`` (vocabularies up to 65 536) or ``uint32`` ids of
whole documents, each followed by the end-of-text id, so the trainer maps it and reads any
window without parsing. Beside it, ``NAME.docs`` holds each document's first token offset
(``int64``), and, for data prepared with a loss mask (chat data trained on the assistant's turns only),
``NAME.mask`` one ``uint8`` per token: 1 where the token is a target the loss counts, 0 where it is
context only. ``index.json`` names every file with its token and document counts and sha256,
the dtype, the vocabulary and what it was made from; it is written last, so a directory
without it is not a finished one. Opening checks each file's size against the index (a
truncated shard is one clear line); ``verify`` also checks the sha256 (``train.py --check`` does).

    DIR/index.json
    DIR/tokenizer.json, tokenizer_config.json, special_tokens_map.json
    DIR/train-00000.bin, DIR/train-00000.docs, [DIR/train-00000.mask], ..., DIR/validation-00000.bin, ...
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megakit.errors import UsageError

INDEX = "index.json"
FORMAT = "megakit-tokens"
VERSION = 1
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds every id."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks (shards are larger than memory wants)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class ShardWriter:
    """Appends documents to ``SPLIT-00000.bin``, ``SPLIT-00001.bin``, ... (a new shard past ``shard_tokens``)."""

    def __init__(self, directory: Path, split: str, dtype: np.dtype, *, shard_tokens: int, masks: bool = False) -> None:
        self.directory, self.split, self.dtype, self.shard_tokens = Path(directory), split, dtype, shard_tokens
        self.masks = masks  # every document then comes with its loss mask, written to NAME.mask
        self.entries: list[dict] = []
        self._file = None

    def _open(self) -> None:
        name = f"{self.split}-{len(self.entries):05d}.bin"
        self._file, self._digest = open(self.directory / name, "wb"), hashlib.sha256()  # noqa: SIM115 (closed by _close)
        self._name, self._tokens, self._starts = name, 0, []
        if self.masks:
            self._mask_file = open(self.directory / f"{name[:-4]}.mask", "wb")  # noqa: SIM115 (closed by _close)
            self._mask_digest = hashlib.sha256()

    def add(self, ids: np.ndarray, mask: np.ndarray | None = None) -> None:
        """One document's ids (its end-of-text included) and, for a writer with ``masks``, its loss mask: one
        0/1 per id, 1 where the id is a target the loss counts."""
        if (mask is None) == self.masks or (mask is not None and len(mask) != len(ids)):
            raise ValueError(
                f"a loss mask per id is {'required' if self.masks else 'not expected'} here "
                f"({len(ids)} ids, mask {None if mask is None else len(mask)})"
            )
        if self._file is None:
            self._open()
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._digest.update(data)
        if mask is not None:
            bits = np.ascontiguousarray(mask, dtype=np.uint8).tobytes()
            self._mask_file.write(bits)
            self._mask_digest.update(bits)
        self._starts.append(self._tokens)
        self._tokens += len(ids)
        if self._tokens >= self.shard_tokens:
            self._close()

    def _close(self) -> None:
        self._file.close()
        self._file = None
        docs = f"{self._name[:-4]}.docs"
        starts = np.asarray(self._starts, dtype=np.int64)
        (self.directory / docs).write_bytes(starts.tobytes())
        self.entries.append(
            {
                "file": self._name,
                "tokens": self._tokens,
                "documents": len(starts),
                "sha256": self._digest.hexdigest(),
                "docs_file": docs,
                "docs_sha256": hashlib.sha256(starts.tobytes()).hexdigest(),
            }
        )
        if self.masks:
            self._mask_file.close()
            self.entries[-1].update(mask_file=f"{self._name[:-4]}.mask", mask_sha256=self._mask_digest.hexdigest())

    def close(self) -> list[dict]:
        """Finish the open shard and return every shard's index entry."""
        if self._file is not None:
            self._close()
        return self.entries


def write_index(directory: Path, index: dict) -> None:
    """The index, written last (to a temporary name, fsynced, renamed)."""
    tmp = Path(directory) / f".{INDEX}.tmp"
    with open(tmp, "w") as f:
        json.dump({"format": FORMAT, "version": VERSION, **index}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(Path(directory) / INDEX)


def looks_prepared(directory: Path) -> bool:
    """Whether ``directory`` holds what prepare-data writes (so a missing index is an error, not raw text)."""
    return directory.is_dir() and (
        (directory / INDEX).exists()
        or any(directory.glob("train-[0-9]*.bin"))
        or (directory / "tokenizer.json").exists()
    )


def read_index(directory: str | Path) -> dict:
    """The data directory's index; a directory without one was never finished by prepare-data."""
    path = Path(directory) / INDEX
    if not path.is_file():
        raise UsageError(
            f"{directory} has no {INDEX}, so it is not a finished megakit data directory (prepare-data "
            "was interrupted, or the index was removed); run megakit prepare-data ... --out "
            f"{directory} again"
        )
    try:
        index = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{path} is unreadable ({error}); run megakit prepare-data again") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT or index.get("version") != VERSION:
        raise UsageError(f"{path} is not a megakit token index of version {VERSION}; run megakit prepare-data again")
    return index


@dataclass(frozen=True)
class TokenShards:
    """An opened data directory: per split, the memory-mapped shards (1-D arrays) and their document starts."""

    directory: Path
    index: dict

    @property
    def vocab_size(self) -> int:
        return int(self.index["vocab_size"])

    @property
    def fingerprint(self) -> str:
        return self.index["source"]["fingerprint"]

    def tokens(self, split: str) -> list[np.ndarray]:
        """The split's token shards, memory-mapped (read-only, nothing loaded)."""
        return [
            self._map(entry["file"], self.index["dtype"], entry["tokens"])
            for entry in self.index["splits"][split]
            if entry["tokens"]
        ]

    def documents(self, split: str) -> list[np.ndarray]:
        """The split's document-start offsets, one memory-mapped array per shard."""
        return [
            self._map(entry["docs_file"], "int64", entry["documents"])
            for entry in self.index["splits"][split]
            if entry["tokens"]
        ]

    def masks(self, split: str) -> list[np.ndarray] | None:
        """Per shard, the loss mask (``uint8``, 1: a target the loss counts); None for data prepared without one."""
        entries = [entry for entry in self.index["splits"][split] if entry["tokens"]]
        if not entries or "mask_file" not in entries[0]:
            return None
        return [self._map(entry["mask_file"], "uint8", entry["tokens"]) for entry in entries]

    def _map(self, name: str, dtype: str, count: int) -> np.ndarray:
        return np.memmap(self.directory / name, dtype=np.dtype(dtype), mode="r", shape=(count,))


def open_shards(directory: str | Path, *, verify: bool = False) -> TokenShards:
    """The data directory's shards; UsageError naming the file if one is missing, truncated or (``verify``) altered."""
    directory = Path(directory)
    index = read_index(directory)
    itemsize = np.dtype(index["dtype"]).itemsize
    for split in SPLITS:
        for entry in index["splits"][split]:
            files = [
                (entry["file"], entry["tokens"] * itemsize, entry["sha256"]),
                (entry["docs_file"], entry["documents"] * 8, entry["docs_sha256"]),
            ]
            if "mask_file" in entry:
                files.append((entry["mask_file"], entry["tokens"], entry["mask_sha256"]))
            for name, size, digest in files:
                path = directory / name
                have = path.stat().st_size if path.is_file() else None
                if have != size:
                    state = (
                        "missing"
                        if have is None
                        else f"truncated ({have} bytes, {INDEX} says {size})"
                        if have < size
                        else f"longer than {INDEX} says ({have} bytes, it says {size}), so it does not match {INDEX}"
                    )
                    raise UsageError(f"{path} is {state}; run megakit prepare-data ... --out {directory} again")
                if verify and sha256_file(path) != digest:
                    raise UsageError(f"{path} does not match its sha256 in {INDEX}; run megakit prepare-data again")
    return TokenShards(directory, index)
