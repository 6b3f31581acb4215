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
Lustre (mounted with ``flock``) carry it between nodes.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from megakit.errors import UsageError
from megakit.train.resilience.save_dir import remove_leftovers


def lock_path(save: str | Path) -> Path:
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
    return (f"--save {save} is in use by another run ({held}); two runs on one --save would replace each other's "
            "checkpoints: wait for it to end or stop it, or choose another --save")


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
                say(f"megakit: warning: the filesystem of --save {save} cannot lock {path} "
                    f"({error.strerror or error}); nothing stops a second run from writing there too")
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
        record = {"host": socket.gethostname(), "pid": os.getpid(),
                  "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
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


def hold_save_dir(save: str | None, *, rank: int, say=print) -> SaveLock | None:
    """Rank 0 takes ``save``'s lock for the run and removes what saves killed mid-way left there
    (``save_dir.remove_leftovers``); every rank learns the outcome (a broadcast over the world), so a refusal
    is raised alike on every rank, before any step. None without ``--save``, and on every other rank."""
    from megakit.nn import comm

    if not save:
        return None
    lock, refusal = None, None
    if rank == 0:
        try:
            lock = SaveLock.acquire(save, say=say)
            remove_leftovers(save, say=say)
        except UsageError as error:
            refusal = str(error)
    refusal = comm.broadcast_object(refusal, 0, comm.WORLD)
    if refusal is not None:
        raise UsageError(refusal)
    return lock
