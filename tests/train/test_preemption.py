"""Runs that stop on notice: a signal or a lost launcher ends the run after a step every rank agrees on, saved first.

Real jobs through the real launchers (TP 2 on 2 processes, gpt-tiny):

- SIGTERM to one worker: every rank stops after the same step, saves it and exits 75 (the ``deepspeed`` command
  passes it on). DeepSpeed's CPU all-reduce buffers are measured in the workers' maps against ``WORKSPACE_BYTES``.
  HOME cannot be written: DeepSpeed's op is loaded from the temporary directory instead, said in one line.
- SIGTERM to the ``deepspeed`` command (it has no handler on one node and dies alone): launch.py and the workers
  notice, save and end; no process, /dev/shm buffer or lock is left. This job is also the uninterrupted run.
- torchrun resumes the first job's checkpoint (``--load auto``) with the uninterrupted run's losses, bit for
  bit; its agent then dies by SIGKILL (its workers' parent, which hosted the store): they save and end.
- One process without ``--save`` stops cleanly on SIGUSR1; a second signal stops a process at once even while
  it waits in a blocking call; /dev/shm without room for the buffers is one line and exit 2.
"""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from multiproc import THREADS, free_port
from paths import ROOT

from megakit.train.engine.deepspeed_shm import WORKSPACE_BYTES
from megakit.train.resilience.preemption import EXIT_STOPPED, broken_link

TRAIN = ["scripts/train.py", "--model", "gpt-tiny", "--seq-len", "32", "--tp", "2", "--steps", "400", "--no-progress"]


def _env(**extra) -> dict:
    return dict(os.environ, OMP_NUM_THREADS=THREADS, **extra)


def _steps(text: str) -> int:
    """The last step the log shows done (-1 before the first)."""
    found = re.findall(r"^step\s+(\d+) \|", text, re.M)
    return int(found[-1]) if found else -1


class _Job:
    """A job started in the background, its output in a file; ``until(step)`` waits for that step's line."""

    def __init__(self, tmp: Path, name: str, cmd: list[str], env: dict) -> None:
        self.log = tmp / f"{name}.txt"
        with open(self.log, "w") as out:
            self.process = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    @property
    def text(self) -> str:
        return self.log.read_text()

    def until(self, step: int, timeout_s: float = 240) -> list[psutil.Process]:
        """Wait until ``step`` is done; the job's processes below the one started."""
        deadline = time.time() + timeout_s
        while _steps(self.text) < step:
            assert self.process.poll() is None and time.time() < deadline, self.text[-3000:]
            time.sleep(0.1)
        return psutil.Process(self.process.pid).children(recursive=True)

    def worker(self, tree: list[psutil.Process], local_rank: int) -> psutil.Process:
        """The worker DeepSpeed's launch.py started for ``local_rank``."""
        return next(p for p in tree if f"--local_rank={local_rank}" in p.cmdline())

    def end(self, timeout_s: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def _all_gone(tree: list[psutil.Process], timeout_s: float = 60) -> list:
    """The processes of ``tree`` still running after ``timeout_s`` (killed then); zombies count as gone."""
    deadline = time.time() + timeout_s

    def alive():
        out = []
        for p in tree:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    while alive() and time.time() < deadline:
        time.sleep(0.2)
    left = alive()
    for p in left:
        p.kill()
    return [(p.pid, p.cmdline()[:3]) for p in left]


def _losses(path: Path) -> dict[int, float]:
    """``{step: loss}`` from --metrics-out (one JSON object, or JSON Lines of steps)."""
    text = path.read_text()
    try:
        steps = json.loads(text)["steps"]
    except (ValueError, KeyError, TypeError):
        steps = [json.loads(line) for line in text.splitlines() if line.strip()]
        steps = [s for s in steps if "loss" in s and "step" in s]
    return {s["step"]: s["loss"] for s in steps}


def _saved_step(directory: Path) -> int:
    """The step of the newest checkpoint in ``directory`` (a single one, or a --keep series' latest)."""
    manifest = directory / "manifest.json"
    if not manifest.exists():
        manifest = directory / (directory / "latest").read_text().strip() / "manifest.json"
    return json.loads(manifest.read_text())["step"]


def _no_lock_held(directory: Path) -> None:
    """Every file under ``directory`` can be locked at once: no process holds a lock there."""
    for path in directory.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises BlockingIOError when held
                fcntl.flock(f, fcntl.LOCK_UN)


def _built_op() -> Path:
    """Where DeepSpeed's CPU all-reduce op is built under HOME; built there first on a machine that has not yet (a
    first build takes about 50 s of CPU: outside the jobs' timed waits, and once for the jobs of this module)."""
    from torch.utils.cpp_extension import get_default_build_root

    built = (
        Path(get_default_build_root())
        / f"py{sys.version_info.major}{sys.version_info.minor}_cpu"
        / "deepspeed_shm_comm"
    )
    if not list(built.glob("*.so")):  # torch's file lock makes a build in flight elsewhere (xdist) wait for it
        subprocess.run(
            [
                sys.executable,
                "-c",
                "from deepspeed.accelerator import get_accelerator; "
                "get_accelerator().create_op_builder('ShareMemCommBuilder').load()",
            ],
            env=_env(),
            check=True,
            capture_output=True,
            timeout=1200,
        )
    return built


def _unwritable_home(tmp: Path) -> dict:
    """HOME under a regular file; TMPDIR seeded with the op this machine built already."""
    built = _built_op()
    fallback = tmp / "tmp" / f"torch_extensions_{os.getuid()}"
    fallback.mkdir(parents=True)
    fallback.chmod(0o700)  # only this user can write there, whatever the umask: else it is not used
    if list(built.glob("*.so")) and not (built / "lock").exists():
        shutil.copytree(built, fallback / built.name)
    (tmp / "file").write_text("")
    return {"HOME": str(tmp / "file" / "home"), "TMPDIR": str(tmp / "tmp")}


def _shm_mappings(pid: int, port: int) -> list[int]:
    """Sizes of the DeepSpeed all-reduce buffers of job ``port`` mapped into process ``pid``."""
    sizes = []
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        if f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_" in line:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            sizes.append(end - start)
    return sizes


@pytest.mark.slow
def test_a_signal_or_a_lost_launcher_saves_at_an_agreed_step_and_the_run_resumes_bitwise(tmp_path):
    page = os.sysconf("SC_PAGE_SIZE")
    deepspeed = ["deepspeed", "--num_gpus", "2", "--master_port"]
    # 1. SIGTERM to the worker of rank 1, with HOME unwritable
    port = free_port()
    save = tmp_path / "ckpt"
    first = _Job(
        tmp_path,
        "first",
        [*deepspeed, str(port), *TRAIN, "--save", str(save), "--metrics-out", str(tmp_path / "first.json")],
        _env(**_unwritable_home(tmp_path)),
    )
    tree = first.until(2)
    victim = first.worker(tree, 1)
    mapped = _shm_mappings(victim.pid, port)
    victim.send_signal(signal.SIGTERM)
    assert first.end() == EXIT_STOPPED, first.text[-3000:]
    assert _all_gone(tree) == [] and not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    _no_lock_held(save)
    assert mapped == [-(-WORKSPACE_BYTES // page) * page] * 2, mapped  # its own buffer and its peer's, measured
    stopped = re.search(
        r"megakit: SIGTERM on rank 1 \(pp 0, dp 0, tp 1\): stopped at step (\d+), saved to "
        rf"{re.escape(str(save))} \(--load auto resumes there\); exit status 75",
        first.text,
    )
    assert stopped, first.text[-3000:]
    n = int(stopped.group(1))
    assert _saved_step(save) == n and _steps(first.text) == n - 1, (n, first.text[-2000:])
    assert f"DeepSpeed builds its CPU ops in {tmp_path / 'tmp'}/torch_extensions_{os.getuid()} instead" in first.text
    assert list((tmp_path / "tmp" / f"torch_extensions_{os.getuid()}").rglob("deepspeed_shm_comm*.so"))
    assert "Traceback" not in first.text, first.text[-3000:]

    # 2. SIGTERM to the deepspeed command: it dies alone; the workers notice, save and end, and so does launch.py
    port = free_port()
    reference = _Job(
        tmp_path,
        "reference",
        [
            *deepspeed,
            str(port),
            *TRAIN,
            "--save",
            str(tmp_path / "other"),
            "--metrics-out",
            str(tmp_path / "reference.json"),
        ],
        _env(),
    )
    tree = reference.until(n + 3)
    reference.process.send_signal(signal.SIGTERM)
    assert reference.end() == -signal.SIGTERM
    assert _all_gone(tree) == [], reference.text[-3000:]
    gone = re.search(
        r"megakit: the deepspeed command \(pid \d+\) gone for rank \d .*: stopped at step (\d+), saved "
        r"to .*other",
        reference.text,
    )
    assert gone, reference.text[-3000:]
    assert _saved_step(tmp_path / "other") == int(gone.group(1)) > n + 3
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))
    _no_lock_held(tmp_path / "other")

    # 3. torchrun resumes the first checkpoint bit for bit; SIGKILL to its agent: the workers save and end
    resumed = _Job(
        tmp_path,
        "resumed",
        [
            "torchrun",
            "--standalone",
            "--nproc_per_node",
            "2",
            *TRAIN,
            "--save",
            str(save),
            "--load",
            "auto",
            "--metrics-out",
            str(tmp_path / "resumed.json"),
        ],
        _env(),
    )
    tree = resumed.until(n + 2)
    resumed.process.kill()
    resumed.end()
    assert _all_gone(tree) == [], resumed.text[-3000:]
    again = re.search(
        r"megakit: torchrun's agent \(pid \d+\) gone for rank \d .*: stopped at step (\d+), saved to "
        rf"{re.escape(str(save))} ",
        resumed.text,
    )
    assert again and _saved_step(save) == int(again.group(1)) > n + 2, resumed.text[-3000:]
    _no_lock_held(save)
    full, before, after = (_losses(tmp_path / f"{name}.json") for name in ("reference", "first", "resumed"))
    assert sorted(before) == list(range(n)) and min(after) == n, (sorted(before), sorted(after))
    assert set(range(n, n + 3)) <= set(after) & set(full), (sorted(after), sorted(full))
    assert all(full[s] == loss for s, loss in {**before, **after}.items() if s in full), (before, after)  # bitwise


@pytest.mark.slow
def test_without_save_sigusr1_stops_one_process_cleanly(tmp_path):
    _built_op()  # not inside until()'s wait
    job = _Job(tmp_path, "alone", [sys.executable, *TRAIN[:5], "--steps", "400", "--no-progress"], _env())
    job.until(1)
    job.process.send_signal(signal.SIGUSR1)
    assert job.end() == EXIT_STOPPED, job.text[-3000:]
    assert re.search(
        r"megakit: SIGUSR1 on rank 0 \(pp 0, dp 0, tp 0\): stopped at step \d+, nothing saved "
        r"\(no --save\); exit status 75",
        job.text,
    ), job.text[-3000:]
    assert "Traceback" not in job.text


_BLOCKED = """
import os, sys, threading, time
from megakit.train.resilience.preemption import StopRequests
with StopRequests(name="rank 3", echo_s=float(sys.argv[1])) as stops:
    def tell():
        while not stops.reason:
            time.sleep(0.02)
        print("asked", stops.reason, flush=True)
    threading.Thread(target=tell, daemon=True).start()
    print("ready", flush=True)
    os.read(os.pipe()[0], 1)  # blocks in C for ever, as a collective waiting for a peer that is saving
"""


_ECHO_S = 4.0  # wider than ECHO_S: the echo is sent after a readline round trip, slow on 2 busy cores


def test_a_second_signal_stops_at_once_even_in_a_blocking_call_and_an_echo_does_not():
    child = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED, str(_ECHO_S)],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline() == f"asked {int(signal.SIGTERM)}\n"
        child.send_signal(signal.SIGTERM)  # the launcher passing the same notice on: not a second one
        time.sleep(_ECHO_S + 0.3)
        assert child.poll() is None
        child.send_signal(signal.SIGTERM)
        sent = time.time()  # a Python handler would never run (the read is restarted): only the bound says "at once"
        assert child.wait(timeout=30) == 128 + signal.SIGTERM and time.time() - sent < 5
        assert child.stderr.read() == "megakit: rank 3: a second SIGTERM: stopping at once, without a checkpoint\n"
    finally:
        child.kill()


_LEAVING = """
import sys, time
from megakit.train.resilience.preemption import EXIT_STOPPED, StopRequests
with StopRequests(name="rank 1", echo_s=0.5) as stops:
    print("ready", flush=True)
    while not stops.reason:
        time.sleep(0.02)
    stops.leaving()  # the stop's save is on disk
    print("saved", flush=True)
    sys.stdin.readline()  # the last barrier, while DeepSpeed's launch.py signals this rank again
sys.exit(EXIT_STOPPED)
"""


def test_a_signal_once_the_run_is_leaving_is_ignored():
    """DeepSpeed's launch.py passes scancel's SIGTERM on one worker at a time: a later rank's comes seconds after
    the first, once its checkpoint is saved; it must not end the rank with 143 and "without a checkpoint"."""
    child = subprocess.Popen(
        [sys.executable, "-c", _LEAVING],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline() == "ready\n"
        child.send_signal(signal.SIGTERM)
        assert child.stdout.readline() == "saved\n"
        time.sleep(1.0)  # past the echo window (0.5 s)
        child.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert child.poll() is None
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == EXIT_STOPPED
        assert child.stderr.read() == ""
    finally:
        child.kill()


def test_a_launcher_gone_is_a_link_of_the_process_chain_broken():
    code = (
        "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
        " print(p.pid, flush=True); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        links = [(child, parent.pid, "the parent")]
        assert broken_link(links) is None
        parent.kill()
        parent.wait()
        deadline = time.time() + 10
        while broken_link(links) is None and time.time() < deadline:  # reparented once its parent is reaped
            time.sleep(0.05)
        assert broken_link(links) == "the parent"
    finally:
        os.kill(child, signal.SIGKILL)


@pytest.mark.slow
def test_dev_shm_without_room_for_deepspeed_s_buffers_is_one_line_and_exit_2(tmp_path):
    """Docker's default /dev/shm (64 MB) in a mount namespace of its own: the ranks died of SIGSEGV in 3 runs of 5
    (those where one rank's ``write`` of its buffer failed outright), and ran on truncated buffers in the others."""
    if (
        shutil.which("unshare") is None
        or subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=64m tmpfs /dev/shm"], capture_output=True
        ).returncode
        != 0
    ):
        pytest.skip("this machine cannot mount a small tmpfs on /dev/shm in a mount namespace (unshare -m)")
    _built_op()  # not inside the run's timeout
    command = " ".join(
        [
            "mount -t tmpfs -o size=64m tmpfs /dev/shm &&",
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            *TRAIN,
        ]
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", command], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [line for line in (out.stdout + out.stderr).splitlines() if "/dev/shm" in line]
    assert lines == [
        "train.py: error: DeepSpeed's CPU all-reduce needs 132 MiB of /dev/shm (66 MiB for each of the "
        "2 ranks on this host) but 64 MiB is free (short of it, they can die of SIGSEGV): free some, or "
        "enlarge it (Docker: --shm-size=1g; its default is 64m)"
    ], out.stdout[-3000:] + out.stderr[-3000:]


def test_an_unwritable_torch_extensions_dir_is_one_line_naming_it(tmp_path, monkeypatch):
    from megakit.errors import UsageError
    from megakit.train.engine.deepspeed_shm import writable_extensions_dir

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "file" / "ext"))
    with pytest.raises(
        UsageError,
        match=r"^TORCH_EXTENSIONS_DIR=.*/file/ext cannot be written \(Not a directory\); "
        "DeepSpeed builds its CPU ops there: point it at a writable directory$",
    ):
        writable_extensions_dir()


def test_save_on_signal_is_on_and_can_be_turned_off():
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.config(script.parse_args(["--save", "d"])).save_on_signal
    assert not script.config(script.parse_args(["--save", "d", "--no-save-on-signal"])).save_on_signal


def test_a_guessable_torch_extensions_dir_others_can_write_is_not_used(tmp_path, monkeypatch):
    """Another user could make /tmp/torch_extensions_<uid> before this one does and plant an op there to be loaded."""
    import tempfile

    from megakit.train.engine.deepspeed_shm import writable_extensions_dir

    (tmp_path / "file").write_text("")
    monkeypatch.setenv("HOME", str(tmp_path / "file" / "home"))  # torch's default build root cannot be written
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    squatted = tmp_path / f"torch_extensions_{os.getuid()}"
    squatted.mkdir()
    squatted.chmod(0o777)
    said = []
    writable_extensions_dir(say=said.append)
    chosen = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    assert chosen != squatted and chosen.parent == tmp_path and chosen.stat().st_mode & 0o777 == 0o700, chosen
    assert said == [
        f"megakit: {tmp_path}/file/home/.cache/torch_extensions cannot be written (Not a directory); "
        f"DeepSpeed builds its CPU ops in {chosen} instead (not {squatted}: it is another user's, or "
        "others can write in it) (set TORCH_EXTENSIONS_DIR to choose)"
    ], said
    squatted.chmod(0o700)  # this user's own, and only it can write: used
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    writable_extensions_dir(say=said.append)
    assert said[-1].endswith(f"DeepSpeed builds its CPU ops in {squatted} instead (set TORCH_EXTENSIONS_DIR to choose)")


def test_workspace_bytes_is_the_size_of_deepspeed_s_struct():
    """``WORKSPACE_BYTES`` read off the installed DeepSpeed's shm.cpp: its states (a 4-byte enum each), then its
    buffer, whose size is a multiple of 4, so the struct has no padding: its size is the sum."""
    import deepspeed

    source = (Path(deepspeed.__file__).parent / "ops" / "csrc" / "cpu" / "comm" / "shm.cpp").read_text()
    defined = {
        name: eval(value.split("//")[0])
        for name, value in re.findall(r"^#define (NAIVE_ALLREDUCE_THRESHOLD|MAX_BUF_SIZE) ([^\n]+)$", source, re.M)
    }
    struct = re.search(r"struct allreduce_workspace \{(.*?)\};", source, re.S).group(1)
    states = int(re.search(r"enum coll_state states\[(\d+)\];", struct).group(1))
    buffer = eval(re.search(r"char buffer\[([^\]]+)\];", struct).group(1), {}, defined)
    assert WORKSPACE_BYTES == states * 4 + buffer, (states, buffer)
