"""Muon under DeepSpeed's ZeRO 1-2: the layer-wise distributed optimizer over DP, as Megatron's.

DeepSpeed's ZeRO 1/2 optimizer (``DeepSpeedZeroOptimizer``) flattens each parameter group (the params in order,
each padded to its alignment, the whole padded to a multiple of the DP size), cuts the flat buffer into DP equal
partitions, and hands the client optimizer ONE flat fp32 partition per group (its ``.grad`` the DP-averaged,
unscaled and clipped gradient of those elements). It keeps doing all of that here -- the gradients' reduce-scatter,
the fp32 masters, the clip, fp16's loss scale, copying the masters back into the bf16/fp32 weights -- and
``MuonWithAdamW`` steps the partition:

1. the momentum and its Nesterov blend are elementwise, so they run on the partition (``momentum_buffer`` has the
   partition's shape: DeepSpeed's fragment mapping saves and restores it per weight);
2. the weights go in buckets of consecutive weights (``BUCKET_NUMEL`` elements at most), and in each bucket every
   Muon weight has one owner DP rank (``owners``, the same answer on every rank); one all-to-all over the group's DP
   group sends each rank's pieces of the bucket's weights to their owners (a weight may straddle partitions: its
   pieces are contiguous ranges of its row-major elements), the owner rebuilds each (a TP shard: TP peers at the
   same DP index own the same weights) and orthogonalises it (``orthogonalise_over_tp`` for TP-split ones), and a
   second all-to-all returns each rank its pieces;
3. weight decay and ``-adjust_lr(lr, shape)`` apply per element of each piece, as ZeRO 0 does per weight.

Per rank the step holds the partition's update and one bucket's exchange at a time, and moves about twice the
partition per step; an all-gather of the flat group would hold all of it (tens of GiB at 8B parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megakit.core.planner.muon import BUCKET_NUMEL
from megakit.nn import comm as C


@dataclass(frozen=True, kw_only=True)
class Piece:
    """The contiguous range of one weight's row-major elements that one DP rank's partition holds."""

    rank: int
    start: int  # the first element's index in the weight's flattened tensor
    numel: int
    at: int  # where the range starts in that rank's partition


def pieces(offsets: list[int], numels: list[int], *, partition_size: int, ranks: int) -> list[list[Piece]]:
    """Per weight (at ``offsets[i]`` in the flat group, ``numels[i]`` elements), its pieces in rank order: the
    partition of rank ``r`` is the flat range ``[r * partition_size, (r + 1) * partition_size)``."""
    out = []
    for offset, numel in zip(offsets, numels, strict=True):
        row, end = [], offset + numel
        for r in range(offset // partition_size, min(ranks, -(-end // partition_size))):
            lo, hi = max(offset, r * partition_size), min(end, (r + 1) * partition_size)
            if hi > lo:
                row.append(Piece(rank=r, start=lo - offset, numel=hi - lo, at=lo - r * partition_size))
        out.append(row)
    return out


@dataclass(frozen=True, kw_only=True)
class FlatGroup:
    """One ZeRO parameter group as the Muon step needs it: its weights in flat order and where they lie."""

    names: list[str]
    shapes: list[torch.Size]  # this rank's (TP-shard) shapes
    tp_dims: list[int | None]  # the TP split dimension (None: whole on every TP rank)
    pieces: list[list[Piece]]
    buckets: list[list[int]]  # the weights exchanged together, in flat order (``buckets``)
    owner: list[int]  # the DP rank that orthogonalises each weight (balanced within its bucket)
    group: object  # the group's DP process group (experts: their EDP group)

    def mine(self, rank: int) -> list[tuple[int, Piece]]:
        """(weight index, piece) of each weight's piece in ``rank``'s partition, in flat order."""
        return [(j, pc) for j, row in enumerate(self.pieces) for pc in row if pc.rank == rank]


# The weights one exchange carries: at most BUCKET_NUMEL elements (fp32: 256 MiB), or one weight larger than it.
# One exchange for the whole group would hold about eight fp32 copies of the rank's partition at once (the update,
# what is sent, received, rebuilt, orthogonalised and returned: 26 GiB for Llama-3-8B at TP 2 x DP 4), more than
# the activations; bucket by bucket, the partition's update and about five buckets' shares.


def buckets(numels: list[int], ranks: int, limit: int = BUCKET_NUMEL) -> tuple[list[list[int]], list[int]]:
    """The weights' indices in runs of consecutive weights, each at most ``limit`` elements (a larger weight alone),
    and each weight's owner among ``ranks``, balanced within its run (``muon.owners``)."""
    from megakit.train.engine.muon import owners

    runs: list[list[int]] = []
    size = 0
    for j, numel in enumerate(numels):
        if not runs or size + numel > limit:
            runs.append([])
            size = 0
        runs[-1].append(j)
        size += numel
    owner = [0] * len(numels)
    for run in runs:
        for j, o in zip(run, owners([numels[j] for j in run], ranks), strict=True):
            owner[j] = o
    return runs, owner


def flat_group(zero_optimizer, index: int, names: dict[int, str]) -> FlatGroup:
    """``FlatGroup`` of group ``index`` of DeepSpeed's ZeRO 1/2 optimizer (its ``round_robin_bit16_*`` lists: the
    params in the flat buffer's order, with their offsets) or of its BF16 optimizer (bf16 with fp32 gradient
    accumulation at ZeRO 1: the params back to back, padding at the end only)."""
    group = zero_optimizer.real_dp_process_group[index]
    if hasattr(zero_optimizer, "round_robin_bit16_groups"):
        params = zero_optimizer.round_robin_bit16_groups[index]
        offsets = zero_optimizer.round_robin_bit16_offsets[index]
        partition_size = int(zero_optimizer.partition_size[index])
    else:
        params = zero_optimizer.bf16_groups[index]
        offsets = [sum(p.numel() for p in params[:j]) for j in range(len(params))]
        partition_size = zero_optimizer.bf16_groups_flat[index].numel() // C.size(group)
    numels = [p.numel() for p in params]
    runs, owner = buckets(numels, C.size(group))
    return FlatGroup(
        names=[names[id(p)] for p in params],
        shapes=[p.shape for p in params],
        tp_dims=[getattr(p, "tp_dim", None) for p in params],
        pieces=pieces(offsets, numels, partition_size=partition_size, ranks=C.size(group)),
        buckets=runs,
        owner=owner,
        group=group,
    )


def orthogonalise_flat(
    update: torch.Tensor, flat: FlatGroup, tp_group, weights: list[int]
) -> list[tuple[int, Piece, torch.Tensor]]:
    """(weight, piece, its orthogonalised elements) of each piece this rank's partition holds of ``weights`` (one
    bucket), layer-wise over DP: one all-to-all of the pieces to their weights' owners (forward: pieces to owners),
    Newton-Schulz on each owned weight, one all-to-all of the results back to the ranks holding the pieces."""
    from megakit.train.engine.muon import orthogonalise, orthogonalise_over_tp

    n, me, chosen = C.size(flat.group), C.rank(flat.group), set(weights)
    held = [(j, pc) for j, pc in flat.mine(me) if j in chosen]
    owned = [j for j in weights if flat.owner[j] == me]
    send = [update.narrow(0, pc.at, pc.numel) for r in range(n) for j, pc in held if flat.owner[j] == r]
    send_splits = [sum(pc.numel for j, pc in held if flat.owner[j] == r) for r in range(n)]
    recv_splits = [sum(pc.numel for j in owned for pc in flat.pieces[j] if pc.rank == s) for s in range(n)]
    received = C.all_to_all_single(_cat(send, update), flat.group, send_splits=send_splits, recv_splits=recv_splits)
    whole = {j: update.new_empty(flat.shapes[j].numel()) for j in owned}
    cursor = 0
    for s in range(n):  # each source's block: its pieces of my weights, in flat order
        for j in owned:
            for pc in (pc for pc in flat.pieces[j] if pc.rank == s):
                whole[j].narrow(0, pc.start, pc.numel).copy_(received.narrow(0, cursor, pc.numel))
                cursor += pc.numel
    split = [j for j in owned if flat.tp_dims[j] is not None and C.size(tp_group) > 1]
    done = {j: orthogonalise(flat.names[j], whole[j].view(flat.shapes[j])) for j in owned if j not in split}
    tp_updates = [(flat.names[j], whole[j].view(flat.shapes[j]), flat.tp_dims[j]) for j in split]
    done |= dict(zip(split, orthogonalise_over_tp(tp_updates, tp_group), strict=True))
    back = [
        done[j].reshape(-1).narrow(0, pc.start, pc.numel)
        for s in range(n)
        for j in owned
        for pc in flat.pieces[j]
        if pc.rank == s
    ]
    returned = C.all_to_all_single(_cat(back, update), flat.group, send_splits=recv_splits, recv_splits=send_splits)
    out, cursor = [], 0
    for r in range(n):
        for j, pc in held:
            if flat.owner[j] == r:
                out.append((j, pc, returned.narrow(0, cursor, pc.numel)))
                cursor += pc.numel
    return out


def _cat(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    return torch.cat(parts) if parts else like.new_empty(0)


def bind(zero_optimizer) -> None:
    """Tell ``--optimizer muon``'s ``MuonWithAdamW`` the flat layout of the groups DeepSpeed's ZeRO 1/2 (or BF16)
    optimizer hands it (a no-op where it steps the weights themselves: ZeRO 0 in fp32). Called once after
    ``deepspeed.initialize``."""
    from megakit.train.engine.muon import MuonWithAdamW

    client = getattr(zero_optimizer, "optimizer", None)
    if not isinstance(client, MuonWithAdamW):
        return
    flattens = hasattr(zero_optimizer, "round_robin_bit16_groups") or hasattr(zero_optimizer, "bf16_groups")
    assert flattens, f"--optimizer muon does not know the layout of {type(zero_optimizer).__name__}'s groups"
    for i, group in enumerate(client.param_groups):
        params = (getattr(zero_optimizer, "round_robin_bit16_groups", None) or zero_optimizer.bf16_groups)[i]
        assert not any(hasattr(p, "use_muon") for p in params), "DeepSpeed's own Muon hooks would step these"
        if group["use_muon"]:
            client.flat[id(group["params"][0])] = flat_group(zero_optimizer, i, client.names)
            client.muon_params.add(id(group["params"][0]))
