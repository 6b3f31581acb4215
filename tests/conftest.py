"""Suite-wide hygiene for the multi-process tests: no job may leave a DeepSpeed buffer in /dev/shm.

DeepSpeed's CPU all-reduce names a shared-memory buffer per rank of a launched job
(``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never removes it; the trainer
unlinks the names once every rank has mapped them (``megakit.train.engine.deepspeed_shm``). After each module,
a buffer named with a port this session handed out (``multiproc.free_port``) is a leak: it is removed,
and the module fails (wiping them silently hid exactly that). Other processes' buffers are left alone.

Launcher jobs shared by several modules (a start costs more than most cases) are session fixtures here.

Under pytest-xdist (the README's ``-n 2 --dist loadgroup``) the tests that share a module- or session-scoped
fixture -- one launcher job, one prepared data set -- form one unit of work, so a job runs once, on one worker;
every other test goes wherever a worker is free.
"""

import glob
import json
import os
import sys

import pytest


def _issued_ports() -> set[int]:
    # the helper is imported both as ``multiproc`` and as ``tests.multiproc``: two modules, two sets
    return {
        port
        for name in ("multiproc", "tests.multiproc")
        if name in sys.modules
        for port in sys.modules[name].ISSUED_PORTS
    }


def _port(path: str) -> int | None:
    parts = os.path.basename(path).split("_")
    return int(parts[-2]) if len(parts) >= 2 and parts[-2].isdigit() else None


_AUTOUSE = {"_no_deepspeed_shared_memory_left"}  # module-scoped, but each worker's copy checks its own jobs


@pytest.hookimpl(tryfirst=True)  # before xdist names each test's group from its mark
def pytest_collection_modifyitems(items):
    """Mark each test with its xdist group: the tests joined, directly or through others, by a shared fixture wider
    than a test (autouse ones excepted: every test of a module uses them, and each worker's copy checks its own)."""
    parent: dict = {}

    def find(key):
        while parent.setdefault(key, key) != key:
            key = parent[key] = parent[parent[key]]
        return key

    shared = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs if info else {}
        shared[item] = [
            (item.module.__name__ if d[-1].scope == "module" else "session", name)
            for name, d in defs.items()
            if d
            and d[-1].scope in ("module", "session")
            and d[-1].baseid  # ours, not pytest's
            and name not in _AUTOUSE
        ]
        for key in shared[item]:
            parent[find(key)] = find(shared[item][0])
    for item in items:
        group = find(shared[item][0]) if shared[item] else (item.nodeid,)
        item.add_marker(pytest.mark.xdist_group("/".join(map(str, group))))


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


@pytest.fixture(scope="session")
def resume_jobs(tmp_path_factory) -> dict:
    """test_resume.py's and test_resume_compressed.py's 4-process cases in ONE launcher job; per module: its
    directory, cases, results and the job's stdout."""
    import test_resume
    import test_resume_compressed
    from test_trainer import sweep

    jobs = {}
    for module in (test_resume, test_resume_compressed):
        tmp = tmp_path_factory.mktemp(module.__name__)
        jobs[module.__name__] = {"tmp": tmp, "cases": module.sweep_cases(tmp)}
    output: list[str] = []
    results = sweep(tmp_path_factory, 4, [case for job in jobs.values() for case in job["cases"]], output=output)
    for job in jobs.values():
        job["results"], results = results[: len(job["cases"])], results[len(job["cases"]) :]
        job["stdout"] = output[0]
    return jobs


@pytest.fixture
def plan_json(monkeypatch, capsys):
    """``megakit plan ... --json`` in-process, returning its "plan" object (the calibration tests' way in). The exact
    parameter count is skipped: it builds the model through transformers only to name it, and the cost never reads
    it."""
    import megakit.interop.hf as hf
    from megakit.commands.cli import main

    monkeypatch.setattr(hf, "exact_param_count", lambda raw: None)

    def run(*argv) -> dict:
        assert main(["plan", *map(str, argv), "--json"]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)["plan"]

    return run
