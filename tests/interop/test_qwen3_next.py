"""Qwen3-Next and Qwen3.5 (hybrid Gated DeltaNet) against transformers' own models, and their parallel layouts.

A tiny Qwen3-Next (``layer_types`` linear, full, linear, full; experts with a gated shared expert and one dense block;
GQA full attention with the output gate, partial rotary and (1 + w) norms) and a dense Qwen3.5 text model, their weights
drawn so that each piece acts (norm weights, decays, conv taps and biases away from their initial values), at 150 tokens
(the mixer's chunks of 64 and a padded one): logits within 1e-5 in fp32. A control with RoPE on whole heads must move
the logits far past that. The weights go through megakit's import and export unchanged.

One 4-process launcher job (``tests/helpers/launch_sweep.py``) trains ``models/qwen3-next-tiny.json`` on packed
documents (``--reset-attention-mask``) at TP 2 x CP 2 with SP under ZeRO 2, PP 2 x VPP 2 x DP 2 under ZeRO 1, and EP 2
over TP 2 x DP 2 with SP under ZeRO 3: every loss, and the first step's gradient norm, follow the single-process
model's.
"""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from corpora import _short_documents
from jobs import ds_config, sweep
from tolerance import fp32_bound

transformers = pytest.importorskip("transformers")

from hf_reference import eager, megakit_copy  # noqa: E402

from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.errors import UsageError  # noqa: E402
from megakit.interop.hf import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from megakit.train.run import TrainConfig, resolve  # noqa: E402

TOL = 1e-5
TYPES = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
FIELDS = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    layer_types=TYPES,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)
MOE = dict(
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    shared_expert_intermediate_size=24,
    mlp_only_layers=[2],
    norm_topk_prob=True,
)


@torch.no_grad()
def _draw(model):
    """Every piece acting: norms N(0, 0.3) around their (1 + w) or N(1, 0.3), decays and conv taps moved, sharp
    attention (at transformers' 0.02 a rotation hides in rounding)."""
    for name, p in model.named_parameters():
        if name.endswith("linear_attn.norm.weight"):
            p.normal_(1.0, 0.3)
        elif "norm" in name:
            p.normal_(0.0, 0.3)
        elif name.endswith(("dt_bias", "A_log")):
            p.normal_(0.0, 0.5)
        elif name.endswith("conv1d.weight"):
            p.normal_(0.0, 0.5)
        elif name.endswith(("q_proj.weight", "k_proj.weight", "in_proj_qkvz.weight", "in_proj_qkv.weight")):
            p.normal_(0.0, 0.2)
        elif p.dim() > 1:
            p.normal_(0.0, 0.1)
    return model


def _models(kind: str):
    if kind == "qwen3_next":
        hf = eager(transformers.Qwen3NextForCausalLM, transformers.Qwen3NextConfig(**FIELDS, **MOE))
    elif kind == "qwen3_5_moe_text":  # experts in every block, no dense MLP
        moe = {k: v for k, v in MOE.items() if k not in ("mlp_only_layers", "norm_topk_prob")}
        fields = {k: v for k, v in FIELDS.items() if k != "intermediate_size"}
        hf = eager(transformers.Qwen3_5MoeForCausalLM, transformers.Qwen3_5MoeTextConfig(**fields, **moe))
    else:
        hf = eager(transformers.Qwen3_5ForCausalLM, transformers.Qwen3_5TextConfig(**FIELDS))
    _draw(hf)
    return hf, ModelConfig.from_hf(hf.config.to_dict(), source=kind)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"])
@torch.no_grad()
def test_logits_match_transformers_and_the_weights_round_trip(kind):
    hf, config = _models(kind)
    assert config.linear.layer_types == tuple(TYPES) and config.rotary_fraction == 0.25
    assert (config.moe is not None) == (kind != "qwen3_5_text")
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    diff = (megakit_copy(config, hf)(ids) - want).abs().max().item()
    gap = (megakit_copy(replace(config, rotary_fraction=1.0), hf)(ids) - want).abs().max().item()
    print(f"{kind}: max |logit diff| {diff:.2e}; RoPE on whole heads: {gap:.2e}")
    assert diff < TOL
    assert gap > 1e-2, gap
    ours = from_hf_state_dict(config, hf.state_dict())
    back = from_hf_state_dict(config, to_hf_state_dict(config, ours))
    assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    assert ModelConfig.from_hf(config.to_hf(), source=kind) == config


def test_presets_and_bad_input_are_one_line(tmp_path):
    big = ModelConfig.load("qwen3-next-80b-a3b")
    assert big.linear.layer_types.count("full_attention") == 12 and big.moe.experts == 512
    with pytest.raises(UsageError, match="layer type 'mamba' is not one megakit builds"):
        ModelConfig.from_hf({**transformers.Qwen3NextConfig(**FIELDS).to_dict(), "layer_types": TYPES[:3] + ["mamba"]})
    tiny = ModelConfig.load("qwen3-next-tiny")
    assert "linear attention key heads 4" in " ".join(tiny.tp_conflicts(8))
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(UsageError, match=re.escape("key heads 4 are not divisible by TP x CP = 2 x 4")):
        resolve(TrainConfig(ds_config=ds, data=str(data), model="qwen3-next-tiny", tp=2, cp=4, seq_len=32), 8)


# -- one launcher job: TP x CP with SP, PP x VPP, ZeRO 3 and EP on packed documents, against one process --------
SEQ, STEPS = 32, 2
DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True)
LAYOUTS = {
    "tp2-cp2-sp-zero2": dict(zero=2, tp=2, cp=2, sequence_parallel=True),
    "pp2-vpp2-dp2-zero1": dict(zero=1, pp=2, vpp=2),
    "ep2-tp2-sp-dp2-zero3": dict(zero=3, tp=2, ep=2, sequence_parallel=True),
}


@pytest.mark.slow
def test_layouts_train_as_one_process(tmp_path_factory):
    from megakit.train.doctor.reference import reference_run

    data = _short_documents(tmp_path_factory)
    cases = []
    for spec in LAYOUTS.values():
        spec = dict(spec)
        config = ds_config(spec.pop("zero"), micro=1, accumulation=2 if "pp" in spec else 1)
        config["optimizer"]["params"]["eps"] = 1e-4
        cases.append(
            dict(ds_config=config, model="qwen3-next-tiny", steps=STEPS, seq_len=SEQ, data=data, **DOCUMENTS, **spec)
        )
    for (name, spec), case, got in zip(LAYOUTS.items(), cases, sweep(tmp_path_factory, 4, cases), strict=True):
        dp = 4 // (spec.get("tp", 1) * spec.get("pp", 1) * spec.get("cp", 1))
        want = reference_run(
            case["ds_config"], model=case["model"], steps=STEPS, dp=dp, seq_len=SEQ, data=data, documents=DOCUMENTS
        )
        for step, (a, b) in enumerate(zip(got["loss"], want["loss"], strict=True)):
            assert abs(a - b) <= fp32_bound(b, 4 * SEQ), (name, step, a, b)  # the step's tokens, at most
        a, b = got["grad_norm"][0], want["grad_norm"][0]  # the first step's gradient, before clipping
        assert abs(a - b) <= 1e-4 * b, (name, a, b)


def test_the_planner_prices_the_mixer_linearly_and_plans_qwen3_next_on_32_h100s(capsys):
    """Per token, only the 12 full-attention blocks' work grows with the sequence; the GDN blocks' is constant, and
    the recurrent states are in the activations. ``megakit plan`` finds a layout for Qwen3-Next-80B-A3B on 32 H100s."""
    from megakit.commands.cli import main
    from megakit.core.planner.activations import activation_tensors
    from megakit.core.planner.model_spec import ModelSpec

    config = ModelConfig.load("qwen3-next-80b-a3b")
    widths = 2 * config.heads * config.head_dim  # scores and values, 6 FLOPs per key each (fwd + bwd)
    grown = config.causal_flops_per_token(65536) - config.causal_flops_per_token(32768)
    assert grown == pytest.approx(12 * 6 * widths * (65537 - 32769) / 2)
    names = {t.name for t in activation_tensors(ModelSpec(name="q", config=config, seq_len=8192), tp=2)}
    assert {"linear attention mixer", "linear attention states"} <= names
    assert main(["plan", "--model", "qwen3-next-80b-a3b", "--gpus", "32", "--gpu", "h100-80gb"]) == 0
    assert "tokens/s" in capsys.readouterr().out
