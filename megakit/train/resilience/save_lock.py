"""One writer per ``--save`` directory: rank 0 holds an ``fcntl.flock`` on ``.DIR.lock`` for the whole run.

Two runs on one ``--save`` (a Slurm requeue while the old job still runs, a copied job script)
would replace each other's checkpoints and read each other's attempts record. The lock file
sits beside DIR, not inside it, for the reason the attempts record does: a single checkpoint
at DIR is replaced by a rename at every save, and a lock on a file inside would go with the
old copy, so a second run would lock a new file unopposed.

The file names its holder (host, PID, start), so a second run refuses in one line that says who
holds it. The kernel drops a flock when its process dies, however it dies; a file left by a
killed run is therefore free, and the next run takes it over and says whose it was. ``release``
removes the file. On a shared filesystem the lock is as good as its ``flock``: NFS v4 and
Lustre (mounted with ``flock``) carry it between nodes; NFS with ``local_lock=flock|all`` and
Lustre with ``localflock`` keep it per node, so there it does not guard two nodes.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from megakit.errors import UsageError
from megakit.interop.checkpoint_format import read_manifest
from megakit.train.resilience.save_dir import holds_checkpoint, remove_leftovers


def lock_path(save: str | Path) -> Path:
    """The lock file of a ``--save`` directory (beside it, hidden)."""
    path = Path(save)
    return path.with_name(f".{path.name}.lock")


def _holder(fd: int) -> str:
    """Who the lock file says holds it, in words ("" if it names no one)."""
    try:
        data = json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        return f"host {data['host']}, PID {data['pid']}, started {data['started']}"
    except (OSError, ValueError, KeyError, TypeError):
        return ""


def in_use(save: str | Path, held: str) -> str:
    """The one line that says another run holds ``save``."""
    return (
        f"--save {save} is in use by another run ({held}); two runs on one --save would replace each other's "
        "checkpoints: wait for it to end or stop it, or choose another --save"
    )


def holder(save: str | Path) -> str | None:
    """Who holds ``save``'s lock now, in words, or None (``train.py --check``: a job that would be refused)."""
    path = lock_path(save)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return _holder(fd) or f"see {path}"
    except OSError:
        return None
    finally:
        os.close(fd)


class SaveLock:
    """The lock on one ``--save`` directory, held from ``acquire`` until ``release`` (or the process's end)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @classmethod
    def acquire(cls, save: str | Path, *, say=print) -> "SaveLock":
        """Take the lock or raise UsageError naming its holder; a lock a dead run left is taken over, said in
        one line."""
        path = lock_path(save)
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                held = _holder(fd) or f"see {path}"
                os.close(fd)
                raise UsageError(in_use(save, held)) from None
            except OSError as error:  # a filesystem without locks: the run goes on, unguarded, and says so
                os.close(fd)
                path.unlink(missing_ok=True)
                say(
                    f"megakit: warning: the filesystem of --save {save} cannot lock {path} "
                    f"({error.strerror or error}); nothing stops a second run from writing there too"
                )
                return cls(path, None)
            try:  # the file we locked is still the one at the path (a releasing run may have just removed it)
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        previous = _holder(fd)
        if previous:
            say(f"megakit: took over the lock on --save {save} from a run that is gone ({previous})")
        record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(record).encode(), 0)
        return cls(path, fd)

    def release(self) -> None:
        """Remove the lock file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            if os.stat(self.path).st_ino == os.fstat(self._fd).st_ino:
                self.path.unlink()
        except FileNotFoundError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None


def changed(save: str | Path, checkpoint: Path | None, start: int) -> str | None:
    """Why what ``resolve`` chose to load before the lock was taken (``checkpoint`` at step ``start``, or nothing)
    no longer holds now that it is, or None: a run that held the lock meanwhile (the job a requeue replaced, still
    saving as it stopped) may have published a newer checkpoint there."""
    if checkpoint is None:
        if not holds_checkpoint(save):
            return None
        what = "it held no checkpoint when this run chose to start from step 0"
        now = "holds one"
    else:
        try:
            step = read_manifest(checkpoint)["step"]
        except UsageError:
            step = None
        if step == start:
            return None
        what = f"this run chose {checkpoint} at step {start}"
        now = "is gone" if step is None else f"is at step {step}"
    return (
        f"--save {save} changed while this run started: {what}, and that {now} now (another run saved there "
        "before this one took the directory's lock); start the run again"
    )


def hold_save_dir(
    save: str | None, *, rank: int, checkpoint: Path | None = None, start: int = 0, say=print
) -> SaveLock | None:
    """Rank 0 takes ``save``'s lock for the run, checks that ``checkpoint`` (the one ``resolve`` chose, at step
    ``start``; None: from scratch) is still what DIR holds (``changed``), and removes what saves killed mid-way left
    there (``save_dir.remove_leftovers``), never ``checkpoint``. Every rank learns the verdict (a broadcast over
    the world, sent whatever rank 0 met), so a refusal is raised alike on every rank, before any step. None
    without ``--save``, and on every other rank."""
    from megakit.nn import comm

    if not save:
        return None
    lock, verdict, raised = None, None, None
    if rank == 0:
        try:
            lock = SaveLock.acquire(save, say=say)
            verdict = changed(save, checkpoint, start)
            if verdict is None:
                remove_leftovers(save, keep=checkpoint, say=say)
        except UsageError as error:
            verdict = str(error)
        except OSError as error:  # a directory at the lock's path, a lock file another user owns: the user's to fix
            verdict = (
                f"--save {save}: cannot lock {lock_path(save)} ({error.strerror or error}); remove it or "
                "make it writable, or choose another --save"
            )
        except Exception as error:  # an internal error: raised here, and named on the ranks that wait for rank 0
            raised, verdict = error, f"rank 0 failed while taking --save {save}: {type(error).__name__}: {error}"
        if verdict is not None and lock is not None:
            lock.release()
            lock = None
    verdict = comm.broadcast_object((verdict, raised is not None), 0, comm.WORLD)
    if raised is not None:
        raise raised
    if verdict[0] is not None:
        raise (RuntimeError if verdict[1] else UsageError)(verdict[0])
    return lock
