"""Gemma 3's text model (``Gemma3ForCausalLM``) against transformers' own, in fp32.

A tiny config with every piece that differs from Llama made to matter: 6 blocks at 5 local : 1 global, a window of
8 at 48 tokens, local RoPE theta 1e4 against global theta 1e6 with linear scaling 8, ``query_pre_attn_scalar`` 24
against a head_dim of 16, GQA, tied head, and every (1 + w) norm weight drawn at random (transformers starts them at
0, where (1 + w) and w + 1 agree with a plain RMSNorm's weight of one: no test). Each control swaps one piece back
and must move the logits past the tolerance, so each piece is shown to be read.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import eager, megakit_copy  # noqa: E402

from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.interop.hf import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from megakit.nn.model import Transformer, full_state_dict, load_full_state_dict  # noqa: E402

TOL = 1e-5
FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=128,
    sliding_window=8,
    query_pre_attn_scalar=24,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
    },
)


def _hf_model():
    model = eager(transformers.Gemma3ForCausalLM, transformers.Gemma3TextConfig(**FIELDS))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.5)
    return model


@torch.no_grad()
def test_gemma3_logits_match_transformers_and_each_piece_matters():
    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="gemma3")
    assert config.layer_types == tuple(hf.config.layer_types) and hf.config.layer_types[5] == "full_attention"
    assert [config.attention_window(i) for i in range(6)] == [8, 8, 8, 8, 8, 0]
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    diff = (megakit_copy(config, hf)(ids) - want).abs().max().item()
    print(f"gemma3: max |logit diff| {diff:.2e}")
    assert diff < TOL
    controls = {
        "plain RMSNorm": dict(norm_offset=False),
        "no sandwich norms": dict(sandwich_norms=False),
        "SwiGLU": dict(mlp_act="silu"),
        "no embedding scale": dict(embed_scale=1.0),
        "1/sqrt(head_dim)": dict(query_pre_attn_scalar=0.0),
        "one RoPE": dict(sliding_rope_theta=0.0),
        "no windows": dict(layer_types=("full_attention",) * 6),
    }
    for what, change in controls.items():
        model = Transformer(config.replace(**change)).eval()
        state = from_hf_state_dict(config, hf.state_dict())
        if not change.get("sandwich_norms", True):
            state = {k: v for k, v in state.items() if "post_norm" not in k}
        load_full_state_dict(model, state)
        gap = (model(ids) - want).abs().max().item()
        assert gap > 1e-3, (what, gap)


def test_gemma3_config_and_weights_round_trip_and_transformers_reads_them(tmp_path):
    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="gemma3")
    assert ModelConfig.from_hf(config.to_hf()) == config
    written = config.to_hf()
    original = hf.config.to_dict()
    for field, value in written.items():  # field for field what transformers wrote (its own bookkeeping aside)
        if field not in ("architectures",):
            assert original[field] == value, (field, original[field], value)
    again = transformers.Gemma3ForCausalLM(
        transformers.Gemma3TextConfig(**{k: v for k, v in written.items() if k != "model_type"})
    ).eval()
    ours = megakit_copy(config, hf)
    missing, unexpected = again.load_state_dict(to_hf_state_dict(config, full_state_dict(ours)), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    again.tie_weights()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() < TOL


def test_gemma3_parameter_count_is_transformers_own():
    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="gemma3")
    assert config.num_params() == sum(p.numel() for p in hf.parameters())
    assert dataclasses.replace(config, sandwich_norms=False).num_params() == config.num_params() - 6 * 2 * 64


def test_window_aware_attention_context_counts_the_keys_the_mask_allows(capsys):
    """``attention_context`` is the mean over queries of the keys the causal window allows (counted from the mask
    every attention path uses); the planner's GFLOP per token adds 12 x q x it per block to 6 x the weight
    matrices."""
    from megakit.commands import cli
    from megakit.nn.attention.masks import allowed_keys

    config = ModelConfig.load("gemma3-tiny")
    for s in (8, 16, 64):
        for i in (0, 5):  # a sliding block (window 8) and the full one
            mask = allowed_keys(s, config.attention_window(i), None, "cpu")
            counted = (torch.ones(s, s).tril() if mask is None else mask.float()).sum().item() / s
            assert abs(config.attention_context(i, s) - counted) < 1e-9, (s, i)
    big = ModelConfig.load("gemma-3-4b")
    weights = 3 * big.head_flops() + 6 * big.layers * big.block_params().matmul  # the matrices (norms aside)
    q = big.heads * big.head_dim
    want = weights + 12 * q * sum(big.attention_context(i, 4096) for i in range(big.layers))
    assert big.causal_flops_per_token(4096) == pytest.approx(want, rel=1e-12)
    assert cli.main(["plan", "--model", "gemma-3-4b", "--seq-len", "4096", "--gpus", "8", "--json"]) == 0
    import json

    flops = json.loads(capsys.readouterr().out)["plan"]["gflops_per_token"]
    assert flops["causal"] == pytest.approx(want / 1e9)
    # 29 of 34 blocks slide over 1024 of 4096 tokens: 12 q x (2048.5 - 896.1) x 29 fewer FLOPs than without windows
    saved = 12 * q * 29 * ((4096 + 1) / 2 - (1024 - 1024 * 1023 / 8192)) / 1e9
    assert flops["windows_ignored"] - flops["causal"] == pytest.approx(saved, rel=1e-9)
