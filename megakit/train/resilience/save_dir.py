"""What a ``--save`` directory holds: one checkpoint or a ``--keep`` series, which of it is complete, and what
saves killed mid-way left there.

A save publishes in steps (``megakit.interop.checkpoint``; the series' in ``resume.publish_in_series``):

1. every rank writes its shards to ``DIR.tmp-XXXX``;                  killed here: DIR as it was, a temporary
2. rank 0 writes the manifest there;                                  killed here: the same (never read)
3. an existing ``DIR`` is renamed ``DIR.old-YYYY``;                   killed here: no DIR, the last complete
                                                                      checkpoint at ``DIR.old-YYYY``
4. ``DIR.tmp-XXXX`` is renamed ``DIR``;                               killed here: DIR new, the old copy beside
5. the old copy is removed;
6. in a series: ``latest`` names the new ``step-N`` (a temporary, renamed); older ones beyond ``--keep`` go.

So a checkpoint is complete once renamed into place, and a ``.tmp-`` never is. A moved-aside
``.old-`` copy is complete: where the checkpoint it was moved aside for is in place it is older
and stale; where not (killed at 3), it is the newest complete checkpoint, which ``--load``
resumes from where it lies and which is removed only once a newer save has been published.
"""

from __future__ import annotations

import glob
import shutil
from pathlib import Path

from megakit.errors import UsageError
from megakit.interop.checkpoint import existing_ancestor
from megakit.interop.checkpoint_format import MANIFEST, read_manifest
from megakit.train.engine.deepspeed_shm import unwritable

LATEST = "latest"
STEP_PREFIX = "step-"


def is_series(directory: str | Path) -> bool:
    """Whether ``directory`` holds a ``--keep`` series of checkpoints rather than one."""
    path = Path(directory)
    return (
        path.is_dir()
        and not (path / MANIFEST).is_file()
        and ((path / LATEST).is_file() or any(path.glob(f"{STEP_PREFIX}*")))
    )


def _siblings(path: Path, kind: str) -> list[Path]:
    """``path.tmp-*`` or ``path.old-*``, by name."""
    return sorted(path.parent.glob(f"{glob.escape(path.name)}.{kind}-*"))


def moved_aside(path: Path) -> list[Path]:
    """The complete copies of ``path`` that saves killed between their two renames left, oldest step first."""
    found = [p for p in _siblings(path, "old") if (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: _step(p))


def _step(path: Path) -> int:
    try:
        return int(read_manifest(path)["step"])
    except (UsageError, KeyError, TypeError, ValueError):
        return -1


def series_steps(directory: Path) -> list[Path]:
    """A series' complete checkpoints, newest first: each ``step-N``, or, where a save killed while replacing it
    moved it aside, its ``step-N.old-*`` copy."""
    out = []
    for path in sorted(directory.glob(f"{STEP_PREFIX}[0-9]*"), reverse=True):
        if "." in path.name or not path.is_dir():
            continue
        out.append(path)
    names = {p.name for p in out}
    for old in directory.glob(f"{STEP_PREFIX}[0-9]*.old-*"):
        if old.name.split(".old-")[0] not in names and (old / MANIFEST).is_file():
            out.append(old)
    return sorted(out, key=lambda p: p.name.split(".")[0], reverse=True)


def series_candidates(directory: Path) -> list[Path]:
    """A series' checkpoints in the order ``--load`` tries them: the one ``latest`` names (or its moved-aside copy;
    the named path itself where neither is complete, which the reader then finds damaged) first, then the other
    complete ones, newest first."""
    candidates = series_steps(directory)
    if (directory / LATEST).is_file():
        name = (directory / LATEST).read_text().strip()
        pointed = [c for c in candidates if c.name.split(".old-")[0] == name] or [directory / name]
        candidates = pointed[:1] + [c for c in candidates if c != pointed[0]]
    return candidates


def newest_complete(save: str | Path) -> Path | None:
    """The checkpoint ``--load`` takes first from ``save`` (``resume.choose_checkpoint``, which also verifies its
    checksums: not here, which would read it whole), or None."""
    path = Path(save)
    if is_series(path):
        return next((c for c in series_candidates(path) if (c / MANIFEST).is_file()), None)
    if (path / MANIFEST).is_file():
        return path
    moved = moved_aside(path) if not path.exists() else []
    return moved[-1] if moved else None


def holds_checkpoint(save: str | Path) -> bool:
    """Whether the ``--save`` directory holds a complete checkpoint (in place, moved aside, or in its series)."""
    path = Path(save)
    return (path / MANIFEST).is_file() or bool(moved_aside(path)) or (is_series(path) and bool(series_steps(path)))


def temporaries(path: Path) -> list[Path]:
    """Unfinished saves of ``path`` (a checkpoint directory or a series): never read, whatever they hold."""
    found = _siblings(path, "tmp")
    if path.is_dir() and not (path / MANIFEST).is_file():
        found += sorted(path.glob(f"{STEP_PREFIX}*.tmp-*")) + sorted(path.glob(f"{LATEST}.tmp"))
    return found


def leftovers(save: str | Path, *, keep: Path | None = None) -> list[Path]:
    """What saves killed mid-way left in the ``--save`` directory and nothing will read: the unfinished saves, and
    the moved-aside copies of checkpoints that are in place again (a copy is kept while it is the newest).
    ``keep``: the checkpoint this run loads (``--load DIR.old-X``), never one of them, however stale."""
    path = Path(save)
    found = temporaries(path)
    if (path / MANIFEST).is_file():  # a copy of a later step than the one in place is some other run's: kept
        found += [old for old in _siblings(path, "old") if _step(old) <= _step(path)]
    if path.is_dir() and not (path / MANIFEST).is_file():
        for old in sorted(path.glob(f"{STEP_PREFIX}[0-9]*.old-*")):
            if (path / old.name.split(".old-")[0] / MANIFEST).is_file():
                found.append(old)
    kept = keep.absolute() if keep is not None else None
    return [p for p in found if p.absolute() != kept]


def remove_leftovers(save: str | Path, *, keep: Path | None = None, say=print) -> list[Path]:
    """Remove ``leftovers(save, keep=keep)``, naming them in one line. Only the run that holds the directory's lock
    (``save_lock``) may: another run's save in progress looks the same."""
    found = leftovers(save, keep=keep)
    for path in found:
        try:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        except OSError as error:  # named, not fatal: nothing reads it
            say(f"megakit: could not remove {path} ({error.strerror or error}); nothing reads it")
    if found:
        say(f"megakit: removed what saves killed mid-way left in {save}: {', '.join(p.name for p in found)}")
    return found


def check_writable(save: str | Path, *, series: bool) -> None:
    """UsageError unless this process can create files where a save writes: beside DIR (its temporaries, the run's
    lock and attempts record) and, for a series, in DIR (``deepspeed_shm.unwritable``'s probe file, in the nearest
    directory that exists: nothing is made here)."""
    target = Path(save).absolute()
    for place in [target.parent] + ([target] if series and target.is_dir() else []):
        existing = existing_ancestor(place)
        if not existing.is_dir():
            raise UsageError(
                f"--save {save}: {existing} is a file, not a directory, so no checkpoint can be written "
                "under it; choose another --save path"
            )
        why = unwritable(existing)
        if why is not None:
            raise UsageError(f"--save {save}: cannot write in {existing} ({why}); choose a writable --save directory")
