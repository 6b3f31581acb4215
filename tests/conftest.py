"""Suite-wide hygiene for the multi-process tests: no job may leave a DeepSpeed buffer in /dev/shm.

DeepSpeed's CPU all-reduce names a shared-memory buffer per rank of a launched job
(``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never removes it; the trainer
unlinks the names once every rank has mapped them (``megakit.train.deepspeed_shm``). After each module,
a buffer named with a port this session handed out (``multiproc.free_port``) is a leak: it is removed,
and the module fails (wiping them silently hid exactly that). Other processes' buffers are left alone.

Launcher jobs shared by several modules (a start costs more than most cases) are session fixtures here: one
2-process and one 4-process job run the cases of test_trainer, test_moe_train, test_moe_hf_step, test_resume and
test_resume_compressed; one 2-process guard job those of test_guards and test_spikes.
"""

import glob
import json
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


def _shared_job(tmp_path_factory, nprocs: int, parts: dict[str, dict]) -> dict[str, dict]:
    """Run every part's ``cases`` in ONE launcher job of ``nprocs`` processes, in the order given; per part: its
    entries plus its ``results`` and the job's ``stdout``."""
    from test_trainer import sweep

    output: list[str] = []
    results = sweep(tmp_path_factory, nprocs, [case for part in parts.values() for case in part["cases"]],
                    timeout=1800, output=output)
    for part in parts.values():
        part["results"], results = results[:len(part["cases"])], results[len(part["cases"]):]
        part["stdout"] = output[0]
    return parts


@pytest.fixture(scope="session")
def token_shards(tmp_path_factory) -> str:
    from test_trainer import _token_shards

    return _token_shards(tmp_path_factory)


@pytest.fixture(scope="session")
def two_process_job(tmp_path_factory, token_shards) -> dict:
    """test_moe_train.py's EP 2 cases, then test_trainer.py's DP x ZeRO sweep, in ONE 2-process job."""
    import test_moe_train
    import test_trainer

    parts = {"test_moe_train": {"cases": test_moe_train.ep2_cases()},
             "test_trainer": {"cases": test_trainer.dp_cases(tmp_path_factory, token_shards)}}
    os.environ["MEGAKIT_FP8_EMULATE"] = "1"  # read by the --fp8 cases only
    try:
        return _shared_job(tmp_path_factory, 2, parts)
    finally:
        del os.environ["MEGAKIT_FP8_EMULATE"]


@pytest.fixture(scope="session")
def four_process_job(tmp_path_factory, token_shards) -> dict:
    """test_resume.py's, test_resume_compressed.py's, test_moe_hf_step.py's and test_moe_train.py's 4-process cases,
    then test_trainer.py's TP x PP x CP sweep (its compiled case last), in ONE 4-process job; per module: its
    directory (``tmp``)."""
    import test_moe_hf_step
    import test_moe_train
    import test_resume
    import test_resume_compressed
    import test_trainer

    parts = {}
    for module in (test_resume, test_resume_compressed, test_moe_hf_step):
        tmp = tmp_path_factory.mktemp(module.__name__)
        parts[module.__name__] = {"tmp": tmp, "cases": module.sweep_cases(tmp)}
    saved = tmp_path_factory.mktemp("moe-ckpt")
    parts["test_moe_train"] = {"tmp": saved, "cases": test_moe_train.ep4_cases(saved)}
    parts["test_trainer"] = {"cases": test_trainer.mp_cases(tmp_path_factory, token_shards)}
    return _shared_job(tmp_path_factory, 4, parts)


@pytest.fixture(scope="session")
def resume_jobs(four_process_job) -> dict:
    """test_resume.py's and test_resume_compressed.py's part of the 4-process job: per module its directory, cases,
    results and the job's stdout."""
    return four_process_job


@pytest.fixture(scope="session")
def guard_job(tmp_path_factory) -> dict:
    """test_guards.py's NaN-guard cases and test_spikes.py's spiked run, each case with its own injected ``faults``,
    in ONE 2-process job of tests/guard_sweep.py; per module: its directory, cases, results and the job's log."""
    import test_guards
    import test_spikes
    from multiproc import free_port
    from test_trainer import deepspeed

    parts = {}
    for module in (test_guards, test_spikes):
        tmp = tmp_path_factory.mktemp(module.__name__)
        parts[module.__name__] = {"tmp": tmp, "cases": module.sweep_cases(tmp)}
    work = tmp_path_factory.mktemp("guard_job")
    (work / "cases.json").write_text(json.dumps([case for part in parts.values() for case in part["cases"]]))
    port = free_port()
    out = deepspeed(2, "tests/guard_sweep.py", str(work / "cases.json"), str(work / "results.json"), port=port,
                    timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    results = json.loads((work / "results.json").read_text())
    for part in parts.values():
        part["results"], results = results[:len(part["cases"])], results[len(part["cases"]):]
        part["log"] = out.stdout + out.stderr
    return parts
