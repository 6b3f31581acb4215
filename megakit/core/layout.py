"""The rank grid (TP fastest, then CP, then DP, then PP) and its process groups, built once.

Rank order follows Megatron: ``rank = tp + T * (cp + C * (dp + D * pp))``, so the T ranks
of a tensor-parallel group are consecutive and sit inside one node, and the T x C ranks
of one context-parallel group (its ring of K/V blocks, every attention layer) come right
after them, inside the node too whenever T x C <= GPUs per node. With CP = 1 the order
is the 3D one, ``tp + T * (dp + D * pp)``. A worked example
with 16 ranks, TP = 2, DP = 2, PP = 4 (``Layout(tp=2, pp=4, dp=2)``)::

    pp stage 0:  dp 0 -> ranks [0, 1]    dp 1 -> ranks [2, 3]
    pp stage 1:  dp 0 -> ranks [4, 5]    dp 1 -> ranks [6, 7]
    pp stage 2:  dp 0 -> ranks [8, 9]    dp 1 -> ranks [10, 11]
    pp stage 3:  dp 0 -> ranks [12, 13]  dp 1 -> ranks [14, 15]

    tp groups:   [0, 1] [2, 3] [4, 5] ... [14, 15]
    dp groups:   [0, 2] [1, 3] [4, 6] ... [13, 15]
    pp groups:   [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    mp groups:   (TP x PP, one model replica) [0, 1, 4, 5, 8, 9, 12, 13] [2, 3, 6, 7, ...]
    embedding:   (first + last stage, for tied weights) [0, 12] [1, 13] [2, 14] [3, 15]

With ``Layout(tp=2, cp=2, dp=2)`` (8 ranks): tp groups [0, 1] [2, 3] ..., cp groups
[0, 2] [1, 3] [4, 6] [5, 7], dp groups [0, 4] [1, 5] [2, 6] [3, 7], and "dpcp" groups
(the ranks holding the same weights, over which gradients are averaged) [0, 2, 4, 6]
[1, 3, 5, 7].

Expert parallelism folds onto TP x CP x DP (Megatron-Core's "MoE parallel folding", torchtitan's
dp2ep, with expert TP = 1): attention keeps the grid above, and each pipeline stage's T x C x D ranks,
taken in rank order (TP fastest, then CP, then DP), are cut into expert-parallel groups "ep" of ``ep``
consecutive ranks, which split each MoE layer's experts between them; the ranks at the same place of
every EP group hold the same experts, the expert-data-parallel group "edp" (expert gradients are reduced
there). So EP x EDP = TP x CP x DP, and an EP group fills its TP groups before it takes ranks of another
DP or CP replica: at TP 8 with EP 8, the all-to-all stays inside the TP group's node. ``Layout(dp=4,
ep=2)``: ep groups [0, 1] [2, 3], edp groups [0, 2] [1, 3]. ``Layout(tp=2, dp=2, ep=4)``: one ep group
[0, 1, 2, 3], edp groups [0] [1] [2] [3]. ``Layout(tp=2, cp=2, dp=2, ep=2)`` (8 ranks): ep groups [0, 1]
[2, 3] [4, 5] [6, 7] (the TP pairs), edp groups [0, 2, 4, 6] [1, 3, 5, 7]. Each TP rank routes its own
part of the tokens (``megakit.nn.moe.layer``).

``Layout`` is pure data and needs no processes; ``megakit.nn.topology.Topology`` adds
the torch.distributed groups for the calling rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from megakit.errors import UsageError

AXES = ("pp", "dp", "cp", "tp")  # outermost -> innermost


def check_ep_fold(tp: int, cp: int, dp: int, ep: int, *, fix: str = "") -> None:
    """UsageError unless ``ep`` divides a stage's TP x CP x DP ranks, naming the degrees that would (``fix``: more)."""
    folded = tp * cp * dp
    if folded % ep:
        divisors = ", ".join(str(d) for d in range(1, folded + 1) if folded % d == 0)
        raise UsageError(
            f"--ep {ep} does not divide TP x CP x DP = {tp} x {cp} x {dp} = {folded}, the ranks of a "
            f"pipeline stage that expert parallelism folds over; use one of {divisors}{fix}"
        )


def hybrid_degrees(cp: int, heads: int) -> list[int]:
    """The all-to-all degrees hybrid CP can run at CP ``cp`` with ``heads`` per TP rank: above 1 (else the ring),
    below CP (else Ulysses), dividing CP (the runs of ranks) and the heads (each rank's head group)."""
    return [a for a in range(2, cp) if cp % a == 0 and heads % a == 0]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Sizes of the four parallel axes; rank <-> coordinate arithmetic."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1  # expert parallelism, folded onto TP x CP x DP (not an axis of its own)
    cp_a2a: int = 1  # hybrid CP: the all-to-all degree inside each CP group (1: no sub-groups; see ``groups``)

    def __post_init__(self) -> None:
        for axis in (*AXES, "ep"):
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise UsageError(f"--{axis} must be a positive integer, got {size!r}")
        check_ep_fold(self.tp, self.cp, self.dp, self.ep)
        if not isinstance(self.cp_a2a, int) or self.cp_a2a < 1 or self.cp % self.cp_a2a:
            raise UsageError(f"--cp-a2a {self.cp_a2a} must divide --cp {self.cp}")

    @property
    def hybrid_cp(self) -> bool:
        """CP as all-to-all groups of ``cp_a2a`` ranks joined by a ring (neither degree 1)."""
        return 1 < self.cp_a2a < self.cp

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1) -> "Layout":
        """The layout that fills ``world_size`` ranks: DP takes what TP x PP (x CP) leaves."""
        for name, size in (("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(size, int) or size < 1:
                raise UsageError(f"--{name} must be a positive integer, got {size!r}")
        if world_size % (tp * pp * cp):
            names, sizes = ("TP x PP", f"{tp} x {pp}") if cp == 1 else ("TP x PP x CP", f"{tp} x {pp} x {cp}")
            raise UsageError(
                f"world size {world_size} is not divisible by {names} = {sizes} = {tp * pp * cp}; "
                f"launch a multiple of {tp * pp * cp} processes or change --tp/--pp" + ("/--cp" if cp > 1 else "")
            )
        return cls(tp=tp, pp=pp, cp=cp, dp=world_size // (tp * pp * cp), ep=ep)

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    def rank(self, *, pp: int, dp: int, tp: int, cp: int = 0) -> int:
        """The global rank at these coordinates (TP innermost, then CP, DP, PP): the inverse of ``coords``."""
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": ., "dp": ., "cp": ., "tp": .}`` of a global rank."""
        assert 0 <= rank < self.world_size, (rank, self)
        return {
            "tp": rank % self.tp,
            "cp": rank // self.tp % self.cp,
            "dp": rank // (self.tp * self.cp) % self.dp,
            "pp": rank // (self.tp * self.cp * self.dp),
        }

    @property
    def edp(self) -> int:
        """Expert-data-parallel ranks: the replicas of each expert shard (EP x EDP = TP x CP x DP)."""
        return self.tp * self.cp * self.dp // self.ep

    def ep_coords(self, rank: int) -> dict[str, int]:
        """``{"ep": ., "edp": .}``: a rank's index in its EP group (which experts it holds) and in its EDP group."""
        folded = rank % (self.tp * self.cp * self.dp)  # the rank's place in its pipeline stage
        return {"ep": folded % self.ep, "edp": folded // self.ep}

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as lists of global ranks.

        kind: "tp", "cp", "dp", "pp" (ranks that differ only along that axis), "dpcp" (DP x CP:
        the ranks that hold the same weights, over which gradients are averaged), "mp" (TP x PP:
        one full model replica), "embedding" (first and last pipeline stage), "ep" (the ranks
        that share one MoE layer's experts between them), "edp" (the ranks holding the same
        experts, over which expert gradients are averaged), or, for hybrid CP, "cp_a2a" (runs of
        ``cp_a2a`` consecutive ranks of each CP group: their all-to-all) and "cp_ring" (the ranks at
        the same place of every run: their ring). CP rank ``c`` holds zig-zag chunks ``c`` and
        ``2 CP - 1 - c``, so run ``i`` holds chunks ``[i a, (i + 1) a)`` and their mirrors: exactly
        the chunks ring rank ``i`` of a ring of ``CP / a`` holds in its own zig-zag split.
        """
        if kind in ("cp_a2a", "cp_ring"):
            a, out = self.cp_a2a, []
            for ring in self.groups("cp"):
                out += (
                    [ring[i : i + a] for i in range(0, self.cp, a)]
                    if kind == "cp_a2a"
                    else [ring[i::a] for i in range(a)]
                )
            return sorted(out)
        if kind in ("ep", "edp"):
            stage, out = self.tp * self.cp * self.dp, []
            for p in range(self.pp):
                folded = list(range(p * stage, (p + 1) * stage))
                out += (
                    [folded[i : i + self.ep] for i in range(0, stage, self.ep)]
                    if kind == "ep"
                    else [folded[i :: self.ep] for i in range(self.ep)]
                )
            return sorted(out)
        if kind == "mp":
            return sorted(
                [self.rank(pp=p, dp=d, cp=c, tp=t) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)
                for c in range(self.cp)
            )
        if kind == "embedding":
            stages = sorted({0, self.pp - 1})
            return sorted(
                [self.rank(pp=p, dp=d, cp=c, tp=t) for p in stages]
                for d in range(self.dp)
                for c in range(self.cp)
                for t in range(self.tp)
            )
        if kind == "dpcp":
            return sorted(
                [self.rank(pp=p, dp=d, cp=c, tp=t) for d in range(self.dp) for c in range(self.cp)]
                for p in range(self.pp)
                for t in range(self.tp)
            )
        assert kind in AXES, kind
        others = [axis for axis in AXES if axis != kind]
        sizes = [range(getattr(self, axis)) for axis in others]
        return sorted(
            [self.rank(**dict(zip(others, fixed)), **{kind: i}) for i in range(getattr(self, kind))]
            for fixed in itertools.product(*sizes)
        )
