"""``Mamba2Config``: the Mamba-2 mixer of a hybrid model (NVIDIA's Nemotron-H and Nemotron-3).

Read from the Hugging Face ``nemotron_h`` fields (``from_hf``) and written back (``to_hf``). Pure Python: the planner
reads it. The mixer (``megakit.nn.linear_attention.mamba2``) projects the hidden state to a gate ``z``, the values
``x`` (``heads x head_dim``), ``B`` and ``C`` (``groups x state``, each group shared by ``heads / groups`` heads)
and one step size ``dt`` per head; ``x``, ``B`` and ``C`` go through a short causal depthwise conv of ``conv_kernel``
taps, and the state-space scan runs in chunks of ``chunk`` tokens (Dao and Gu 2024, SSD).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from megakit.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class Mamba2Config:
    """The Mamba-2 mixer's shape (the field comments name transformers' ``NemotronHConfig`` fields)."""

    heads: int  # mamba_num_heads
    head_dim: int  # mamba_head_dim
    state: int  # ssm_state_size
    groups: int = 1  # n_groups: B and C heads (and the gated norm's groups)
    conv_kernel: int = 4
    chunk: int = 128  # chunk_size of the SSD scan
    conv_bias: bool = True  # use_conv_bias
    bias: bool = False  # use_bias: in_proj's and out_proj's
    dt_min: float = 0.0  # time_step_limit: dt is clamped to [dt_min, dt_max] after the softplus
    dt_max: float = math.inf

    def __post_init__(self) -> None:
        for name in ("heads", "head_dim", "state", "groups", "conv_kernel", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"Mamba-2 field {name} must be a positive integer, got {value!r}")
        if self.heads % self.groups:
            raise UsageError(f"Mamba-2 heads {self.heads} must be a multiple of its groups {self.groups} (n_groups)")

    @property
    def inner(self) -> int:
        """The mixer's inner width, ``heads x head_dim`` (the gate's, the values', out_proj's input)."""
        return self.heads * self.head_dim

    @property
    def conv_channels(self) -> int:
        """Channels of the depthwise conv: x, B and C."""
        return self.inner + 2 * self.groups * self.state

    def split_conflicts(self, n: int) -> list[str]:
        """What a split of the heads over ``n`` ranks (TP, or TP x CP) does not divide; the groups go with them."""
        return [f"{what} {k}" for what, k in (("Mamba heads", self.heads), ("Mamba groups", self.groups)) if k % n]

    def check_split(self, tp: int, cp: int) -> None:
        """UsageError unless TP x CP divides the heads and the groups (the mixer splits both over both)."""
        bad = self.split_conflicts(tp * cp)
        if bad:
            raise UsageError(
                f"TP x CP = {tp} x {cp} = {tp * cp} does not divide {', '.join(bad)}; the Mamba-2 mixer splits its "
                f"heads and groups over both: choose TP and CP whose product divides {self.groups}"
            )

    def params(self, hidden: int, tp: int = 1) -> tuple[int, int, int]:
        """(matrix, TP-sharded vector, replicated) parameters of one mixer on one TP rank."""
        proj = self.inner + self.conv_channels + self.heads  # z, x, B, C, dt
        matmul = hidden * proj // tp + self.inner // tp * hidden
        vectors = self.conv_channels * (self.conv_kernel + self.conv_bias) + 3 * self.heads + self.inner  # + norm
        vectors += self.bias * proj
        return matmul, vectors // tp, self.bias * hidden

    def flops_per_token(self, hidden: int) -> float:
        """Forward FLOPs per token of one mixer (multiply-adds x 2): the projections, the conv, and the chunked scan
        (per chunk of ``Q`` tokens: C B^T and its product with x, ``2 Q n`` and ``2 Q p`` per head and token, the
        chunk state in and out, ``4 n p``); linear in the sequence."""
        proj = 2 * hidden * (self.inner + self.conv_channels + self.heads) + 2 * self.inner * hidden
        conv = 2 * self.conv_channels * self.conv_kernel
        q, n, p = self.chunk, self.state, self.head_dim
        scan = self.heads * (2 * q * n + 2 * q * p + 4 * n * p)
        return float(proj + conv + scan)

    def scan_flops_per_token(self) -> float:
        """Forward FLOPs per token of the conv and the chunked scan (``flops_per_token`` less the projections)."""
        q, n, p = self.chunk, self.state, self.head_dim
        return float(2 * self.conv_channels * self.conv_kernel + self.heads * (2 * q * n + 2 * q * p + 4 * n * p))

    def state_bytes(self, batch: int, bytes_per: int = 4) -> int:
        """One mixer's recurrent state and conv window, per sequence batch: ``heads x head_dim x state`` (fp32) and
        ``(conv_kernel - 1) x conv channels``."""
        return (
            batch * bytes_per * (self.heads * self.head_dim * self.state + (self.conv_kernel - 1) * self.conv_channels)
        )

    @classmethod
    def from_hf(cls, data: dict) -> "Mamba2Config":
        """The mixer of a ``nemotron_h`` config.json."""
        low, high = data.get("time_step_limit") or (0.0, math.inf)
        return cls(
            heads=data["mamba_num_heads"],
            head_dim=data["mamba_head_dim"],
            state=data["ssm_state_size"],
            groups=data.get("n_groups", 1),
            conv_kernel=data.get("conv_kernel", 4),
            chunk=data.get("chunk_size", 128),
            conv_bias=data.get("use_conv_bias", True),
            bias=data.get("use_bias", False),
            dt_min=float(low),
            dt_max=float(high),
        )

    def to_hf(self) -> dict:
        """The ``nemotron_h`` fields of this mixer."""
        return {
            "mamba_num_heads": self.heads,
            "mamba_head_dim": self.head_dim,
            "ssm_state_size": self.state,
            "n_groups": self.groups,
            "conv_kernel": self.conv_kernel,
            "chunk_size": self.chunk,
            "use_conv_bias": self.conv_bias,
            "use_bias": self.bias,
            "time_step_limit": [self.dt_min, self.dt_max],
        }
