"""Compressed averaging over DP, with error feedback (FAQ 3 and 5: when bandwidth is the limit).

Both reducers replace DeepSpeed's DP all-reduce (the trainer sets
``engine.enable_backward_allreduce = False``, as DeepSpeed's own ``PipelineEngine`` does);
``megakit.core.compression`` says which codec compresses what, and why.

- ``GradientReducer`` (fp16, int8) averages the gradients before ``engine.step()``: each
  rank adds the residual it kept from the last call, compresses, exchanges, decompresses
  every rank's part and averages; what compression dropped becomes the next residual
  (error feedback: Seide et al. 2014, Karimireddy et al. 2019).
- ``UpdateReducer`` (sign, Top-K) averages the optimizer's weight updates after it. Here the
  residual is kept *in the weights*: a rank's weights are the weights every rank shares
  plus its own updates that the others have not received yet (Qsparse-local-SGD, Basu et
  al. 2019, with one local step). Its optimizer thus sees where its own steps took it;
  when the residual sat apart, a coordinate's Adam kept pushing a weight that had not
  moved and overshot once it was sent (measured: Top-K 1 % +6.5 % above the exact loss
  that way, +2.5 % this way; Top-K 10 % was worse still, +11.8 %). ``synchronize()`` sends
  what is pending, densely, so that checkpoints and evaluations see one model.

Without error feedback Top-K never sends the small coordinates at all and the model
trains measurably worse (tests/test_compression.py, tests/test_trainer.py).

``fp16`` is all-reduced in half precision; ``int8`` and ``sign`` are reduced in two
compressed phases (all-to-all, then all-gather: ``_Codec``), so their traffic per rank does
not grow with DP; ``topk``'s indices differ per rank, so its pairs are all-gathered. Both
counts are kept per call, as bytes on the wire: ``bytes_sent`` (what this rank sent) and
``bytes_dense`` (what the uncompressed ring all-reduce of the same tensors would have).

Deterministic and per tensor: no scale chunk and no Top-K selection spans two tensors, so
ranks holding the same tensor (a TP-replicated norm weight, an embedding tied over PP
stages) compress it alike and the replicas stay identical.
"""

from __future__ import annotations

import itertools

import torch

from megakit.core.compression import CHUNK, Compression
from megakit.nn import comm

_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _chunk_ids(sizes: tuple[int, ...], device) -> torch.Tensor:
    """Per element of the flattened tensors, its chunk: ``CHUNK`` elements of one tensor share a scale, and no
    chunk spans two tensors, so a tensor's compression depends on that tensor alone (a TP-replicated norm weight,
    or an embedding tied over PP stages, compresses alike on every rank that holds it)."""
    ids, base = [], 0
    for n in sizes:
        ids.append(torch.arange(n, device=device) // CHUNK + base)
        base += -(-n // CHUNK)
    return torch.cat(ids)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Bool ``(n,)`` -> uint8 ``(ceil(n / 8),)``, eight signs per byte."""
    bits = torch.nn.functional.pad(bits, (0, -bits.numel() % 8))
    return (bits.view(-1, 8).to(torch.uint8) * _BITS.to(bits.device)).sum(-1, dtype=torch.uint8)


def _unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    return (packed.unsqueeze(-1) & _BITS.to(packed.device)).ne(0).view(-1)[:n]


def _flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def _unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def _chunk_scales(values: torch.Tensor, ids: torch.Tensor, chunks: int, reduce: str) -> torch.Tensor:
    """Per chunk, the ``reduce`` ("max" or "mean") of ``values``. Chunks are runs of ``ids``, so a segmented
    reduction (deterministic on GPU too, unlike an atomic scatter) gives every rank holding a tensor the same bits."""
    if chunks == 0:
        return values.new_zeros(0)
    return torch.segment_reduce(values, reduce, lengths=torch.bincount(ids, minlength=chunks))


def _encode(kind: str, x: torch.Tensor, ids: torch.Tensor, chunks: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """int8 or sign: ``([payload, scales], what the payload decodes to)``; ``ids``: each element's chunk."""
    if kind == "int8":
        scale = _chunk_scales(x.abs(), ids, chunks, "max").clamp_min_(1e-30) / 127.0
        q = (x / scale[ids]).round_().clamp_(-127, 127).to(torch.int8)
        return [q, scale], q.float() * scale[ids]
    scale = _chunk_scales(x.abs(), ids, chunks, "mean")  # keeps each chunk's L1 mass (1-bit SGD / signSGD with EF)
    bits = x >= 0
    return [_pack_bits(bits), scale], torch.where(bits, scale[ids], -scale[ids])


def _decode(kind: str, payload: torch.Tensor, scale: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if kind == "int8":
        return payload[: ids.numel()].float() * scale[ids]
    return _unpack_bits(payload, ids.numel()).float().mul_(2).sub_(1) * scale[ids]


def _padded(parts: list[torch.Tensor]) -> torch.Tensor:
    """``(len(parts), longest)``, each part zero-padded: the equal blocks a collective needs."""
    out = torch.zeros(len(parts), max(p.numel() for p in parts), dtype=parts[0].dtype, device=parts[0].device)
    for row, part in zip(out, parts):
        row[: part.numel()] = part
    return out


class ByteMeter:
    """The bytes this rank put on the wire for DP, beside what the dense fp32 all-reduce of the same tensors would
    have (a ring all-reduce sends 2 (n-1)/n of its buffer; an all-gather, n - 1 blocks; an all-to-all, n - 1 of
    its n blocks)."""

    def __init__(self) -> None:
        self.bytes_sent = self.bytes_dense = 0

    def take_bytes(self) -> tuple[int, int]:
        """``(sent, dense)`` since the last call."""
        out = (round(self.bytes_sent), round(self.bytes_dense))
        self.bytes_sent = self.bytes_dense = 0
        return out

    def count(self, nbytes: int, group, collective: str = "all_reduce", *, dense: bool = False) -> None:
        """Count ``nbytes`` handed to ``collective`` over ``group`` (``dense``: as the uncompressed baseline)."""
        n = comm.size(group)
        wire = nbytes * {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1, "all_to_all": (n - 1) / n}[collective]
        if dense:
            self.bytes_dense += wire
        else:
            self.bytes_sent += wire


class _Codec(ByteMeter):
    """``exchange(flat)``: the mean over ``group`` of every rank's compressed ``flat``, and what this rank sent.

    fp16 is all-reduced. int8 and sign are reduced in two phases, as 1-bit Adam's compressed all-reduce: an
    all-to-all sends rank j the compressed segment j of every rank, which it decompresses and sums; it compresses
    that sum again (with its own error feedback) and an all-gather hands every rank every segment. Each rank thus
    sends 2 (n-1)/n of its compressed tensor, as a dense ring all-reduce sends of the dense one; an all-gather of
    every rank's whole compressed tensor would send n - 1 times it, more than the dense all-reduce from DP 8 on.
    Top-K's indices differ per rank, so its pairs are all-gathered (n - 1 times 2 % of dense at 1 %).
    """

    def __init__(self, compression: Compression, group, *, error_feedback: bool = True) -> None:
        super().__init__()
        self.compression, self.group, self.error_feedback = compression, group, error_feedback
        self.server_residual: torch.Tensor | None = None  # int8/sign: what recompressing this rank's sums dropped

    _ids: torch.Tensor | None = None
    _sizes: tuple[int, ...] | None = None

    def exchange(self, flat: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mean over ranks of the decompressed tensors, this rank's decompressed tensor)``; ``flat`` holds
        tensors of ``sizes`` elements end to end, each compressed on its own."""
        if self._ids is None or self._sizes != sizes:
            if self._sizes != sizes:
                self.server_residual = None  # it was of other tensors
            self._sizes, self._ids = sizes, _chunk_ids(sizes, flat.device)
            self._segments = self._cut(comm.size(self.group))
        kind = self.compression.kind
        total, kept = self._two_phase(flat) if kind in ("int8", "sign") else getattr(self, f"_{kind}")(flat)
        return total.div_(comm.size(self.group)), kept

    def state(self) -> dict[str, torch.Tensor]:
        """What the next exchange depends on besides its input (for a checkpoint): the residual this rank kept and
        the tensor sizes it belongs to."""
        out = {} if self._sizes is None else {"sizes": torch.tensor(self._sizes, dtype=torch.int64)}
        if self.server_residual is not None:
            out["server_residual"] = self.server_residual
        return out

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take back what ``state()`` gave (tensors already on this rank's device)."""
        if "sizes" in state:
            self._sizes = tuple(state["sizes"].tolist())
        self.server_residual = state.get("server_residual")

    def held_back(self, numel: int) -> torch.Tensor:
        """What recompressing this rank's sums (int8, sign) has held back for the next ones, in place in a zero
        tensor of ``numel`` elements (in sum units: what this rank would add to a sum to send it)."""
        out = torch.zeros(numel, device=self._ids.device if self._ids is not None else None)
        if self.server_residual is not None:
            e0, e1, _, _ = self._segments[comm.rank(self.group)]
            out[e0:e1] = self.server_residual
        return out

    def _cut(self, n: int) -> list[tuple[int, int, int, int]]:
        """Rank j's segment: ``(first element, end, first chunk, end)``: whole chunks, starting at the first chunk
        boundary at or past j/n of the elements (chunks differ in size: small tensors make short ones)."""
        chunks = int(self._ids[-1]) + 1 if self._ids.numel() else 0
        starts = torch.zeros(chunks + 1, dtype=torch.long)
        starts[1:] = torch.bincount(self._ids.cpu(), minlength=chunks).cumsum(0)
        targets = torch.tensor([-(-j * int(starts[-1]) // n) for j in range(n + 1)])
        bounds = torch.searchsorted(starts, targets).clamp_(max=chunks).tolist()
        return [(int(starts[a]), int(starts[b]), a, b) for a, b in itertools.pairwise(bounds)]

    def _send(self, x: torch.Tensor, collective: str) -> torch.Tensor:
        self.count(x.numel() * x.element_size(), self.group, collective)
        if collective == "all_reduce":
            return comm.all_reduce(x, self.group)
        if collective == "all_to_all":
            return comm.all_to_all(x, self.group)
        return comm.all_gather(x.contiguous(), self.group).view(comm.size(self.group), *x.shape)

    # Each codec: (sum over ranks of the decompressed tensors, this rank's decompressed tensor).
    def _none(self, flat):
        return self._send(flat.clone(), "all_reduce"), flat.clone()

    def _fp16(self, flat):
        n = comm.size(self.group)
        half = (flat / n).half()  # divided first, as DeepSpeed does: a loss-scaled sum overflows n times later
        kept = half.float() * n  # before the all-reduce sums into ``half``
        return self._send(half, "all_reduce").float() * n, kept

    def _two_phase(self, flat):
        kind, me, segments = self.compression.kind, comm.rank(self.group), self._segments
        ids = [self._ids[e0:e1] - c0 for e0, e1, c0, _ in segments]
        kept, sent = torch.empty_like(flat), []
        for (e0, e1, c0, c1), local in zip(segments, ids):  # phase 1: segment j of this rank to rank j
            parts, kept[e0:e1] = _encode(kind, flat[e0:e1], local, c1 - c0)
            sent.append(parts)
        payloads, scales = (self._send(_padded([p[i] for p in sent]), "all_to_all") for i in (0, 1))
        mine = sum(_decode(kind, payload, scale, ids[me]) for payload, scale in zip(payloads, scales))
        if self.error_feedback and self.server_residual is not None:
            mine = mine + self.server_residual
        (payload, scale), decoded = _encode(kind, mine, ids[me], segments[me][3] - segments[me][2])
        width = [max(p[i].numel() for p in sent) for i in (0, 1)]  # every rank's blocks alike, as in phase 1
        payloads = self._send(torch.nn.functional.pad(payload, (0, width[0] - payload.numel())), "all_gather")
        scales = self._send(torch.nn.functional.pad(scale, (0, width[1] - scale.numel())), "all_gather")
        total = torch.empty_like(flat)
        for (e0, e1, _, _), local, payload, scale in zip(segments, ids, payloads, scales):  # phase 2: every sum
            total[e0:e1] = _decode(kind, payload, scale, local)
        if self.error_feedback and torch.isfinite(total).all():  # the same on every rank; an overflow step is
            self.server_residual = mine - decoded  # skipped, and so is its residual
        return total, kept

    def _topk(self, flat):
        index, offset = [], 0
        for part in flat.split(self._sizes):  # each tensor's own largest share
            k = min(part.numel(), max(1, int(part.numel() * self.compression.ratio)))
            index.append(part.abs().topk(k, sorted=False).indices + offset)
            offset += part.numel()
        index = torch.cat(index)
        values = flat[index]
        kept = torch.zeros_like(flat).index_copy_(0, index, values)
        index = index.to(torch.int32 if flat.numel() < 2**31 else torch.int64)
        indices, all_values = self._send(index, "all_gather"), self._send(values, "all_gather")
        total = torch.zeros_like(flat).index_add_(0, indices.reshape(-1).long(), all_values.reshape(-1))
        return total, kept


class GradientReducer(_Codec):
    """fp16, int8: averages gradients over ``group``, keeping this rank's residual between calls."""

    residual: torch.Tensor | None = None

    def reduce(self, grads: list[torch.Tensor]) -> None:
        """Replace every tensor of ``grads`` by its (compressed) average over the group, in place."""
        if comm.size(self.group) == 1 or not grads:
            return
        flat = _flat(grads)
        self.count(sum(g.numel() * g.element_size() for g in grads), self.group, dense=True)
        sizes = tuple(g.numel() for g in grads)
        if self.error_feedback and self.residual is not None and self._sizes == sizes:
            flat += self.residual
        mean, kept = self.exchange(flat, sizes)
        if self.error_feedback and torch.isfinite(mean).all():  # the same on every rank: DeepSpeed skips an
            self.residual = flat.sub_(kept)  # overflowing step, so its residual is not kept; else sent next step
        _unflatten_into(grads, mean)

    def state(self) -> dict[str, torch.Tensor]:
        """The state to checkpoint: the base's and the error-feedback residual."""
        return super().state() | ({} if self.residual is None else {"residual": self.residual})

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore the base's state and the residual a checkpoint kept."""
        super().load_state(state)
        self.residual = state.get("residual")


class UpdateReducer(_Codec):
    """sign, Top-K: averages the optimizer's weight updates over ``group``; each rank's weights keep its own
    updates that compression has not sent yet (the module docstring says why)."""

    def __init__(self, compression: Compression, group, params: list[torch.Tensor], **kw) -> None:
        super().__init__(compression, group, **kw)
        self.shared = [p.detach().clone() for p in params]  # the weights every DP rank holds alike
        self.pending = False  # whether a rank's weights may differ from the shared ones

    def after_step(self, params: list[torch.Tensor]) -> None:
        """Call after every optimizer step: send (compressed) what this rank's weights hold beyond the shared ones."""
        if comm.size(self.group) == 1:
            return
        self.pending = True
        with torch.no_grad():
            pending = _flat(params) - _flat(self.shared)  # this step's update plus what earlier steps did not send
            self.count(pending.numel() * pending.element_size(), self.group, dense=True)
            mean, kept = self.exchange(pending, tuple(p.numel() for p in params))
            shared = _flat(self.shared).add_(mean)
            _unflatten_into(self.shared, shared)
            _unflatten_into(params, shared.add_(pending.sub_(kept)) if self.error_feedback else shared)

    def state(self) -> dict[str, torch.Tensor]:
        """Nothing: after ``synchronize()`` (which precedes every save) the weights are the shared ones, nothing is
        pending and the second phase holds nothing back, so a reducer built on the loaded weights is this one."""
        assert not (self.pending and self.error_feedback), "synchronize() before saving"
        return {}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore: this compressor keeps no state."""
        assert not state, sorted(state)

    def synchronize(self, params: list[torch.Tensor]) -> None:
        """Send every rank's pending updates densely, so that all hold the same weights (before a save or an eval)."""
        if comm.size(self.group) == 1 or not self.error_feedback or not self.pending:
            return  # without feedback nothing is pending: every rank holds the shared weights
        self.pending = False
        with torch.no_grad():
            pending = _flat(params) - _flat(self.shared) + self.held_back(sum(p.numel() for p in params))
            self.server_residual = None  # sent now
            self.count(pending.numel() * pending.element_size(), self.group)
            shared = _flat(self.shared).add_(comm.all_reduce(pending, self.group).div_(comm.size(self.group)))
            _unflatten_into(self.shared, shared)
            _unflatten_into(params, shared)


class ModelAverager(ByteMeter):
    """``--local-sgd H``: every H optimizer steps, average the weights over ``group`` (post-local SGD, Lin et al.
    2020); in between each DP rank steps on its own gradients. (torch's ``PeriodicModelAverager`` averages only
    parameters that hold a gradient, and DeepSpeed has freed them by then: the one flat all-reduce is here.)"""

    def __init__(self, period: int, group, *, start_step: int = 0) -> None:
        super().__init__()
        self.period, self.group, self.steps = period, group, start_step
        self.averaged_at = start_step  # the replicas start alike (built from one seed, or loaded)

    def after_step(self, params: list[torch.Tensor]) -> None:
        """Call after every optimizer step; averages on every ``period``-th (counted from the run's start)."""
        self.steps += 1
        self.count(sum(p.numel() * p.element_size() for p in params), self.group, dense=True)  # synchronous DP's
        if self.steps % self.period == 0:
            self.synchronize(params)

    def synchronize(self, params: list[torch.Tensor]) -> None:
        """Average the weights now (every ``period`` steps, and before a save or an evaluation)."""
        if comm.size(self.group) == 1 or self.averaged_at == self.steps:
            return
        self.averaged_at = self.steps
        with torch.no_grad():
            flat = torch.cat([p.detach().reshape(-1) for p in params])
            self.count(flat.numel() * flat.element_size(), self.group)
            _unflatten_into(params, comm.all_reduce(flat, self.group).div_(comm.size(self.group)))
