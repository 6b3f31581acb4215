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


class SentOutputs:
    """One step's outputs that go to the next stage: each gets a handle at forward, its values are released
    once its send is known complete, and its backward runs through the handle.

    NCCL's works say when they are done (``poll``); gloo's only once waited for, so there an output is
    released when its gradient arrives (``arrived``: the peer received it, so the send is done), and
    batched P2P, which waits for its sends, releases at once (``released``)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled  # zero bubble's B and W take the output itself: nothing is released
        self.outputs: dict = {}  # key -> (output, handle)
        self.sending: list = []  # (key, tensor, work) of isends not yet known complete, oldest first

    def keep(self, key, output: torch.Tensor) -> None:
        """Hold ``output`` (a stage's forward result) until its send completes."""
        if self.enabled and output.requires_grad:
            self.outputs[key] = (output, handle(output))

    def sent(self, key, tensor: torch.Tensor, work) -> None:
        """``tensor`` (the output, or a copy) is on its way under ``work``."""
        self.sending.append((key, tensor, work))

    def released(self, key) -> None:
        """The send of ``key`` is complete: free the output's values."""
        if key in self.outputs:
            release(self.outputs[key][0])

    def poll(self, wait: bool = False) -> None:
        """Release the outputs whose sends have completed, oldest first (all, waiting, with ``wait``)."""
        while self.sending and (wait or self.sending[0][2].is_completed()):
            key, _, work = self.sending.pop(0)
            work.wait()
            self.released(key)

    def arrived(self, key) -> None:
        """The gradient for ``key`` arrived, so its send is done."""
        for i, (sent_key, _, work) in enumerate(self.sending):
            if sent_key == key:
                del self.sending[i]
                work.wait()
                self.released(key)
                return

    def backward_scalar(self, key, grad: torch.Tensor) -> torch.Tensor | None:
        """The scalar whose backward hands ``grad`` to output ``key`` (None: that output needs no gradient)."""
        if key not in self.outputs:
            return None
        return with_gradient(self.outputs.pop(key)[1], grad)
