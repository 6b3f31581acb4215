"""A stage output's values freed once sent, its backward kept (Megatron-LM's ``deallocate_output_tensor``).

The next stage keeps its own copy of what a stage sends, and the sending stage's backward needs the
output's autograd node, its shape and the gradient that comes back, never the output's values. So
once the send has completed, ``release`` frees the output's storage: one (S', B, H) tensor per
micro-batch in flight on every stage but the last, as in Korthikanti et al.'s count (none kept).

The backward then enters the graph through a ``handle`` made at forward time: a scalar whose
gradient, in backward, is the one received (times the scalar's own, so DeepSpeed's loss scale
applies). ``engine.backward`` takes it as it takes a loss; ``(output * grad).sum()`` would need
the values back.
"""

from __future__ import annotations

import torch


class _Handle(torch.autograd.Function):
    """Forward: a zero scalar. Backward: the gradient set on the node (``incoming``) times the scalar's."""

    @staticmethod
    def forward(ctx, output: torch.Tensor) -> torch.Tensor:
        ctx.incoming = None
        return output.new_zeros(())

    @staticmethod
    def backward(ctx, scale: torch.Tensor) -> torch.Tensor:
        incoming, ctx.incoming = ctx.incoming, None
        if incoming is None:
            raise RuntimeError("a stage output's backward ran before its gradient arrived (sent_output.with_gradient)")
        return incoming * scale


def handle(output: torch.Tensor) -> torch.Tensor:
    """A scalar through which ``output``'s backward runs once its gradient is known (``with_gradient``)."""
    return _Handle.apply(output)


def with_gradient(handle_: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``handle_``, whose backward now hands ``grad`` to the output it was made from."""
    handle_.grad_fn.incoming = grad  # a custom Function's node is its ctx
    return handle_


def release(output: torch.Tensor) -> None:
    """Free ``output``'s values; autograd keeps its node and shape (what the backward needs)."""
    output.data = torch.empty(0, dtype=output.dtype, device=output.device)
