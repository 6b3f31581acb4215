"""Zero bubble's split backward: a stage's input gradient now (B), its weight gradients later (W).

B is ``torch.distributed.pipelining``'s ``stage_backward_input``: autograd from the stage
output to the stage input only (``retain_graph``), recording the gradient that arrives
where each group of weights branches off the input path. W resumes from those branch
points, so it repeats none of B's work. torch's own ``stage_backward_weight`` writes
``.grad`` by hand, which skips the hooks that run when a gradient accumulates
(DeepSpeed's ZeRO gathers gradients in them); megakit's W instead runs
``torch.autograd.backward`` from the branch points *into* the weights, so those hooks fire
as in a plain backward. On the first stage the input is token ids, with no gradient:
as torch does, B does nothing and W is the whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.autograd.graph import GradientEdge
from torch.distributed.pipelining._backward import (
    _get_grad_fn_or_grad_acc,
    stage_backward_input,
)


@dataclass(kw_only=True)
class Deferred:
    """What a micro-batch's W needs after its B: the graph's weight branches, or the whole backward."""

    output: torch.Tensor
    grad: torch.Tensor | None
    param_groups: list | None  # None: B did nothing (no input gradient), W runs the whole backward


def backward_input(
    chunk: nn.Module,
    x: torch.Tensor,
    output: torch.Tensor,
    grad: torch.Tensor | None,
) -> tuple[torch.Tensor | None, Deferred]:
    """B: the gradient of ``x`` (None when ``x`` needs none); ``output`` is the scaled loss when ``grad`` is None."""
    if not x.requires_grad:
        return None, Deferred(output=output, grad=grad, param_groups=None)
    grads, groups = stage_backward_input([output], None if grad is None else [grad], [x], chunk.parameters())
    return grads[0], Deferred(output=output, grad=grad, param_groups=groups)


def backward_weight(chunk: nn.Module, deferred: Deferred) -> None:
    """W: accumulate into ``.grad`` the weight gradients of the micro-batch whose B made ``deferred``."""
    if deferred.param_groups is None:
        torch.autograd.backward(deferred.output, deferred.grad)
        return
    weights = {_get_grad_fn_or_grad_acc(p): p for p in chunk.parameters() if p.requires_grad}
    for group in deferred.param_groups:
        edges, grads, hooks = [], [], []
        for saved, node in zip(group["grads"], group["intermediates"]):
            edges += [GradientEdge(node, i) for i, g in enumerate(saved) if g is not None]
            grads += [g for g in saved if g is not None]
            if len(group["intermediates"]) > 1:  # as torch: a branch point below another gets its saved grad only
                hooks.append(node.register_prehook(lambda _, saved=saved: saved))
        try:
            if edges:
                torch.autograd.backward(edges, grads, inputs=[weights[acc] for acc in group["params"]])
        finally:
            for hook in hooks:
                hook.remove()
