"""The pipeline executor: runs this rank's instruction list of a schedule over torch.distributed P2P.

One ``PipelineExecutor`` per rank holds that rank's model chunk(s) (one per virtual
stage it owns: ``vpp`` of them when interleaved) and, for each optimizer step,
walks its list from ``schedules`` — nothing else decides what runs when. Each
instruction class has its handler (``PipelineExecutor._handlers``):

- ``Forward`` runs the chunk on the micro-batch's input (token ids on the first
  virtual stage, the received hidden state elsewhere) and keeps input and output
  for the backward; the last virtual stage is called with labels and returns the loss;
- ``Backward`` calls the pluggable ``backward(scalar, is_loss)``: on the last virtual stage
  ``scalar`` is the micro-batch's loss; elsewhere it is the stage output's handle, whose
  gradient is the one received (``sent_output``: a sent output's values are freed once the send
  completes, as Megatron-LM does). The default scales the loss by ``1 / micro_batches``, as
  DeepSpeed's ``engine.backward(loss)`` does with ``gradient_accumulation_steps = micro_batches``;
- ``BackwardInput`` / ``BackwardWeight`` (zero bubble, ``split_backward``): B computes
  the gradient of the stage input only, W later the weights' (the loss scaled as above);
- P2P, ``p2p="async"`` (gloo's default): a send posts ``isend`` and moves on; a receive
  waits for an ``irecv`` posted a few instructions ahead. ``p2p="batched"`` (NCCL's
  default, where a send waits for its receive): each run of consecutive sends/receives
  is one ``batch_isend_irecv``, and only schedules the simulator proves deadlock-free
  that way may run (interleaving thanks to its fused pairs, ``schedules.add_p2p``).
  Activations carry P2P tag 0, gradients tag 1. With ``activation_shape`` no shape
  header is sent; a gradient's shape is that of the activation sent;
- ``ReduceTiedGrads`` sums the tied embeddings' gradients (``stage_grads``), ``ReduceGrads``
  averages over ``topo.dp_group``, ``OptimizerStep`` calls ``optimizer_step()`` if given
  (a trainer using DeepSpeed replaces the last two: its engine reduces and steps).

TP composes inside a stage (TP rank t talks to TP rank t of the next stage) and DP
across replicas (each its own pipeline; gradients meet in ``ReduceGrads``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

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
)
from megakit.core.simulator import P2P_MODES, ScheduleError, fastest_order, simulate
from megakit.errors import UsageError
from megakit.nn import comm as C
from megakit.nn.pipeline import sent_output, split_backward, stage_grads

__all__ = ["PipelineExecutor", "StepTimes", "activation_shape"]
_TAG = {RecvActivation: 0, SendActivation: 0, RecvGrad: 1, SendGrad: 1}


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """Where one step's wall time went on this rank (seconds): what the measured bubble is made of."""

    forward: float
    backward: float
    total: float
    micro_batches: int
    peak_in_flight: int  # most (micro-batch, chunk) activations held at once: the simulator's figure

    @property
    def bubble(self) -> float:
        """Fraction of the step this rank spent not computing (waiting, communicating, reducing)."""
        return 1.0 - (self.forward + self.backward) / self.total if self.total else 0.0


@dataclass(kw_only=True)
class _StepState:
    """What one ``step`` builds up and consumes: made per step, so nothing leaks into the next."""

    inputs: Sequence[torch.Tensor] | None
    labels: Sequence[torch.Tensor] | None
    sample_ids: Sequence[Sequence[int]] | None
    extras: Sequence[dict] | None
    recv_index: list[int]  # positions of the receives in the list, in order
    next_recv: int = 0  # the first receive in recv_index not yet posted or taken
    stash: dict = field(default_factory=dict)  # (mb, chunk) -> (input, output); ("grad"/"W", mb, chunk) -> grad / W's
    received: dict = field(default_factory=dict)  # (recv class, mb, chunk) -> tensor
    sent_shape: dict = field(default_factory=dict)  # (mb, chunk) -> shape of the activation sent
    pending: list = field(default_factory=list)  # (tensor, work) of isends, waited for at the end of the step
    outputs: sent_output.SentOutputs = None  # the outputs sent on: released once sent, their backward's handles
    posted: dict = field(default_factory=dict)  # list index -> (buffer, work) of irecvs posted ahead
    local: dict = field(default_factory=lambda: {0: [], 1: []})  # messages to this same rank, by tag
    losses: list = field(default_factory=list)
    forward_time: float = 0.0
    backward_time: float = 0.0
    in_flight: int = 0
    peak: int = 0


class PipelineExecutor:
    """Runs one rank's part of a pipeline schedule; ``step(inputs, labels)`` is one optimizer step.

    Args:
        chunks: this rank's model chunk per local chunk index (virtual stage ``c * pp + pp_rank``).
        topo: the ``Topology``: ``pp_rank``, neighbours via ``stage_rank``, ``dp_group``, ``embedding_group``.
        schedule: a schedule with communication (``schedules.build_schedule``); ``schedule.pp == topo.pp``.
        backward: ``backward(scalar, is_loss)``, see the module docstring.
        activation_shape: shape of the hidden state between stages (e.g. ``(B, S, H)``), or None to
            send a shape header before every activation.
        reduce_grads / optimizer_step: callables replacing the default DP average / doing the step.
        gradient: ``gradient(p)``, the tensor the optimizer steps ``p`` with (default ``p.grad``), which
            ``ReduceTiedGrads`` sums.
        p2p: "async" or "batched" (see the module docstring); default: batched on NCCL, async otherwise.
        broadcast_loss: average the loss over DP replicas and send it from the last stage to every
            stage (a scalar all-reduce and broadcast); otherwise return this replica's loss on the last stage.
    """

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        topo,
        *,
        schedule: Schedule,
        backward: Callable | None = None,
        activation_shape: Sequence[int] | None = None,
        activation_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        reduce_grads: Callable[[], None] | None = None,
        optimizer_step: Callable[[], None] | None = None,
        broadcast_loss: bool = True,
        prefetch: int = 2,
        p2p: str | None = None,
        gradient: Callable | None = None,
    ) -> None:
        if schedule.pp != topo.pp:
            raise UsageError(
                f"the schedule has {schedule.pp} stages but the topology has --pp {topo.pp}; build it with pp={topo.pp}"
            )
        if len(chunks) != schedule.vpp:
            raise UsageError(f"this rank holds {len(chunks)} model chunks but the schedule wants vpp={schedule.vpp}")
        if not schedule.has_p2p:
            raise UsageError("the schedule has no send/recv; build it with schedules.build_schedule or add_p2p")
        self.chunks = list(chunks)
        self.topo = topo
        if backward is not None and schedule.split_backward:
            raise UsageError(
                f"{schedule.name} splits each backward into B and W and runs both itself; pass no backward"
            )
        self.backward_fn = backward or self._default_backward
        self.activation_shape = tuple(activation_shape) if activation_shape is not None else None
        self.dtype = activation_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reduce_grads_fn = reduce_grads or (lambda: stage_grads.average_over_dp(self.chunks, self.topo))
        self.optimizer_step_fn = optimizer_step
        self.gradient = gradient
        self.broadcast_loss = broadcast_loss
        self.prefetch = prefetch
        self.p2p = p2p or ("batched" if dist.get_backend() == "nccl" else "async")
        if self.p2p not in P2P_MODES:
            raise UsageError(f"unknown P2P mode {p2p!r}; use one of {', '.join(P2P_MODES)}")
        if self.p2p == "batched":
            if activation_shape is None:
                raise UsageError(
                    "batched P2P (NCCL) needs activation_shape: pass the hidden-state shape between stages"
                )
            try:  # NCCL's send waits for its receive: only schedules proven safe under that may run
                simulate(schedule, p2p="batched")
            except ScheduleError as error:
                raise UsageError(
                    f"schedule {schedule.name} is not deadlock-free with batched (NCCL) P2P: {error}; "
                    "use a schedule from schedules.build_schedule"
                ) from None
        self.schedule = fastest_order(schedule, p2p=self.p2p)  # zero bubble under NCCL: maybe W before a send
        self.actions = self.schedule.stages[topo.pp_rank]
        self.last_times: StepTimes | None = None  # filled by every step()
        self._handlers = {
            RecvActivation: self._run_recv,
            RecvGrad: self._run_recv,
            Forward: self._run_forward,
            Backward: self._run_backward,
            BackwardInput: self._run_backward_input,
            BackwardWeight: self._run_backward_weight,
            SendActivation: self._run_send,
            SendGrad: self._run_send,
            ReduceTiedGrads: lambda st, index, a: self.reduce_tied_grads(),
            ReduceGrads: lambda st, index, a: self.reduce_grads_fn(),
            OptimizerStep: self._run_optimizer_step,
        }  # what each instruction class runs
        self.tied = stage_grads.find_tied_parameters(self.chunks, topo, virtual_stages=schedule.virtual_stages)
        self.sync_tied_weights()

    # -- virtual stages -------------------------------------------------------------------------
    def _vs(self, chunk: int) -> int:
        return self.schedule.virtual_stage(self.topo.pp_rank, chunk)

    @property
    def holds_first(self) -> bool:
        return self.topo.pp_rank == 0

    @property
    def holds_last(self) -> bool:
        return self.topo.pp_rank == self.schedule.pp - 1

    # -- end of step: tied copies and DP replicas (megakit.nn.pipeline.stage_grads) ------------------------
    def sync_tied_weights(self) -> None:
        """Make both copies of each tied parameter equal to the first stage's."""
        stage_grads.sync_tied_weights(self.tied, self.topo)

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of tied copies (embedding + LM head), so both copies step identically."""
        stage_grads.reduce_tied_grads(self.tied, self.topo, self.gradient)

    def _default_backward(self, scalar: torch.Tensor, is_loss: bool) -> None:
        torch.autograd.backward(scalar / self.schedule.micro_batches if is_loss else scalar)

    # -- P2P: each torch.distributed call in one small method ----------------------------------
    def _isend(self, tensor: torch.Tensor, a: Instruction) -> C.Handle:
        return C.isend(tensor, self.topo.stage_rank(a.peer), tag=_TAG[type(a)])

    def _irecv(self, buf: torch.Tensor, a: Instruction) -> C.Handle:
        return C.irecv(buf, self.topo.stage_rank(a.peer), tag=_TAG[type(a)])

    def _message(self, tensor: torch.Tensor, a: Instruction) -> tuple[torch.Tensor, int, int]:
        return tensor, self.topo.stage_rank(a.peer), _TAG[type(a)]

    # -- receives and sends ---------------------------------------------------------------------
    def _recv_shape(self, st: _StepState, a: Instruction) -> tuple[int, ...] | None:
        if isinstance(a, RecvGrad):
            return tuple(st.sent_shape[(a.micro_batch, a.chunk)]) if (a.micro_batch, a.chunk) in st.sent_shape else None
        return self.activation_shape

    def _post_recvs(self, st: _StepState, upto: int) -> None:
        """Post irecvs, in list order, for the receives among the next few actions whose shapes are known."""
        while st.next_recv < len(st.recv_index) and len(st.posted) < self.prefetch + 1:
            index = st.recv_index[st.next_recv]
            if index > upto:
                return
            a = self.actions[index]
            shape = self._recv_shape(st, a)
            if shape is None or a.peer == self.topo.pp_rank:
                return  # keep order: this one is posted (with a header) when it is reached
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            st.posted[index] = (buf, self._irecv(buf, a))
            st.next_recv += 1

    def _recv(self, st: _StepState, index: int, a: Instruction) -> torch.Tensor:
        self._post_recvs(st, index)
        if index in st.posted:
            buf, work = st.posted.pop(index)
            work.wait()
            return buf
        assert st.recv_index[st.next_recv] == index, "receives must be taken in order"
        st.next_recv += 1
        if a.peer == self.topo.pp_rank:  # PP = 1 with chunks: a hand-over inside this rank
            return st.local[_TAG[type(a)]].pop(0)
        assert isinstance(a, RecvActivation), "a gradient's shape is that of the activation sent: always known"
        header = torch.zeros(9, dtype=torch.int64, device=self.device)
        C.recv(header, self.topo.stage_rank(a.peer), tag=_TAG[type(a)])
        buf = torch.empty(tuple(header[1 : 1 + int(header[0])].tolist()), dtype=self.dtype, device=self.device)
        C.recv(buf, self.topo.stage_rank(a.peer), tag=_TAG[type(a)])
        return buf

    def _outgoing(self, st: _StepState, a: Instruction) -> torch.Tensor:
        """The tensor a send carries: the forward's output, or the gradient of the forward's input."""
        key = (a.micro_batch, a.chunk)
        if isinstance(a, SendActivation):
            out = st.stash[key][1]
            st.sent_shape[key] = out.shape
            return out
        grad = st.stash.pop(("grad", *key))
        assert grad is not None, f"no input gradient for micro-batch {a.micro_batch} chunk {a.chunk}"
        return grad

    def _checked(self, a: Instruction, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to(self.dtype).contiguous()
        if (
            isinstance(a, SendActivation)
            and self.activation_shape is not None
            and tuple(tensor.shape) != self.activation_shape
        ):
            raise UsageError(
                f"a stage produced an activation of shape {tuple(tensor.shape)} but activation_shape "
                f"is {self.activation_shape}; pass the hidden-state shape the model sends"
            )
        return tensor

    def _send(self, st: _StepState, a: Instruction, tensor: torch.Tensor) -> None:
        tensor = self._checked(a, tensor)
        if a.peer == self.topo.pp_rank:
            st.local[_TAG[type(a)]].append(tensor.clone())
            st.outputs.released((a.micro_batch, a.chunk))
            return
        if isinstance(a, SendActivation) and self.activation_shape is None:
            assert tensor.dim() <= 8, tensor.shape
            header = torch.tensor(
                [tensor.dim(), *tensor.shape] + [0] * (8 - tensor.dim()), dtype=torch.int64, device=tensor.device
            )
            st.pending.append((header, self._isend(header, a)))
        if isinstance(a, SendActivation):
            st.outputs.sent((a.micro_batch, a.chunk), tensor, self._isend(tensor, a))
        else:
            st.pending.append((tensor, self._isend(tensor, a)))

    def _run_batch(self, st: _StepState, index: int) -> int:
        """Batched mode: post the run of sends/receives at ``index`` at once, wait for all; return the index after
        it."""
        sends, receives, recvs, end = [], [], [], index
        while end < len(self.actions) and isinstance(self.actions[end], SENDS + RECVS):
            a = self.actions[end]
            if a.peer == self.topo.pp_rank:  # a hand-over inside this rank
                if isinstance(a, SENDS):
                    self._send(st, a, self._outgoing(st, a))
                else:
                    recvs.append((a, st.local[_TAG[type(a)]].pop(0)))
            elif isinstance(a, SENDS):
                sends.append(self._message(self._checked(a, self._outgoing(st, a)), a))
            else:
                buf = torch.empty(self._recv_shape(st, a), dtype=self.dtype, device=self.device)
                receives.append(self._message(buf, a))
                recvs.append((a, buf))
            end += 1
        C.send_and_receive(sends, receives)  # NCCL runs them together: two stages sending to each other do not wait
        for a in self.actions[index:end]:
            if isinstance(a, SendActivation) and a.peer != self.topo.pp_rank:
                st.outputs.released((a.micro_batch, a.chunk))
        for a, buf in recvs:
            self._store_received(st, a, buf)
        return end

    # -- one instruction each -------------------------------------------------------------------
    def _store_received(self, st: _StepState, a: Instruction, buf: torch.Tensor) -> None:
        if isinstance(a, RecvActivation):
            buf.requires_grad_(True)
        st.received[(type(a), a.micro_batch, a.chunk)] = buf

    def _run_recv(self, st: _StepState, index: int, a: Instruction) -> None:
        self._store_received(st, a, self._recv(st, index, a))

    def _run_send(self, st: _StepState, index: int, a: Instruction) -> None:
        self._send(st, a, self._outgoing(st, a))

    def _run_forward(self, st: _StepState, index: int, a: Instruction) -> None:
        st.outputs.poll()
        began = time.perf_counter()
        key, vs = (a.micro_batch, a.chunk), self._vs(a.chunk)
        x = st.inputs[a.micro_batch] if vs == 0 else st.received.pop((RecvActivation, *key))
        rows = {} if st.sample_ids is None else {"sample_ids": st.sample_ids[a.micro_batch]}
        if st.extras is not None:  # documents and positions: every stage's forward takes them
            rows.update(st.extras[a.micro_batch])
        if vs == self.schedule.virtual_stages - 1:
            out = self.chunks[a.chunk](x, st.labels[a.micro_batch], **rows)
            st.losses.append(out.detach())
        else:
            out = self.chunks[a.chunk](x, **rows)
            st.outputs.keep(key, out)
        st.stash[key] = (x, out)
        st.in_flight += 1
        st.peak = max(st.peak, st.in_flight)
        st.forward_time += time.perf_counter() - began

    def _run_backward(self, st: _StepState, index: int, a: Instruction) -> None:
        st.outputs.poll()
        began = time.perf_counter()
        key = (a.micro_batch, a.chunk)
        st.outputs.arrived(key)
        x, out = st.stash.pop(key)
        st.in_flight -= 1
        if self._vs(a.chunk) == self.schedule.virtual_stages - 1:
            self.backward_fn(out, True)
        elif (scalar := st.outputs.backward_scalar(key, st.received.pop((RecvGrad, *key)))) is not None:
            self.backward_fn(scalar, False)
        st.stash[("grad", *key)] = x.grad if x.requires_grad else None
        st.backward_time += time.perf_counter() - began

    def _run_backward_input(self, st: _StepState, index: int, a: Instruction) -> None:
        began, key = time.perf_counter(), (a.micro_batch, a.chunk)
        x, out = st.stash.pop(key)
        last = self._vs(a.chunk) == self.schedule.virtual_stages - 1  # the loss: scaled as _default_backward does
        out, grad = (out / self.schedule.micro_batches, None) if last else (out, st.received.pop((RecvGrad, *key)))
        st.stash[("grad", *key)], st.stash[("W", *key)] = split_backward.backward_input(
            self.chunks[a.chunk], x, out, grad
        )
        st.backward_time += time.perf_counter() - began

    def _run_backward_weight(self, st: _StepState, index: int, a: Instruction) -> None:
        began = time.perf_counter()  # W: the activations the weights needed are free after it
        split_backward.backward_weight(self.chunks[a.chunk], st.stash.pop(("W", a.micro_batch, a.chunk)))
        st.in_flight -= 1
        st.backward_time += time.perf_counter() - began

    def _run_optimizer_step(self, st: _StepState, index: int, a: Instruction) -> None:
        if self.optimizer_step_fn is not None:
            self.optimizer_step_fn()

    # -- one step -------------------------------------------------------------------------------
    def step(
        self,
        inputs: Sequence[torch.Tensor] | None = None,
        labels: Sequence[torch.Tensor] | None = None,
        sample_ids: Sequence[Sequence[int]] | None = None,
        extras: Sequence[dict] | None = None,
    ):
        """Run one optimizer step's schedule: ``inputs`` (first stage) and ``labels`` (last stage), one per micro-batch.

        ``sample_ids`` (every stage, one per micro-batch): the rows' numbers in the data stream,
        passed to each chunk's forward so that dropout masks are the layout-free ones; ``extras`` (every
        stage, one dict per micro-batch): more keywords of each chunk's forward (packed ``documents``).

        Returns the mean loss over micro-batches (a float): with ``broadcast_loss``
        (default) also over DP replicas and on every stage; otherwise this replica's, on
        the last stage only (None elsewhere).
        """
        m = self.schedule.micro_batches
        for name, values, needed in (("inputs", inputs, self.holds_first), ("labels", labels, self.holds_last)):
            if needed and (values is None or len(values) != m):
                got = "none" if values is None else len(values)
                raise UsageError(f"this stage needs {m} micro-batch {name} (one per micro-batch), got {got}")
        st = _StepState(
            inputs=inputs,
            labels=labels,
            sample_ids=sample_ids,
            extras=extras,
            recv_index=[i for i, a in enumerate(self.actions) if isinstance(a, RECVS)],
            outputs=sent_output.SentOutputs(enabled=not self.schedule.split_backward),
        )
        start = time.perf_counter()
        batched, index = self.p2p == "batched", 0
        while index < len(self.actions):
            a = self.actions[index]
            if batched and isinstance(a, SENDS + RECVS):
                index = self._run_batch(st, index)
                continue
            if not batched:
                self._post_recvs(st, index + 4)
            self._handlers[type(a)](st, index, a)
            index += 1
        st.outputs.poll(wait=True)
        for _, work in st.pending:
            work.wait()
        assert not st.posted and not st.received, "schedule left messages unconsumed"
        self.last_times = StepTimes(
            forward=st.forward_time,
            backward=st.backward_time,
            total=time.perf_counter() - start,
            micro_batches=m,
            peak_in_flight=st.peak,
        )
        return self._step_loss(st.losses)

    def _step_loss(self, losses: list[torch.Tensor]) -> float | None:
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32, device=self.device)
        if not self.broadcast_loss:
            return float(loss) if losses else None
        loss = loss.detach().to(torch.float32).clone()
        if self.topo.dp > 1 and self.holds_last:  # the step's loss: the mean over DP replicas too
            C.all_reduce(loss, self.topo.dp_group)
            loss /= self.topo.dp
        if self.schedule.pp > 1:
            C.broadcast(loss, self.topo.stage_rank(self.schedule.pp - 1), self.topo.pp_group)
        return float(loss)


def activation_shape(
    config, *, micro_batch_size: int, seq_len: int, tp: int = 1, sequence_parallel: bool = False
) -> tuple[int, int, int]:
    """The hidden state one ``Transformer`` stage hands the next: ``(S, B, H)``, ``(S/tp, B, H)`` with SP."""
    return (seq_len // tp if sequence_parallel else seq_len, micro_batch_size, config.hidden)
