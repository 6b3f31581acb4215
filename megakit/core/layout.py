"""The 3D rank grid (TP fastest, then DP, then PP) and its process groups, built once.

Rank order follows Megatron: ``rank = tp + T * (dp + D * pp)``, so the T ranks of
a tensor-parallel group are consecutive and sit inside one node. A worked example
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

``Layout`` is pure data and needs no processes; ``megakit.nn.topology.Topology`` adds
the torch.distributed groups for the calling rank.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakit.errors import UsageError

AXES = ("pp", "dp", "tp")  # outermost -> innermost


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Sizes of the three parallel axes; rank <-> coordinate arithmetic."""

    tp: int = 1
    pp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise UsageError(f"--{axis} must be a positive integer, got {size!r}")

    @classmethod
    def for_world(cls, world_size: int, *, tp: int = 1, pp: int = 1) -> "Layout":
        """The layout that fills ``world_size`` ranks: DP takes what TP x PP leaves."""
        if world_size % (tp * pp):
            raise UsageError(
                f"world size {world_size} is not divisible by TP x PP = {tp} x {pp} = {tp * pp}; "
                f"launch a multiple of {tp * pp} processes or change --tp/--pp"
            )
        return cls(tp=tp, pp=pp, dp=world_size // (tp * pp))

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, *, pp: int, dp: int, tp: int) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def coords(self, rank: int) -> dict[str, int]:
        """``{"pp": ., "dp": ., "tp": .}`` of a global rank."""
        assert 0 <= rank < self.world_size, (rank, self)
        return {"tp": rank % self.tp, "dp": rank // self.tp % self.dp, "pp": rank // (self.tp * self.dp)}

    def groups(self, kind: str) -> list[list[int]]:
        """Every group of one kind, as lists of global ranks.

        kind: "tp", "dp", "pp" (ranks that differ only along that axis), "mp" (TP x PP:
        one full model replica) or "embedding" (first and last pipeline stage).
        """
        if kind == "mp":
            return [
                [self.rank(pp=p, dp=d, tp=t) for p in range(self.pp) for t in range(self.tp)]
                for d in range(self.dp)
            ]
        if kind == "embedding":
            stages = sorted({0, self.pp - 1})
            return [
                [self.rank(pp=p, dp=d, tp=t) for p in stages]
                for d in range(self.dp)
                for t in range(self.tp)
            ]
        assert kind in AXES, kind
        others = [axis for axis in AXES if axis != kind]
        result = []
        for a in range(getattr(self, others[0])):
            for b in range(getattr(self, others[1])):
                fixed = {others[0]: a, others[1]: b}
                result.append([self.rank(**fixed, **{kind: i}) for i in range(getattr(self, kind))])
        return sorted(result)
