"""Asynchronous checkpoints (``--async-save``): the step waits only for the copy of the state to host memory.

A save has two halves (``megakit.interop.checkpoint``): ``stage_checkpoint`` checks the
request and copies this rank's tensors to host memory, with the trainer's own collectives;
``StagedCheckpoint.write`` writes the safetensors shards, fsyncs them, gathers every rank's
record to rank 0, which writes the manifest and renames the temporary directory into place.
``AsyncWriter`` runs the second half in a background thread, as torch.distributed.checkpoint's
``async_save`` and DeepSpeed's asynchronous checkpoint engines do, and keeps megakit's format:

- its collectives go over a group of their own (``comm.side_group``, gloo), so they never
  interleave with the trainer's on the world group, which the main thread goes on using;
- one save at a time: ``submit`` first waits for the previous one (and re-raises its error),
  so checkpoints are published in order and host memory holds one copy of the state;
- that copy goes into host buffers kept from one save to the next (``HostBuffers``; pinned on a
  GPU, copied without blocking, then one synchronisation): allocating gigabytes afresh at each
  save costs more than copying into them (on this project's CPU VM, 5 s instead of 1 for 2.4 GB);
- a crash during the write leaves what a crashed synchronous save leaves: a ``.tmp-``
  directory that no reader takes, and the previous checkpoint as it was;
- the caller waits at the end (``wait``) and before it needs the newest checkpoint on disk (a
  rollback); an error raised in the background is raised there, on every rank alike.
"""

from __future__ import annotations

import threading

import torch


class HostBuffers:
    """Host tensors for a save's copies, by name, reused by the next save of the same shapes."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def copy(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` copied into this save's host buffer ``name`` (valid once ``AsyncWriter.submit`` returns)."""
        buffer = self._buffers.get(name)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
            self._buffers[name] = buffer
        return buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)


class AsyncWriter:
    """One background thread at a time running a checkpoint's write; ``wait()`` joins it and raises its error."""

    def __init__(self, group) -> None:
        self.group = group  # what the write's collectives go over (a group no other thread uses)
        self.buffers = HostBuffers()  # free for the next save's copies once wait() has returned
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, staged, then=None) -> None:
        """Write ``staged`` (a ``StagedCheckpoint``) in the background, after the previous save has finished;
        ``then()`` runs after it is published (a series' ``latest`` pointer, pruning)."""
        self.wait()
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the host copies made without blocking have landed

        def work() -> None:
            try:
                staged.write(self.group)
                if then is not None:
                    then()
            except BaseException as error:  # raised again by wait(), in the caller's thread
                self._error = error

        # a daemon: a process that dies does not wait on it (its .tmp- directory is never read)
        self._thread = threading.Thread(target=work, name="megakit-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the save in flight (if any) is on disk; raise its error, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
