"""``LinearAttentionConfig``: the Gated DeltaNet part of a hybrid model description (Qwen3-Next, Qwen3.5).

A hybrid model runs a linear-attention mixer in some blocks and full attention in the others, by ``layer_types``
(transformers' field: one of ``LAYER_TYPES`` per block; Qwen3-Next's ``full_attention_interval`` N gives every N-th
block full attention). The Gated DeltaNet mixer has ``key_heads`` query/key heads of ``key_head_dim`` and
``value_heads`` (a multiple) value heads of ``value_head_dim``, a causal depthwise conv of ``conv_kernel`` taps, and
runs its delta rule in chunks of ``chunk`` tokens. Pure Python: the planner reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

from megakit.errors import UsageError

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class LinearAttentionConfig:
    """The linear-attention fields of a hybrid model (validated on construction: one line per bad field)."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4
    chunk: int = 64  # transformers' torch path's chunk
    layer_types: tuple[str, ...] = ()  # per block; empty: every block linear

    def __post_init__(self) -> None:
        for name in ("key_heads", "value_heads", "key_head_dim", "value_head_dim", "conv_kernel", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"linear attention field {name} must be a positive integer, got {value!r}")
        if self.value_heads % self.key_heads:
            raise UsageError(
                f"linear attention value heads {self.value_heads} are not a multiple of its key heads "
                f"{self.key_heads}; each key head serves a whole group of value heads"
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise UsageError(
                f"layer type {unknown[0]!r} is not one megakit builds; use {' or '.join(map(repr, LAYER_TYPES))}"
            )

    def is_linear(self, index: int) -> bool:
        """Whether block ``index`` runs the linear-attention mixer (else full attention)."""
        return not self.layer_types or self.layer_types[index] == "linear_attention"

    def check_parallel(self, *, tp: int, cp: int) -> None:
        """Refuse, in one line, head counts that TP x CP does not divide (each rank runs whole heads)."""
        if self.key_heads % (tp * cp):
            raise UsageError(
                f"linear attention key heads {self.key_heads} are not divisible by TP x CP = {tp} x {cp}; "
                "choose --tp and --cp whose product divides them"
            )

    def state_elements(self) -> int:
        """One sequence's recurrent state of one block: ``value_heads x key_head_dim x value_head_dim``."""
        return self.value_heads * self.key_head_dim * self.value_head_dim

    def conv_channels(self) -> int:
        """The conv's channels: q and k (``key_heads x key_head_dim`` each) and v."""
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    # -- what the planner and the counts read (per block, per TP rank) ------------------------------------------
    def mixer_params(self, hidden: int, tp: int = 1) -> tuple[int, int, int]:
        """``(matmul, column-split vectors, replicated)`` parameters of one mixer on one TP rank: the q/k/v/z/b/a
        projections and the out projection; the conv taps, ``A_log`` and ``dt_bias`` (split with the heads); the
        gated norm's weight."""
        nk, nv = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        matmul = hidden * (2 * nk + 2 * nv + 2 * self.value_heads) + nv * hidden
        return matmul // tp, (self.conv_channels() * self.conv_kernel + 2 * self.value_heads) // tp, self.value_head_dim

    def core_flops_per_token(self, tp: int = 1) -> float:
        """Forward FLOPs per token of the chunked delta rule on one TP rank, constant in the sequence (chunk ``C``):
        inside its chunk ``k_beta k^T`` and ``q k^T`` (``2 C d_k`` each), the two triangular solves (``C (d_k +
        d_v)``), the scores times the new values (``2 C d_v``); across chunks three ``d_k x d_v`` products with the
        state (``6 d_k d_v``); per value head."""
        c, dk, dv = self.chunk, self.key_head_dim, self.value_head_dim
        per_head = 4 * c * dk + c * (dk + dv) + 2 * c * dv + 6 * dk * dv
        return self.value_heads / tp * per_head

    def state_bytes(self, *, micro_batch: int, tp: int, cp: int, bytes_per_element: int = 4) -> float:
        """One mixer's recurrent state held through the scan, per rank: a ``d_k x d_v`` fp32 state per value head
        and sequence, for each chunk boundary that backward reads (``chunks``: the caller multiplies), over TP x CP."""
        return micro_batch * self.state_elements() / (tp * cp) * bytes_per_element

    def activation_elements_per_token(self, tp: int = 1) -> float:
        """Elements per token one mixer keeps for backward on one TP rank (any CP: the all-to-all trades tokens for
        heads), linear in the sequence: what ``kept_elements_per_token`` and ``core_elements_per_token`` count."""
        return self.kept_elements_per_token(tp) + self.core_elements_per_token(tp)

    def kept_elements_per_token(self, tp: int = 1) -> float:
        """Of ``activation_elements_per_token``, what selective recompute keeps: the projections' outputs (q, k, v,
        z, b, a: the core's inputs and the gate), the gated norm's input, normalised, weighted and ``silu(z)`` tensors
        (and its rstd per value head), and the out projection's input."""
        nk, nv = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        projections = 2 * nk + 2 * nv + 2 * self.value_heads
        return (projections + 5 * nv + self.value_heads) / tp

    def core_elements_per_token(self, tp: int = 1) -> float:
        """Of ``activation_elements_per_token``, what the torch core keeps (selective recompute drops it), fp32 as it
        runs, as measured of ``delta_rule`` (``tests/nn/test_mixer_recompute.py``): the conv's output (SiLU's input)
        and the gates' three per value head; then per value head ``5 C`` (the chunk's decay, UT, scores and their
        masks), ``8 d_k`` (q and k repeated to the value heads, in fp32, l2-normed, scaled, decayed, their solves),
        ``3 d_v`` (v times beta, the new values, the output) and 9 scalars (beta, the decays' cumulative sums)."""
        c, dk, dv = self.chunk, self.key_head_dim, self.value_head_dim
        return (self.conv_channels() + self.value_heads * (5 * c + 8 * dk + 3 * dv + 9)) / tp

    def cp_all_to_all_elements_per_token(self, tp: int = 1) -> float:
        """Elements per token one rank sends through the CP all-to-alls of one mixer's forward (the same again in
        backward): q, k, v, b and a to the head groups, the output back; ``(cp - 1) / cp`` of it leaves the rank."""
        nk, nv = self.key_heads * self.key_head_dim, self.value_heads * self.value_head_dim
        return (2 * nk + 2 * nv + 2 * self.value_heads) / tp

    @classmethod
    def from_hf(cls, hf: dict, layers: int) -> LinearAttentionConfig:
        """From a transformers ``qwen3_next`` / ``qwen3_5_text`` config dict of ``layers`` blocks."""
        types = hf.get("layer_types")
        if not types:
            interval = hf.get("full_attention_interval", 4)
            types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]
        return cls(
            key_heads=hf["linear_num_key_heads"],
            value_heads=hf["linear_num_value_heads"],
            key_head_dim=hf["linear_key_head_dim"],
            value_head_dim=hf["linear_value_head_dim"],
            conv_kernel=hf.get("linear_conv_kernel_dim", 4),
            layer_types=tuple(types),
        )

    def to_hf(self) -> dict:
        """The transformers fields (``from_hf``'s inverse)."""
        return dict(
            linear_num_key_heads=self.key_heads,
            linear_num_value_heads=self.value_heads,
            linear_key_head_dim=self.key_head_dim,
            linear_value_head_dim=self.value_head_dim,
            linear_conv_kernel_dim=self.conv_kernel,
            layer_types=list(self.layer_types),
        )
