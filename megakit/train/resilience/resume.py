"""A training run's checkpoints: ``--save``, ``--save-every``, ``--keep`` and ``--load``, resumed exactly.

A checkpoint holds what the next step depends on, so a resumed run's losses are the
uninterrupted run's:

- weights (``megakit.interop.checkpoint``), at any TP x PP layout;
- per parameter, the fp32 master weights and the optimizer's moments, whole over DP and
  split over TP like the parameter, so they reshard to any TP x PP x DP and ZeRO stage.
  DeepSpeed's public views give and take them: ``safe_get_full_fp32_param`` and
  ``safe_get_full_optimizer_state`` (and the ``safe_set_full_*`` twins) under ZeRO 1-3 and
  bf16; the torch optimizer's own ``state`` under fp32 ZeRO-0, where the parameter is the
  master copy;
- the optimizer's step count; the LR schedule, the data position and the dropout masks
  are functions of the step, the global batch and the seed, which must match on resume;
- what one DP rank holds alone (``own_state``): its Adam moments when it steps on its own
  gradients (sign, Top-K, local SGD) and its error-feedback residuals (fp16, int8), in a
  file per rank keyed by the layout and DP method (``per_rank_key``). Only a run with the
  same key reads them; any other starts every DP rank from DP rank 0's moments and empty
  residuals, and says so in one line.

``--save DIR --save-every N`` writes ``DIR/step-000123`` and then, last, ``DIR/latest``;
``--keep K`` removes all but the newest K. ``--load DIR`` takes a checkpoint directory, or
the newest intact one of a series (``latest`` first), saying which, and falls back past a
damaged one with one line saying why. A save killed half-way leaves a ``.tmp-`` directory,
which is never a candidate, or, between its two renames, the last complete checkpoint moved
aside, which is (``megakit.train.resilience.save_dir`` lists each point and what it leaves).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch

from megakit.errors import UsageError
from megakit.interop.checkpoint import load_rank_state, load_state, named_parameters, stage_checkpoint
from megakit.interop.checkpoint_format import (
    MANIFEST,
    ShardReader,
    manifest_config,
    read_manifest,
    state_keys,
)
from megakit.train.resilience.save_dir import (  # noqa: F401 (LATEST, STEP_PREFIX, is_series: API, as before)
    LATEST,
    STEP_PREFIX,
    check_writable,
    holds_checkpoint,
    is_series,
    moved_aside,
    newest_complete,
    remove_leftovers,
    series_candidates,
    series_steps,
    temporaries,
)

TOKENIZER = "tokenizer"  # the data's tokenizer, copied into each checkpoint


# -- which checkpoint ------------------------------------------------------------------------------
def _intact(path: Path) -> str | None:
    """None if ``path`` is a complete checkpoint whose tensors match their checksums, else why not."""
    try:
        manifest = read_manifest(path)
        with ShardReader(path, manifest) as reader:
            reader.verify()
    except UsageError as error:
        return str(error)
    return None


def describe(checkpoint: Path, manifest: dict | None = None) -> str:
    """``step N, MODEL`` of a checkpoint, and where it was imported from (``megakit convert --from-hf``)."""
    manifest = manifest or read_manifest(checkpoint)
    words = [f"step {manifest['step']}"]
    if manifest["extra"].get("imported_from"):
        words.append(f"imported from {manifest['extra']['imported_from']}")
    try:
        config = manifest_config(manifest, source=str(checkpoint))
        words.append(
            f"{config.hf_type or config.family}, {config.layers} layers, hidden {config.hidden}, "
            f"{config.num_params() / 1e6:.2f} M parameters"
        )
    except UsageError:
        pass
    return ", ".join(words)


def choose_checkpoint(load: str, *, say=print, doing: str = "resuming from") -> Path:
    """The checkpoint ``--load`` (or a command reading one) means: the directory itself, or the newest intact one
    of a series; ``say`` names the one chosen (``megakit: <doing> DIR (step N, model)``), any damaged one passed
    over, and unfinished saves ignored. Where a save killed between its two renames moved the checkpoint aside
    (``DIR.old-*``, ``megakit.train.resilience.save_dir``), that copy is the one: it is read where it lies."""
    path = Path(load)
    ignored = temporaries(path)
    if ignored:
        say(
            f"megakit: ignoring {', '.join(str(p) for p in ignored)}: not (yet) complete (a save killed before "
            "it finished, or one still in progress: only the run that holds the --save lock may tell)"
        )
    if not is_series(path):
        moved = moved_aside(path) if not path.exists() else []
        if moved:
            say(
                f"megakit: {path} is missing: a save killed while replacing it moved its last complete checkpoint "
                f"aside to {moved[-1]}; {doing} that copy (the next save to {path.name} replaces it)"
            )
            path = moved[-1]
        manifest = read_manifest(path)  # one clear line if it is not a checkpoint
        say(
            f"megakit: {'starting from' if manifest['step'] == 0 and doing == 'resuming from' else doing} {path} "
            f"({describe(path, manifest)})"
        )
        return path
    if (path / LATEST).is_file():
        name = (path / LATEST).read_text().strip()
        newer = [c.name for c in series_steps(path) if c.name.split(".")[0] > name]
        if newer:
            say(
                f"megakit: {path}/{LATEST} names {name}, not the newer {', '.join(newer)}: a save killed before it "
                f"moved {LATEST}, or a run resumed from an earlier step; {LATEST} is the one taken"
            )
    for candidate in series_candidates(path):
        why = _intact(candidate)
        if why is None:
            aside = " (moved aside by a save killed while replacing it)" if ".old-" in candidate.name else ""
            say(f"megakit: {doing} {candidate}{aside} ({describe(candidate)})")
            return candidate
        say(f"megakit: skipping damaged checkpoint {candidate} ({why}); trying the one before")
    raise UsageError(f"--load {path}: no intact checkpoint in the series; start without --load or restore one")


def _inside(load: Path, save: Path) -> bool:
    """Whether ``--load`` resumes from the ``--save`` directory (it, a step of its series, or its moved-aside copy)."""
    load, save = load.absolute(), save.absolute()
    return (
        load == save
        or save in load.parents
        or (load.parent == save.parent and load.name.startswith(f"{save.name}.old-"))
    )


def check_checkpoint_flags(
    *, save: str | None, load: str | None, steps: int, series: bool = False, say=print
) -> tuple[int, Path | None]:
    """``(step to start from, checkpoint to load)``; UsageError for what would fail later.

    Runs before any process group exists. ``steps`` counts every step, loaded ones included
    (Megatron's ``--train-iters``), so the LR schedule in the ds_config means the same thing.
    ``series``: ``--keep`` (the saves go to ``DIR/step-N``). A ``--save`` directory must be writable, of the
    kind this run writes, and hold no other run's checkpoint: a run that does not resume from it would replace
    it (or, as a series beside a single checkpoint, leave ``--load DIR`` reading the old one).
    """
    if save:
        target = Path(save)
        if (
            target.exists()
            and not (target / MANIFEST).is_file()
            and not is_series(target)
            and (not target.is_dir() or any(target.iterdir()))
        ):
            raise UsageError(
                f"--save {target} exists and is not a megakit checkpoint; choose another directory or remove it"
            )
        check_writable(target, series=series)
        if series and ((target / MANIFEST).is_file() or moved_aside(target)):
            raise UsageError(
                f"--save {target} holds a single checkpoint, and --keep would write a series of "
                f"{target}/step-N beside it that --load {target} does not read; choose another --save "
                "directory for the series, or drop --keep to go on with the single checkpoint"
            )
        if not series and is_series(target):
            raise UsageError(
                f"--save {target} holds a --keep series; add --save-every N --keep K to go on with it, "
                "or choose another --save directory"
            )
        if holds_checkpoint(target) and not (load and _inside(Path(load), target)):
            raise UsageError(
                f"--save {target} already holds a checkpoint of another run, which this run "
                f"({'from ' + load if load else 'from scratch'}) would replace; resume that run with "
                f"--load auto{f' --init {load}' if load else ''} (the same command then restarts it), "
                "or choose another --save directory (or remove it)"
            )
    if not load:
        return 0, None
    chosen = choose_checkpoint(load, say=say)
    start = read_manifest(chosen)["step"]
    if start >= steps:
        raise UsageError(
            f"checkpoint {chosen} is at step {start} and --steps counts all steps, loaded ones "
            f"included; pass --steps larger than {start}"
        )
    return start, chosen


def check_same_run(checkpoint: Path, *, seed: int, global_batch: int, vocab_size: int | None = None) -> None:
    """The data position and the dropout masks resume only with the same seed and global batch (and the
    weights only into a model of the same vocabulary)."""
    manifest = read_manifest(checkpoint)
    extra = manifest["extra"]
    saved_vocab = manifest.get("config", {}).get("vocab_size")
    if vocab_size is not None and saved_vocab is not None and saved_vocab != vocab_size:
        raise UsageError(
            f"checkpoint {checkpoint} has a vocabulary of {saved_vocab} but this run's model and data have "
            f"{vocab_size}; resume with the --data (tokenizer) it was trained on"
        )
    for what, flag, ours in (
        ("seed", "--seed", seed),
        ("global_batch", "global batch (micro-batch x accumulation x DP)", global_batch),
    ):
        if what in extra and extra[what] != ours:
            raise UsageError(
                f"checkpoint {checkpoint} was trained with {what} {extra[what]}, this run has {ours}; "
                f"resume with the same {flag}, or the data position and dropout masks would not "
                "continue"
            )


# -- what the optimizer holds ----------------------------------------------------------------------
def _torch_optimizer(engine) -> torch.optim.Optimizer:
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _moment_keys(optimizer) -> list[str]:
    keys = {
        k
        for state in optimizer.state.values()
        for k, v in state.items()
        if k != "step" and torch.is_tensor(v) and v.dim() > 0
    }
    return sorted(keys) or ["exp_avg", "exp_avg_sq"]


def optimizer_step_count(engine) -> int:
    """The optimizer's step count: the largest kept anywhere. DeepSpeed's FusedAdam (an Adam ds_config without
    ``torch_adam``) advances only the last parameter's ``state["step"]`` in each group and steps them all with
    it, so the first parameter's count stays 0."""
    optimizer = _torch_optimizer(engine)
    counts = [int(state["step"]) for state in optimizer.state.values() if "step" in state]
    counts += [int(group.get("step", 0)) for group in optimizer.param_groups]
    return max(counts)


def _keys_of(optimizer, param, keys: list[str]) -> list[str]:
    """The moments among ``keys`` that ``param`` has: all, except where the optimizer says (``--optimizer muon``'s
    ``state_keys``: Muon's momentum or AdamW's two; under ZeRO 1-2 a rank without a fragment cannot see which)."""
    own = getattr(optimizer, "state_keys", None)
    return keys if own is None else [k for k in keys if k in own(param)]


def _host(name: str, tensor: torch.Tensor, copy=None) -> torch.Tensor:
    return copy(name, tensor) if copy is not None else tensor.detach().to("cpu", copy=True)


def optimizer_state(engine, copy=None) -> dict[str, dict[str, torch.Tensor]]:
    """Parameter name -> {"fp32": master, moment: tensor} on the CPU (this rank's TP shard, whole over DP), copied
    by ``copy(name, tensor)`` if given (``HostBuffers.copy``).

    Collective over DP under ZeRO (DeepSpeed gathers each fragment): every rank calls it.
    """
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    optimizer = _torch_optimizer(engine)
    keys = _moment_keys(optimizer)
    if optimizer.state:
        link_optimizer_state(engine)
    out = {}
    for name, param in named_parameters(engine.module).items():
        master = safe_get_full_fp32_param(param)
        if master is None:  # fp32 ZeRO-0: the parameter is the master, the torch optimizer holds the moments
            state = optimizer.state.get(param, {})
            out[name] = {k: _host(f"{k}/{name}", state[k], copy) for k in keys if k in state}
            continue
        out[name] = {"fp32": _host(f"fp32/{name}", master, copy)}
        for key in _keys_of(optimizer, param, keys):
            value = safe_get_full_optimizer_state(param, key)
            if value is not None:
                out[name][key] = _host(f"{key}/{name}", value, copy)
    return out


def _create_optimizer_state(engine, keys: list[str]) -> None:
    """Adam-style state for every parameter the torch optimizer steps, as its first step would make it.

    Before a first step nothing exists for DeepSpeed's ``safe_set_full_*`` to write into (ZeRO 3 steps its flat
    fp32 partitions, in the torch optimizer's groups only during its step); ZeRO 1-2 and bf16 then link each
    parameter to its fragment of the new state (DeepSpeed does the same after its first step).
    """
    optimizer = _torch_optimizer(engine)
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", [])  # ZeRO 3: out of param_groups between steps
    for p in [p for group in optimizer.param_groups for p in group["params"]] + list(flats):
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            for key in _keys_of(optimizer, p, keys):
                state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
    link_optimizer_state(engine)


def link_optimizer_state(engine) -> None:
    """(Re)link each parameter to its fragment of the optimizer state, for ``safe_get/set_full_*``.

    DeepSpeed links once, right after the first parameter group's first step, so a second
    group (megakit's undecayed biases and norms) is linked to state not yet created and
    its moments read as missing; linking again once every group has state fixes that.
    """
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        if hasattr(engine.optimizer, "_hp_optimizer_states_linked"):
            engine.optimizer._hp_optimizer_states_linked = False
        link()


def set_optimizer_state(engine, state: dict[str, dict[str, torch.Tensor]], step: int) -> None:
    """Put saved master weights, moments and the step count into the engine's optimizer (any ZeRO stage)."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    optimizer = _torch_optimizer(engine)
    keys = sorted({k for per in state.values() for k in per if k != "fp32"})
    _create_optimizer_state(engine, keys)
    with torch.no_grad():
        for name, param in named_parameters(engine.module).items():
            saved = state[name]
            if not hasattr(param, "_hp_mapping") and not hasattr(param, "ds_id"):  # fp32 ZeRO-0: torch's own
                if "fp32" in saved:  # saved by a mixed-precision or ZeRO run: the master is the better copy
                    param.copy_(saved["fp32"])
                for key in keys:  # --optimizer muon: a Muon matrix has a momentum, an AdamW one its two moments
                    if key in saved and key in optimizer.state[param]:
                        optimizer.state[param][key].copy_(saved[key])
                    else:
                        optimizer.state[param].pop(key, None)
                continue
            if "fp32" in saved:  # every DP rank calls: each writes its own fragment
                safe_set_full_fp32_param(param, saved["fp32"].to(param.device))
            for key in _keys_of(optimizer, param, keys):
                safe_set_full_optimizer_state(param, saved[key].to(param.device), key)
    for per_param in optimizer.state.values():
        if "step" in per_param:
            per_param["step"] = torch.tensor(
                float(step), dtype=per_param["step"].dtype, device=per_param["step"].device
            )
    for group in optimizer.param_groups:
        if "step" in group:
            group["step"] = step


# -- what only one DP rank holds -------------------------------------------------------------------
def per_rank_key(run, topo) -> dict:
    """What a resumed run must match to reuse per-rank state: every rank holding the same shard, and kept in step
    over DP the same way (the period of local SGD aside: it only says when to average)."""
    sync = "local-sgd" if run.cfg.local_sgd else str(run.compression)
    return {
        "tp": topo.tp,
        "pp": topo.pp,
        "dp": topo.dp,
        "cp": topo.cp,
        "vpp": run.cfg.vpp,
        "zero": run.zero_stage,
        "sync": sync,
    }


def _describe_key(key: dict) -> str:
    cp = f" x CP{key['cp']}" if key.get("cp", 1) > 1 else ""
    return f"TP{key.get('tp')} x PP{key.get('pp')} x DP{key.get('dp')}{cp}, ZeRO {key.get('zero')}, {key.get('sync')}"


def own_state(engine, topo, dp_sync) -> dict[str, torch.Tensor]:
    """What this rank alone holds, on the CPU, after ``dp_sync.synchronize()``: its error-feedback residuals, and
    its Adam moments when each DP rank steps on its own gradients (DP rank 0's are in the checkpoint already)."""
    out = {f"residual/{k}": t for k, t in dp_sync.state().items()}
    if dp_sync.own_moments and topo.get_data_parallel_rank() > 0:  # fp32 ZeRO 0 (run._check_dp_sync)
        optimizer = _torch_optimizer(engine)
        for name, param in named_parameters(engine.module).items():
            for key, value in optimizer.state.get(param, {}).items():
                if key != "step" and torch.is_tensor(value) and value.dim() > 0:
                    out[f"optimizer/{key}/{name}"] = value.detach().to("cpu", copy=True)
    return out


def restore_own_state(engine, topo, checkpoint: Path, dp_sync, key: dict, *, say=print) -> None:
    """After ``restore`` and once ``dp_sync`` exists: each rank's own moments and residuals, if the checkpoint
    was saved at ``key``; at another layout or DP method they are dropped, which ``say`` reports in one line."""
    saved = read_manifest(checkpoint).get("per_rank")
    if saved is None:
        return
    if saved["key"] != key:
        say(
            f"megakit: {checkpoint} holds per-DP-rank state (each replica's Adam moments, error-feedback residuals) "
            f"saved at {_describe_key(saved['key'])}; this run is {_describe_key(key)}, so every DP rank starts from "
            "DP rank 0's moments and empty residuals (the resume is not bitwise)"
        )
        return
    state = load_rank_state(checkpoint, topo)
    optimizer, params = _torch_optimizer(engine), named_parameters(engine.module)
    with torch.no_grad():
        for name, value in state.items():
            kind, _, rest = name.partition("/")
            if kind == "optimizer":
                moment, pname = rest.split("/", 1)
                optimizer.state[params[pname]][moment].copy_(value)
    dp_sync.load_state({name.partition("/")[2]: t for name, t in state.items() if name.startswith("residual/")})


# -- save and load ----------------------------------------------------------------------------------
def restore(engine, topo, checkpoint: Path, step: int) -> None:
    """After ``deepspeed.initialize``: the saved optimizer state (if any); the trainer places the LR schedule."""
    manifest = read_manifest(checkpoint)
    if state_keys(manifest):
        set_optimizer_state(
            engine, load_state(checkpoint, engine.module, topo), int(manifest["extra"].get("optimizer_step", step))
        )


def _add_tokenizer(source: Path, checkpoint: Path) -> None:
    """Copy the tokenizer beside the weights (to a temporary name, then renamed, before ``latest`` names it)."""
    from megakit.interop.tokenizer import copy_tokenizer

    tmp = checkpoint / f".{TOKENIZER}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    copy_tokenizer(source, tmp)
    shutil.rmtree(checkpoint / TOKENIZER, ignore_errors=True)
    os.replace(tmp, checkpoint / TOKENIZER)


def _last_complete(directory: Path) -> str:
    """The checkpoint a failed save leaves as the one to resume from, in words (for its error)."""
    try:
        chosen = newest_complete(directory)
        if chosen is not None:
            return f"the last complete checkpoint (step {read_manifest(chosen)['step']}, {chosen}) is intact"
    except (UsageError, OSError):
        pass
    return "there is no complete checkpoint yet"


def _size(checkpoint: Path) -> int:
    """Bytes of a checkpoint's tensor files, as its manifest lists them (no walk of the directory at every save)."""
    manifest = read_manifest(checkpoint)
    files = [*manifest["files"].values(), *manifest.get("per_rank", {}).get("files", {}).values()]
    return sum(entry.get("bytes", 0) for entry in files)


def save_run(
    directory: str,
    engine,
    topo,
    config,
    *,
    step: int,
    extra: dict,
    series: bool,
    keep: int,
    tokenizer: Path | None = None,
    dp_sync=None,
    rank_key: dict | None = None,
    writer=None,
    say=None,
) -> Path:
    """Save weights and optimizer state; in a series, as ``DIR/step-N`` with ``DIR/latest`` written last.
    ``tokenizer``: a directory whose tokenizer files go into ``CHECKPOINT/tokenizer`` (for ``convert --to-hf``).
    ``dp_sync`` (synchronized): each rank's own state is saved too, under ``rank_key`` (``per_rank_key``).
    ``writer`` (``--async-save``, an ``AsyncWriter``): return once the state is copied to host memory, after the
    previous save has finished; the writer writes and publishes it in the background.

    Once it is on disk, rank 0 says so in one line (step, path, size, seconds) and removes what saves killed
    mid-way left in DIR (``save_dir.remove_leftovers``): the caller holds DIR's lock (``save_lock``), so no other
    save is in progress there. Collective over the world (see ``save_checkpoint``); an error on any rank raises on
    every rank (with a writer: the write's, at its next ``wait``).
    """
    started, say = time.perf_counter(), say or (lambda text: print(text, flush=True))
    if writer is not None:
        writer.wait()  # one save at a time: host memory holds one copy of the state
    copy = writer.buffers.copy if writer is not None else None  # host buffers kept from the last save
    state = optimizer_state(engine, copy)  # collective over DP under ZeRO: every rank; copies on the CPU
    target = Path(directory) / f"{STEP_PREFIX}{step:07d}" if series else Path(directory)
    staged = stage_checkpoint(
        target,
        engine.module,
        topo,
        step=step,
        config=config,
        state=state,
        extra={**extra, "tp": topo.tp, "pp": topo.pp, "dp": topo.dp, "optimizer_step": optimizer_step_count(engine)},
        rank_state=None if dp_sync is None else own_state(engine, topo, dp_sync),
        rank_key=rank_key,
        copy=copy,
    )
    if topo.rank == 0:  # what a failed write reports as intact
        staged.intact = _last_complete(Path(directory))

    def publish() -> None:  # rank 0, once the checkpoint is in place
        if topo.rank != 0:
            return
        if tokenizer is not None:
            _add_tokenizer(tokenizer, target)
        if series:
            publish_in_series(Path(directory), target, keep=keep)
        background = ", written in the background" if writer is not None else ""
        say(
            f"megakit: saved step {step} to {target} ({_size(target) / 2**20:.1f} MiB, on disk "
            f"{time.perf_counter() - started:.1f} s after the step{background})"
        )
        remove_leftovers(directory, say=say)

    if writer is None:
        staged.write()
        publish()
    else:
        writer.submit(staged, then=publish)
    return target


def publish_in_series(directory: Path, target: Path, *, keep: int) -> None:
    """Point ``DIR/latest`` at ``target`` (a temporary name, then renamed), then remove all but the newest ``keep``
    complete checkpoints up to ``target`` (``save_dir.series_steps``: unfinished saves take no place, a copy moved
    aside does; ``target`` is never removed, nor a newer step an earlier trajectory left, which this run's own
    save of that step replaces)."""
    pointer = directory / f"{LATEST}.tmp"
    pointer.write_text(target.name + "\n")
    os.replace(pointer, directory / LATEST)
    complete = [p for p in series_steps(directory) if p.name.split(".")[0] <= target.name]  # newest first
    for old in complete[keep:]:
        shutil.rmtree(old, ignore_errors=True)
