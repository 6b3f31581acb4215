"""Zero bubble's split backward: a stage's input gradient now (B), its weight gradients later (W).

torch's ``torch.distributed.pipelining`` does the split, and megakit uses its two helpers
rather than copying them: ``stage_backward_input`` runs autograd from the stage's output
to its input only (``retain_graph``) and records the gradient arriving where each
weight's branch leaves the input path; ``stage_backward_weight`` later resumes from
there to the weights, so W repeats none of B's work, and accumulates into ``.grad``
(hooks on the weights, e.g. DeepSpeed's, fire as in a plain backward). On the first
stage the input is token ids, with no gradient: as torch does, B does nothing and W
is the whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.pipelining._backward import (
    stage_backward_input,
    stage_backward_weight,
)


@dataclass(kw_only=True)
class Deferred:
    """What a micro-batch's W needs after its B: the graph's weight branches, or the whole backward."""

    output: torch.Tensor
    grad: torch.Tensor | None
    param_groups: list | None  # None: B did nothing (no input gradient), W runs the whole backward


def backward_input(chunk: nn.Module, x: torch.Tensor, output: torch.Tensor, grad: torch.Tensor | None,
                   ) -> tuple[torch.Tensor | None, Deferred]:
    """B: the gradient of ``x`` (None when ``x`` needs none); ``output`` is the scaled loss when ``grad`` is None."""
    if not x.requires_grad:
        return None, Deferred(output=output, grad=grad, param_groups=None)
    grads, groups = stage_backward_input([output], None if grad is None else [grad], [x], chunk.parameters())
    return grads[0], Deferred(output=output, grad=grad, param_groups=groups)


def backward_weight(chunk: nn.Module, deferred: Deferred) -> None:
    """W: accumulate the weight gradients of the micro-batch whose B made ``deferred``."""
    if deferred.param_groups is None:
        torch.autograd.backward(deferred.output, deferred.grad)
        return
    stage_backward_weight(chunk.parameters(), deferred.param_groups)

