"""Turn a dead or frozen rank into a prompt, named failure instead of a hang.

Why: with gloo, a peer killed outright makes the others' sockets fail within seconds,
but a peer that stops (SIGSTOP, a stuck driver, a swapped-out node) leaves every other
rank waiting in its collective for ever. A heartbeat thread fixes both: each rank
bumps a counter in the job's rendezvous store (the TCPStore the launcher's
MASTER_ADDR/PORT already gave us) every ``interval_s`` and reads everyone else's.
The thread runs while the main thread is blocked in a collective, so a peer whose
counter stops moving for ``stall_s`` is dead or frozen: the watchdog names it and
ends this rank with status 1, and the ``deepspeed`` launcher then ends the job.

A rank that leaves on purpose marks itself "done", so it is never blamed. A rank's own
error (an exception that did not come out of a collective) is its own, not the network's:
``from_communication`` tells the two apart, so only the first asks the watchdog who is silent.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from datetime import timedelta

from megakit.train.cluster.placement import host_id

_PREFIX = "megakit/heartbeat/"
DONE = b"done"


_COMMUNICATION = (
    f"{os.sep}torch{os.sep}distributed{os.sep}",
    f"{os.sep}deepspeed{os.sep}comm{os.sep}",
    f"{os.sep}megakit{os.sep}nn{os.sep}comm.py",
)


def from_communication(error: BaseException) -> bool:
    """Whether ``error`` was raised inside a collective or P2P call (torch.distributed, DeepSpeed's comm, or
    ``megakit.nn.comm``, whose handles' ``wait`` raises there), where a dead peer or the network shows up; anything
    else (an index out of range, a shape mismatch in a layer) is the rank's own."""
    frames = traceback.extract_tb(error.__traceback__)
    return bool(frames) and any(part in frames[-1].filename for part in _COMMUNICATION)


def connect_store(host: str, port: int, *, timeout_s: float):
    """A client of the job's rendezvous TCPStore with its own (short) timeout.

    Its own connection, so a frozen store host times out here without touching the
    timeout torch.distributed uses for its own rendezvous.
    """
    import torch.distributed as dist

    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


class Watchdog:
    """A daemon thread that exits the process (status 1) when a peer stops beating.

    ``peers``: the ranks to watch (default: all). A trainer passes the ranks this rank
    waits on directly (its TP, DP and PP groups): a frozen rank is then noticed by its
    neighbours, whose exit ends the job, and each rank reads O(group) keys per beat
    instead of O(world). ``interval_s`` defaults to ``stall_s / 20``.
    ``describe(rank)`` gives the text used to name a rank (e.g. its TP/PP/DP place).
    ``store_gone_with_launcher()``: whether a lost store went with the launcher that hosted it (torchrun's agent):
    the run is then stopping on its own (``preemption``), and the watchdog ends quietly instead of the rank.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        stall_s: float = 60.0,
        interval_s: float | None = None,
        describe=str,
        store,
        peers=None,
        store_gone_with_launcher=lambda: False,
    ) -> None:
        self.rank, self.world_size = rank, world_size
        self.peers = sorted(set(range(world_size) if peers is None else peers) - {rank})
        interval_s = min(1.0, stall_s / 20) if interval_s is None else interval_s
        self.stall_s, self.interval_s, self.describe = stall_s, interval_s, describe
        self.store, self.store_gone_with_launcher = store, store_gone_with_launcher
        self._beats = 0
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megakit-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        """Register this rank and start beating, so others can tell it is alive."""
        if self.world_size > 1:
            self.store.set(f"{_PREFIX}where/{self.rank}", f"{host_id()} {os.getpid()}")
            self._beat()
            self._thread.start()
        return self

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(f"{_PREFIX}{self.rank}", str(self._beats))

    def stalled_peers(self) -> list[tuple[int, float]]:
        """Peers whose heartbeat has not moved, with for how long (seconds); reads the store once."""
        now = time.monotonic()
        stalled = []
        for peer in self.peers:
            key = f"{_PREFIX}{peer}"
            value = self.store.get(key) if self.store.check([key]) else b"missing"
            if value == DONE:
                continue
            last_value, since = self._seen.get(peer, (None, now))
            if value != last_value:
                self._seen[peer] = (value, now)
            else:
                stalled.append((peer, now - since))
        return stalled

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
                dead = [(p, age) for p, age in self.stalled_peers() if age >= self.stall_s]
            except Exception as error:  # the store lives on rank 0: losing it means rank 0 is gone
                if self._stop.is_set() or self.store_gone_with_launcher():
                    self.store = None  # nothing to tell it on the way out
                    return
                self._fail(f"lost the job's rendezvous store on {self.describe(0)} ({type(error).__name__}: {error})")
                return
            if dead:
                names = ", ".join(f"{self.describe(p)} (silent for {age:.0f} s)" for p, age in dead)
                self._fail(f"{names} stopped responding")
                return

    def _fail(self, why: str) -> None:
        if self.rank == 0:  # rank 0 hosts the store: give the others time to read who is silent
            time.sleep(self.interval_s * 2)
        print(
            f"megakit: {self.describe(self.rank)}: {why}; ending this rank so the job fails instead of hanging",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def _local_state(self, peer: int) -> str | None:
        """'died' or 'stopped' for a peer on this host whose process is gone or frozen, else None."""
        host, pid = self.store.get(f"{_PREFIX}where/{peer}").decode().split()
        if host != host_id():  # another machine or PID namespace: its pid means nothing here
            return None
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return "died"
        return {"Z": "died", "X": "died", "T": "stopped", "t": "stopped"}.get(state)

    def diagnose(self, wait_s: float = 2.5) -> str:
        """After a collective failed: which peer died or froze (best effort, a few seconds at most).

        Peers on this host are looked up in /proc at once (the launcher kills the whole job
        about a second after one rank dies); others by watching their heartbeat for ``wait_s``.
        """
        try:
            local = [(p, self._local_state(p)) for p in self.peers]
            found = [f"{self.describe(p)} {state}" for p, state in local if state]
            if found:
                return ", ".join(found)
            self.stalled_peers()
            time.sleep(wait_s)
            stalled = [p for p, age in self.stalled_peers() if age >= wait_s * 0.8]
        except Exception:
            return f"{self.describe(0)} (it hosts the job's rendezvous store) is gone"
        if not stalled:
            return "no peer is silent, so the failure came from the network or a peer's error"
        return ", ".join(self.describe(p) for p in stalled) + " stopped (no heartbeat)"

    def stop(self, *, done: bool = True) -> None:
        """Stop beating; with ``done`` tell the others this rank left on purpose."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s * 3)
        if done and self.world_size > 1 and self.store is not None:
            try:
                self.store.set(f"{_PREFIX}{self.rank}", DONE.decode())
            except Exception:
                pass
