"""Run a schedule without processes: prove it deadlock-free and count its bubble.

The simulator executes every stage's action list with the semantics the executor
uses on real processes:

- a **send** is asynchronous (posted, never blocks the sender); the message
  arrives ``costs.p2p`` after the sender's clock;
- a **receive** blocks its stage until the matching message has arrived. Messages
  between two ranks travel in one FIFO per direction and kind (activation or
  gradient: the executor's P2P tag), so a receive that finds a different
  micro-batch at the head of its channel is a *mismatched send/recv* error
  (``tagged=False`` merges the two kinds into one FIFO per direction, as NCCL,
  which has no tags, would);
- a **forward** on a virtual stage > 0 needs its activation received first, and a
  **backward** needs its own forward done and, except on the last virtual stage,
  its gradient received first.

Execution is round-robin over stages, each running until it blocks; a full round
in which no stage moves is a deadlock, reported with what every stage waits for
(never a hang). Times are causal (each action starts when both its stage and its
input are ready), so the order the simulator visits stages does not change them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from megakit.core.schedules import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    SEND_ACT,
    SEND_GRAD,
    SENDS,
    Action,
    Schedule,
    add_p2p,
)
from megakit.errors import UsageError


class ScheduleError(Exception):
    """A schedule that cannot run: deadlock, mismatched send/recv, or a backward before its forward."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Time per action: floats, or one float per stage (measured costs of unequal stages).

    ``forward`` and ``backward`` are the cost of a whole stage's layers for one
    micro-batch; with ``vpp`` chunks a chunk costs 1/vpp of it, so interleaving does
    not change the total work. ``p2p`` is the time a message takes to arrive.
    """

    forward: float | tuple[float, ...] = 1.0
    backward: float | tuple[float, ...] = 2.0
    p2p: float = 0.0
    reduce: float = 0.0
    step: float = 0.0

    def per_stage(self, name: str, stage: int) -> float:
        value = getattr(self, name)
        return float(value[stage] if isinstance(value, (tuple, list)) else value)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One executed compute action: for the timeline."""

    stage: int
    kind: str
    micro_batch: int
    chunk: int
    start: float
    end: float


@dataclass(frozen=True, kw_only=True)
class Report:
    """What a simulated step costs: time, bubble, and activation memory in micro-batches."""

    schedule: Schedule
    step_time: float
    busy: tuple[float, ...]  # compute time per stage
    bubble_per_stage: tuple[float, ...]  # idle fraction of the step per stage
    peak_in_flight: tuple[int, ...]  # max (micro-batch, chunk) activations held at once, per stage
    events: tuple[Event, ...] = field(repr=False)

    @property
    def bubble(self) -> float:
        """Idle fraction of the step, averaged over stages (all equal for uniform stages)."""
        return sum(self.bubble_per_stage) / len(self.bubble_per_stage)


def _validate_costs(costs: Costs, pp: int) -> None:
    for name in ("forward", "backward", "p2p", "reduce", "step"):
        value = getattr(costs, name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if isinstance(value, (tuple, list)) and name not in ("forward", "backward"):
            raise UsageError(f"{name} cost must be one number; only forward and backward costs may differ per stage")
        if isinstance(value, (tuple, list)) and len(value) != pp:
            raise UsageError(f"{name} costs give {len(value)} values for {pp} stages; give one per stage")
        if any(not isinstance(x, (int, float)) or x < 0 for x in values):
            raise UsageError(f"{name} cost must be a non-negative number, got {value!r}")


def _message(schedule: Schedule, stage: int, a: Action) -> tuple[tuple[int, int, str], tuple[int, int]]:
    """``(channel, payload)`` of a send or recv: channel = (src, dst, kind), payload = (mb, dst virtual stage)."""
    vs = schedule.virtual_stage(stage, a.chunk)
    if a.kind == SEND_ACT:
        return (stage, a.peer, "act"), (a.micro_batch, vs + 1)
    if a.kind == RECV_ACT:
        return (a.peer, stage, "act"), (a.micro_batch, vs)
    if a.kind == SEND_GRAD:
        return (stage, a.peer, "grad"), (a.micro_batch, vs - 1)
    assert a.kind == RECV_GRAD, a
    return (a.peer, stage, "grad"), (a.micro_batch, vs)


P2P_MODES = ("async", "batched")


def simulate(schedule: Schedule, costs: Costs = Costs(), *, tagged: bool = True, p2p: str = "async") -> Report:
    """Execute ``schedule`` (communication is inserted first if it has none); raise ``ScheduleError`` if it cannot run.

    ``tagged=False`` models a transport without P2P tags (NCCL): activations and
    gradients between two ranks then share one FIFO, so their orders must agree too.
    ``p2p="batched"`` models NCCL's rendezvous instead of asynchronous sends: each run
    of consecutive send/recv actions is posted together (``batch_isend_irecv``), a
    send completes only when its receive is posted, and the stage moves on only when
    the whole batch has completed; channels are then untagged.
    """
    if p2p not in P2P_MODES:
        raise UsageError(f"unknown P2P mode {p2p!r}; use one of {', '.join(P2P_MODES)}")
    if not schedule.has_p2p:
        schedule = add_p2p(schedule)
    pp, vpp, last = schedule.pp, schedule.vpp, schedule.virtual_stages - 1
    _validate_costs(costs, pp)
    channels: dict[tuple, deque] = {}
    posted_sends: dict[tuple, deque] = {}  # batched mode: ops posted, not yet matched, per channel
    posted_recvs: dict[tuple, deque] = {}
    batch: list = [None] * pp  # batched mode: the ops this stage has posted and waits on
    pc = [0] * pp  # next action per stage
    clock = [0.0] * pp
    busy = [0.0] * pp
    received: list[dict] = [{} for _ in range(pp)]  # (kind, mb, vs) -> arrival time
    forwarded: list[dict] = [{} for _ in range(pp)]  # (mb, chunk) -> end time of its forward
    done_backward: list[set] = [set() for _ in range(pp)]
    in_flight = [0] * pp
    peak = [0] * pp
    events: list[Event] = []

    def fail(stage: int, a: Action, why: str) -> None:
        raise ScheduleError(f"{schedule.name} p={pp} m={schedule.micro_batches}: stage {stage} action #{pc[stage]} ({a}): {why}")

    def check_send(stage: int, a: Action) -> None:
        if a.peer is None or not 0 <= a.peer < pp:
            fail(stage, a, f"peer {a.peer} is not a stage")
        if a.kind == SEND_ACT and (a.micro_batch, a.chunk) not in forwarded[stage]:
            fail(stage, a, "sends an activation before computing it")
        if a.kind == SEND_GRAD and (a.micro_batch, a.chunk) not in done_backward[stage]:
            fail(stage, a, "sends a gradient before computing it")

    def match(channel: tuple) -> None:
        sends, recvs = posted_sends.get(channel), posted_recvs.get(channel)
        while sends and recvs:
            if sends[0]["payload"] != recvs[0]["payload"]:
                r = recvs[0]
                fail(r["stage"], r["action"], f"expects {r['payload']} from stage {channel[0]} but the next message "
                                              f"posted on that channel is {sends[0]['payload']} (mismatched send/recv)")
            s, r = sends.popleft(), recvs.popleft()
            s["done"] = r["done"] = max(s["posted"], r["posted"]) + costs.p2p

    def batched(stage: int) -> bool:
        """Post this stage's run of send/recv actions at once; move past it when all have matched."""
        actions = schedule.stages[stage]
        if batch[stage] is None:
            ops, i = [], pc[stage]
            while i < len(actions) and actions[i].kind in SENDS + (RECV_ACT, RECV_GRAD) and actions[i].peer != stage:
                a = actions[i]
                if a.kind in SENDS:
                    check_send(stage, a)
                elif a.peer is None or not 0 <= a.peer < pp:
                    fail(stage, a, f"peer {a.peer} is not a stage")
                (src, dst, kind), payload = _message(schedule, stage, a)
                op = dict(stage=stage, action=a, payload=(*payload, kind), posted=clock[stage], done=None)
                (posted_sends if a.kind in SENDS else posted_recvs).setdefault((src, dst), deque()).append(op)
                ops.append(op)
                match((src, dst))
                i += 1
            batch[stage] = ops
            return True  # posting is progress: a peer may now complete its own batch
        ops = batch[stage]
        if any(op["done"] is None for op in ops):
            return False
        for op in ops:
            a = op["action"]
            if a.kind in (RECV_ACT, RECV_GRAD):
                received[stage][(op["payload"][2], *op["payload"][:2])] = op["done"]
        clock[stage] = max([clock[stage]] + [op["done"] for op in ops])
        pc[stage] += len(ops)
        batch[stage] = None
        return True

    def step(stage: int) -> bool:
        """Run one action of ``stage`` if it can; False if it is blocked or finished."""
        actions = schedule.stages[stage]
        if pc[stage] >= len(actions):
            return False
        a = actions[pc[stage]]
        if p2p == "batched" and a.kind in SENDS + (RECV_ACT, RECV_GRAD) and a.peer != stage:
            return batched(stage)  # (a hand-over to this same rank, PP = 1 with chunks, is a buffer)
        if a.kind in SENDS or a.kind in (RECV_ACT, RECV_GRAD):
            if a.peer is None or not 0 <= a.peer < pp:
                fail(stage, a, f"peer {a.peer} is not a stage")
            channel, payload = _message(schedule, stage, a)
            kind = channel[2]
            if not tagged:
                channel, payload = channel[:2], (*payload, kind)
            if a.kind in SENDS:
                check_send(stage, a)
                channels.setdefault(channel, deque()).append((payload, clock[stage] + costs.p2p))
            else:
                queue = channels.get(channel)
                if not queue:
                    return False  # blocked: the message has not been sent yet
                (got, arrival) = queue[0]
                if got != payload:
                    fail(stage, a, f"expects {kind} of micro-batch {payload[0]} for virtual stage {payload[1]} from "
                                   f"stage {a.peer} but the next message on that channel is {got} (mismatched send/recv)")
                queue.popleft()
                received[stage][(kind, *payload[:2])] = arrival
                clock[stage] = max(clock[stage], arrival)
        elif a.kind in (FORWARD, BACKWARD):
            mb, chunk = a.micro_batch, a.chunk
            if mb is None or not 0 <= mb < schedule.micro_batches or not 0 <= chunk < vpp:
                fail(stage, a, "micro-batch or chunk out of range")
            vs = schedule.virtual_stage(stage, chunk)
            start = clock[stage]
            if a.kind == FORWARD:
                if (mb, chunk) in forwarded[stage]:
                    fail(stage, a, "runs the same forward twice")
                if vs > 0:
                    if ("act", mb, vs) not in received[stage]:
                        fail(stage, a, "runs a forward before receiving its activation")
                cost = costs.per_stage("forward", stage) / vpp
                forwarded[stage][(mb, chunk)] = start + cost
                in_flight[stage] += 1
                peak[stage] = max(peak[stage], in_flight[stage])
            else:
                if (mb, chunk) not in forwarded[stage]:
                    fail(stage, a, "runs a backward before its forward (backward must follow forward)")
                if (mb, chunk) in done_backward[stage]:
                    fail(stage, a, "runs the same backward twice")
                if vs < last and ("grad", mb, vs) not in received[stage]:
                    fail(stage, a, "runs a backward before receiving its output gradient")
                cost = costs.per_stage("backward", stage) / vpp
                done_backward[stage].add((mb, chunk))
                in_flight[stage] -= 1
            clock[stage] = start + cost
            busy[stage] += cost
            events.append(Event(stage=stage, kind=a.kind, micro_batch=mb, chunk=chunk, start=start, end=start + cost))
        else:  # end-of-step: reduce tied grads / reduce grads / optimizer step
            cost = costs.step if a.kind == "optimizer_step" else costs.reduce
            clock[stage] += cost
        pc[stage] += 1
        return True

    while True:
        moved = False
        for stage in range(pp):
            while step(stage):
                moved = True
        if all(pc[s] >= len(schedule.stages[s]) for s in range(pp)):
            break
        if not moved:
            waits = "; ".join(f"stage {s} waits at {schedule.stages[s][pc[s]]}" for s in range(pp)
                              if pc[s] < len(schedule.stages[s]))
            raise ScheduleError(f"{schedule.name} p={pp} m={schedule.micro_batches}: deadlock: {waits}")

    leftover = {ch: len(q) for ch, q in list(channels.items()) + list(posted_sends.items()) if q}
    if leftover:
        raise ScheduleError(f"{schedule.name}: messages sent but never received (mismatched send/recv): {leftover}")
    expected = {(mb, c) for mb in range(schedule.micro_batches) for c in range(vpp)}
    for stage in range(pp):
        if set(forwarded[stage]) != expected or done_backward[stage] != expected:
            raise ScheduleError(f"{schedule.name}: stage {stage} does not run forward and backward exactly once "
                                f"for every micro-batch and chunk")
    step_time = max(clock)
    bubble = tuple(1.0 - b / step_time if step_time else 0.0 for b in busy)
    return Report(schedule=schedule, step_time=step_time, busy=tuple(busy), bubble_per_stage=bubble,
                  peak_in_flight=tuple(peak), events=tuple(events))
