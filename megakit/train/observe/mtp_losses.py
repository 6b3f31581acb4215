"""Each MTP depth's loss over a step, for the log (``megakit.nn.mtp``): what Megatron prints as ``mtp_1 loss``.

The training loss is the objective ``L_main + lambda / D x sum(L_k)``; a user watching the modules learn needs each
``L_k`` itself. Every micro-batch's ``L_k`` is already divided by its share of the step's count of depth-k targets
(``megakit.train.data.token_weighting``), so the step's ``L_k`` is their mean over the micro-batches and the DP
replicas. The last stage's ranks hold it; one all-reduce of D numbers over the job (as the MoE metrics do) brings it
to every rank.
"""

from __future__ import annotations

import torch

from megakit.nn import comm
from megakit.nn.model import Transformer


class MTPLosses:
    """Forward hooks on the stage's loss-computing ``Transformer``; ``after_step()`` -> each depth's step loss."""

    def __init__(self, module: torch.nn.Module, topo, depths: int) -> None:
        self.topo, self.depths = topo, depths
        self.device = next(module.parameters()).device
        self.sums, self.forwards = torch.zeros(depths, dtype=torch.float64, device=self.device), 0  # no host sync
        for m in module.modules():
            if isinstance(m, Transformer) and m.post and len(m.mtp):
                m.register_forward_hook(self._record)

    def _record(self, model, inputs, output) -> None:
        if model.training and model.mtp_losses:
            self.sums += torch.stack(model.mtp_losses).double()
            self.forwards += 1
            model.mtp_losses = []

    def after_step(self) -> list[float]:
        """The step's ``L_k``, k = 1..D, the same on every rank."""
        holds = self.forwards > 0  # the last stage's ranks: TP x CP copies of each DP replica's values
        flag = torch.tensor([float(holds)], dtype=torch.float64, device=self.device)
        total = comm.all_reduce(torch.cat([self.sums / max(self.forwards, 1), flag]), comm.WORLD).cpu()
        self.sums.zero_()
        self.forwards = 0
        return (total[:-1] / total[-1].clamp(min=1)).tolist()
