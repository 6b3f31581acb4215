"""The checkpoint format on disk: manifest, file names, checksums, and reading any slice back.

A checkpoint directory holds ``manifest.json`` and safetensors shard files. The manifest
(format ``megakit-checkpoint``, version 2) records the step, the caller's ``extra``
metadata, the model config, the layout that saved it, each file's size, and for every
parameter (by its layout-independent name) the full unpadded shape, dtype, ``tp_dim`` and
``slices``: which file holds which rows ``[start, stop)`` of ``tp_dim`` (a replicated
parameter: one slice, the whole tensor) and the xxh3-128 checksum of what it stored; a routed
expert's weights are cut along ``ep_dim`` 0 over EP instead (``experts-ppXX-epYY`` files), read back
whole or by rows in the same way. The tensor key inside a file is the parameter's name. An optional
``per_rank`` section lists the ``rank-…`` files that hold what only one rank has (each tensor's
checksum) and the ``key`` a run must match to read them. Version 1 (one sha256 per file instead
of per-tensor checksums) is still read. Collective saving and loading live in ``megakit.interop.checkpoint``;
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

FORMAT, VERSION, MANIFEST = "megakit-checkpoint", 2, "manifest.json"
READABLE = (1, 2)


STATE_PREFIX = "state/"


def state_name(key: str, name: str) -> str:
    """Where tensor ``key`` (e.g. ``exp_avg``) of parameter ``name`` is stored."""
    return f"{STATE_PREFIX}{key}/{name}"


def state_keys(manifest: dict) -> list[str]:
    """The per-parameter state keys a checkpoint holds (empty: weights only)."""
    return sorted({n[len(STATE_PREFIX) :].split("/", 1)[0] for n in manifest["params"] if n.startswith(STATE_PREFIX)})


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 4 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def checksum(t: torch.Tensor) -> str:
    """xxh3-128 of a tensor's bytes: ~30 GB/s, so verifying every tensor read costs far less than reading it."""
    import xxhash

    return xxhash.xxh3_128(t.detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Write ``tensors`` as one safetensors file and fsync it; each tensor's checksum (computed meanwhile:
    the write and the hash both release the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    from safetensors.torch import save_file

    def write() -> None:
        save_file(tensors, path, metadata={"format": "pt"})
        fsync(path)

    with ThreadPoolExecutor(1) as pool:
        written = pool.submit(write)
        sums = {name: checksum(t) for name, t in tensors.items()}
        written.result()
    return sums


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


def rank_file(pp_rank: int, tp_rank: int, dp_rank: int, pp: int, tp: int, dp: int) -> str:
    """``rank-pp00-tp01-dp01.safetensors``: the state only this rank holds (its own Adam moments, its residuals),
    read back only by the same rank of the same layout."""
    width = max(2, len(str(max(pp, tp, dp) - 1)))
    return f"rank-pp{pp_rank:0{width}d}-tp{tp_rank:0{width}d}-dp{dp_rank:0{width}d}.safetensors"


def write_rank_file(
    directory: Path, tensors: dict[str, torch.Tensor], ranks: tuple[int, int, int], sizes: tuple[int, int, int]
) -> dict:
    """Write one rank's own CPU ``tensors`` to ``directory`` (``ranks``, ``sizes``: its (pp, tp, dp) coordinates
    and the layout's); its record for ``build_manifest``."""
    directory.mkdir(parents=True, exist_ok=True)
    fname = rank_file(*ranks, *sizes)
    sums = write_tensors(directory / fname, {k: t.contiguous() for k, t in tensors.items()})
    return {
        "file": fname,
        "bytes": (directory / fname).stat().st_size,
        **dict(zip(("pp", "tp", "dp"), ranks)),
        "tensors": sums,
    }


def expert_file(pp_rank: int, ep_rank: int, pp: int, ep: int) -> str:
    """``experts-pp00-ep01.safetensors``: the routed experts EP rank ``ep_rank`` of stage ``pp_rank`` holds."""
    width = max(2, len(str(max(pp, ep) - 1)))
    return f"experts-pp{pp_rank:0{width}d}-ep{ep_rank:0{width}d}.safetensors"


def split_dim(entry: dict) -> int | None:
    """The dimension a stored tensor is cut along: ``tp_dim`` over TP, ``ep_dim`` over EP (experts); None: whole."""
    return entry["tp_dim"] if entry["tp_dim"] is not None else entry.get("ep_dim")


def build_manifest(
    records: list,
    *,
    step: int,
    config: ModelConfig,
    extra: dict,
    tp: int,
    pp: int,
    dp: int,
    ep: int = 1,
    rank_key: dict | None = None,
) -> dict:
    """The manifest from every written file's record (``None`` for ranks that wrote nothing).

    Checks that each split parameter's slices tile ``[0, full)`` exactly. Per-rank files (a record's
    ``rank_file``) are listed under ``per_rank`` with ``rank_key``: what a run must match to read them.
    """
    files, params, per_rank = {}, {}, {}
    for record in records:
        if record is not None and "rank_file" in record:
            per_rank[record["rank_file"]["file"]] = {k: v for k, v in record["rank_file"].items() if k != "file"}
        if record is None or "file" not in record:
            continue
        files[record["file"]] = {k: record[k] for k in ("bytes", "pp", "tp", "ep") if k in record}
        for name, entry in record["params"].items():
            merged = params.setdefault(
                name, {k: entry[k] for k in ("shape", "dtype", "tp_dim", "ep_dim") if k in entry} | {"slices": []}
            )
            assert merged["shape"] == entry["shape"] and merged["dtype"] == entry["dtype"], (name, merged, entry)
            if entry["slice"] is not None:
                merged["slices"].append({"file": record["file"], **entry["slice"]})
    for name, entry in params.items():
        entry["slices"].sort(key=lambda s: s.get("start", 0))
        if split_dim(entry) is None:
            assert len(entry["slices"]) == 1, (name, entry)
        else:
            ends = [0] + [s["stop"] for s in entry["slices"]]
            tiled = [s["start"] for s in entry["slices"]] == ends[:-1]
            assert tiled and ends[-1] == entry["shape"][split_dim(entry)], (name, entry)
    layout = {"tp": tp, "pp": pp, "dp": dp} | ({"ep": ep} if ep > 1 else {})
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": step,
        "extra": extra,
        "config": config.to_dict(),
        "layout": layout,
        "files": files,
        "params": params,
    }
    if per_rank:
        manifest["per_rank"] = {"key": rank_key or {}, "files": dict(sorted(per_rank.items()))}
    return manifest


def read_manifest(directory) -> dict:
    """The manifest of the checkpoint in ``directory``; UsageError if it is missing or malformed."""
    path = Path(directory)
    moved = sorted(path.parent.glob(f"{glob.escape(path.name)}.old-*"))
    if not path.exists() and moved:
        raise UsageError(
            f"checkpoint directory {path} does not exist, but a save killed while replacing it left "
            f"{moved[-1]}; rename that back to {path.name}"
        )
    if not path.is_dir():
        raise UsageError(
            f"checkpoint directory {path} does not exist; give a directory written by save_checkpoint "
            f"(it holds {MANIFEST})"
        )
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise UsageError(
            f"{path} holds no {MANIFEST}, so it is not a complete megakit checkpoint; "
            "give the directory a finished save wrote"
        )
    try:
        manifest = json.loads(manifest_path.read_text())
        ok = (
            isinstance(manifest, dict)
            and manifest.get("format") == FORMAT
            and all(isinstance(manifest.get(k), dict) for k in ("config", "files", "params", "layout", "extra"))
            and isinstance(manifest.get("step"), int)
        )
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{manifest_path} is corrupt ({exc}); restore it or save the checkpoint again") from exc
    if not ok:
        raise UsageError(
            f"{manifest_path} is not a megakit checkpoint manifest; restore it or save the checkpoint again"
        )
    if manifest.get("version") not in READABLE:
        raise UsageError(
            f"{manifest_path} has format version {manifest.get('version')!r}; this megakit reads "
            f"versions {', '.join(map(str, READABLE))}"
        )
    return manifest


def manifest_config(manifest: dict, *, source="checkpoint") -> ModelConfig:
    """The model config a manifest stores; a malformed one is the user's checkpoint to save again."""
    try:
        return ModelConfig(**manifest["config"])
    except TypeError as exc:
        raise UsageError(f"{source}'s model config is malformed ({exc}); save the checkpoint again") from exc


def read_rank_file(directory: Path, fname: str) -> dict[str, torch.Tensor]:
    """The tensors of per-rank file ``fname``, checked, or nothing if the checkpoint lists no such file."""
    manifest = read_manifest(directory)
    if fname not in manifest.get("per_rank", {}).get("files", {}):
        return {}
    with ShardReader(directory, manifest) as reader:
        return {name: t.clone() for name, t in reader.rank_tensors(fname).items()}


class ShardReader:
    """Reads any slice of any parameter from a checkpoint.

    Use as a context manager (it keeps the files it opened open). Every tensor read is checked
    against the checksum the manifest records for it (version 1 checkpoints: each file's sha256).
    """

    def __init__(self, directory, manifest: dict) -> None:
        self.directory, self.manifest = Path(directory), manifest
        self._files: dict = {}
        self._verified: set = set()
        self._stack = ExitStack()

    def __enter__(self) -> "ShardReader":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _corrupt(self, fname: str, why: str) -> UsageError:
        return UsageError(
            f"checkpoint file {self.directory / fname} fails its checksum ({why}): it is corrupt; "
            "restore it or save the checkpoint again"
        )

    def _open(self, fname: str):
        """The safetensors file, memory-mapped (version 1 checkpoints: after checking its sha256)."""
        if fname not in self._files:
            from safetensors import safe_open

            path = self.directory / fname
            if not path.is_file():
                raise UsageError(
                    f"checkpoint {self.directory} lacks {fname}, which its manifest lists; "
                    "it is incomplete: restore the file or save the checkpoint again"
                )
            want = self.manifest["files"].get(fname, {}).get("sha256")  # version 1: one sha256 per file
            if want is not None and sha256_file(path) != want:
                raise self._corrupt(fname, "its sha256 differs from the manifest's")
            try:
                self._files[fname] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as error:  # a damaged header, a truncated file
                raise self._corrupt(fname, f"{type(error).__name__}: {str(error)[:80]}") from None
        return self._files[fname]

    def _tensor(self, part: dict, name: str) -> torch.Tensor:
        """The tensor ``name`` stored in ``part["file"]``, checked against its checksum on first read."""
        handle = self._open(part["file"])
        try:
            t = handle.get_tensor(name)
        except Exception as error:
            raise self._corrupt(part["file"], f"{name}: {type(error).__name__}: {str(error)[:80]}") from None
        if "xxh3" in part and (part["file"], name) not in self._verified:
            if checksum(t) != part["xxh3"]:
                raise self._corrupt(part["file"], f"tensor {name} differs from what was written")
            self._verified.add((part["file"], name))
        return t

    def verify(self) -> None:
        """Read and check every tensor of the checkpoint (what ``load`` would find, found now)."""
        for name, entry in self.manifest["params"].items():
            for part in entry["slices"]:
                self._tensor(part, name)
        for fname in self.manifest.get("per_rank", {}).get("files", {}):
            self.rank_tensors(fname)

    def rank_tensors(self, fname: str) -> dict[str, torch.Tensor]:
        """Every tensor of the per-rank file ``fname`` (``rank_file``), each checked against its checksum."""
        entry = self.manifest.get("per_rank", {}).get("files", {}).get(fname)
        if entry is None:
            raise UsageError(
                f"checkpoint {self.directory} lists no per-rank file {fname}; it was saved at another layout"
            )
        return {name: self._tensor({"file": fname, "xxh3": digest}, name) for name, digest in entry["tensors"].items()}

    def entry(self, name: str) -> dict:
        """The manifest's record of parameter ``name`` (its file, shape, dtype and digest)."""
        entry = self.manifest["params"].get(name)
        if entry is None and name.startswith("mtp."):  # the same model, its prediction modules not kept
            raise UsageError(
                f"checkpoint {self.directory} holds no Multi-Token Prediction modules ({name!r}): it was "
                "saved without --mtp, or imported from weights without them; drop --mtp"
            )
        if entry is None:
            raise UsageError(
                f"checkpoint {self.directory} has no parameter {name!r}; it was saved from a different model"
            )
        return entry

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The parameter ``name``, or rows ``[start, stop)`` of its split dimension (unpadded indices)."""
        try:
            return self._read(name, start, stop)
        except (KeyError, IndexError, TypeError) as exc:  # a hand-edited manifest, not a bug of ours
            raise UsageError(
                f"{self.directory / MANIFEST} describes {name!r} inconsistently ({type(exc).__name__}: "
                f"{exc}); restore it or save the checkpoint again"
            ) from exc

    def _read(self, name: str, start: int | None, stop: int | None) -> torch.Tensor:
        entry = self.entry(name)
        dim = split_dim(entry)
        if dim is None:
            return self._tensor(entry["slices"][0], name)
        start, stop = (0, entry["shape"][dim]) if start is None else (start, stop)
        pieces = []
        for part in entry["slices"]:
            lo, hi = max(start, part["start"]), min(stop, part["stop"])
            if lo < hi:
                index = (slice(None),) * dim + (slice(lo - part["start"], hi - part["start"]),)
                pieces.append(self._tensor(part, name)[index])
        shape = list(entry["shape"])
        shape[dim] = max(stop - start, 0)
        if len(pieces) == 1:
            out = pieces[0]  # a view: the caller copies it where it belongs
        else:
            out = torch.cat(pieces, dim) if pieces else torch.empty(shape, dtype=getattr(torch, entry["dtype"]))
        assert list(out.shape) == shape, (name, out.shape, shape)
        return out
