"""Under ZeRO-3, megakit's linears save their weight for backward, not a view of it.

``F.linear`` on a 3-D input saves ``weight.t()``: a view of the storage DeepSpeed gathered
for the forward. DeepSpeed then releases the parameter (``param.data = torch.empty(0)``), but
the view keeps the whole gathered weight alive until that layer's backward, and backward
gathers it again: every layer's full weights are held at the activation peak, which ZeRO-3
exists to avoid (gpt-tiny on 2 ranks: 192 KiB, 32 % over the predicted activations).
DeepSpeed's ``zero3_linear_wrap`` saves the parameter itself, which the release does empty,
and gathers it again in backward.

DeepSpeed's ZeRO-3 engine installs it by replacing ``torch.nn.functional.linear`` for the
whole process (``zero.Init``'s ``memory_efficient_linear``, on by default). That reaches calls
that look ``F.linear`` up as they run (the LM head), not megakit's layers, which hold the
function they were built with in ``layer.matmul`` (the swap point ``--fp8`` uses too):
``save_weights_not_views`` sets it there, a float8 matmul left as it is. The replacement
outlives the run: ``linear_restored`` puts torch's back when ``train()`` returns, so a later
run in the same process (a test sweep, a benchmark's variants) computes with torch's own.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear


def save_weights_not_views(module: torch.nn.Module) -> int:
    """Give each plain column/row-parallel linear in ``module`` DeepSpeed's ZeRO-3 linear; how many."""
    from deepspeed.runtime.zero.linear import zero3_linear_wrap

    layers = [
        m for m in module.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.matmul is F.linear
    ]
    for layer in layers:
        layer.matmul = zero3_linear_wrap
    return len(layers)


@contextlib.contextmanager
def linear_restored():
    """``torch.nn.functional.linear`` as it was on entry, again on exit (see the module's docstring)."""
    linear = torch.nn.functional.linear
    try:
        yield
    finally:
        torch.nn.functional.linear = linear
