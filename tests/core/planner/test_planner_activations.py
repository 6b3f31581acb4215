"""The activation model, tensor by tensor, against what megakit's own model saves for backward
(CPU, fp32, counted with torch.autograd.graph.saved_tensors_hooks, each storage once)."""

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from activations import block_saved_bytes, saved_bytes  # noqa: E402

from megakit.core.planner.memory import (  # noqa: E402
    activation_tensors,
    estimate_memory,
    logits_bytes,
)
from megakit.core.planner.model_spec import ModelSpec  # noqa: E402
from megakit.nn.model import ModelConfig, Transformer  # noqa: E402

S, B = 64, 2


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
    full = estimate_memory(
        spec,
        precision="fp32",
        micro_batch=B,
        seq_len=S,
        recompute="full",
        flash_attention=dropout == 0,
        dropout_mask_bytes=1,
    )
    assert full.activation_per_layer == pytest.approx(saved_bytes(recomputed, x))


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_whole_model_activations_and_head(name):
    config = ModelConfig.load(name)
    spec = ModelSpec.from_config(name)
    model = Transformer(config).train()
    ids = torch.randint(0, config.vocab_size, (B, S))
    measured = saved_bytes(model, ids, labels=ids)
    est = estimate_memory(spec, precision="fp32", micro_batch=B, seq_len=S, flash_attention=True, dropout_mask_bytes=1)
    saved_head = logits_bytes(
        spec, tp=1, sequence_parallel=False, precision="fp32", seq_len=S, micro_batch=B, transient=False
    )
    assert est.items["activations"] + saved_head == pytest.approx(measured, rel=0.03)


def _mla(q_lora_rank: int = 24):
    """deepseek-v3-tiny's attention (hidden 64, 4 heads, kv_lora_rank 16, nope 16, rope 8, v 16) on a dense MLP: the
    model and the planner's spec of it."""
    base = ModelConfig.load("deepseek-v3-tiny")
    config = base.replace(moe=None, mla=dataclasses.replace(base.mla, q_lora_rank=q_lora_rank))
    return config, ModelSpec(config=config, name="deepseek-v3-tiny", seq_len=S)


def _predicted(spec, **kw):
    return sum(t.bytes(seq_len=S, micro_batch=B) for t in activation_tensors(spec, precision="fp32", **kw))


@pytest.mark.parametrize("q_lora_rank", [24, 0])
def test_an_mla_block_saves_what_the_planner_predicts(q_lora_rank):
    """On CPU MLA's core is SDPA's math path (torch's CPU flash kernel needs q, k and v of one head width), which
    keeps the s x s probabilities: ``flash_attention=False``. Selective recompute keeps the latents, q, k, v and
    ``o_proj``'s input (v its own tensor: a view would keep ``kv_b_proj``'s whole output) as the planner's
    selective count says; counted as plain attention (v and the output at the key width, no latents) it differs."""
    config, spec = _mla(q_lora_rank)
    kept = block_saved_bytes(config, torch.randn(S, B, config.hidden, requires_grad=True))
    assert kept["none"] == _predicted(spec, flash_attention=False)
    selective = estimate_memory(spec, precision="fp32", micro_batch=B, seq_len=S, recompute="selective")
    assert kept["selective"] == selective.activation_per_layer
    plain = ModelSpec(config=config.replace(mla=None), name="plain", seq_len=S)
    assert kept["none"] != _predicted(plain, flash_attention=False)


def _mla_under_tp_and_cp(rank: int, world: int) -> list:
    """(case, bytes saved by one MLA block on this rank, the planner's) at TP 2 with and without SP (and without a
    query latent), and at CP 2 on the ring."""
    from megakit.core.layout import Layout
    from megakit.nn.topology import Topology

    out = []
    tp2, cp2 = Topology(Layout(tp=2)), Topology(Layout(cp=2))
    for q_lora_rank in (24, 0):
        config, spec = _mla(q_lora_rank)
        for sp in (False, True):
            block = Transformer(
                config, tp2, layers=range(0, 1), pre=False, post=False, seed=1, sequence_parallel=sp
            ).train()
            x = torch.randn(S // 2 if sp else S, B, config.hidden, requires_grad=True)
            out.append(
                (
                    f"q_lora_rank {q_lora_rank} tp 2 sp {sp}",
                    saved_bytes(block, x),
                    _predicted(spec, tp=2, sequence_parallel=sp, flash_attention=False),
                )
            )
    config, spec = _mla()
    block = Transformer(config, cp2, layers=range(0, 1), pre=False, post=False, seed=1).train()
    measured = saved_bytes(block, torch.randn(S // 2, B, config.hidden, requires_grad=True))
    rope = 2 * S // 2 * config.mla.qk_rope_head_dim * 4  # cos, sin at the rank's positions: once a model, all blocks
    held = sum(t.bytes(seq_len=S // 2, micro_batch=B) for t in activation_tensors(spec, precision="fp32", ring=True))
    out.append(("cp 2 ring", measured - rope, held))
    return out


def test_mla_blocks_under_tp_sp_and_ring_cp_save_what_the_planner_predicts():
    """The replicated latent path is whole on every TP rank without SP and split with it, except the up-projections'
    inputs (gathered, kept whole); the ring keeps v and its output at the value width and ``o_proj`` keeps a copy."""
    from multiproc import run_ranks

    for case, measured, predicted in run_ranks(_mla_under_tp_and_cp, 2)[0]:
        assert measured == predicted, case
