"""What a ``--compress`` spec means: its parse, and the bytes per gradient element it puts on the wire.

One place for both, so the trainer that compresses and the planner that prices the
compressed DP traffic agree. The codecs themselves are in ``megakit.nn.compression``.

| spec        | each rank's compressed tensor, per gradient element (fp32: 4 bytes) | travels as |
|-------------|----------------------------------------------------------------------|------------|
| ``none``    | the fp32 gradient, all-reduced by DeepSpeed                           | all-reduce |
| ``fp16``    | 2 bytes                                                               | all-reduce |
| ``int8``    | 1 byte + one fp32 scale per ``CHUNK`` elements                        | two phases |
| ``sign``    | 1 bit + one fp32 scale per ``CHUNK`` elements (1-bit SGD, Seide 2014) | two phases |
| ``topk:R``  | the largest R·n elements as (int32 index, fp32 value) pairs (DGC)     | all-gather |

A ring all-reduce puts 2 (n-1)/n of its tensor on the wire per rank; the two phases (an
all-to-all of compressed segments, each rank sums its segment and recompresses it, then an
all-gather, as 1-bit Adam's compressed all-reduce) the same of the compressed tensor; an
all-gather n - 1 times it, so Top-K's share grows with DP (``Compression.wire_fraction``).

Where it applies: ``fp16`` and ``int8`` lose little, so they compress the gradients and
every rank's optimizer steps on the same average, as without compression. ``sign`` and
``topk`` lose most of each step's gradient and return it later through error feedback;
Adam scales every coordinate by its own gradient history, so a coordinate that receives
its delayed gradient as one spike takes a far smaller step than the dense run took
(measured: Top-K 1 % of gradients ends 14 % above the exact loss, with or without
feedback). They therefore compress what the optimizer applies instead: each rank steps
Adam on its own gradients, and the weight updates are averaged, compressed, with error
feedback (the idea of 1-bit Adam, Tang et al. 2021, which compresses after Adam's
non-linear part). Each rank's weights keep its own updates until they are sent, so its
optimizer sees where its steps took it (``megakit.nn.compression.UpdateReducer``: with the
residual kept apart, Top-K 1 % ended 6.5 % above the exact loss; this way 2.5 %).
"""

from __future__ import annotations

from dataclasses import dataclass

from megakit.errors import UsageError

CHUNK = 512  # elements sharing one scale (int8, sign): 1/128 byte per element of overhead
KINDS = ("none", "fp16", "int8", "sign", "topk")


@dataclass(frozen=True)
class Compression:
    """How DP gradients are compressed (``--compress``): one value object that parses, prints and compares."""

    kind: str = "none"
    ratio: float = 1.0  # topk: the share of elements sent

    @property
    def enabled(self) -> bool:
        return self.kind != "none"

    @property
    def after_optimizer(self) -> bool:
        """Compress the optimizer's weight update rather than the gradient (see the module docstring)."""
        return self.kind in ("sign", "topk")

    @property
    def zero_stages(self) -> tuple[int, ...]:
        """The ZeRO stages it composes with: gradient codecs replace ZeRO 1's bucket all-reduce too; weight
        updates need the whole weights on every rank (ZeRO 0)."""
        return (0,) if self.after_optimizer else (0, 1)

    @property
    def collective(self) -> str:
        """How the compressed tensor travels: shaped as a ring all-reduce (fp16; int8 and sign in two phases,
        all-to-all then all-gather: 2 (n-1)/n of it per rank), or all-gathered (Top-K: n - 1 times it)."""
        return "all_gather" if self.kind == "topk" else "all_reduce"

    def wire_bytes_per_element(self) -> float:
        """Bytes of this rank's compressed tensor per gradient element (what ``collective`` carries)."""
        return {
            "none": 4.0,
            "fp16": 2.0,
            "int8": 1.0 + 4.0 / CHUNK,
            "sign": 1 / 8 + 4.0 / CHUNK,
            "topk": 8.0 * self.ratio,
        }[self.kind]

    def wire_fraction(self, dp: int = 2) -> float:
        """Bytes on the wire against the uncompressed fp32 ring all-reduce of the same gradients, at ``dp``."""
        dp = max(dp, 2)
        shape = (dp - 1) if self.collective == "all_gather" else 2 * (dp - 1) / dp
        return self.wire_bytes_per_element() * shape / (4.0 * 2 * (dp - 1) / dp)

    def __str__(self) -> str:
        return f"topk:{self.ratio:g}" if self.kind == "topk" else self.kind


def parse_compression(text: str) -> Compression:
    """``none | fp16 | int8 | sign | topk:RATIO`` (0 < RATIO < 1) as a ``Compression``; UsageError otherwise."""
    kind, _, arg = text.strip().lower().partition(":")
    if kind not in KINDS:
        raise UsageError(
            f"--compress {text}: not one of none, fp16, int8, sign, topk:RATIO "
            "(e.g. topk:0.01 sends the largest 1 % of gradient elements)"
        )
    if kind != "topk":
        if arg:
            raise UsageError(f"--compress {text}: {kind} takes no argument; only topk:RATIO does")
        return Compression(kind)
    try:
        ratio = float(arg)
    except ValueError:
        raise UsageError(f"--compress {text}: topk needs the share of elements to send, e.g. topk:0.01") from None
    if not 0.0 < ratio < 1.0:
        raise UsageError(
            f"--compress {text}: the Top-K ratio must be above 0 and below 1 (topk:0.01 sends 1 %); "
            "use --compress none to send everything"
        )
    return Compression("topk", ratio)
