"""The single-process gradient norm of a TP x PP model, and megakit's clipper for fp32 ZeRO-0.

TP shards count once each, replicated parameters once per stage (on TP rank 0), and the
tied embedding copy on the last stage (``ds_pipe_replicated``) not at all. Routed experts
(``megakit.train.engine.experts``) are split over the EP group, which is folded over TP x CP x DP: one
sum over the EP group counts each of the stage's experts once, and it joins the rest on TP rank
0. DeepSpeed's
fp32 ZeRO-0 path ignores that mark and does not report the norm, so there megakit clips
itself with the same rule.
"""

from __future__ import annotations

import math

import torch

from megakit.nn import comm
from megakit.train.engine.experts import is_expert


def counted_in_norm(param, topo) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm (each element counted once in the job)."""
    if getattr(param, "ds_pipe_replicated", False):
        return False
    return bool(getattr(param, "tensor_model_parallel", False)) or topo.tp_rank == 0


def global_grad_norm(params, topo) -> tuple[float, bool]:
    """``(norm, this rank's gradients finite)``: the single-process gradient norm of the whole model.

    Collective: a scalar all-reduce (sum of squares) over the model-parallel (TP x PP) group, and with EP > 1
    first one of the experts' over the EP group.
    """
    params = [p for p in params if p.grad is not None]
    device = params[0].grad.device if params else None
    local = torch.zeros((), dtype=torch.float64, device=device)
    experts = torch.zeros((), dtype=torch.float64, device=device)
    finite = True
    for p in params:
        finite &= bool(torch.isfinite(p.grad).all())
        if is_expert(p):
            experts.add_(p.grad.detach().double().pow(2).sum())
        elif counted_in_norm(p, topo):
            local.add_(p.grad.detach().double().pow(2).sum())
    if getattr(topo, "ep", 1) > 1:  # each EP rank holds other experts (reduced over EDP: the same there)
        comm.all_reduce(experts, topo.ep_group)
    if topo.tp_rank == 0:  # the EP group's sum is the same on each of its TP ranks: counted once
        local += experts
    if topo.tp * topo.pp > 1:
        comm.all_reduce(local, topo.mp_group)
    return float(local.sqrt()), finite


class Zero0Clipper:
    """Clips fp32 ZeRO-0 gradients by the global norm, as an optimizer pre-step hook (after DP reduction).

    A non-finite norm on any rank (one all-reduced flag: with --local-sgd the DP ranks' gradients
    differ) clears every gradient instead, so the optimizer skips the step, as DeepSpeed's own
    optimizers do (``megakit.train.resilience.guards``).
    """

    def __init__(self, params, topo, max_norm: float) -> None:
        self.params, self.topo, self.max_norm = list(params), topo, max_norm
        self.norm, self.finite, self.applied = float("nan"), True, True

    def __call__(self, optimizer, args, kwargs) -> None:
        """The pre-step hook: clips by the global norm, or clears the gradients so the step is skipped."""
        self.norm, self.finite = global_grad_norm(self.params, self.topo)
        self.applied = _everywhere(self.finite and math.isfinite(self.norm), self.params)
        if not self.applied:
            for p in self.params:
                p.grad = None  # torch's optimizers leave a parameter without a gradient as it is
            return
        if self.max_norm > 0 and math.isfinite(self.norm):
            coef = self.max_norm / (self.norm + 1e-6)
            if coef < 1.0:
                for p in self.params:
                    if p.grad is not None:
                        p.grad.mul_(coef)


def _everywhere(flag: bool, params) -> bool:
    """Whether ``flag`` holds on every rank (a one-element all-reduce over the world)."""
    device = next((p.grad.device for p in params if p.grad is not None), None)
    bad = torch.tensor([0.0 if flag else 1.0], device=device)
    comm.all_reduce(bad, comm.WORLD)
    return not bool(bad.item())
