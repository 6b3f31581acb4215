"""Pipeline schedules as data: for each stage, the ordered list of instructions it runs.

A schedule is produced in two passes, as in ``torch.distributed.pipelining``:

1. a small pure function orders the *compute* of one stage (``Forward`` and
   ``Backward`` of micro-batch i on model chunk c) — GPipe, 1F1B, interleaved 1F1B;
2. ``add_p2p`` inserts the communication each compute action implies (receive the
   activation before a forward, send it after; receive the gradient before a
   backward, send it after) and appends the end-of-step actions (reduce tied
   embedding gradients, reduce gradients over DP, optimizer step).

The same list is proven deadlock-free by ``simulator.simulate`` and run by
``pipeline.PipelineExecutor``: nothing else decides what a rank does. Each
instruction is a small frozen dataclass whose class says what it does; both handle
it through a table keyed by that class (as DeepSpeed's ``_INSTRUCTION_MAP``).

Virtual stages: with interleaving, rank ``r`` holds ``vpp`` model chunks; chunk ``c``
of rank ``r`` is virtual stage ``c * pp + r`` of ``pp * vpp``. A micro-batch flows
through virtual stages 0, 1, ... in order, so it visits every rank ``vpp`` times.
Without interleaving ``vpp = 1`` and virtual stage = rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from megakit.errors import UsageError

SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")


@dataclass(frozen=True, kw_only=True)
class Instruction:
    """One instruction of one stage; its class says what it does (the executor and simulator dispatch on it).

    ``micro_batch`` and ``chunk`` (the local model chunk) say which activation the
    instruction touches; ``peer`` is the pipeline stage (rank in the PP group) that a
    send/recv talks to. End-of-step instructions carry neither.
    """

    micro_batch: int | None = None
    chunk: int = 0
    peer: int | None = None
    short: ClassVar[str]  # the name in a printed schedule
    channel: ClassVar[str] = ""  # sends and receives: "act" or "grad" (their P2P tag)

    def __post_init__(self) -> None:
        assert type(self) in KINDS, type(self)  # one of the classes below, not the base

    @property
    def kind(self) -> type[Instruction]:
        """The instruction's class, so ``a.kind == FORWARD`` reads as before."""
        return type(self)

    def __str__(self) -> str:
        if self.micro_batch is None:
            return self.short
        chunk = f".{self.chunk}" if self.chunk else ""
        peer = f"@{self.peer}" if self.peer is not None else ""
        return f"{self.short}{self.micro_batch}{chunk}{peer}"


class Forward(Instruction):
    """Run the stage (this chunk) forward on one micro-batch and keep what its backward needs."""

    short = "F"


class Backward(Instruction):
    """The whole backward of one micro-batch: input and weight gradients together."""

    short = "B"


class BackwardInput(Instruction):
    """Zero bubble's B: the gradient w.r.t. the stage input only, on the critical path (the weights wait)."""

    short = "b"


class BackwardWeight(Instruction):
    """Zero bubble's W: the weight gradients of a micro-batch whose B ran, deferred into what would be bubble."""

    short = "w"


class SendActivation(Instruction):
    """Send a forward's output to the next virtual stage."""

    short, channel = "sA", "act"  # channel: activations and gradients travel apart (the P2P tag)


class RecvActivation(Instruction):
    """Receive the previous virtual stage's output: this forward's input."""

    short, channel = "rA", "act"


class SendGrad(Instruction):
    """Send the gradient of a backward's input to the virtual stage before."""

    short, channel = "sG", "grad"


class RecvGrad(Instruction):
    """Receive the gradient of this stage's output from the virtual stage after."""

    short, channel = "rG", "grad"


class ReduceTiedGrads(Instruction):
    """Sum the tied embedding's gradient between the first and last stage."""

    short = "tied"


class ReduceGrads(Instruction):
    """Average the step's gradients over data parallelism (DeepSpeed's reduction)."""

    short = "reduce"


class OptimizerStep(Instruction):
    """Step the optimizer once the step's gradients are complete."""

    short = "step"


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
BACKWARDS = (Backward, BackwardInput)  # what makes the gradient sent to the stage before
SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)
KINDS = COMPUTE + SENDS + RECVS + (ReduceTiedGrads, ReduceGrads, OptimizerStep)
# the names from when kinds were strings
FORWARD, BACKWARD = Forward, Backward
SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD = SendActivation, RecvActivation, SendGrad, RecvGrad
REDUCE_TIED, REDUCE_GRADS, STEP = ReduceTiedGrads, ReduceGrads, OptimizerStep


def Action(*, kind: type[Instruction], **fields) -> Instruction:
    """``Action(kind=FORWARD, micro_batch=0)``, from when instructions were one class: ``Forward(micro_batch=0)``."""
    assert kind in KINDS, kind
    return kind(**fields)


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """One optimizer step of a pipeline: ``stages[r]`` is the instruction list of PP rank ``r``."""

    name: str
    pp: int
    micro_batches: int
    vpp: int
    stages: tuple[tuple[Instruction, ...], ...]

    @property
    def virtual_stages(self) -> int:
        return self.pp * self.vpp

    def virtual_stage(self, stage: int, chunk: int) -> int:
        """The model-order index of ``stage``'s chunk ``chunk`` (chunks are dealt round-robin over stages)."""
        return chunk * self.pp + stage

    def owner(self, virtual_stage: int) -> tuple[int, int]:
        """``(stage, chunk)`` holding a virtual stage."""
        return virtual_stage % self.pp, virtual_stage // self.pp

    @property
    def split_backward(self) -> bool:
        """True when backwards are split into B and W (zero bubble)."""
        return any(isinstance(a, BackwardWeight) for actions in self.stages for a in actions)

    @property
    def has_p2p(self) -> bool:
        return any(isinstance(a, SENDS + RECVS) for actions in self.stages for a in actions)

    def compute_only(self) -> "Schedule":
        """The same schedule with communication and end-of-step actions removed."""
        stages = tuple(tuple(a for a in actions if isinstance(a, COMPUTE)) for actions in self.stages)
        return Schedule(name=self.name, pp=self.pp, micro_batches=self.micro_batches, vpp=self.vpp, stages=stages)


def _check(pp: int, micro_batches: int, vpp: int = 1) -> None:
    for flag, value in (("--pp", pp), ("--micro-batches", micro_batches), ("--vpp", vpp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value!r}")


def _schedule(name, pp, micro_batches, vpp, stages) -> Schedule:
    return Schedule(name=name, pp=pp, micro_batches=micro_batches, vpp=vpp, stages=tuple(tuple(s) for s in stages))


# -- compute orders ---------------------------------------------------------------------------
def gpipe_compute(pp: int, micro_batches: int) -> Schedule:
    """All forwards, then all backwards (GPipe): keeps every micro-batch in flight."""
    _check(pp, micro_batches)
    stage: list[Instruction] = [Forward(micro_batch=i) for i in range(micro_batches)]
    stage += [Backward(micro_batch=i) for i in range(micro_batches)]
    return _schedule("gpipe", pp, micro_batches, 1, [stage] * pp)


def one_f_one_b_compute(pp: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-Flush): warm-up forwards, then alternate one forward one backward, then cool-down.

    Stage ``r`` warms up with ``min(pp - r - 1, m)`` forwards, so it holds at most
    ``pp - r`` micro-batches' activations at once, against GPipe's ``m``.
    """
    _check(pp, micro_batches)
    stages = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, micro_batches)
        steady = micro_batches - warmup
        actions: list[Instruction] = [Forward(micro_batch=i) for i in range(warmup)]
        for i in range(steady):  # steady state: F(warmup + i), B(i)
            actions.append(Forward(micro_batch=warmup + i))
            actions.append(Backward(micro_batch=i))
        actions += [Backward(micro_batch=i) for i in range(steady, micro_batches)]
        stages.append(actions)
    return _schedule("1f1b", pp, micro_batches, 1, stages)


def interleaved_compute(pp: int, micro_batches: int, vpp: int) -> Schedule:
    """Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM) with ``vpp`` chunks per rank.

    Micro-batches go in groups of ``pp``: the k-th forward of a rank runs chunk
    ``(k // pp) % vpp`` on micro-batch ``(k // (pp * vpp)) * pp + k % pp``; backwards
    mirror it from the last chunk. Warm-up is ``2 (pp - r - 1) + (vpp - 1) pp``
    forwards (all of them when ``m == pp``). The bubble shrinks to (p-1)/(v m + p - 1)
    because each chunk is 1/v of the stage's work. Needs ``m`` divisible by ``pp``.
    """
    _check(pp, micro_batches, vpp)
    if micro_batches < pp:
        raise UsageError(
            f"the interleaved schedule needs at least as many micro-batches as stages, got "
            f"--micro-batches {micro_batches} for --pp {pp}; use {pp} or a multiple of it"
        )
    if micro_batches % pp:
        raise UsageError(
            f"the interleaved schedule needs --micro-batches divisible by --pp, got {micro_batches} and {pp}; "
            f"use a multiple of {pp} (e.g. {pp * max(1, -(-micro_batches // pp))})"
        )
    total = micro_batches * vpp

    def unit(k: int, kind: type[Instruction]) -> Instruction:
        chunk = (k // pp) % vpp
        chunk = chunk if kind is Forward else vpp - 1 - chunk
        return kind(micro_batch=(k // (pp * vpp)) * pp + k % pp, chunk=chunk)

    stages = []
    for rank in range(pp):
        # with m == pp every forward comes first, as in Megatron-LM (the bubble is the same)
        warmup = total if micro_batches == pp else min(2 * (pp - rank - 1) + (vpp - 1) * pp, total)
        actions = [unit(k, Forward) for k in range(warmup)]
        for i in range(total - warmup):
            actions.append(unit(warmup + i, Forward))
            actions.append(unit(i, Backward))
        actions += [unit(k, Backward) for k in range(total - warmup, total)]
        stages.append(actions)
    return _schedule(f"interleaved(v={vpp})", pp, micro_batches, vpp, stages)


def zb_h1_compute(pp: int, micro_batches: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3.1): 1F1B with W deferred.

    Each backward is split into B (input gradient, what the stage before waits for)
    and W (weight gradient, which nobody waits for). Stage ``r`` runs 1F1B's forwards
    and B's in 1F1B's order and holds back its first ``r`` W's, running one W after
    each later B and the rest at the end, so the W's fill the cool-down where 1F1B
    idles. That is torch's ``_get_1f1b_rank_ops(enable_zero_bubble=True)`` for one
    chunk per rank. Each stage keeps at most ``pp`` micro-batches alive (1F1B's
    first stage's peak), and with costs F, B, W the idle time per stage falls from
    (p-1)(F+B+W) to (p-1)(F+B-W): a third of 1F1B's when F = B = W.
    """
    _check(pp, micro_batches)
    stages = []
    for rank in range(pp):
        warmup = min(pp - rank - 1, micro_batches)
        actions: list[Instruction] = [Forward(micro_batch=i) for i in range(warmup)]
        weights = 0
        for i in range(micro_batches):  # the i-th B, after the forward of the steady state if any is left
            if warmup + i < micro_batches:
                actions.append(Forward(micro_batch=warmup + i))
            actions.append(BackwardInput(micro_batch=i))
            if i >= rank:
                actions.append(BackwardWeight(micro_batch=weights))
                weights += 1
        actions += [BackwardWeight(micro_batch=i) for i in range(weights, micro_batches)]
        stages.append(actions)
    return _schedule("zb-h1", pp, micro_batches, 1, stages)


# -- communication pass ---------------------------------------------------------------------
def add_p2p(compute: Schedule, *, fuse_pairs: bool = False) -> Schedule:
    """Insert send/recv around every compute action, then the end-of-step actions.

    Forward on virtual stage s > 0 first receives its activation from s - 1; its
    output goes to s + 1 unless s is the last. Backward on s < last first receives
    the gradient from s + 1 and sends its input gradient to s - 1 unless s = 0.
    A receive sits right before the compute that needs it and a send right after
    the compute that makes it.

    ``fuse_pairs`` (interleaved 1F1B, as Megatron-LM does it): a steady-state
    forward and the backward right after it run back to back — both receives
    before the pair, both sends after — so the four messages of a step travel as
    one batch; without this, interleaving deadlocks where a send waits for its
    receive (NCCL). A pair whose backward depends on its own forward's output is
    left apart.
    """
    assert not compute.has_p2p, "schedule already has communication"
    pp, last = compute.pp, compute.virtual_stages - 1
    stages = []
    for rank, actions in enumerate(compute.stages):
        units: list[tuple[list[Instruction], Instruction, list[Instruction]]] = []  # (receives, compute, sends)
        for a in actions:
            vs = compute.virtual_stage(rank, a.chunk)
            mb, chunk = a.micro_batch, a.chunk
            if isinstance(a, BackwardWeight):  # local: nothing to receive or send
                units.append(([], a, []))
                continue
            recv: list[Instruction]
            send: list[Instruction]
            if isinstance(a, Forward):
                recv = [RecvActivation(micro_batch=mb, chunk=chunk, peer=(vs - 1) % pp)] if vs > 0 else []
                send = [SendActivation(micro_batch=mb, chunk=chunk, peer=(vs + 1) % pp)] if vs < last else []
            else:
                recv = [RecvGrad(micro_batch=mb, chunk=chunk, peer=(vs + 1) % pp)] if vs < last else []
                send = [SendGrad(micro_batch=mb, chunk=chunk, peer=(vs - 1) % pp)] if vs > 0 else []
            units.append((recv, a, send))
        out: list[Instruction] = []
        i = 0
        while i < len(units):
            recv, a, send = units[i]
            nxt = units[i + 1] if i + 1 < len(units) else None
            if (
                fuse_pairs
                and nxt
                and isinstance(a, Forward)
                and isinstance(nxt[1], Backward)
                and not (nxt[1].micro_batch == a.micro_batch and nxt[0])
            ):
                out += recv + nxt[0] + [a, nxt[1]] + send + nxt[2]
                i += 2
            else:
                out += recv + [a] + send
                i += 1
        if compute.virtual_stages > 1 and rank in (0, pp - 1):  # the ranks holding embedding and head
            out.append(ReduceTiedGrads())
        out += [ReduceGrads(), OptimizerStep()]
        stages.append(out)
    return _schedule(compute.name, compute.pp, compute.micro_batches, compute.vpp, stages)


def weights_before_grad_sends(schedule: Schedule) -> Schedule:
    """Zero bubble under rendezvous P2P (NCCL, ``p2p="batched"``): each W that follows a gradient send runs first.

    Where a send waits for its receive, a gradient sent right after B waits alone until the
    stage before posts its receive, while the W behind it could run; sent after W, it goes out
    in one batch with the next receive. At F = B = W, p = 4, m = 8 the step takes 30 against
    1F1B's 33 (27 with asynchronous sends, where the original order is best)."""
    stages = []
    for actions in schedule.stages:
        out, i = list(actions), 0
        while i < len(out) - 1:
            if isinstance(out[i], SendGrad) and isinstance(out[i + 1], BackwardWeight):
                out[i], out[i + 1] = out[i + 1], out[i]
                i += 1  # past one W only: the last sends of a step must not wait for every W left
            i += 1
        stages.append(out)
    return _schedule(schedule.name, schedule.pp, schedule.micro_batches, schedule.vpp, stages)


def schedule_gpipe(pp: int, micro_batches: int) -> Schedule:
    """GPipe with communication: the baseline that keeps all m micro-batches in flight."""
    return add_p2p(gpipe_compute(pp, micro_batches))


def schedule_1f1b(pp: int, micro_batches: int) -> Schedule:
    """1F1B (PipeDream-Flush) with communication: DeepSpeed's ``TrainSchedule`` order."""
    return add_p2p(one_f_one_b_compute(pp, micro_batches))


def schedule_interleaved(pp: int, micro_batches: int, vpp: int) -> Schedule:
    """Interleaved 1F1B with ``vpp`` model chunks per rank, with communication."""
    # m == pp runs all forwards first: no steady state, nothing to fuse
    return add_p2p(interleaved_compute(pp, micro_batches, vpp), fuse_pairs=micro_batches != pp)


def build_schedule(name: str, pp: int, micro_batches: int, vpp: int = 1) -> Schedule:
    """The schedule called ``name`` ("1f1b", "gpipe", "interleaved" or "zb-h1"), with communication."""
    if name == "1f1b":
        if vpp != 1:
            raise UsageError(f"--vpp {vpp} needs --schedule interleaved; 1f1b has one chunk per stage")
        return schedule_1f1b(pp, micro_batches)
    if name == "gpipe":
        if vpp != 1:
            raise UsageError(f"--vpp {vpp} needs --schedule interleaved; gpipe has one chunk per stage")
        return schedule_gpipe(pp, micro_batches)
    if name == "interleaved":
        return schedule_interleaved(pp, micro_batches, vpp)
    if name == "zb-h1":
        if vpp != 1:
            raise UsageError(
                f"--schedule zb-h1 runs one chunk per stage, got --vpp {vpp}; drop --vpp or use --schedule interleaved"
            )
        return add_p2p(zb_h1_compute(pp, micro_batches))
    raise UsageError(f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULES)}")


def bubble_formula(name: str, pp: int, micro_batches: int, vpp: int = 1, *, weight_share: float = 0.5) -> float:
    """The textbook bubble fraction: (p-1)/(m+p-1), or (p-1)/(v m+p-1) when interleaved.

    ZB-H1 (Qi et al. 2023): idle (p-1)(F+B-W) over m(F+B+W) of work; with backward = 2F
    (the convention here) and W a ``weight_share`` of it, F+B-W = F (1 + 2 (1 - 2 share)).
    """
    if name == "zb-h1":
        idle = (pp - 1) * (1 + 2 * (1 - 2 * weight_share))
        return idle / (3 * micro_batches + idle)
    v = vpp if name == "interleaved" else 1
    return (pp - 1) / (v * micro_batches + pp - 1)
