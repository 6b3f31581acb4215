"""Where each rank runs: which node (for placing TP groups) and which host (for looking up a process).

Two different questions, two different answers:

- *node*: the launcher's unit of placement, the group of processes it started together
  (torchrun's ``GROUP_RANK``, DeepSpeed's ``CROSS_RANK``). A TP group all-reduces in every
  layer, so it must stay on one node's fast links; two launches on one machine (a
  simulated two-node job) are two nodes.
- *host*: the kernel and PID namespace a process lives in, ``/proc/sys/kernel/random/boot_id``
  plus the inode of ``/proc/self/ns/pid``. Only a peer on the same host can be looked up in
  ``/proc`` by its pid; hostnames do not tell (containers often share one).

``gather_places`` exchanges both once at start-up, over the default process group.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass

from megakit.errors import UsageError

NODE_VARIABLES = ("GROUP_RANK", "CROSS_RANK", "NODE_RANK")  # torchrun, DeepSpeed's launcher, others


@dataclass(frozen=True)
class Place:
    """One rank's node and host, and its process id on that host."""

    node: str
    host: str
    pid: int


def host_id() -> str:
    """This process's host: the boot id and PID namespace, so pids are comparable within one host id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # no /proc (not Linux): fall back to the name, and never trust pids across it
        return f"name:{socket.gethostname()}:{os.getpid()}"
    return f"{boot}:{namespace}"


def node_id(environ=os.environ) -> str:
    """The launcher's node of this process, or its host when the launcher says nothing."""
    for name in NODE_VARIABLES:
        if environ.get(name, "") != "":
            return f"node {environ[name]}"
    return f"host {host_id()}"


def here() -> Place:
    """This process's node, host and pid."""
    return Place(node=node_id(), host=host_id(), pid=os.getpid())


def gather_places() -> list[Place]:
    """Every rank's ``Place``, by rank (collective over the default group)."""
    import torch.distributed as dist

    from megakit.nn import comm

    if not dist.is_initialized():
        return [here()]
    return comm.all_gather_object(here(), comm.WORLD)


def check_tp_within_nodes(tp_groups: list[list[int]], places: list[Place], *, allow: bool = False) -> str | None:
    """Refuse a TP group whose ranks sit on different nodes; with ``allow``, return a warning instead.

    Returns None when every TP group is inside one node.
    """
    for group in tp_groups:
        nodes = sorted({places[r].node for r in group})
        if len(nodes) == 1:
            continue
        per_node = sum(1 for p in places if p.node == places[group[0]].node)
        what = (
            f"TP group of ranks {group[0]}-{group[-1]} spans {len(nodes)} nodes ({', '.join(nodes)}), so its "
            "all-reduce in every layer would cross the slow link between them"
        )
        if allow:
            return f"warning: {what}; running anyway because of --allow-cross-node-tp"
        raise UsageError(
            f"{what}; use a --tp that divides the {per_node} processes per node (e.g. --tp "
            f"{math.gcd(len(group), per_node)}) and the rest as --pp, or pass --allow-cross-node-tp "
            "to run it anyway"
        )
    return None
