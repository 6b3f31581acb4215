"""The checkpoint format on disk: manifest, file names, checksums, and reading any slice back.

A checkpoint directory holds ``manifest.json`` and safetensors shard files. The manifest
(format ``megakit-checkpoint``, version 1) records the step, the caller's ``extra``
metadata, the model config, the layout that saved it, each file's sha256 and size, and
for every parameter (by its layout-independent name) the full unpadded shape, dtype,
``tp_dim`` and ``slices``: which file holds which rows ``[start, stop)`` of ``tp_dim``
(a replicated parameter: one slice, the whole tensor). The tensor key inside a file is
the parameter's name. Collective saving and loading live in ``megakit.interop.checkpoint``;
this module needs no process group (``megakit convert`` uses it alone).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from contextlib import ExitStack
from pathlib import Path

import torch

from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError

FORMAT, VERSION, MANIFEST = "megakit-checkpoint", 1, "manifest.json"


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def fsync(path: Path) -> None:
    """Flush a file (or a directory's entries) to disk, so a rename never publishes lost data."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def shard_file(pp_rank: int, tp_rank: int, pp: int, tp: int) -> str:
    """``model-pp00-tp01.safetensors``: the file written by PP rank ``pp_rank``, TP rank ``tp_rank``."""
    width = max(2, len(str(max(pp, tp) - 1)))
    return f"model-pp{pp_rank:0{width}d}-tp{tp_rank:0{width}d}.safetensors"


def build_manifest(records: list, *, step: int, config: ModelConfig, extra: dict, tp: int, pp: int,
                   dp: int) -> dict:
    """The manifest from every writing rank's record (``None`` for ranks that wrote nothing).

    Checks that each split parameter's slices tile ``[0, full)`` exactly.
    """
    files, params = {}, {}
    for record in records:
        if record is None:
            continue
        files[record["file"]] = {k: record[k] for k in ("sha256", "bytes", "pp", "tp")}
        for name, entry in record["params"].items():
            merged = params.setdefault(name, {k: entry[k] for k in ("shape", "dtype", "tp_dim")} | {"slices": []})
            assert merged["shape"] == entry["shape"] and merged["dtype"] == entry["dtype"], (name, merged, entry)
            if entry["slice"] is not None:
                merged["slices"].append({"file": record["file"], **entry["slice"]})
    for name, entry in params.items():
        entry["slices"].sort(key=lambda s: s.get("start", 0))
        if entry["tp_dim"] is None:
            assert len(entry["slices"]) == 1, (name, entry)
        else:
            ends = [0] + [s["stop"] for s in entry["slices"]]
            tiled = [s["start"] for s in entry["slices"]] == ends[:-1]
            assert tiled and ends[-1] == entry["shape"][entry["tp_dim"]], (name, entry)
    return {"format": FORMAT, "version": VERSION, "step": step, "extra": extra, "config": config.to_dict(),
            "layout": {"tp": tp, "pp": pp, "dp": dp}, "files": files, "params": params}


def read_manifest(directory) -> dict:
    """The manifest of the checkpoint in ``directory``; UsageError if it is missing or malformed."""
    path = Path(directory)
    moved = sorted(path.parent.glob(f"{glob.escape(path.name)}.old-*"))
    if not path.exists() and moved:
        raise UsageError(f"checkpoint directory {path} does not exist, but a save killed while replacing it left "
                         f"{moved[-1]}; rename that back to {path.name}")
    if not path.is_dir():
        raise UsageError(f"checkpoint directory {path} does not exist; give a directory written by save_checkpoint "
                         f"(it holds {MANIFEST})")
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise UsageError(f"{path} holds no {MANIFEST}, so it is not a complete megakit checkpoint; "
                         "give the directory a finished save wrote")
    try:
        manifest = json.loads(manifest_path.read_text())
        ok = (isinstance(manifest, dict) and manifest.get("format") == FORMAT
              and all(isinstance(manifest.get(k), dict) for k in ("config", "files", "params", "layout", "extra"))
              and isinstance(manifest.get("step"), int))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{manifest_path} is corrupt ({exc}); restore it or save the checkpoint again") from exc
    if not ok:
        raise UsageError(f"{manifest_path} is not a megakit checkpoint manifest; restore it or save the checkpoint again")
    if manifest.get("version") != VERSION:
        raise UsageError(f"{manifest_path} has format version {manifest.get('version')!r}; this megakit reads "
                         f"version {VERSION}")
    return manifest


def manifest_config(manifest: dict, *, source="checkpoint") -> ModelConfig:
    try:
        return ModelConfig(**manifest["config"])
    except TypeError as exc:
        raise UsageError(f"{source}'s model config is malformed ({exc}); save the checkpoint again") from exc


class ShardReader:
    """Reads any slice of any parameter from a checkpoint, verifying each file's sha256 on first use.

    Use as a context manager (it keeps the safetensors files it opened open).
    """

    def __init__(self, directory, manifest: dict) -> None:
        self.directory, self.manifest = Path(directory), manifest
        self._files: dict = {}
        self._stack = ExitStack()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _open(self, fname: str):
        if fname not in self._files:
            from safetensors import safe_open

            path = self.directory / fname
            want = self.manifest["files"].get(fname, {}).get("sha256")
            if not path.is_file():
                raise UsageError(f"checkpoint {self.directory} lacks {fname}, which its manifest lists; "
                                 "it is incomplete: restore the file or save the checkpoint again")
            got = sha256_file(path)
            if got != want:
                raise UsageError(f"checkpoint file {path} fails its checksum (sha256 {got[:12]}..., manifest says "
                                 f"{str(want)[:12]}...): it is corrupt; restore it or save the checkpoint again")
            self._files[fname] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._files[fname]

    def entry(self, name: str) -> dict:
        entry = self.manifest["params"].get(name)
        if entry is None:
            raise UsageError(f"checkpoint {self.directory} has no parameter {name!r}; it was saved from a different model")
        return entry

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The parameter ``name``, or rows ``[start, stop)`` of its ``tp_dim`` (unpadded indices)."""
        try:
            return self._read(name, start, stop)
        except (KeyError, IndexError, TypeError) as exc:  # a hand-edited manifest, not a bug of ours
            raise UsageError(f"{self.directory / MANIFEST} describes {name!r} inconsistently ({type(exc).__name__}: "
                             f"{exc}); restore it or save the checkpoint again") from exc

    def _read(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        entry = self.entry(name)
        dim = entry["tp_dim"]
        if dim is None:
            return self._open(entry["slices"][0]["file"]).get_tensor(name)
        start, stop = (0, entry["shape"][dim]) if start is None else (start, stop)
        pieces = []
        for part in entry["slices"]:
            lo, hi = max(start, part["start"]), min(stop, part["stop"])
            if lo < hi:
                index = (slice(None),) * dim + (slice(lo - part["start"], hi - part["start"]),)
                pieces.append(self._open(part["file"]).get_slice(name)[index])
        shape = list(entry["shape"])
        shape[dim] = max(stop - start, 0)
        out = torch.cat(pieces, dim) if pieces else torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        assert list(out.shape) == shape, (name, out.shape, shape)
        return out
