"""DeepSpeed's CPU all-reduce: where its op is built, room for its buffers in /dev/shm, and their names there.

On CPU, ``deepspeed.initialize`` builds (at a machine's first run) and loads its shared-memory all-reduce op,
and when every rank is on one host (the launcher's LOCAL_SIZE is the world size) each rank writes a buffer of
``WORKSPACE_BYTES`` to /dev/shm. Both fail badly in DeepSpeed 0.19.8: a HOME that cannot be written stops the
build with a traceback, and a /dev/shm without room for the buffers can end the ranks with SIGSEGV and no word
(``shared_create`` takes a failed ``write``'s -1 for a size and maps that). These checks run first.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import math
import os
import shutil
import stat
import tempfile

import torch
import torch.distributed as dist

from megakit.errors import UsageError
from megakit.nn import comm

# shm.cpp's ``struct allreduce_workspace`` (DeepSpeed 0.19.8): ``enum coll_state states[2]`` (4 bytes each), then
# two 1 MiB buffers for small all-reduces and two of 32 MiB for large ones (``char buffer[2 * 1 MiB + 2 * 32 MiB]``).
# Each rank writes all of it, so tmpfs holds every byte: 69,206,024 B, 69,210,112 B in 4 KiB pages.
WORKSPACE_BYTES = 2 * 4 + 2 * 2**20 + 2 * 32 * 2**20


def unwritable(directory: str | os.PathLike) -> str | None:
    """None when ``directory`` can be made and written in, else why not: a probe file, gone at once (permissions
    alone miss a read-only mount or an immutable directory). Also ``save_dir.check_writable``'s probe."""
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as error:
        return error.strerror or type(error).__name__
    return None


def writable_extensions_dir(*, say=print) -> None:
    """Make sure DeepSpeed can build its ops: TORCH_EXTENSIONS_DIR, else torch's default under HOME's cache;
    when HOME's cannot be written, a directory of the system's temporary one instead, said in one line.
    UsageError (one line naming TORCH_EXTENSIONS_DIR) when no place can be written."""
    from torch.utils.cpp_extension import get_default_build_root

    chosen = os.environ.get("TORCH_EXTENSIONS_DIR")
    if chosen:
        why = unwritable(chosen)
        if why is not None:
            raise UsageError(
                f"TORCH_EXTENSIONS_DIR={chosen} cannot be written ({why}); DeepSpeed builds its CPU "
                "ops there: point it at a writable directory"
            )
        return
    default = get_default_build_root()
    why = unwritable(default)
    if why is None:
        return
    fallback = os.path.join(tempfile.gettempdir(), f"torch_extensions_{os.getuid()}")
    unsafe = "" if _private(fallback) else f" (not {fallback}: it is another user's, or others can write in it)"
    try:
        if unsafe:  # a name anyone can guess: another user could have made it and planted an op there to be loaded
            fallback = tempfile.mkdtemp(prefix=f"torch_extensions_{os.getuid()}_")  # built anew at each run
            atexit.register(shutil.rmtree, fallback, ignore_errors=True)
        elif unwritable(fallback) is not None:
            raise OSError
    except OSError:
        raise UsageError(
            f"DeepSpeed builds its CPU ops in {default}, which cannot be written ({why}), and "
            f"{fallback} cannot either; set TORCH_EXTENSIONS_DIR to a writable directory"
        ) from None
    os.environ["TORCH_EXTENSIONS_DIR"] = fallback
    say(
        f"megakit: {default} cannot be written ({why}); DeepSpeed builds its CPU ops in {fallback} instead{unsafe} "
        "(set TORCH_EXTENSIONS_DIR to choose)"
    )


def _private(directory: str) -> bool:
    """Whether ``directory`` (made with mode 0700 when absent) is this user's own and no one else can write in it:
    DeepSpeed loads the ops it finds built there."""
    with contextlib.suppress(OSError):  # FileExistsError among them
        os.mkdir(directory, 0o700)
    try:
        info = os.lstat(directory)  # not a link: it could lead anywhere
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o022


def _creates_buffers() -> bool:
    """Whether ``deepspeed.initialize`` will write the buffers: DeepSpeed's own test (CPU accelerator, its op
    usable, every rank on this host, its communication not started yet); alike on every rank."""
    import deepspeed.comm as ds_comm
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    builder = accelerator.create_op_builder("ShareMemCommBuilder") if accelerator.device_name() == "cpu" else None
    return (
        builder is not None
        and deepspeed.ops.__compatible_ops__.get(builder.NAME, False)
        and os.environ.get("LOCAL_SIZE") == str(dist.get_world_size())
        and not ds_comm.is_initialized()
    )


def check_shared_memory(path: str = "/dev/shm") -> None:
    """UsageError, alike on every rank, when ``path`` lacks room for every local rank's buffer.

    Collective over WORLD (one small all-reduce) when the buffers are to be written; call it on every rank
    before ``deepspeed.initialize``, after a collective that every rank reaches before any of them gets there.
    """
    if not _creates_buffers():
        return
    ranks = dist.get_world_size()
    page = os.sysconf("SC_PAGE_SIZE")
    need = ranks * math.ceil(WORKSPACE_BYTES / page) * page
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    short = torch.tensor([float(free < need)])
    comm.all_reduce(short, comm.WORLD)  # ranks that saw another moment's free space still decide alike
    if short.item():
        mib = 2**20
        raise UsageError(
            f"DeepSpeed's CPU all-reduce needs {need / mib:.0f} MiB of {path} ({WORKSPACE_BYTES / mib:.0f}"
            f" MiB for each of the {ranks} ranks on this host) but {free / mib:.0f} MiB is free (short of "
            "it, they can die of SIGSEGV): free some, or enlarge it (Docker: --shm-size="
            f"{math.ceil((need + 256 * mib) / 2**30)}g; its default is 64m)"
        )


def unlink_shared_memory() -> None:
    """Remove the name of this rank's DeepSpeed CPU all-reduce buffer from /dev/shm, keeping the buffer.

    DeepSpeed 0.19.8's shared-memory all-reduce (CPU, all ranks on one host) creates
    ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<MASTER_ADDR>_<MASTER_PORT>_<rank>`` and never
    removes it. Every rank has mapped every buffer once ``deepspeed.initialize`` returned
    everywhere (the barrier), so the names can go at once: the mappings live on, and the
    memory is freed when the job ends on any exit path, SIGKILL included. Call it on every
    rank right after ``deepspeed.initialize``.
    """
    comm.barrier(comm.WORLD)
    env = os.environ
    pattern = (
        f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
        f"{env.get('MASTER_PORT', '')}_{dist.get_rank()}"
    )
    for path in glob.glob(glob.escape(pattern)):
        with contextlib.suppress(OSError):
            os.remove(path)
