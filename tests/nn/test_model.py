"""The single-process model: configs, Hugging Face equivalence, pipeline stages, init, errors."""

from __future__ import annotations

import json
import re

import pytest
import torch

from megakit.errors import UsageError
from megakit.nn.model import (
    ModelConfig,
    Transformer,
    full_state_dict,
    load_full_state_dict,
    model_flops_per_token,
)

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "preset,changes", [("gpt-tiny", {}), ("llama-tiny", {}), ("llama-tiny", dict(qkv_bias=True, tie_embeddings=True))]
)
def test_matches_hugging_face_transformers(preset, changes):
    """Same weights in transformers' own implementation give the same logits, both ways round:
    the architecture is right, and so is the weight mapping in megakit.interop.hf."""
    import transformers

    from megakit.interop.hf import from_hf_state_dict, hf_config, to_hf_state_dict

    config = ModelConfig.load(preset).replace(**changes)
    assert ModelConfig.from_hf(hf_config(config)) == config
    hf_cfg = transformers.AutoConfig.for_model(**hf_config(config))
    hf_cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    ids = torch.randint(0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))

    def perturb(model):  # biases and norms start at 0 and 1: make every mapping visible
        gen = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        return model

    ours = perturb(Transformer(config, seed=3).eval())  # megakit -> transformers
    missing, unexpected = hf.load_state_dict(to_hf_state_dict(config, full_state_dict(ours)), strict=False)
    assert not unexpected and all(k.endswith("attn.bias") for k in missing), (missing, unexpected)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)

    hf = perturb(transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval())  # transformers -> megakit
    load_full_state_dict(ours, from_hf_state_dict(config, hf.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def _preset(name):
    from megakit.core.model_config import PRESETS

    return PRESETS / f"{name}.json"


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])
def test_pipeline_stages_are_slices_of_the_full_model(preset):
    config = ModelConfig.load(preset)
    full = Transformer(config, seed=7)
    full_params = dict(full.named_parameters())
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    stages = [
        Transformer(config, layers=range(0, 1), pre=True, post=False, seed=7),
        Transformer(config, layers=range(1, 3), pre=False, post=False, seed=7),
        Transformer(config, layers=range(3, 4), pre=False, post=True, seed=7),
    ]
    for stage in stages:
        for name, param in stage.named_parameters():
            assert name in full_params, name
            assert torch.equal(param, full_params[name]), name
    names = set().union(*(dict(s.named_parameters()) for s in stages))
    assert names == set(full_params)
    if config.tie_embeddings:  # the last stage holds its own copy of the tied embedding, same name
        assert "embed.weight" in dict(stages[-1].named_parameters())
        assert stages[-1].embed.weight.ds_pipe_replicated and not stages[0].embed.weight.ds_pipe_replicated
    h = ids
    for stage in stages:
        h = stage(h)
    torch.testing.assert_close(h, full(ids), rtol=0, atol=0)


def test_init_depends_on_seed_and_name_only():
    config = ModelConfig.load("gpt-tiny")
    a = full_state_dict(Transformer(config, seed=11))
    torch.manual_seed(1234)  # the global RNG state neither matters nor changes
    before = torch.get_rng_state()
    b = full_state_dict(Transformer(config, seed=11))
    assert torch.equal(before, torch.get_rng_state())
    c = full_state_dict(Transformer(config, seed=12))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], c["layers.0.attn.q_proj.weight"])
    # Distinct parameters get distinct values; output projections are scaled down.
    assert not torch.equal(a["layers.0.attn.q_proj.weight"], a["layers.1.attn.q_proj.weight"])
    assert a["layers.0.attn.o_proj.weight"].std() < 0.6 * a["layers.0.attn.q_proj.weight"].std()
    assert torch.equal(a["layers.0.attn_norm.weight"], torch.ones(config.hidden))


def test_state_dict_round_trip():
    config = ModelConfig.load("llama-tiny")
    a, b = Transformer(config, seed=1), Transformer(config, seed=2)
    load_full_state_dict(b, full_state_dict(a))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    with pytest.raises(UsageError, match="lacks"):
        load_full_state_dict(b, {})


def test_config_loading_and_errors(tmp_path):
    gpt = ModelConfig.load("gpt-tiny")
    assert (gpt.family, gpt.hidden, gpt.heads, gpt.kv_heads, gpt.ffn, gpt.tie_embeddings) == (
        "gpt2",
        32,
        4,
        4,
        128,
        True,
    )
    llama = ModelConfig.load("llama-tiny")
    assert (llama.family, llama.kv_heads, llama.head_dim, llama.tie_embeddings) == ("llama", 4, 4, False)
    assert gpt.padded_vocab(3) == 258 and gpt.padded_vocab(4) == 256
    assert ModelConfig.load(_preset("gpt-mini")) == ModelConfig.load("gpt-mini")
    assert ModelConfig.load("llama-3.1-405b").layers == 126  # a dot in a preset's name is no file suffix
    assert ModelConfig.load("tinyllama-1.1b") == ModelConfig.load(_preset("tinyllama-1.1b"))
    with pytest.raises(UsageError, match="not found"):
        ModelConfig.load("no-such-model")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="cannot read"):
        ModelConfig.load(bad)
    bad.write_text(json.dumps({"model_type": "bert", "vocab_size": 10, "hidden_act": "gelu"}))
    with pytest.raises(UsageError, match="model_type 'bert'"):
        ModelConfig.load(tmp_path)
    bad.write_text(json.dumps({"model_type": "gpt2", "activation_function": "relu"}))
    with pytest.raises(UsageError, match="activation 'relu'"):
        ModelConfig.load(bad)
    bad.write_text(json.dumps({"model_type": "llama", "vocab_size": 10}))
    with pytest.raises(UsageError, match="lacks the field .num_attention_heads."):
        ModelConfig.load(bad)


@pytest.mark.parametrize(
    "preset, key, value, message",
    [
        ("llama-tiny", "rms_norm_eps", "1e-5", 'has rms_norm_eps "1e-5"; give a number above 0'),
        (
            "llama-tiny",
            "num_hidden_layers",
            True,
            "has num_hidden_layers true; give a positive integer (true and false",
        ),
        ("llama-tiny", "num_hidden_layers", 0, "has num_hidden_layers 0; give a positive integer"),
        ("llama-tiny", "tie_word_embeddings", "false", 'has tie_word_embeddings "false"; give true or false'),
        ("llama-tiny", "head_dim", 4.0, "has head_dim 4.0; give an integer >= 0 or null"),
        ("gpt-tiny", "n_layer", 2.5, "has n_layer 2.5; give a positive integer"),
        ("gpt-tiny", "resid_pdrop", 1.5, "has resid_pdrop 1.5; give a number in [0, 1)"),
        ("moe-tiny", "num_experts_per_tok", False, "has num_experts_per_tok false; give a positive integer"),
        ("deepseek-v3-tiny", "kv_lora_rank", "16", 'has kv_lora_rank "16"; give a positive integer'),
    ],
)
def test_a_config_value_of_the_wrong_type_is_named_by_its_file_and_key(tmp_path, preset, key, value, message):
    """A number given as a string, or a bool where a number goes (Python takes true for 1), is refused in one line
    that names the file and the Hugging Face key, not megakit's own field; a bool is not an int in ModelConfig."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**json.loads(_preset(preset).read_text()), key: value}))
    with pytest.raises(UsageError, match=re.escape(f"model config {path} {message}")):
        ModelConfig.load(path)
    with pytest.raises(UsageError, match="field layers must be a positive integer, got True"):
        ModelConfig.load("llama-tiny").replace(layers=True)
    with pytest.raises(UsageError, match="field norm_eps must be a finite number, got '1e-5'"):
        ModelConfig.load("llama-tiny").replace(norm_eps="1e-5")


def test_bad_tp_names_the_numbers():
    llama = ModelConfig.load("llama-tiny")  # 8 heads, 4 KV heads, hidden 32, FFN 96
    with pytest.raises(UsageError, match=r"TP 8 does not divide KV heads 4;"):
        llama.check_tp(8)
    with pytest.raises(UsageError, match=r"TP 3 does not divide attention heads 8, KV heads 4, hidden size 32;"):
        llama.check_tp(3)
    llama.check_tp(4)


def test_bad_inputs():
    config = ModelConfig.load("gpt-tiny")
    model = Transformer(config)
    with pytest.raises(UsageError, match="exceeds the model's max_seq_len 64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(UsageError, match="token ids"):
        model(torch.zeros(1, 8))
    with pytest.raises(UsageError, match="range"):
        Transformer(config, layers=range(2, 9))


def test_flops_per_token():
    config = ModelConfig.load("gpt-mini")
    n_matmul = config.layers * config.layer_params() + config.vocab_size * config.hidden
    assert model_flops_per_token(config, 128) == 6 * n_matmul + 12 * config.layers * config.hidden * 128
    assert config.num_params() == sum(p.numel() for p in Transformer(config).parameters())


def test_recompute_gives_the_same_gradients_with_dropout():
    """Full recompute re-runs each block in backward; both dropout streams must replay exactly. The gradients
    compared are real (every parameter gets one) and dropout shaped them (they differ from dropout 0's)."""
    config = ModelConfig.load("llama-tiny").replace(dropout=0.3)
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = {}
    for p, recompute in ((0.3, False), (0.3, True), (0.0, False)):
        model = Transformer(config.replace(dropout=p), seed=5, recompute=recompute).train()
        torch.manual_seed(0)
        model(ids, ids).backward()
        grads[p, recompute] = full_state_dict(model, grads=True)
    plain, recomputed, undropped = grads[0.3, False], grads[0.3, True], grads[0.0, False]
    assert plain.keys() == recomputed.keys() and len(plain) > 10
    for name in plain:
        assert torch.equal(plain[name], recomputed[name]), name
        assert plain[name].abs().max() > 0, name  # a gradient, not zeros compared with zeros
    changed = [name for name in plain if not torch.allclose(plain[name], undropped[name], rtol=1e-3, atol=1e-6)]
    assert len(changed) == len(plain), sorted(set(plain) - set(changed))  # the masks acted on every gradient


def test_bf16_and_meta():
    config = ModelConfig.load("gpt-tiny")
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    fp32 = Transformer(config, seed=1)
    bf16 = Transformer(config, seed=1, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert torch.equal(bf16.embed.weight, fp32.embed.weight.to(torch.bfloat16))  # same draws, cast
    loss = bf16(ids, ids.int())
    loss.backward()
    assert loss.dtype == torch.float32 and abs(loss.item() - fp32(ids, ids).item()) < 2e-2
    assert all(torch.isfinite(p.grad).all() for p in bf16.parameters())
    meta = Transformer(ModelConfig.load("llama-3-8b").replace(layers=2), device="meta")
    assert sum(p.numel() for p in meta.parameters()) == ModelConfig.load("llama-3-8b").replace(layers=2).num_params()
