"""The activation model, tensor by tensor, against what megakit's own model saves for backward
(CPU, fp32, counted with torch.autograd.graph.saved_tensors_hooks, each storage once)."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from megakit.core.planner.memory import (  # noqa: E402
    activation_tensors,
    estimate_memory,
    logits_bytes,
)
from megakit.core.planner.model_spec import ModelSpec  # noqa: E402
from megakit.nn.model import ModelConfig, Transformer  # noqa: E402

S, B = 64, 2


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


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_one_block_saves_what_the_model_predicts(name, dropout):
    torch.manual_seed(0)
    config = dataclasses.replace(ModelConfig.load(name), dropout=dropout)
    spec = dataclasses.replace(ModelSpec.from_config(name), dropout=dropout)
    x = torch.randn(S, B, config.hidden, requires_grad=True)
    # Attention is PyTorch's fused (flash) kernel unless dropout needs megakit's written-out path,
    # and megakit's dropout keeps a one-byte (bool) mask on every device.
    tensors = activation_tensors(spec, precision="fp32", flash_attention=dropout == 0, dropout_mask_bytes=1)
    predicted = sum(t.bytes(seq_len=S, micro_batch=B) for t in tensors)
    block = Transformer(config, layers=range(0, 1), pre=False, post=False).train()
    measured = saved_bytes(block, x)  # the block input is saved by the first norm: counted
    assert predicted == pytest.approx(measured, rel=0.02)
    # Full recompute keeps only each block's input.
    recomputed = Transformer(config, layers=range(0, 1), pre=False, post=False, recompute=True).train()
    full = estimate_memory(spec, precision="fp32", micro_batch=B, seq_len=S, recompute="full",
                           flash_attention=dropout == 0, dropout_mask_bytes=1)
    assert full.activation_per_layer == pytest.approx(saved_bytes(recomputed, x))


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_whole_model_activations_and_head(name):
    config = ModelConfig.load(name)
    spec = ModelSpec.from_config(name)
    model = Transformer(config).train()
    ids = torch.randint(0, config.vocab_size, (B, S))
    measured = saved_bytes(model, ids, labels=ids)
    est = estimate_memory(spec, precision="fp32", micro_batch=B, seq_len=S, flash_attention=True,
                          dropout_mask_bytes=1)
    saved_head = logits_bytes(spec, tp=1, sequence_parallel=False, precision="fp32", seq_len=S, micro_batch=B,
                              transient=False)
    assert est.items["activations"] + saved_head == pytest.approx(measured, rel=0.03)
