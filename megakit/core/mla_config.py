"""``MLAConfig``: Multi-head Latent Attention (DeepSeek-V2/V3, Kimi K2), the attention part of a model description.

Queries come through a low-rank latent (``q_lora_rank``; 0: a plain projection), keys and values through one
compressed latent of ``kv_lora_rank`` and a RoPE key of ``qk_rope_head_dim`` shared by every head; per head the
query and key are ``qk_nope_head_dim + qk_rope_head_dim`` wide and the value ``v_head_dim``. Under TP the
down-projections and their norms are replicated, the up-projections split by heads (Megatron-Core, torchtitan).
Read from transformers 5's ``DeepseekV3Config`` fields; pure Python: the model (``megakit.nn.attention.latent``)
and the planner (``attention_params``, the widths) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakit.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek-V2/V3), validated here so a bad config fails before any build."""

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int = 0  # 0: q_proj straight from the hidden state
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"MLA field {name} must be a positive integer, got {value!r}")
        if not isinstance(self.q_lora_rank, int) or self.q_lora_rank < 0:
            raise UsageError(f"MLA field q_lora_rank must be a positive integer or null, got {self.q_lora_rank!r}")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def attention_params(self, hidden: int, heads: int, tp: int = 1) -> tuple[int, int]:
        """``(matrices, norms)`` of one block's attention on one TP rank: the up-projections and ``o_proj`` split
        by heads, the down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) and the latent norms whole."""
        n = heads // tp
        q = (
            hidden * self.q_lora_rank + self.q_lora_rank * n * self.qk_head_dim
            if self.q_lora_rank
            else hidden * n * self.qk_head_dim
        )
        kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * n * (
            self.qk_nope_head_dim + self.v_head_dim
        )
        return q + kv + n * self.v_head_dim * hidden, self.q_lora_rank + self.kv_lora_rank

    def projections(
        self, hidden: int, heads: int, tp: int = 1, *, sequence_parallel: bool = False
    ) -> list[tuple[str, float, int, int]]:
        """``(name, rows, k, n)`` of one block's attention GEMMs on one TP rank, in execution order: ``k x n`` weights
        over ``rows`` of the block's tokens (1: all of them). As ``megakit.nn.attention.latent`` runs them: the
        down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) whole on every rank, over the rank's ``1/tp`` of the
        tokens under SP (else all of them, the same work on each rank), the up-projections (``q_b_proj`` or
        ``q_proj``, ``kv_b_proj``) and ``o_proj`` split by heads over all the tokens. Their weights sum to
        ``attention_params``' matrices."""
        n, down = heads // tp, 1 / tp if sequence_parallel else 1.0
        q = (
            [("q_a_proj", down, hidden, self.q_lora_rank), ("q_b_proj", 1.0, self.q_lora_rank, n * self.qk_head_dim)]
            if self.q_lora_rank
            else [("q_proj", 1.0, hidden, n * self.qk_head_dim)]
        )
        return q + [
            ("kv_a_proj_with_mqa", down, hidden, self.kv_lora_rank + self.qk_rope_head_dim),
            ("kv_b_proj", 1.0, self.kv_lora_rank, n * (self.qk_nope_head_dim + self.v_head_dim)),
            ("o_proj", 1.0, n * self.v_head_dim, hidden),
        ]

    @classmethod
    def from_hf(cls, data: dict) -> "MLAConfig":
        """Reads the MLA fields of a transformers config.json, so converted checkpoints keep their shapes."""
        return cls(
            kv_lora_rank=data["kv_lora_rank"],
            qk_nope_head_dim=data["qk_nope_head_dim"],
            qk_rope_head_dim=data["qk_rope_head_dim"],
            v_head_dim=data["v_head_dim"],
            q_lora_rank=data.get("q_lora_rank") or 0,
            rope_interleave=bool(data.get("rope_interleave", True)),
        )

    def to_hf(self) -> dict:
        """The MLA fields as transformers writes them (q_lora_rank None when absent), for the export."""
        return {
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "q_lora_rank": self.q_lora_rank or None,
            "rope_interleave": self.rope_interleave,
        }
