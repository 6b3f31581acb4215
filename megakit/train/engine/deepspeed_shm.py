"""DeepSpeed's CPU all-reduce buffers in /dev/shm: named only as long as the ranks need the names."""

from __future__ import annotations

import contextlib
import glob
import os

import torch.distributed as dist

from megakit.nn import comm


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
    pattern = (f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}_"
               f"{env.get('MASTER_PORT', '')}_{dist.get_rank()}")
    for path in glob.glob(glob.escape(pattern)):
        with contextlib.suppress(OSError):
            os.remove(path)
