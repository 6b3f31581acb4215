"""The trainer's part in the MoE layers: the balancing losses' scale, the expert bias once per step, and metrics.

- Losses. Each MoE block adds ``coeff x aux`` (and the sequence aux and z losses) to the
  objective itself, as the gradient of its output (``megakit.nn.moe``), so pipeline stages
  need not send it on. The trainer tells it what the language-model loss is multiplied by
  before backward: ``1 / gradient_accumulation_steps`` (DeepSpeed's scaling; DP x CP
  averaging follows in DeepSpeed's reduction, as for the dense gradient), times the fp16 loss
  scale. Each loss is a mean over one micro-batch of one DP replica, so its gradient does not
  depend on TP, CP, EP, PP or the accumulation.
- Aux-loss-free bias (``--moe-expert-bias``): after the optimizer step, once per applied step (a step
  the NaN guard skips leaves it as it was, like every other state), from the
  step's token counts summed over every micro-batch and rank (``nn.moe.update_expert_bias``):
  not per micro-batch (torchtitan #1324), not recounted by recompute (#1593).
- Metrics, per MoE layer of the whole model: tokens per expert (max and mean over the
  experts, of the step's global batch), the dropped fraction, the aux, sequence-aux and z
  losses (means over the step's micro-batches and DP replicas) and the expert-bias norm.
  Every rank fills the rows of its stage's layers and one all-reduce over the job (through
  ``megakit.nn.comm``) brings all of them to rank 0. The step line shows one figure, the
  worst layer's max/mean load.
"""

from __future__ import annotations

import torch

from megakit.nn import comm
from megakit.nn.moe import MoE, _in_backward, set_aux_loss_scale, update_expert_bias

FIELDS = ("max_tokens", "mean_tokens", "dropped", "aux", "seq_aux", "z", "bias_norm")


def _layer_index(name: str, layers: int) -> int:
    """``layers.3.mlp`` (or ``0.layers.3.mlp`` in a chunk list) -> 3; the MTP module at index k (0-based; depth
    k + 1) ``mtp.k.block.mlp`` -> the model's ``layers`` + k, its block's number in DeepSeek's checkpoints."""
    parts = name.split(".")
    if "mtp" in parts:
        return layers + int(parts[parts.index("mtp") + 1])
    return int(parts[parts.index("layers") + 1])


class MoEStep:
    """Hooks on the stage's MoE layers; ``before_step`` and ``after_step`` around each optimizer step."""

    def __init__(self, module: torch.nn.Module, topo, *, layers: int, accumulation: int, mtp: int = 0) -> None:
        """``layers``: the model's blocks; ``mtp``: its MTP modules trained (their blocks' rows follow)."""
        self.module, self.topo, self.layers, self.accumulation = module, topo, layers + mtp, accumulation
        # in module order, as update_expert_bias returns their counts
        self.moe = [(_layer_index(n, layers), m) for n, m in module.named_modules() if isinstance(m, MoE)]
        self.sums = torch.zeros(len(FIELDS), self.layers, dtype=torch.float64)
        self.forwards = torch.zeros(self.layers, dtype=torch.float64)
        self.device = next(module.parameters()).device
        for index, layer in self.moe:
            layer.register_forward_hook(self._hook(index))

    def _hook(self, index: int):
        def record(layer, inputs, output) -> None:
            if not layer.training or _in_backward():  # eval, or recompute in backward
                return
            s = layer.stats
            for field in ("dropped", "aux", "seq_aux", "z"):
                self.sums[FIELDS.index(field), index] += float(s[field])
            self.forwards[index] += 1
        return record

    def before_step(self, engine) -> None:
        """The balancing losses' gradient scale: what DeepSpeed multiplies the loss by."""
        scale = 1.0 / self.accumulation
        if engine.fp16_enabled():
            scale *= float(getattr(engine.optimizer, "loss_scale", getattr(engine.optimizer, "cur_scale", 1.0)))
        set_aux_loss_scale(self.module, scale)

    def after_step(self, *, applied: bool) -> dict[int, dict[str, float]]:
        """After the step guard's verdict: move the expert bias if the step was ``applied`` (a skipped step
        changes no state); the step's metrics per MoE layer (every rank)."""
        counts = update_expert_bias(self.module, self.topo, move=applied)  # summed over DP x CP and TP
        table = torch.zeros(len(FIELDS), self.layers, dtype=torch.float64)
        for row, (index, layer) in enumerate(self.moe):
            load = counts[row].double()
            n = max(float(self.forwards[index]), 1.0)
            table[:, index] = self.sums[:, index] / n
            table[FIELDS.index("max_tokens"), index] = load.max()
            table[FIELDS.index("mean_tokens"), index] = load.mean()
            bias = getattr(layer.gate, "e_score_correction_bias", None)
            table[FIELDS.index("bias_norm"), index] = 0.0 if bias is None else float(bias.norm())
        self.sums.zero_()
        self.forwards.zero_()
        t = self.topo
        holders = t.tp * t.dp * t.cp  # every rank of a stage holds its layers' rows
        table = comm.all_reduce(table.to(self.device), comm.WORLD).cpu() / holders
        moe_layers = [i for i in range(self.layers) if table[FIELDS.index("mean_tokens"), i] > 0]
        return {i: {f: float(table[k, i]) for k, f in enumerate(FIELDS)} for i in moe_layers}
