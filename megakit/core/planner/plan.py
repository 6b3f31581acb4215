"""Plan: one point of the search space (a parallel layout plus the knobs that change memory and speed)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
    """TP × PP × DP with ZeRO, micro-batching and recomputation.

    ``accumulation`` is the number of micro-batches per optimizer step per DP rank, so the
    global batch is ``micro_batch × accumulation × dp`` sequences; with PP > 1 these
    micro-batches are what the 1F1B pipeline streams."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    accumulation: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    precision: str = "bf16"
    offload: str = "none"
    flash_attention: bool = True

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation * self.dp

    def memory_kwargs(self) -> dict:
        """The keyword arguments of ``memory.estimate_memory`` for this plan."""
        return dict(tp=self.tp, pp=self.pp, dp=self.dp, zero_stage=self.zero_stage, micro_batch=self.micro_batch,
                    accumulation=self.accumulation, recompute=self.recompute,
                    sequence_parallel=self.sequence_parallel, vpp=self.vpp, precision=self.precision,
                    offload=self.offload, flash_attention=self.flash_attention)

    def describe(self) -> str:
        parts = [f"TP={self.tp}", f"PP={self.pp}", f"DP={self.dp}"]
        if self.vpp > 1:
            parts.append(f"VPP={self.vpp}")
        parts.append(f"ZeRO-{self.zero_stage}")
        parts.append(f"mb={self.micro_batch}x{self.accumulation}")
        parts.append(f"recompute={self.recompute}")
        if self.sequence_parallel:
            parts.append("SP")
        if self.offload != "none":
            parts.append(f"offload={self.offload}")
        return " ".join(parts)
