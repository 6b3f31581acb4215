"""A stop on notice: SIGTERM or SIGUSR1, or a launcher that is gone, ends the run at a step every rank agrees on.

Why: a scheduler gives notice before it kills (Slurm sends SIGTERM, then SIGKILL ``KillWait`` later, 30 s by
default; ``--signal=B:TERM@120`` sends it 120 s before the time limit); a run that dies at once loses every
step since its last ``--save-every``. As Megatron's exit-signal handler does, the signal only sets a flag:
the trainer finishes the step, and the flag rides in the step's one small all-reduce (``StepGuard.check``),
so every rank stops after the same step, saves it (with ``--save``) and exits with ``EXIT_STOPPED``.

- Signals are read by a thread from ``signal.set_wakeup_fd`` (CPython's C handler writes the signal's number
  there at once), not by a Python handler, which runs only when the main thread is back in Python: so a
  second signal stops the process at once (status 128 + the signal) even while the main thread waits in a
  collective for a peer that is saving. A signal within ``ECHO_S`` of the first is the same notice passed on
  (``scancel`` signals every process of the job, and the launcher then passes it on to its workers again).
  Once the run is leaving (``leaving()``: the stop's save is on disk, or the run is done), a later signal is
  ignored: DeepSpeed's launch.py passes SIGTERM on to its workers one at a time, each only after the one before
  has exited (or after 30 s, then SIGKILL), so the later ranks get it seconds after ``scancel``'s, when it is
  the same notice again. Ignored rather than ended on with status 75: the rank still marks itself done for the
  watchdogs and waits for its peers at the last barrier, and leaving that early would fail the peers still there.
- A worker notices its launcher is gone by watching its process chain once a second: DeepSpeed's
  ``launch.py`` and torchrun's agent are the worker's parent; the ``deepspeed`` command is launch.py's parent
  and has no signal handler on one node, so SIGTERM to it ends it alone and leaves launch.py and the workers
  running, reparented. Either link changing counts as a stop request (``LAUNCHER_GONE``).
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

EXIT_STOPPED = 75  # sysexits.h EX_TEMPFAIL, "temporary failure, the user is invited to retry": requeue
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
ECHO_S = 2.0  # a second signal sooner than this after the first is the first passed on by a launcher
LAUNCHER_GONE = 256  # a stop reason that is no signal number
_WAKE = 0  # the byte that wakes the thread to end it (no signal has number 0)


def reason_text(reason: int, gone: str | None = None) -> str:
    """``SIGTERM on``, ``the launcher gone for``: what stopped a rank, to be followed by the rank."""
    return f"{gone or 'the launcher'} gone for" if reason == LAUNCHER_GONE else f"{signal.Signals(reason).name} on"


def parent_pid(pid: int) -> int | None:
    """The parent of ``pid`` as /proc has it now (None once ``pid`` is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _command(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def launcher_links(pid: int | None = None) -> list[tuple[int, int, str]]:
    """``(child, parent, what the parent is)`` for each link of ``pid``'s launcher chain that must hold: its
    parent when that is DeepSpeed's launch.py or torchrun's agent, and launch.py's own parent (the ``deepspeed``
    command, or the remote shell of a multi-node launch). Empty for a process no launcher started."""
    pid = os.getpid() if pid is None else pid
    parent = parent_pid(pid)
    if parent is None:
        return []
    command = _command(parent)
    if "deepspeed.launcher.launch" in command:
        grandparent = parent_pid(parent)
        return [(pid, parent, f"DeepSpeed's launch.py (pid {parent})")] + (
            [(parent, grandparent, f"the deepspeed command (pid {grandparent})")]
            if grandparent not in (None, 0, 1)
            else []
        )
    if any(os.path.basename(arg) == "torchrun" or arg == "torch.distributed.run" for arg in command[:3]):
        return [(pid, parent, f"torchrun's agent (pid {parent})")]
    return []


def broken_link(links: list[tuple[int, int, str]]) -> str | None:
    """What is gone, for the first link whose child no longer has that parent; None while the chain holds."""
    for child, parent, what in links:
        if parent_pid(child) != parent:
            return what
    return None


class StopRequests:
    """Collects this process's reason to stop (``reason``: 0, a signal number or ``LAUNCHER_GONE``).

    ``with StopRequests(name="rank 1"):`` installs the SIGTERM/SIGUSR1 handling (in the main thread only;
    elsewhere it watches the launcher alone) and the thread; leaving restores what was there. ``echo_s``: how
    soon after the first a signal is that one passed on (tests widen it: on busy cores a round trip is slow).
    """

    def __init__(
        self, *, name: str, interval_s: float = 1.0, links: list | None = None, echo_s: float = ECHO_S
    ) -> None:
        self.name, self.interval_s, self.echo_s = name, interval_s, echo_s
        self.links = launcher_links() if links is None else links
        self.reason = 0
        self.gone: str | None = None  # the launcher process found gone
        self._first: float | None = None  # when the first signal came
        self._leaving = False
        self._old: dict = {}
        self._old_fd = None
        self._read = self._write = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "StopRequests":
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, _noted)
                signal.siginterrupt(sig, False)  # restart the system calls it interrupts (gloo's sockets)
            self._old_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="megakit-stop-requests", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._old:
            signal.set_wakeup_fd(self._old_fd)
            for sig, old in self._old.items():
                signal.signal(sig, signal.SIG_DFL if old is None else old)  # None: set outside Python
            self._old = {}
        with contextlib.suppress(OSError):
            os.write(self._write, bytes([_WAKE]))
        self._thread.join(timeout=5)
        for fd in (self._read, self._write):
            os.close(fd)

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self._read], [], [], self.interval_s)
            for number in os.read(self._read, 64) if ready else b"":
                if number == _WAKE:
                    return
                if number in SIGNALS:  # not SIGINT, whose Python handler writes here too (KeyboardInterrupt, as ever)
                    self._signalled(number)
            self.launcher_gone()

    def launcher_gone(self) -> bool:
        """Whether a process of the launcher chain is gone (looked up now); the first time, a stop request."""
        if self.links and self.gone is None:
            self.gone = broken_link(self.links)
            if self.gone is not None and not self.reason:
                self.reason = LAUNCHER_GONE
        return self.gone is not None

    def leaving(self) -> None:
        """The run has saved what it will (the stop's checkpoint is on disk, or the run is done): from now on a
        signal is ignored, and the rank goes on to exit with its own status."""
        self._leaving = True

    def _signalled(self, number: int) -> None:
        now = time.monotonic()
        if self._first is None:
            self._first = now
            if self.reason != LAUNCHER_GONE:
                self.reason = number
        elif not self._leaving and now - self._first >= self.echo_s:  # a second notice: no step to finish, no save
            os.write(
                sys.stderr.fileno(),
                f"megakit: {self.name}: a second {signal.Signals(number).name}: stopping "
                "at once, without a checkpoint\n".encode(),
            )
            os._exit(128 + number)


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing; the thread has the signal from the wakeup fd already."""
