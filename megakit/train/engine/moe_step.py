"""The trainer's part in the MoE layers: the balancing losses' scale, the expert bias once per step, and metrics.

- Losses. Each MoE block adds ``coeff x aux`` (and the sequence aux and z losses) to the
  objective itself, as the gradient of its output (``megakit.nn.moe.layer``), so pipeline stages
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
- No host waits in the step: each micro-batch's statistics are summed on the device, and the
  table is copied to the host once per step, after its all-reduce (on a GPU every ``float(t)``
  would wait for the device to drain its queue: 4 per MoE layer per micro-batch before).
"""

from __future__ import annotations

import torch

from megakit.nn import comm
from megakit.nn.moe.layer import MoE, set_aux_loss_scale, update_expert_bias

FIELDS = ("max_tokens", "mean_tokens", "dropped", "aux", "seq_aux", "z", "bias_norm")
_SUMMED = slice(2, 6)  # a slice: an index list would be copied to the device
SUMMED = FIELDS[_SUMMED]  # per micro-batch, in ``MoE.stats``: the step's mean over its micro-batches
assert SUMMED == MoE.SUMMED  # the layer sums them itself (``MoE.step_sums``), in this order


def _layer_index(name: str, layers: int) -> int:
    """``layers.3.mlp`` (or ``0.layers.3.mlp`` in a chunk list) -> 3; the MTP module at index k (0-based; depth
    k + 1) ``mtp.k.block.mlp`` -> the model's ``layers`` + k, its block's number in DeepSeek's checkpoints."""
    parts = name.split(".")
    if "mtp" in parts:
        return layers + int(parts[parts.index("mtp") + 1])
    return int(parts[parts.index("layers") + 1])


class MoEStep:
    """The stage's MoE layers (each sums its statistics on the device, ``MoE.step_sums``); ``before_step`` and
    ``after_step`` around each optimizer step."""

    def __init__(self, module: torch.nn.Module, topo, *, layers: int, accumulation: int, mtp: int = 0) -> None:
        """``layers``: the model's blocks; ``mtp``: its MTP modules trained (their blocks' rows follow)."""
        self.module, self.topo, self.layers, self.accumulation = module, topo, layers + mtp, accumulation
        # in module order, as update_expert_bias returns their counts
        self.moe = [(_layer_index(n, layers), m) for n, m in module.named_modules() if isinstance(m, MoE)]
        self.device = next(module.parameters()).device

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
        table = torch.zeros(len(FIELDS), self.layers, dtype=torch.float64, device=self.device)
        for row, (index, layer) in enumerate(self.moe):  # device tensors and host numbers only: nothing waits
            load = counts[row].double()
            table[_SUMMED, index] = layer.step_sums / layer.step_forwards.clamp(min=1)  # not recomputes, nor eval
            table[FIELDS.index("max_tokens"), index] = load.max()
            table[FIELDS.index("mean_tokens"), index] = load.mean()
            bias = getattr(layer.gate, "e_score_correction_bias", None)
            if bias is not None:
                table[FIELDS.index("bias_norm"), index] = bias.norm()
            layer.step_sums.zero_()
            layer.step_forwards.zero_()
        t = self.topo
        holders = t.tp * t.dp * t.cp  # every rank of a stage holds its layers' rows
        rows = (comm.all_reduce(table, comm.WORLD) / holders).tolist()  # the step's one copy to the host
        mean = rows[FIELDS.index("mean_tokens")]
        return {i: {f: rows[k][i] for k, f in enumerate(FIELDS)} for i in range(self.layers) if mean[i] > 0}
