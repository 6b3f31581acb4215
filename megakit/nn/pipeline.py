"""The pipeline executor: runs this rank's action list of a schedule over torch.distributed P2P.

One ``PipelineExecutor`` per rank holds that rank's model chunk(s) (one per virtual
stage it owns: ``vpp`` of them when interleaved) and, for each optimizer step,
walks its list from ``schedules`` — nothing else decides what runs when:

- ``forward`` runs the chunk on the micro-batch's input (token ids on the first
  virtual stage, the received hidden state elsewhere) and keeps input and output
  for the backward; the last virtual stage is called with labels and returns the loss;
- ``backward`` calls the pluggable ``backward(output, grad)``: ``grad`` is None on the
  last virtual stage (``output`` is the micro-batch's loss) and the gradient from
  the next stage elsewhere. The default scales the loss by ``1 / micro_batches``
  (the step's loss is the mean over micro-batches), as DeepSpeed's
  ``engine.backward(loss)`` does with ``gradient_accumulation_steps = micro_batches``;
  a trainer routes it through DeepSpeed: last stage ``engine.backward(output)``,
  others ``engine.backward((output * grad).sum(), scale_wrt_gas=False)``;
- P2P, ``p2p="async"`` (gloo's default): ``send_*`` posts ``isend`` and moves on
  (the simulator's asynchronous-send model); ``recv_*`` waits for an ``irecv`` that
  was posted a few actions ahead, so the transfer overlaps the compute before it.
  ``p2p="batched"`` (NCCL's default, where a send waits for its receive): each run
  of consecutive send/recv actions goes out as one ``batch_isend_irecv``, and the
  executor refuses a schedule the simulator cannot prove deadlock-free that way
  (megakit's GPipe, 1F1B and interleaved schedules all pass; interleaving does
  thanks to its fused forward-backward pairs, see ``schedules.add_p2p``).
  Activation messages carry P2P tag 0 and gradient messages tag 1; the simulator
  proves the order is also right without tags (NCCL). No shape handshake is needed
  when ``activation_shape`` is given (every boundary carries the same hidden
  state); a gradient's shape is that of the activation this rank sent;
- ``reduce_tied_grads`` all-reduces (sums) the gradients of parameters that the
  first and last virtual stage both hold under one name (tied input/output
  embeddings) over ``topo.embedding_group``; ``reduce_grads`` averages gradients
  over ``topo.dp_group``; ``optimizer_step`` calls ``optimizer_step()`` if given.
  A trainer using DeepSpeed replaces the last two (its engine reduces and steps).

TP composes inside a stage (each TP rank talks to the same TP rank of the next
stage; tensor-parallel collectives run inside the chunk) and DP across replicas
(each replica is its own pipeline; gradients meet in ``reduce_grads``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from megakit.core.schedules import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    RECV_GRAD,
    RECVS,
    REDUCE_GRADS,
    REDUCE_TIED,
    SEND_ACT,
    SEND_GRAD,
    SENDS,
    STEP,
    Schedule,
)
from megakit.core.simulator import P2P_MODES, ScheduleError, simulate
from megakit.errors import UsageError

__all__ = ["PipelineExecutor", "StepTimes", "activation_shape"]
_TAG = {RECV_ACT: 0, SEND_ACT: 0, RECV_GRAD: 1, SEND_GRAD: 1}


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


class PipelineExecutor:
    """Runs one rank's part of a pipeline schedule; ``step(inputs, labels)`` is one optimizer step.

    Args:
        chunks: this rank's model chunk per local chunk index (virtual stage ``c * pp + pp_rank``).
        topo: the ``Topology``: ``pp_rank``, neighbours via ``stage_rank``, ``dp_group``, ``embedding_group``.
        schedule: a schedule with communication (``schedules.build_schedule``); ``schedule.pp == topo.pp``.
        backward: ``backward(output, grad)``, see the module docstring.
        activation_shape: shape of the hidden state between stages (e.g. ``(B, S, H)``), or None to
            send a shape header before every activation.
        reduce_grads / optimizer_step: callables replacing the default DP average / doing the step.
        p2p: "async" or "batched" (see the module docstring); default: batched on NCCL, async otherwise.
        broadcast_loss: average the loss over DP replicas and send it from the last stage to every
            stage (a scalar all-reduce and broadcast); otherwise return this replica's loss on the last stage.
    """

    def __init__(self, chunks: Sequence[nn.Module], topo, *, schedule: Schedule,
                 backward: Callable | None = None, activation_shape: Sequence[int] | None = None,
                 activation_dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                 reduce_grads: Callable[[], None] | None = None, optimizer_step: Callable[[], None] | None = None,
                 broadcast_loss: bool = True, prefetch: int = 2, p2p: str | None = None) -> None:
        if schedule.pp != topo.pp:
            raise UsageError(f"the schedule has {schedule.pp} stages but the topology has --pp {topo.pp}; build it with pp={topo.pp}")
        if len(chunks) != schedule.vpp:
            raise UsageError(f"this rank holds {len(chunks)} model chunks but the schedule wants vpp={schedule.vpp}")
        if not schedule.has_p2p:
            raise UsageError("the schedule has no send/recv; build it with schedules.build_schedule or add_p2p")
        self.chunks = list(chunks)
        self.topo = topo
        self.schedule = schedule
        self.actions = schedule.stages[topo.pp_rank]
        self.backward_fn = backward or self._default_backward
        self.activation_shape = tuple(activation_shape) if activation_shape is not None else None
        self.dtype = activation_dtype
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.reduce_grads_fn = reduce_grads or self._average_over_dp
        self.optimizer_step_fn = optimizer_step
        self.broadcast_loss = broadcast_loss
        self.prefetch = prefetch
        self.p2p = p2p or ("batched" if dist.get_backend() == "nccl" else "async")
        if self.p2p not in P2P_MODES:
            raise UsageError(f"unknown P2P mode {p2p!r}; use one of {', '.join(P2P_MODES)}")
        if self.p2p == "batched":
            if activation_shape is None:
                raise UsageError("batched P2P (NCCL) needs activation_shape: pass the hidden-state shape between stages")
            try:  # NCCL's send waits for its receive: only schedules proven safe under that may run
                simulate(schedule, p2p="batched")
            except ScheduleError as error:
                raise UsageError(f"schedule {schedule.name} is not deadlock-free with batched (NCCL) P2P: {error}; "
                                 "use a schedule from schedules.build_schedule") from None
        self.last_times: StepTimes | None = None  # filled by every step()
        self.tied = self._find_tied_parameters()
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

    # -- tied embeddings ------------------------------------------------------------------------
    def _find_tied_parameters(self) -> list[tuple[nn.Parameter, ...]]:
        """Parameters held under one name by the first and the last virtual stage (tied embeddings).

        With PP > 1 they live on two ranks: names are exchanged once over the embedding group.
        Returns, per tied name, this rank's copies (two when one rank holds both ends). The
        last stage's copy gets ``ds_pipe_replicated = True``, the flag DeepSpeed's own
        PipelineModule sets, so DeepSpeed's gradient norm (clipping) counts it once.
        """
        first = dict(self.chunks[0].named_parameters()) if self.holds_first else {}
        last = dict(self.chunks[-1].named_parameters()) if self.holds_last else {}
        if self.schedule.virtual_stages == 1:
            return []
        if self.topo.pp == 1:
            tied = [(first[n], last[n]) for n in sorted(first.keys() & last.keys())]
        elif not (self.holds_first or self.holds_last):
            return []
        else:
            mine = sorted(first if self.holds_first else last)
            gathered: list = [None, None]
            dist.all_gather_object(gathered, mine, group=self.topo.embedding_group)
            shared = sorted(set(gathered[0]) & set(gathered[1]))
            own = first if self.holds_first else last
            tied = [(own[n],) for n in shared]
        for copies in tied:  # the last stage's copy: DeepSpeed's gradient norm must count it once, not twice
            if self.holds_last and (len(copies) == 2 or not self.holds_first):
                copies[-1].ds_pipe_replicated = True
        return tied

    @torch.no_grad()
    def sync_tied_weights(self) -> None:
        """Make both copies of each tied parameter equal to the first stage's (a broadcast over the embedding group)."""
        for copies in self.tied:
            if len(copies) == 2:
                copies[1].copy_(copies[0])
            else:
                dist.broadcast(copies[0].data, src=self.topo.stage_rank(0), group=self.topo.embedding_group)

    def reduce_tied_grads(self) -> None:
        """Sum the gradients of tied copies (embedding + LM head), so both copies step identically.

        Forward: nothing. Here (after the last backward): an all-reduce (sum) over
        ``topo.embedding_group`` when the copies live on two ranks, a local sum otherwise.
        """
        for copies in self.tied:
            for p in copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if len(copies) == 2:
                total = copies[0].grad + copies[1].grad
                copies[0].grad.copy_(total)
                copies[1].grad.copy_(total)
            else:
                dist.all_reduce(copies[0].grad, group=self.topo.embedding_group)

    # -- defaults -------------------------------------------------------------------------------
    def _default_backward(self, output: torch.Tensor, grad: torch.Tensor | None) -> None:
        if grad is None:
            (output / self.schedule.micro_batches).backward()
        else:
            torch.autograd.backward(output, grad)

    def _average_over_dp(self) -> None:
        if self.topo.dp == 1:
            return
        grads = [p.grad for c in self.chunks for p in c.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.topo.dp_group)
        flat /= self.topo.dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()

    # -- P2P ------------------------------------------------------------------------------------
    def _recv_shape(self, a) -> tuple[int, ...] | None:
        if a.kind == RECV_GRAD:
            return tuple(self._sent_shape[(a.micro_batch, a.chunk)]) if (a.micro_batch, a.chunk) in self._sent_shape else None
        return self.activation_shape

    def _post_recvs(self, upto: int) -> None:
        """Post irecvs, in list order, for the receives among the next few actions whose shapes are known."""
        while self._next_recv < len(self._recv_index) and len(self._posted) < self.prefetch + 1:
            index = self._recv_index[self._next_recv]
            if index > upto:
                return
            a = self.actions[index]
            shape = self._recv_shape(a)
            if shape is None or a.peer == self.topo.pp_rank:
                return  # keep order: this one is posted (with a header) when it is reached
            buf = torch.empty(shape, dtype=self.dtype, device=self.device)
            work = dist.irecv(buf, src=self.topo.stage_rank(a.peer), tag=_TAG[a.kind])
            self._posted[index] = (buf, work)
            self._next_recv += 1

    def _recv(self, index: int, a) -> torch.Tensor:
        self._post_recvs(index)
        if index in self._posted:
            buf, work = self._posted.pop(index)
            work.wait()
            return buf
        assert self._recv_index[self._next_recv] == index, "receives must be taken in order"
        self._next_recv += 1
        if a.peer == self.topo.pp_rank:  # PP = 1 with chunks: a hand-over inside this rank
            return self._local[_TAG[a.kind]].pop(0)
        assert a.kind == RECV_ACT, "a gradient's shape is that of the activation sent: always known"
        src = self.topo.stage_rank(a.peer)
        header = torch.zeros(9, dtype=torch.int64, device=self.device)
        dist.recv(header, src=src, tag=_TAG[a.kind])
        buf = torch.empty(tuple(header[1:1 + int(header[0])].tolist()), dtype=self.dtype, device=self.device)
        dist.recv(buf, src=src, tag=_TAG[a.kind])
        return buf

    def _outgoing(self, a) -> torch.Tensor:
        """The tensor a send action carries: the forward's output, or the gradient of the forward's input."""
        key = (a.micro_batch, a.chunk)
        if a.kind == SEND_ACT:
            out = self._stash[key][1]
            self._sent_shape[key] = out.shape
            return out
        grad = self._stash.pop(("grad", *key))
        assert grad is not None, f"no input gradient for micro-batch {a.micro_batch} chunk {a.chunk}"
        return grad

    def _run_batch(self, index: int) -> int:
        """Batched mode: post the run of send/recv actions at ``index`` together and wait for all of them.

        One ``batch_isend_irecv``: NCCL runs the batch's sends and receives
        concurrently, so two stages sending to each other do not wait on each other.
        Returns the index of the first action after the run.
        """
        ops, recvs, end = [], [], index
        while end < len(self.actions) and self.actions[end].kind in SENDS + RECVS:
            a = self.actions[end]
            if a.peer == self.topo.pp_rank:  # a hand-over inside this rank
                if a.kind in SENDS:
                    self._send(a, self._outgoing(a))
                else:
                    recvs.append((a, self._local[_TAG[a.kind]].pop(0)))
            elif a.kind in SENDS:
                tensor = self._checked(a, self._outgoing(a))
                ops.append(dist.P2POp(dist.isend, tensor, self.topo.stage_rank(a.peer), tag=_TAG[a.kind]))
            else:
                buf = torch.empty(self._recv_shape(a), dtype=self.dtype, device=self.device)
                ops.append(dist.P2POp(dist.irecv, buf, self.topo.stage_rank(a.peer), tag=_TAG[a.kind]))
                recvs.append((a, buf))
            end += 1
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        for a, buf in recvs:
            if a.kind == RECV_ACT:
                buf.requires_grad_(True)
            self._received[(a.kind, a.micro_batch, a.chunk)] = buf
        return end

    def _checked(self, a, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().to(self.dtype).contiguous()
        if a.kind == SEND_ACT and self.activation_shape is not None and tuple(tensor.shape) != self.activation_shape:
            raise UsageError(f"a stage produced an activation of shape {tuple(tensor.shape)} but activation_shape "
                             f"is {self.activation_shape}; pass the hidden-state shape the model sends")
        return tensor

    def _send(self, a, tensor: torch.Tensor) -> None:
        dst = self.topo.stage_rank(a.peer)
        tensor = self._checked(a, tensor)
        if a.peer == self.topo.pp_rank:
            self._local[_TAG[a.kind]].append(tensor.clone())
            return
        if a.kind == SEND_ACT and self.activation_shape is None:
            assert tensor.dim() <= 8, tensor.shape
            header = torch.tensor([tensor.dim(), *tensor.shape] + [0] * (8 - tensor.dim()), dtype=torch.int64,
                                  device=tensor.device)
            self._pending.append((header, dist.isend(header, dst=dst, tag=_TAG[a.kind])))
        self._pending.append((tensor, dist.isend(tensor, dst=dst, tag=_TAG[a.kind])))

    # -- one step -------------------------------------------------------------------------------
    def step(self, inputs: Sequence[torch.Tensor] | None = None, labels: Sequence[torch.Tensor] | None = None,
             sample_ids: Sequence[Sequence[int]] | None = None):
        """Run one optimizer step's schedule: ``inputs`` (first stage) and ``labels`` (last stage), one per micro-batch.

        ``sample_ids`` (every stage, one per micro-batch): the rows' numbers in the data stream,
        passed to each chunk's forward so that dropout masks are the layout-free ones.

        Returns the mean loss over micro-batches (a float): with ``broadcast_loss``
        (default) also over DP replicas and on every stage; otherwise this replica's, on
        the last stage only (None elsewhere).
        """
        m = self.schedule.micro_batches
        for name, values, needed in (("inputs", inputs, self.holds_first), ("labels", labels, self.holds_last)):
            if needed and (values is None or len(values) != m):
                got = "none" if values is None else len(values)
                raise UsageError(f"this stage needs {m} micro-batch {name} (one per micro-batch), got {got}")
        self._stash: dict = {}
        self._received: dict = {}
        self._sent_shape: dict = {}
        self._pending: list = []
        self._posted: dict = {}
        self._local: dict = {0: [], 1: []}  # messages to this same rank, by tag
        self._recv_index = [i for i, a in enumerate(self.actions) if a.kind in RECVS]
        self._next_recv = 0
        losses = []
        last_vs = self.schedule.virtual_stages - 1
        spent = {FORWARD: 0.0, BACKWARD: 0.0}
        in_flight = peak = 0
        start = time.perf_counter()
        batched = self.p2p == "batched"
        skip_to = 0
        for index, a in enumerate(self.actions):
            if index < skip_to:
                continue  # already run as part of a batch
            if batched and a.kind in SENDS + RECVS:
                skip_to = self._run_batch(index)
                continue
            if not batched:
                self._post_recvs(index + 4)
            began = time.perf_counter()
            key = (a.micro_batch, a.chunk)
            if a.kind in RECVS:
                buf = self._recv(index, a)
                if a.kind == RECV_ACT:
                    buf.requires_grad_(True)
                self._received[(a.kind, *key)] = buf
            elif a.kind == FORWARD:
                vs = self._vs(a.chunk)
                x = inputs[a.micro_batch] if vs == 0 else self._received.pop((RECV_ACT, *key))
                rows = {} if sample_ids is None else {"sample_ids": sample_ids[a.micro_batch]}
                if vs == last_vs:
                    out = self.chunks[a.chunk](x, labels[a.micro_batch], **rows)
                    losses.append(out.detach())
                else:
                    out = self.chunks[a.chunk](x, **rows)
                self._stash[key] = (x, out)
                in_flight += 1
                peak = max(peak, in_flight)
                spent[FORWARD] += time.perf_counter() - began
            elif a.kind in SENDS:
                self._send(a, self._outgoing(a))
            elif a.kind == BACKWARD:
                x, out = self._stash.pop(key)
                in_flight -= 1
                grad = None if self._vs(a.chunk) == last_vs else self._received.pop((RECV_GRAD, *key))
                self.backward_fn(out, grad)
                self._stash[("grad", *key)] = x.grad if x.requires_grad else None
                spent[BACKWARD] += time.perf_counter() - began
            elif a.kind == REDUCE_TIED:
                self.reduce_tied_grads()
            elif a.kind == REDUCE_GRADS:
                self.reduce_grads_fn()
            elif a.kind == STEP:
                if self.optimizer_step_fn is not None:
                    self.optimizer_step_fn()
            else:
                raise AssertionError(a)
        for _, work in self._pending:
            work.wait()
        assert not self._posted and not self._received, "schedule left messages unconsumed"
        self._pending = []
        self.last_times = StepTimes(forward=spent[FORWARD], backward=spent[BACKWARD],
                                    total=time.perf_counter() - start, micro_batches=m, peak_in_flight=peak)
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=torch.float32, device=self.device)
        if not self.broadcast_loss:
            return float(loss) if losses else None
        loss = loss.detach().to(torch.float32).clone()
        if self.topo.dp > 1 and self.holds_last:  # the step's loss: the mean over DP replicas too
            dist.all_reduce(loss, group=self.topo.dp_group)
            loss /= self.topo.dp
        if self.schedule.pp > 1:
            dist.broadcast(loss, src=self.topo.stage_rank(self.schedule.pp - 1), group=self.topo.pp_group)
        return float(loss)


def activation_shape(config, *, micro_batch_size: int, seq_len: int, tp: int = 1,
                     sequence_parallel: bool = False) -> tuple[int, int, int]:
    """The hidden state one ``Transformer`` stage hands the next: ``(S, B, H)``, ``(S/tp, B, H)`` with SP."""
    return (seq_len // tp if sequence_parallel else seq_len, micro_batch_size, config.hidden)
