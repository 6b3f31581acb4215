"""Suite-wide hygiene for the multi-process tests."""

import glob
import os

import pytest


@pytest.fixture(autouse=True, scope="module")
def _clear_deepspeed_shared_memory():
    """DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank in /dev/shm when a job
    ends; dozens of launched jobs would otherwise fill RAM. No job outlives its test module."""
    yield
    for path in glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"):
        try:
            os.remove(path)
        except OSError:
            pass
