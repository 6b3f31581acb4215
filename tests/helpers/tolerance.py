"""How far two fp32 computations of one quantity may differ: a bound from the arithmetic, not from one CPU's rounding.

Two correct implementations of one formula differ in the order of their sums. Each sum of ``n`` terms
in another order moves the result by up to ``n * EPS * sum|terms|`` in the worst case and by about
``sqrt(n) * EPS * scale`` in practice, rounding errors adding like a random walk (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., sections 3.1 and 4.2). Another machine's SIMD width, BLAS
blocking (MKL takes other kernels on AMD CPUs) or thread count picks another order, so the bound is

    |got - want| <= ULPS * EPS * scale * sqrt(terms)

``scale``: the largest magnitude among the values compared (``max|want|``: a gradient is judged against
its own largest element, never against an absolute 1e-6); ``terms``: the longest reduction whose
order may differ (the tokens a loss sums, the hidden size a GEMM sums). ``ULPS = 16`` is a random
walk's tail with room for the few roundings stacked on each sum. A defect (a wrong scale, a missing
all-reduce, a chunk left out) moves values by a share of themselves, 1e-3 and far more: orders of
magnitude past this bound at the sizes the tests use (``16 * EPS * sqrt(1024) = 6e-5`` relative).
"""

from __future__ import annotations

import math

import torch

EPS = torch.finfo(torch.float32).eps  # 2^-23: one unit in the last place at magnitude 1
ULPS = 16


def fp32_bound(scale: float, terms: int = 1, *, ulps: float = ULPS) -> float:
    """The largest difference two orders of an fp32 computation at ``scale`` over ``terms`` terms may show."""
    return ulps * EPS * float(scale) * math.sqrt(max(terms, 1))


def max_error(got, want) -> tuple[float, float]:
    """``(max|got - want|, max|want|)`` for tensors or floats."""
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    return float((got - want).abs().max()), float(want.abs().max())


def assert_fp32_close(
    got, want, *, terms: int, what: str = "", scale: float | None = None, ulps: float = ULPS
) -> float:
    """Fail unless ``got`` equals ``want`` within ``fp32_bound(scale, terms)``; returns the error over the bound.

    ``scale`` defaults to ``max|want|``; a gradient that is zero in exact arithmetic (a key bias: softmax ignores a
    shift shared by every key) is pure rounding of larger terms, so model gradients pass ``grad_scale(...)``."""
    err, own = max_error(got, want)
    scale = own if scale is None else scale
    bound = fp32_bound(scale, terms, ulps=ulps)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g} (scale {scale:.3g}, {terms} terms)"
    return err / bound if bound else 0.0


def grad_scale(grads: dict) -> float:
    """The whole gradient's norm: the scale its elements are rounded at (each is a sum of terms that large)."""
    return float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())))
