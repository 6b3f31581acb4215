"""Bytes saved for backward by one transformer block, measured with saved-tensor hooks (shared by the planner's
activation tests and the recompute tests)."""

import torch

from megakit.nn.model import Transformer


def saved_bytes(model, x, labels=None, skip_input=False):
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    if skip_input:
        skip.add(x.untyped_storage().data_ptr())
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen.setdefault(ptr, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, labels)
    return sum(seen.values())


def block_saved_bytes(config, x, modes=("none", "selective")) -> dict[str, int]:
    """What one training block of ``config`` keeps for backward from input ``x``, per recompute mode (same weights)."""
    kept = {}
    for recompute in modes:
        torch.manual_seed(0)
        block = Transformer(config, layers=range(0, 1), pre=False, post=False, recompute=recompute).train()
        kept[recompute] = saved_bytes(block, x)
    return kept
