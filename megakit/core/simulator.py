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
  **backward** (or zero bubble's input-gradient B) needs its own forward done and,
  except on the last virtual stage, its gradient received first; a weight-gradient
  W needs its B done. A micro-batch's activations count as in flight from its
  forward until its backward, or until its W when split (W needs what the
  forward saved for the weights).

Execution is round-robin over stages, each running until it blocks; a full round
in which no stage moves is a deadlock, reported with what every stage waits for
(never a hang). Times are causal (each action starts when both its stage and its
input are ready), so the order the simulator visits stages does not change them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, NoReturn

from megakit.core.schedules import (
    RECVS,
    SENDS,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    Schedule,
    SendActivation,
    SendGrad,
    add_p2p,
    weights_before_grad_sends,
)
from megakit.errors import UsageError


class ScheduleError(Exception):
    """A schedule that cannot run: deadlock, mismatched send/recv, or a backward before its forward."""


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Time per action: floats, one float per stage (measured costs of unequal stages), or, for
    ``forward`` and ``backward``, one per virtual stage (chunks holding unequal layers).

    ``forward`` and ``backward`` are the cost of a whole stage's layers for one
    micro-batch; with ``vpp`` chunks a chunk costs 1/vpp of it, so interleaving does
    not change the total work. Given ``pp * vpp`` values instead, in virtual-stage
    order (chunk ``c`` of rank ``r`` is ``c * pp + r``), each chunk costs its own.
    ``p2p`` is the time a message takes to arrive.
    ``weight`` is the share of ``backward`` that is the weight gradient W when a
    schedule splits it (zero bubble): B costs the rest.
    """

    forward: float | tuple[float, ...] = 1.0
    backward: float | tuple[float, ...] = 2.0
    p2p: float = 0.0
    weight: float = 0.5
    reduce: float = 0.0
    step: float = 0.0

    def per_stage(self, name: str, stage: int) -> float:
        """Cost ``name`` on ``stage``: its own value when given per stage, else the one value."""
        value = getattr(self, name)
        return float(value[stage] if isinstance(value, (tuple, list)) else value)


@dataclass(frozen=True, kw_only=True)
class Event:
    """One executed compute instruction: for the timeline."""

    stage: int
    kind: type[Instruction]  # Forward, Backward, BackwardInput or BackwardWeight
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


def _validate_costs(costs: Costs, pp: int, vpp: int = 1) -> None:
    if not 0.0 <= costs.weight <= 1.0:
        raise UsageError(f"weight is the share of the backward that is W, between 0 and 1; got {costs.weight!r}")
    for name in ("forward", "backward", "p2p", "reduce", "step"):
        value = getattr(costs, name)
        values = value if isinstance(value, (tuple, list)) else (value,)
        if isinstance(value, (tuple, list)) and name not in ("forward", "backward"):
            raise UsageError(f"{name} cost must be one number; only forward and backward costs may differ per stage")
        if isinstance(value, (tuple, list)) and len(value) not in (pp, pp * vpp):
            per_chunk = f" or one per virtual stage ({pp * vpp})" if vpp > 1 else ""
            raise UsageError(f"{name} costs give {len(value)} values for {pp} stages; give one per stage{per_chunk}")
        if any(not isinstance(x, (int, float)) or x < 0 for x in values):
            raise UsageError(f"{name} cost must be a non-negative number, got {value!r}")


def _message(schedule: Schedule, stage: int, a: Instruction) -> tuple[tuple[int, int, str], tuple[int, int]]:
    """``(channel, payload)`` of a send or recv: channel = (src, dst, kind), payload = (mb, dst virtual stage)."""
    assert a.peer is not None and a.micro_batch is not None, a  # the simulator checks both before it gets here
    vs = schedule.virtual_stage(stage, a.chunk)
    if isinstance(a, SENDS):  # an activation goes to the next virtual stage, a gradient to the one before
        return (stage, a.peer, a.channel), (a.micro_batch, vs + (1 if isinstance(a, SendActivation) else -1))
    return (a.peer, stage, a.channel), (a.micro_batch, vs)


P2P_MODES = ("async", "batched")


@dataclass(kw_only=True, eq=False)
class _Stage:
    """Where one stage is in its instruction list, and what it has computed and received so far."""

    index: int
    actions: tuple[Instruction, ...]
    pc: int = 0  # next instruction
    clock: float = 0.0
    busy: float = 0.0
    received: dict = field(default_factory=dict)  # (channel kind, mb, vs) -> arrival time
    forwarded: dict = field(default_factory=dict)  # (mb, chunk) -> end time of its forward
    done_backward: set = field(default_factory=set)
    done_weight: set = field(default_factory=set)
    in_flight: int = 0
    peak: int = 0
    batch: list | None = None  # batched mode: the ops this stage has posted and waits on


@dataclass(kw_only=True, eq=False)
class _Op:
    """Batched mode: one posted send or recv, done once its counterpart is posted too."""

    stage: _Stage
    action: Instruction
    payload: tuple  # (mb, dst virtual stage, channel kind)
    posted: float
    done: float | None = None


class _Simulator:
    """One run of a schedule: stages take turns, each running until it blocks."""

    def __init__(self, schedule: Schedule, costs: Costs, *, tagged: bool, p2p: str) -> None:
        self.schedule, self.costs, self.tagged, self.batched = schedule, costs, tagged, p2p == "batched"
        self.pp, self.vpp, self.last = schedule.pp, schedule.vpp, schedule.virtual_stages - 1
        self.stages = [_Stage(index=s, actions=schedule.stages[s]) for s in range(self.pp)]
        self.channels: dict[tuple, deque] = {}  # async mode: messages sent, not yet received
        self.posted_sends: dict[tuple, deque[_Op]] = {}  # batched mode: ops posted, not yet matched, per channel
        self.posted_recvs: dict[tuple, deque[_Op]] = {}
        self.events: list[Event] = []
        self.handlers: dict[type[Instruction], Callable[[_Stage, Any], bool]] = {
            Forward: self._forward,
            Backward: self._backward,
            BackwardInput: self._backward,
            BackwardWeight: self._weight,
            SendActivation: self._send,
            SendGrad: self._send,
            RecvActivation: self._recv,
            RecvGrad: self._recv,
            ReduceTiedGrads: self._reduce,
            ReduceGrads: self._reduce,
            OptimizerStep: self._optimizer_step,
        }

    def fail(self, st: _Stage, a: Instruction, why: str) -> NoReturn:
        s = self.schedule
        raise ScheduleError(f"{s.name} p={s.pp} m={s.micro_batches}: stage {st.index} action #{st.pc} ({a}): {why}")

    def run(self) -> Report:
        s = self.schedule
        while True:
            moved = False
            for st in self.stages:
                while self.step(st):
                    moved = True
            if all(st.pc >= len(st.actions) for st in self.stages):
                break
            if not moved:
                waits = "; ".join(
                    f"stage {st.index} waits at {st.actions[st.pc]}" for st in self.stages if st.pc < len(st.actions)
                )
                raise ScheduleError(f"{s.name} p={s.pp} m={s.micro_batches}: deadlock: {waits}")
        self._check_all_done()
        clocks, busy = [st.clock for st in self.stages], tuple(st.busy for st in self.stages)
        step_time = max(clocks)
        bubble = tuple(1.0 - b / step_time if step_time else 0.0 for b in busy)
        return Report(
            schedule=s,
            step_time=step_time,
            busy=busy,
            bubble_per_stage=bubble,
            peak_in_flight=tuple(st.peak for st in self.stages),
            events=tuple(self.events),
        )

    def _check_all_done(self) -> None:
        s = self.schedule
        leftover = {ch: len(q) for ch, q in list(self.channels.items()) + list(self.posted_sends.items()) if q}
        if leftover:
            raise ScheduleError(f"{s.name}: messages sent but never received (mismatched send/recv): {leftover}")
        expected = {(mb, c) for mb in range(s.micro_batches) for c in range(self.vpp)}
        for st in self.stages:
            weights = expected if s.split_backward else set()
            if set(st.forwarded) != expected or st.done_backward != expected or st.done_weight != weights:
                raise ScheduleError(
                    f"{s.name}: stage {st.index} does not run forward and backward exactly once "
                    f"for every micro-batch and chunk"
                )

    def step(self, st: _Stage) -> bool:
        """Run one instruction of ``st`` if it can; False if it is blocked or finished."""
        if st.pc >= len(st.actions):
            return False
        a = st.actions[st.pc]
        if self.batched and isinstance(a, SENDS + RECVS) and a.peer != st.index:
            return self._batch(st)  # (a hand-over to this same rank, PP = 1 with chunks, is a buffer)
        if not self.handlers[type(a)](st, a):
            return False
        st.pc += 1
        return True

    # -- communication --------------------------------------------------------------------------
    def _check_peer(self, st: _Stage, a: Instruction) -> None:
        if a.peer is None or not 0 <= a.peer < self.pp:
            self.fail(st, a, f"peer {a.peer} is not a stage")

    def _check_send(self, st: _Stage, a: Instruction) -> None:
        self._check_peer(st, a)
        if isinstance(a, SendActivation) and (a.micro_batch, a.chunk) not in st.forwarded:
            self.fail(st, a, "sends an activation before computing it")
        if isinstance(a, SendGrad) and (a.micro_batch, a.chunk) not in st.done_backward:
            self.fail(st, a, "sends a gradient before computing it")

    def _channel(self, st: _Stage, a: Instruction) -> tuple[tuple, tuple, str]:
        """``(channel, payload, kind)``; without tags the two kinds share one channel and the payload names its kind."""
        channel, payload = _message(self.schedule, st.index, a)
        kind = channel[2]
        if not self.tagged:
            return channel[:2], (*payload, kind), kind
        return channel, payload, kind

    def _send(self, st: _Stage, a: Instruction) -> bool:
        """Asynchronous: the message is posted and arrives ``costs.p2p`` later; the sender moves on."""
        self._check_peer(st, a)
        channel, payload, _ = self._channel(st, a)
        self._check_send(st, a)
        self.channels.setdefault(channel, deque()).append((payload, st.clock + self.costs.p2p))
        return True

    def _recv(self, st: _Stage, a: Instruction) -> bool:
        self._check_peer(st, a)
        channel, payload, kind = self._channel(st, a)
        queue = self.channels.get(channel)
        if not queue:
            return False  # blocked: the message has not been sent yet
        (got, arrival) = queue[0]
        if got != payload:
            self.fail(
                st,
                a,
                f"expects {kind} of micro-batch {payload[0]} for virtual stage {payload[1]} from "
                f"stage {a.peer} but the next message on that channel is {got} (mismatched send/recv)",
            )
        queue.popleft()
        st.received[(kind, payload[0], payload[1])] = arrival
        st.clock = max(st.clock, arrival)
        return True

    def _batch(self, st: _Stage) -> bool:
        """Post this stage's run of send/recv instructions at once; move past it when all have matched."""
        if st.batch is None:
            st.batch = self._post_batch(st)
            return True  # posting is progress: a peer may now complete its own batch
        ops = st.batch
        if any(op.done is None for op in ops):
            return False
        for op in ops:
            if isinstance(op.action, RECVS):
                st.received[(op.payload[2], op.payload[0], op.payload[1])] = op.done
        st.clock = max([st.clock] + [op.done for op in ops])
        st.pc += len(ops)
        st.batch = None
        return True

    def _post_batch(self, st: _Stage) -> list[_Op]:
        ops, i = [], st.pc
        while i < len(st.actions) and isinstance(st.actions[i], SENDS + RECVS) and st.actions[i].peer != st.index:
            a = st.actions[i]
            if isinstance(a, SENDS):
                self._check_send(st, a)
            else:
                self._check_peer(st, a)
            (src, dst, kind), payload = _message(self.schedule, st.index, a)
            op = _Op(stage=st, action=a, payload=(*payload, kind), posted=st.clock)
            (self.posted_sends if isinstance(a, SENDS) else self.posted_recvs).setdefault((src, dst), deque()).append(
                op
            )
            ops.append(op)
            self._match((src, dst))
            i += 1
        return ops

    def _match(self, channel: tuple) -> None:
        """Batched mode: a send and a receive complete together once both are posted (NCCL's rendezvous)."""
        sends, recvs = self.posted_sends.get(channel), self.posted_recvs.get(channel)
        while sends and recvs:
            if sends[0].payload != recvs[0].payload:
                r = recvs[0]
                self.fail(
                    r.stage,
                    r.action,
                    f"expects {r.payload} from stage {channel[0]} but the next message "
                    f"posted on that channel is {sends[0].payload} (mismatched send/recv)",
                )
            s, r = sends.popleft(), recvs.popleft()
            s.done = r.done = max(s.posted, r.posted) + self.costs.p2p

    # -- compute and end of step ----------------------------------------------------------------
    def _target(self, st: _Stage, a: Instruction) -> tuple[int, int, int]:
        """``(micro-batch, chunk, virtual stage)`` of a compute instruction."""
        mb, chunk = a.micro_batch, a.chunk
        if mb is None or not 0 <= mb < self.schedule.micro_batches or not 0 <= chunk < self.vpp:
            self.fail(st, a, "micro-batch or chunk out of range")
        return mb, chunk, self.schedule.virtual_stage(st.index, chunk)

    def _forward(self, st: _Stage, a: Forward) -> bool:
        mb, chunk, vs = self._target(st, a)
        if (mb, chunk) in st.forwarded:
            self.fail(st, a, "runs the same forward twice")
        if vs > 0 and (RecvActivation.channel, mb, vs) not in st.received:
            self.fail(st, a, "runs a forward before receiving its activation")
        cost = self._cost("forward", st.index, chunk)
        st.forwarded[(mb, chunk)] = st.clock + cost
        st.in_flight += 1
        st.peak = max(st.peak, st.in_flight)
        return self._compute(st, a, cost)

    def _backward(self, st: _Stage, a: Backward) -> bool:
        mb, chunk, vs = self._target(st, a)
        if (mb, chunk) not in st.forwarded:
            self.fail(st, a, "runs a backward before its forward (backward must follow forward)")
        if (mb, chunk) in st.done_backward:
            self.fail(st, a, "runs the same backward twice")
        if vs < self.last and (RecvGrad.channel, mb, vs) not in st.received:
            self.fail(st, a, "runs a backward before receiving its output gradient")
        cost = self._cost("backward", st.index, chunk)
        st.done_backward.add((mb, chunk))
        if isinstance(a, BackwardInput):  # what W needs stays in flight
            return self._compute(st, a, cost * (1.0 - self.costs.weight))
        st.in_flight -= 1
        return self._compute(st, a, cost)

    def _weight(self, st: _Stage, a: BackwardWeight) -> bool:
        mb, chunk, _ = self._target(st, a)
        if (mb, chunk) not in st.done_backward or (mb, chunk) in st.done_weight:
            self.fail(st, a, "runs a weight gradient before its input gradient, or twice")
        st.done_weight.add((mb, chunk))
        st.in_flight -= 1
        return self._compute(st, a, self._cost("backward", st.index, chunk) * self.costs.weight)

    def _cost(self, name: str, stage: int, chunk: int) -> float:
        """One chunk's ``forward`` or ``backward``: its own value when given per virtual stage, else 1/vpp of its
        stage's."""
        value = getattr(self.costs, name)
        if self.vpp > 1 and isinstance(value, (tuple, list)) and len(value) == self.pp * self.vpp:
            return float(value[self.schedule.virtual_stage(stage, chunk)])
        return self.costs.per_stage(name, stage) / self.vpp

    def _compute(self, st: _Stage, a: Instruction, cost: float) -> bool:
        assert a.micro_batch is not None, a  # _target checked it
        start = st.clock
        st.clock = start + cost
        st.busy += cost
        self.events.append(
            Event(stage=st.index, kind=type(a), micro_batch=a.micro_batch, chunk=a.chunk, start=start, end=start + cost)
        )
        return True

    def _reduce(self, st: _Stage, a: Instruction) -> bool:
        st.clock += self.costs.reduce
        return True

    def _optimizer_step(self, st: _Stage, a: Instruction) -> bool:
        st.clock += self.costs.step
        return True


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
    _validate_costs(costs, schedule.pp, schedule.vpp)
    return _Simulator(schedule, costs, tagged=tagged, p2p=p2p).run()


def fastest_order(schedule: Schedule, *, p2p: str) -> Schedule:
    """Zero bubble under rendezvous P2P: the schedule or its ``weights_before_grad_sends`` order, whichever runs
    faster."""
    if p2p != "batched" or not schedule.split_backward:
        return schedule
    return min((schedule, weights_before_grad_sends(schedule)), key=lambda s: simulate(s, p2p=p2p).step_time)
