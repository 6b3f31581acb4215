"""Suite-wide hygiene for the multi-process tests: no job may leave a DeepSpeed buffer in /dev/shm.

DeepSpeed's CPU all-reduce names a shared-memory buffer per rank of a launched job
(``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never removes it; the trainer
unlinks the names once every rank has mapped them (``megakit.train.deepspeed_shm``). After each module,
a buffer named with a port this session handed out (``multiproc.free_port``) is a leak: it is removed,
and the module fails (wiping them silently hid exactly that). Other processes' buffers are left alone.
"""

import glob
import os
import sys

import pytest


def _issued_ports() -> set[int]:
    # the helper is imported both as ``multiproc`` and as ``tests.multiproc``: two modules, two sets
    return {port for name in ("multiproc", "tests.multiproc") if name in sys.modules
            for port in sys.modules[name].ISSUED_PORTS}


def _port(path: str) -> int | None:
    parts = os.path.basename(path).split("_")
    return int(parts[-2]) if len(parts) >= 2 and parts[-2].isdigit() else None


@pytest.fixture(autouse=True, scope="module")
def _no_deepspeed_shared_memory_left():
    yield
    ports = _issued_ports()
    left = sorted(p for p in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*") if _port(p) in ports)
    for path in left:
        try:
            os.remove(path)
        except OSError:
            pass
    assert not left, f"a job of this module left DeepSpeed buffers in /dev/shm (removed now): {left}"
