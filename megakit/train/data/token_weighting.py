"""The step's loss weighted by tokens: ``sum(loss x mask) / sum(mask)`` over the whole global batch.

DeepSpeed averages twice: each micro-batch's loss by ``1 / GA`` (``engine.backward`` scales it), and the
gradients over the DP x CP ranks. A mean of per-micro-batch means is the mean over the step's tokens only
while every micro-batch counts as many of them; with loss masks, padding or masked end-of-document tokens
it is not, the gradient-accumulation bug that transformers (#34191), torchtune (#1875) and Megatron
(``calculate_per_token_loss``) users met. So, as torchtitan does, each micro-batch divides its summed
loss by ``N / (GA x DP)``, ``N`` being the step's valid tokens over every DP replica: DeepSpeed's two
averages then leave ``sum / N`` exactly, for the gradient and for the logged loss, at any layout. A
micro-batch with no valid token adds 0, never NaN. ``N`` costs one all-reduce of one number per step over
the DP x CP group (every CP rank counts its replica's whole sequence, so that sum is ``CP x N``); every
pipeline stage counts the same labels, so each stage's group finds the same ``N``. The MoE balancing losses
keep their own per-micro-batch scale (``moe_step``). A stage training MTP modules counts each depth's targets
too (``megakit.nn.mtp.depth_token_counts``: fewer, the window's tail and document ends masked), in the same
all-reduce, so each ``L_k`` is its own sum over its own count.
"""

from __future__ import annotations

import torch

from megakit.nn import comm
from megakit.nn.model import mtp_depth, set_loss_tokens
from megakit.nn.mtp import depth_token_counts


def step_tokens(micro_batches, topo, device=None, *, depths: int = 0) -> torch.Tensor:
    """The valid (``!= -100``) labels of the step over every DP replica, ``(1 + depths,)``: the main loss's, then each
    MTP depth's. One all-reduce over DP x CP."""
    count = sum(
        depth_token_counts(labels, depths, extras.get("documents")) for _, labels, _, extras in micro_batches
    ).to(device, torch.float64)  # no host sync
    if topo.dp * topo.cp > 1:
        comm.all_reduce(count, topo.get_data_parallel_group())
    return count / topo.cp


def weight_by_tokens(module, micro_batches, topo, device=None) -> None:
    """Before a step: every micro-batch's summed loss is divided by the step's ``N / (GA x DP)``."""
    counts = step_tokens(micro_batches, topo, device, depths=mtp_depth(module)).clamp(min=1)  # none: 0, not NaN
    set_loss_tokens(module, (counts / (len(micro_batches) * topo.dp)).float())
