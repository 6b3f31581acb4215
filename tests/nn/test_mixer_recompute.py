"""Selective recompute of the linear-attention mixers' cores (Gated DeltaNet's conv and chunked delta rule, Mamba-2's
conv and SSD scan), as Megatron-Core's selective recompute checkpoints a core: the same loss and gradients as no
recompute over packed documents and several chunks (one process), fewer saved bytes, and what the planner keeps."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from activations import saved_bytes

from megakit.core.planner.activations import MIXER_CORES
from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.nn.model import ModelConfig, Transformer, full_state_dict

S, B = 48, 2


def _config(name: str) -> ModelConfig:
    config = ModelConfig.load(name)
    if config.linear is not None:  # chunks of 16: three over the sequence, a document boundary inside one
        config = config.replace(linear=dataclasses.replace(config.linear, chunk=16))
    return config


def _loss_and_grads(config: ModelConfig, recompute: str):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, config.vocab_size, (B, S), generator=gen)
    labels = torch.randint(0, config.vocab_size, (B, S), generator=gen)
    documents = torch.tensor([[0] * 20 + [1] * 28, [0] * 7 + [1] * 30 + [2] * 11])
    model = Transformer(config, seed=4, recompute=recompute).train()
    loss = model(ids, labels, sample_ids=[0, 1], documents=documents)
    loss.backward()
    return loss.detach(), full_state_dict(model, None, grads=True)


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "nemotron-h-tiny"])
def test_selective_recompute_of_the_mixers_equals_none_and_keeps_less(name):
    config = _config(name)
    want_loss, want = _loss_and_grads(config, "none")
    loss, grads = _loss_and_grads(config, "selective")
    assert torch.equal(loss, want_loss)
    assert grads.keys() == want.keys()
    for key in want:
        assert torch.allclose(grads[key], want[key], rtol=0, atol=1e-7), key
    mixer = {}
    for recompute in ("none", "selective"):
        torch.manual_seed(0)
        block = Transformer(config, layers=range(0, 1), pre=False, post=False, recompute=recompute).train()
        mixer[recompute] = block.layers["0"].attn if config.linear else block.layers["0"].mixer
        x = torch.randn(S, B, config.hidden, requires_grad=True)
        mixer[recompute] = saved_bytes(mixer[recompute], x, skip_input=True)
    assert mixer["selective"] < 0.3 * mixer["none"], mixer
    if config.linear is not None:  # the planner's kept part of the mixer element for element (fp32), and the rest
        linear = config.linear
        assert mixer["selective"] == linear.kept_elements_per_token() * 4 * S * B
        whole = linear.activation_elements_per_token() + linear.state_elements() / linear.chunk
        assert mixer["none"] == pytest.approx(whole * 4 * S * B, rel=0.05)
    else:  # the planner's Mamba-2 tensors past the block's norm and in_proj input, less the core's (the torch scan
        from megakit.core.planner import mamba  # keeps ~10 % more than they count without recompute)

        spec = ModelSpec.from_config(name)
        kept = [x for x in mamba.tensors(spec, tp=1, sequence_parallel=False, precision="fp32")[4:]]
        predicted = sum(x.bytes(seq_len=S, micro_batch=B) for x in kept if x.name not in MIXER_CORES)
        assert mixer["selective"] == pytest.approx(predicted, rel=0.05)
        assert mixer["none"] == pytest.approx(sum(x.bytes(seq_len=S, micro_batch=B) for x in kept), rel=0.12)


@pytest.mark.parametrize("name", ["qwen3-next-tiny", "nemotron-h-tiny"])
def test_the_planner_drops_the_mixer_cores_under_selective_recompute(name):
    """With flash attention selective recompute frees of attention only its log-sum-exp: the rest of what it frees of
    a hybrid's mean block is its mixers' cores, which the planner then keeps no longer."""
    spec = ModelSpec.from_config(name)
    kw = dict(precision="fp32", micro_batch=B, seq_len=S, flash_attention=True)
    none, selective = (estimate_memory(spec, recompute=r, **kw).activation_per_layer for r in ("none", "selective"))
    from megakit.core.planner.activations import activation_tensors

    cores = sum(
        x.bytes(seq_len=S, micro_batch=B)
        for x in activation_tensors(spec, precision="fp32", moe=spec.moe is not None)
        if x.name in (*MIXER_CORES, "attention log-sum-exp")
    )
    assert cores > 0 and none - selective == pytest.approx(cores, rel=1e-9)
