"""How ring attention's K/V blocks reach each CP rank, and their gradients go home: the communication, apart from the
algorithm (``megakit.nn.attention.blocks``), as picotron's ``cp_communications`` is.

A transport yields this rank's K/V blocks one by one (``blocks``), takes each block's gradients (``give_back``) and
returns this rank's own (``own_gradients``). ``Ring`` passes every block once around the CP ranks (P2P through
``megakit.nn.comm``, the next block posted before the one in hand is used, so the transfer overlaps the attention);
``Halo``, for a sliding window no longer than a chunk, swaps one chunk's K/V with each zig-zag neighbour instead
(``ring_transport`` picks). K and V travel as one flat buffer, each at its own width (``pack``).
"""

from __future__ import annotations

import math

import torch

from megakit.nn import comm as C

_KV_TAG, _GRAD_TAG = 71, 72  # P2P tags of the ring (its peers are never pipeline peers)


def pass_on(x: torch.Tensor, ranks: list[int], r: int, tag: int):
    """Send ``x`` to the next rank of the ring and receive the previous rank's block, posted as one
    batch (``comm.exchange``); ``arrived`` waits for it. With one rank, ``x`` comes back to itself."""
    cp = len(ranks)
    if cp == 1:
        return x, x, C.Handle(None)
    buf = torch.empty_like(x)
    return x, buf, C.exchange([(x, ranks[(r + 1) % cp], tag)], [(buf, ranks[(r - 1) % cp], tag)])


def arrived(posted) -> torch.Tensor:
    """Wait for a transfer ``pass_on`` (or ``Halo``) posted (its send too); returns what was received."""
    _, buf, handle = posted
    handle.wait()
    return buf


def ring_transport(ranks: list[int], r: int, half: int, window: int):
    """How the K/V blocks reach this rank: from its two zig-zag neighbours alone when the window fits in a chunk
    (``half`` tokens: query chunk ``i`` then needs keys of chunks ``i`` and ``i - 1`` only), else around the ring."""
    if len(ranks) > 1 and 0 < window <= half:
        return Halo(ranks, r, half)
    return Ring(ranks, r)


def pack(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """K and V (or their gradients) flattened into one buffer, each at its own width (MLA: d_qk and d_v), so that a
    transfer stays one message and carries no padding."""
    return torch.cat([k.reshape(-1), v.reshape(-1)])


def unpack(buf: torch.Tensor, k_shape, v_shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack``: K and V as views of ``buf``, given their shapes (the same on every rank of the ring)."""
    split = math.prod(k_shape)
    return buf[:split].view(k_shape), buf[split:].view(v_shape)


class Ring:
    """The full ring: each K/V block travels once around the CP ranks (the next block posted before the one in hand
    is used), and in backward its gradients travel with it, home after one full turn. K and V go as one flat
    buffer (``pack``)."""

    def __init__(self, ranks: list[int], r: int) -> None:
        self.ranks, self.r, self.incoming, self.shapes = ranks, r, None, None

    def blocks(self, k: torch.Tensor, v: torch.Tensor):
        """``((K, V) of a block, its chunk numbers)`` for this rank's block, then each one arriving, ``CP`` in all."""
        cp, r = len(self.ranks), self.r
        self.shapes = (k.shape, v.shape)
        kv = pack(k, v)
        for t in range(cp):
            j = (r - t) % cp
            nxt = pass_on(kv, self.ranks, r, _KV_TAG) if t < cp - 1 else None
            yield unpack(kv, *self.shapes), (j, 2 * cp - 1 - j)
            if nxt is not None:
                kv = arrived(nxt)

    def give_back(self, grad_k, grad_v) -> None:
        """Add this rank's gradients of the block in hand (its K/V heads') to what arrived with it, and pass them on
        with the block."""
        grads = pack(grad_k, grad_v)
        if self.incoming is not None:
            grads += arrived(self.incoming)
        self.incoming = pass_on(grads, self.ranks, self.r, _GRAD_TAG)

    def own_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V gradients ``(B, n_kv, S/cp, d_k|d_v)``, home after the last ``give_back``'s turn."""
        return unpack(arrived(self.incoming), *self.shapes)


class Halo:
    """A window within a chunk: rank ``r`` needs the keys of chunk ``r - 1`` (rank ``r - 1``'s first) and of chunk
    ``2 CP - 2 - r`` (rank ``r + 1``'s second) besides its own, so its first chunk goes to rank ``r + 1`` and its
    second to rank ``r - 1``: two half blocks each way instead of ``CP - 1`` blocks around the ring. Rank 0's first
    chunk has no chunk before it, and rank ``CP - 1``'s chunks ``CP - 1`` and ``CP`` are adjacent: the ends exchange
    with one neighbour. In backward the neighbours' chunk gradients go back the same way. Each half block's K and V
    go as one flat buffer (``pack``)."""

    def __init__(self, ranks: list[int], r: int, half: int) -> None:
        self.ranks, self.r, self.half, self.own, self.posted, self.shapes = ranks, r, half, None, None, None
        cp = len(ranks)
        self.before = ranks[r - 1] if r > 0 else None  # holds chunk r - 1 first
        self.after = ranks[r + 1] if r < cp - 1 else None  # holds chunk 2 CP - 2 - r second
        self.chunks = ((r - 1,) if r > 0 else ()) + ((2 * cp - 2 - r,) if r < cp - 1 else ())

    def _swap(self, to_before, to_after, tag: int):
        """Send each neighbour its half block's K and V (pairs, or None for a missing neighbour) and receive one from
        each (one batch): ``(sent, received, handle)``, the halves from before and after as ``self.chunks`` orders
        them (``sent`` kept until the wait). The ends send and receive one."""
        peers = [peer for peer in (self.before, self.after) if peer is not None]
        sends = [
            (pack(*x), peer, tag) for x, peer in ((to_before, self.before), (to_after, self.after)) if peer is not None
        ]
        received = [torch.empty_like(sends[0][0]) for _ in peers]
        return sends, received, C.exchange(sends, [(buf, peer, tag) for buf, peer in zip(received, peers)])

    def _received(self, posted) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Wait for a ``_swap``; the ``(K, V)`` halves it received."""
        _, received, handle = posted
        handle.wait()
        return [unpack(buf, *self.shapes) for buf in received]

    def blocks(self, k: torch.Tensor, v: torch.Tensor):
        """This rank's block (its chunks' K/V on their way meanwhile), then the neighbours' chunks side by side."""
        cp, r, h = len(self.ranks), self.r, self.half
        self.shapes = (k[..., :h, :].shape, v[..., :h, :].shape)
        posted = self._swap((k[..., h:, :], v[..., h:, :]), (k[..., :h, :], v[..., :h, :]), _KV_TAG)
        yield (k, v), (r, 2 * cp - 1 - r)
        halves = self._received(posted)
        yield (torch.cat([kh for kh, _ in halves], dim=-2), torch.cat([vh for _, vh in halves], dim=-2)), self.chunks

    def give_back(self, grad_k, grad_v) -> None:
        """The own block's gradients (its K/V heads') stay; the neighbours' chunks' go back to their owners."""
        grads = (grad_k, grad_v)
        if self.own is None:
            self.own = grads
            return
        parts = list(zip(*(g.split(self.half, dim=-2) for g in grads)))
        to_before = parts.pop(0) if self.before is not None else None
        to_after = parts.pop(0) if self.after is not None else None
        self.posted = self._swap(to_before, to_after, _GRAD_TAG)

    def own_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's K and V gradients: its own block's, plus its first chunk's from rank ``r + 1`` and its second
        chunk's from rank ``r - 1``."""
        halves = self._received(self.posted)
        h, (dk, dv) = self.half, self.own
        if self.before is not None:
            gk, gv = halves.pop(0)
            dk[..., h:, :] += gk
            dv[..., h:, :] += gv
        if self.after is not None:
            gk, gv = halves.pop(0)
            dk[..., :h, :] += gk
            dv[..., :h, :] += gv
        return dk, dv
