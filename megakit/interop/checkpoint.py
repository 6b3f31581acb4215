"""Checkpoints: safetensors shards plus a JSON manifest, loadable at any TP x PP layout.

Scope: the weights, the step, the caller's JSON metadata and, optionally, tensors split like a
parameter (a trainer's fp32 master and optimizer moments: ``state``), stored as ``state_name(key,
parameter)`` and read back for any layout by ``load_state``. Load weights *before*
``deepspeed.initialize``: the engine makes its master copies from the model at that moment.

On disk::

    DIR/manifest.json                      step, extra, model config, layout, and for
                                           every parameter its full shape, dtype, tp_dim,
                                           which file holds which slice, and the slice's
                                           checksum
    DIR/model-pp00-tp00.safetensors ...    one per (pp, tp) rank of DP replica 0
    DIR/experts-pp00-ep00.safetensors ...  MoE: one per (pp, ep) rank, its slice of the routed experts
    DIR/rank-pp00-tp00-dp01.safetensors    optional, per rank: state only that rank holds (a
                                           local-SGD replica's own Adam moments, its residuals),
                                           read back only at the same layout (``rank_state``)

Why it looks like this:

- No pickle: safetensors and JSON, so loading a checkpoint runs no code.
- Every rank writes only its own shard; no rank ever holds the full model. DP replicas
  hold identical weights, so only DP replica 0 writes. A parameter held by several ranks
  is written once: a replicated one (``tp_dim`` None) by TP rank 0, the last stage's copy
  of a tied embedding by the first stage. Routed experts are split over EP, so each EP rank
  writes its slice; any EP degree reads them back (``megakit.interop.checkpoint_split``).
  Persistent buffers (the aux-loss-free expert bias) are saved like replicated parameters.
- Vocab padding is trimmed before writing, so files hold only real rows and the
  checkpoint does not depend on the TP degree; a reader pads for its own TP.
- Nothing half-written: shards and manifest go to ``DIR.tmp-XXXX``; once every rank has
  written (a gather to rank 0 is the barrier), rank 0 renames it to ``DIR``. An existing
  checkpoint at ``DIR`` is moved aside only then, and removed after the rename. The two halves
  of a save (``stage_checkpoint``: host copies; ``StagedCheckpoint.write``: files, manifest,
  rename) let ``megakit.interop.checkpoint_async`` run the second in a background thread.
- A checksum (xxh3-128) per stored tensor, checked as a reader reads it: fast enough to
  cost little next to the I/O, and it catches any corrupted byte a load would use.
- ZeRO-3 partitions each TP shard over DP: saving gathers one parameter at a time over
  DP (``deepspeed.zero.GatheredParameters``); loading goes into the unpartitioned model,
  before ``deepspeed.initialize``, and is refused after it.

The manifest's fields and the slice reader are in ``megakit.interop.checkpoint_format``.

Collectives: ``save_checkpoint`` and ``load_checkpoint`` are collective over the world --
every rank calls them. Save runs an all-gather of parameter names over the PP group, a
gather of small per-rank records to rank 0 and a broadcast of the outcome; load runs one
all-gather of the outcome. A failure on any rank therefore raises on every rank instead
of leaving the others waiting. ``DIR`` must be on a filesystem every rank sees.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError
from megakit.interop import checkpoint_ranks as R
from megakit.interop.checkpoint_format import (
    MANIFEST,
    STATE_PREFIX,
    ShardReader,
    build_manifest,
    expert_file,
    fsync,
    manifest_config,
    rank_file,
    read_manifest,
    read_rank_file,
    shard_file,
    state_keys,
    state_name,
    write_rank_file,
)
from megakit.interop.checkpoint_split import (
    Split,
    adapted,
    base_name,
    ep_place,
    is_adapter,
    named_tensors,
    split_of,
    write_shard,
    writes,
)
from megakit.nn import comm as C

IGNORED_FIELDS = ("dropout", "init_std")  # training settings: they do not change what the weights mean
ENTRY_BYTES = 1024  # what a stored tensor adds beside its data, at most: its safetensors header and manifest entry


class Loaded(NamedTuple):
    """What ``load_checkpoint`` returns besides the weights it copied into the model."""

    step: int
    extra: dict


# -- the model's parameters ---------------------------------------------------------------------
def _modules(model) -> list[nn.Module]:
    """A stage module, or the chunks of an interleaved stage: a list, or an ``nn.ModuleList``
    (what a DeepSpeed engine over all chunks holds as ``engine.module``)."""
    return list(model) if isinstance(model, (list, tuple, nn.ModuleList)) else [model]


def named_parameters(model) -> dict[str, nn.Parameter]:
    """Name -> parameter over this rank's stage module(s), by the model's layout-independent names (with LoRA
    adapters: the adapters, the only parameters that train)."""
    out: dict[str, nn.Parameter] = {}
    for module in _modules(model):
        for name, param in module.named_parameters():
            assert name not in out, f"parameter {name} appears in two chunks"
            out[name] = param
    if adapted(_modules(model)):
        return {name: p for name, p in out.items() if is_adapter(name)}
    return out


def _zero3(param) -> bool:
    """Partitioned over DP by DeepSpeed ZeRO-3 (the local tensor is empty outside a gather)."""
    return hasattr(param, "ds_id")


def _host_copies(params: dict, wanted, *, copy=None) -> dict[str, torch.Tensor]:
    """CPU copies of the ``wanted`` parameters of this rank's TP x PP shard (``copy(name, tensor)``: how to copy,
    even those already on the CPU; by default a CPU tensor is itself).

    A ZeRO-3 parameter is gathered over its DP group first (``GatheredParameters``: an
    all-gather in, nothing out), one at a time, so every DP rank must call this -- with the
    same parameters in the same order -- even when it writes nothing.
    """
    out = {}
    for name, param in params.items():
        if _zero3(param):
            import deepspeed

            with deepspeed.zero.GatheredParameters([param]):
                if name in wanted:
                    out[name] = copy(name, param) if copy else param.detach().to("cpu", copy=True)
        elif name in wanted:
            out[name] = copy(name, param) if copy else param.detach().to("cpu")
    return out


def _model_config(model) -> ModelConfig | None:
    return getattr(_modules(model)[0], "config", None)


def _config_diff(saved: ModelConfig, ours: ModelConfig) -> list[str]:
    """Fields that differ (training-only settings aside), as "name saved vs ours"."""
    a, b = saved.to_dict(), ours.to_dict()
    return [f"{k} {a[k]} vs {b[k]}" for k in b if k not in IGNORED_FIELDS and a[k] != b[k]]


# -- save -------------------------------------------------------------------------------------------
def save_checkpoint(
    directory,
    model,
    topo=None,
    *,
    step: int,
    config: ModelConfig,
    extra: dict | None = None,
    state: dict[str, dict[str, torch.Tensor]] | None = None,
    rank_state: dict[str, torch.Tensor] | None = None,
    rank_key: dict | None = None,
) -> Path:
    """Write this rank's shard of ``model`` (a stage module, or a list/ModuleList of chunks) to ``directory``.

    Collective over the world: every rank calls it with its own stage. ``extra`` is any
    JSON-serialisable metadata (returned by ``load_checkpoint``). ``state``: parameter name ->
    {key: tensor shaped like this rank's shard of it}, written beside it. ``rank_state``: CPU tensors
    only this rank holds, written as they are, on any DP rank, for ``load_rank_state`` at the same
    layout; ``rank_key`` (JSON) says what a reader must match. Returns the directory.
    """
    return stage_checkpoint(
        directory,
        model,
        topo,
        step=step,
        config=config,
        extra=extra,
        state=state,
        rank_state=rank_state,
        rank_key=rank_key,
    ).write()


def stage_checkpoint(
    directory,
    model,
    topo=None,
    *,
    step: int,
    config: ModelConfig,
    extra: dict | None = None,
    state: dict[str, dict[str, torch.Tensor]] | None = None,
    rank_state: dict[str, torch.Tensor] | None = None,
    rank_key: dict | None = None,
    copy=None,
) -> "StagedCheckpoint":
    """The first half of ``save_checkpoint`` (same arguments and collectives on the trainer's groups): check the
    request, agree on the temporary directory, and copy this rank's tensors to host memory. Its ``write()`` is
    the second half. ``copy(name, tensor)`` (``HostBuffers.copy``): copy the weights even from the CPU, so the
    model may change before the write (``state`` and ``rank_state`` must then be the caller's own copies)."""
    target = Path(directory)
    extra = {} if extra is None else extra
    try:
        json.dumps(extra, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise UsageError(
            f"checkpoint metadata must be JSON-serialisable ({exc}); pass plain numbers, "
            "strings, lists and dicts as extra"
        ) from exc
    if not isinstance(step, int) or step < 0:
        raise UsageError(f"checkpoint step must be a non-negative integer, got {step!r}")
    if target.exists() and not (target / MANIFEST).is_file() and (not target.is_dir() or any(target.iterdir())):
        raise UsageError(
            f"{target} exists and is not a megakit checkpoint; refusing to replace it: "
            "choose another directory or remove it"
        )
    if _model_config(model) is not None and _config_diff(config, _model_config(model)):
        raise UsageError(
            f"the config given to save_checkpoint differs from the model's "
            f"({', '.join(_config_diff(config, _model_config(model))[:4])}); pass the model's own config"
        )
    _, _, _, _, pp_rank, _ = R.coords(topo)
    params = named_tensors(_modules(model))  # parameters and persistent buffers (the expert bias)
    # Who writes what: the first PP stage that holds a name (a tied embedding: the first stage).
    stage_names = R.all_gather(sorted(params), topo, None if topo is None else topo.pp_group)
    first_holder = {}
    for stage, names in enumerate(stage_names):
        for name in names:
            first_holder.setdefault(name, stage)
    tmp = target.with_name(f"{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp = Path(R.broadcast_from_0(str(tmp), topo))
    owned = {n for n, p in params.items() if first_holder[n] == pp_rank and writes(n, p, topo)}
    tensors = _host_copies(params, owned, copy=copy)  # collective over DP under ZeRO-3
    for name in list(tensors):  # state tensors are split like their parameter
        for key, t in (state or {}).get(name, {}).items():
            tensors[state_name(key, name)] = t
    return StagedCheckpoint(
        target=target,
        tmp=tmp,
        topo=topo,
        params=params,
        tensors=tensors,
        step=step,
        config=config,
        extra=extra,
        rank_state=rank_state,
        rank_key=rank_key,
    )


@dataclass
class StagedCheckpoint:
    """A save whose tensors are in host memory: ``write()`` writes, fsyncs and publishes them."""

    target: Path
    tmp: Path
    topo: object
    params: dict  # the live tensors, read only for how each is split (their attributes), never for data
    tensors: dict[str, torch.Tensor]
    step: int
    config: ModelConfig
    extra: dict
    rank_state: dict | None
    rank_key: dict | None
    intact: str | None = None  # what a failed write leaves intact, in words (the caller's: a series' newest)

    def write(self, group=C.WORLD) -> Path:
        """Write the shards to the temporary directory; once every rank has (a gather to rank 0 over ``group`` is
        the barrier), rank 0 writes the manifest and renames it into place. Collective over ``group`` (the whole
        job: from a background thread, a group of its own, ``comm.side_group``); an error on any rank raises on
        every rank. Returns the directory."""
        topo, tmp, tensors, params = self.topo, self.tmp, self.tensors, self.params
        tp, pp, dp, tp_rank, pp_rank, dp_rank = R.coords(topo)
        space = self._check_space(group)
        mine, local_error = {"records": []}, None
        try:
            experts = {
                n: t for n, t in tensors.items() if split_of(base_name(n), params[base_name(n)], topo).key == "ep_dim"
            }
            if dp_rank == 0:
                dense = {n: t for n, t in tensors.items() if n not in experts}
                mine["records"].append(
                    write_shard(tmp, params, dense, topo, shard_file(pp_rank, tp_rank, pp, tp), pp=pp_rank, tp=tp_rank)
                )
            if experts:
                ep, ep_rank, _ = ep_place(topo)
                mine["records"].append(
                    write_shard(
                        tmp,
                        params,
                        experts,
                        topo,
                        expert_file(pp_rank, ep_rank, pp, ep),
                        pp=pp_rank,
                        tp=tp_rank,
                        ep=ep_rank,
                    )
                )
            if self.rank_state:
                mine["records"].append(
                    {"rank_file": write_rank_file(tmp, self.rank_state, (pp_rank, tp_rank, dp_rank), (pp, tp, dp))}
                )
        except Exception as error:  # reported to rank 0, which cleans up and tells every rank
            local_error = self._no_space(error, *space)
            mine = {"failure": R.failure(local_error)}
        gathered = R.gather_to_0(mine, topo, group)  # every rank has written: the barrier before renaming
        failures = None
        if R.rank(topo) == 0:
            failures = [r.get("failure") for r in gathered]
            try:
                if not any(failures):
                    records = [record for r in gathered for record in r["records"]]
                    manifest = build_manifest(
                        records,
                        step=self.step,
                        config=self.config,
                        extra=self.extra,
                        tp=tp,
                        pp=pp,
                        dp=dp,
                        ep=ep_place(topo)[0],
                        rank_key=self.rank_key,
                    )
                    _check_visible(tmp, manifest)
                    path = tmp / MANIFEST
                    path.write_text(json.dumps(manifest, indent=1))
                    fsync(path)
                    _publish(tmp, self.target)
            except Exception as error:
                local_error = self._no_space(error, *space)
                failures[0] = R.failure(local_error)
            finally:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
        failures = R.broadcast_from_0(failures, topo, group)
        R.raise_failures(failures, local_error)
        return self.target

    def _bytes(self) -> int:
        """What this rank writes: its dense shard (DP replica 0), its experts, its own state."""
        dp_rank = R.coords(self.topo)[5]

        def expert(name: str) -> bool:
            return split_of(base_name(name), self.params[base_name(name)], self.topo).key == "ep_dim"

        written = [t for n, t in self.tensors.items() if dp_rank == 0 or expert(n)]
        written += list((self.rank_state or {}).values())
        return sum(t.nbytes + ENTRY_BYTES for t in written)

    def _check_space(self, group) -> tuple[int, int]:
        """``(bytes this save needs, bytes free)`` where it writes; UsageError on every rank, before any byte is
        written, when they do not fit. A gather of each rank's size to rank 0 and a broadcast of the verdict, sent
        whatever a rank met (an error on one raises on every rank, not on it alone while the others wait)."""
        local_error, mine = None, None
        try:
            mine = self._bytes()
        except Exception as error:
            local_error, mine = error, R.failure(error)
        sizes = R.gather_to_0(mine, self.topo, group)
        verdict = None
        if R.rank(self.topo) == 0:
            failures = [s if isinstance(s, tuple) else None for s in sizes]
            needed = free = 0
            line = None
            try:
                if not any(failures):
                    needed, free = sum(sizes) + ENTRY_BYTES, shutil.disk_usage(existing_ancestor(self.tmp.parent)).free
                    line = None if needed <= free else self._no_space_line(needed, free)
            except OSError as error:
                line = (
                    f"cannot check the free space for the checkpoint of step {self.step} in {self.tmp.parent} "
                    f"({error.strerror or error}); --save to a directory on a working filesystem"
                )
            verdict = (needed, free, line, failures)
        needed, free, line, failures = R.broadcast_from_0(verdict, self.topo, group)
        R.raise_failures(failures, local_error)
        if line is not None:
            raise UsageError(line)
        return needed, free

    def _no_space_line(self, needed: int, free: int) -> str:
        intact = self.intact or self._target_intact()
        return (
            f"no space for the checkpoint of step {self.step} in {self.tmp.parent}: it needs {needed:,} bytes "
            f"({needed / 2**20:.1f} MiB), {free:,} are free ({free / 2**20:.1f} MiB); nothing of it was kept and "
            f"{intact}; free some space or --save elsewhere"
        )

    def _target_intact(self) -> str:
        """Without the caller's words (``save_run``'s: a --save directory's newest, ``save_dir.newest_complete``),
        what is known here: the checkpoint at the target, which a save replaces only once it is complete."""
        try:
            return f"the last complete checkpoint (step {read_manifest(self.target)['step']}, {self.target}) is intact"
        except UsageError:
            return "no complete checkpoint was touched"

    def _no_space(self, error: Exception, needed: int, free: int) -> Exception:
        """A full disk (or quota) met while writing, as the one line a check before writing gives."""
        full = isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT)
        if full or any(os.strerror(code) in str(error) for code in (errno.ENOSPC, errno.EDQUOT)):  # safetensors'
            return UsageError(self._no_space_line(needed, free))
        return error


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists: where a directory not made yet would be made."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_visible(tmp: Path, manifest: dict) -> None:
    for fname in [*manifest["files"], *manifest.get("per_rank", {}).get("files", {})]:
        if not (tmp / fname).is_file():
            raise UsageError(
                f"{tmp / fname}, written by another rank, is not visible on rank 0; "
                "save checkpoints to a filesystem that every node shares"
            )


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``; an old checkpoint there is moved aside first, then removed.
    Only this save's own copy: another save's temporaries are not this save's to judge (a run removes what
    killed saves left under its ``--save`` lock: ``megakit.train.resilience.save_dir``)."""
    old = None
    if target.exists():
        old = target.with_name(f"{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
    try:
        os.rename(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    fsync(target.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# -- load -------------------------------------------------------------------------------------------
def load_checkpoint(directory, model, topo=None, *, base: bool = False) -> Loaded:
    """Copy this rank's shard of every parameter of ``model`` from the checkpoint in ``directory``; of a model with
    LoRA adapters, the adapters, or with ``base`` the frozen weights under them.

    Any saved TP x PP layout loads into any other: each rank reads only the slices its shard
    needs. Collective over the world (one all-gather of the outcome): every rank calls it, and
    an error on any rank (missing or corrupt file, other model) raises on all of them.
    Returns the saved step and extra metadata.
    """
    return R.collectively(lambda: _load(Path(directory), model, topo, base), topo)


@torch.no_grad()
def _load(directory: Path, model, topo, base: bool = False) -> Loaded:
    manifest = read_manifest(directory)
    saved = manifest_config(manifest, source=str(directory))
    config = _model_config(model)
    if config is not None:
        diff = _config_diff(saved, config)
        if diff:
            raise UsageError(
                f"checkpoint {directory} was saved from a different model ({', '.join(diff[:4])}, "
                "checkpoint vs model); build the model from the checkpoint's config"
            )
    if any(_zero3(p) for p in named_parameters(model).values()):
        raise UsageError(
            "the model is already partitioned by DeepSpeed ZeRO-3; load the checkpoint into the "
            "model before deepspeed.initialize (the engine copies its master weights from it there)"
        )
    with ShardReader(directory, manifest) as reader:
        for name, tensor in named_tensors(_modules(model), base=base).items():  # parameters, persistent buffers
            tensor.copy_(_read_shard(reader, name, list(tensor.shape), split_of(name, tensor, topo), directory))
    return Loaded(step=manifest["step"], extra=manifest["extra"])


def _saved_split(entry: dict) -> tuple[str | None, int | None]:
    """``(manifest field, dim)`` of a stored tensor's split (``(None, None)``: stored whole)."""
    if entry["tp_dim"] is not None:
        return "tp_dim", entry["tp_dim"]
    if entry.get("ep_dim") is not None:
        return "ep_dim", entry["ep_dim"]
    return None, None


def _read_shard(reader: ShardReader, name: str, shape: list[int], split: Split, directory) -> torch.Tensor:
    """This rank's piece (``shape``, cut as ``split`` says over TP or EP) of entry ``name``, vocab padding as zeros."""
    pname = base_name(name) if name.startswith(STATE_PREFIX) else name
    entry = reader.entry(name)
    if _saved_split(entry) != (split.key, split.dim):
        (key, dim), over = _saved_split(entry), {"tp_dim": " over TP", "ep_dim": " over EP", None: ""}
        raise UsageError(
            f"parameter {pname} is split along {dim}{over[key]} in checkpoint {directory} but "
            f"along {split.dim}{over[split.key]} in the model; it was saved from a different model"
        )
    dim = split.dim
    if dim is None:
        t = reader.read(name)
    else:
        local, want = shape[dim], list(shape)
        want[dim] = entry["shape"][dim]
        if split.parts * local < want[dim] or list(entry["shape"]) != want:
            axis = "TP" if split.key == "tp_dim" else "EP"
            raise UsageError(
                f"parameter {pname} has full shape {entry['shape']} in checkpoint {directory} "
                f"but the model's shard is {shape} at {axis} {split.parts}; it was saved from "
                "a different model"
            )
        start = split.index * local
        t = reader.read(name, min(start, want[dim]), min(start + local, want[dim]))
        if t.shape[dim] < local:  # vocab padding
            pad = list(t.shape)
            pad[dim] = local - t.shape[dim]
            t = torch.cat([t, t.new_zeros(pad)], dim=dim)
    if list(t.shape) != shape:
        raise UsageError(
            f"parameter {pname} has shape {list(t.shape)} in checkpoint {directory} but "
            f"{shape} in the model; it was saved from a different model"
        )
    return t


def load_state(directory, model, topo=None) -> dict[str, dict[str, torch.Tensor]]:
    """Parameter name -> {key: this rank's TP shard} of the state saved beside the weights.

    Reads only the slices this rank needs, at any TP x PP layout (a ZeRO-3 parameter by its
    unpartitioned ``ds_shape``). Collective like ``load_checkpoint``: an error anywhere raises everywhere.
    """
    return R.collectively(lambda: _load_state(Path(directory), model, topo), topo)


def _load_state(directory: Path, model, topo) -> dict[str, dict[str, torch.Tensor]]:
    manifest = read_manifest(directory)
    out: dict[str, dict[str, torch.Tensor]] = {}
    with ShardReader(directory, manifest) as reader:
        for name, param in named_parameters(model).items():
            shape = list(param.ds_shape if _zero3(param) else param.shape)  # ZeRO-3: the unpartitioned shard
            out[name] = {
                key: _read_shard(reader, state_name(key, name), shape, split_of(name, param, topo), directory)
                for key in state_keys(manifest)
            }
    return out


def load_rank_state(directory, topo=None) -> dict[str, torch.Tensor]:
    """This rank's ``rank_state``, as the same rank of the same layout saved it (empty if it saved none); the
    caller first checks the manifest's ``per_rank`` key. Collective like ``load_checkpoint``."""
    tp, pp, dp, tp_rank, pp_rank, dp_rank = R.coords(topo)
    return R.collectively(
        lambda: read_rank_file(Path(directory), rank_file(pp_rank, tp_rank, dp_rank, pp, tp, dp)), topo
    )
