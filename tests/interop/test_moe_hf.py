"""MoE (and Qwen3) numerics against Hugging Face transformers, with no download: tiny seeded models.

A transformers model is saved with ``save_pretrained`` (its safetensors keep one matrix per expert),
imported through megakit's own path (``megakit convert --from-hf``: config.json, the key mapping, the
checkpoint), and must give transformers' logits within 1e-5 in fp32; exported back, the tensors are
bit-identical. ``DeepseekV3MoE`` (whose attention, MLA, megakit does not build) is checked as a block.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from megakit.commands.cli import main  # noqa: E402

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    initializer_range=0.2,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)  # read by ModelConfig in either form
MODELS = {
    "mixtral": lambda: transformers.MixtralConfig(
        **SMALL, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **SMALL,
        intermediate_size=48,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[0],
        norm_topk_prob=False,
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **SMALL,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    ),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, intermediate_size=48),
}


def _save(kind: str, directory) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[kind]()).float().eval()
    model.save_pretrained(directory, safe_serialization=True)
    return model


@pytest.mark.parametrize("kind", list(MODELS))
def test_logits_and_round_trip_match_transformers(kind, tmp_path):
    from safetensors.torch import load_file

    from megakit.core.model_config import ModelConfig
    from megakit.interop.hf import from_hf_state_dict
    from megakit.interop.hf_import import read_hf_weights
    from megakit.nn.model import Transformer, load_full_state_dict

    hf = _save(kind, tmp_path / "hf")
    config = ModelConfig.load(tmp_path / "hf")
    assert config.hf_type == kind and (config.moe is not None) == (kind != "qwen3")
    model = Transformer(config, seed=1).eval()
    load_full_state_dict(model, from_hf_state_dict(config, read_hf_weights(tmp_path / "hf")))
    ids = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = hf(ids).logits, model(ids)
    assert want.abs().max() > 1e-2
    assert (got - want).abs().max() < 1e-5, (kind, (got - want).abs().max())

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 0
    assert main(["convert", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back")]) == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").float().eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, want)  # transformers reads the export as its own


def test_an_expert_key_that_does_not_map_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _save("mixtral", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    stray = "model.layers.1.block_sparse_moe.experts.4.w1.weight"  # a fifth expert in a 4-expert config
    tensors[stray] = tensors["model.layers.1.block_sparse_moe.experts.0.w1.weight"].clone()
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 2
    missing = dict(tensors)
    del missing[stray], missing["model.layers.0.block_sparse_moe.experts.3.w2.weight"]
    save_file(missing, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck2"), "--from-hf"]) == 2
    assert not (tmp_path / "ck").exists() and not (tmp_path / "ck2").exists()


def test_unknown_key_error_text(tmp_path):
    from megakit.core.model_config import ModelConfig
    from megakit.errors import UsageError
    from megakit.interop.hf import from_hf_state_dict
    from megakit.interop.hf_import import read_hf_weights

    _save("qwen3_moe", tmp_path / "hf")
    config, weights = ModelConfig.load(tmp_path / "hf"), read_hf_weights(tmp_path / "hf")
    weights["model.layers.0.mlp.shared_expert.up_proj.weight"] = torch.zeros(8, 32)  # Qwen3-MoE has none
    with pytest.raises(UsageError, match=r"model\.layers\.0\.mlp\.shared_expert\.up_proj\.weight"):
        from_hf_state_dict(config, weights)
    del (
        weights["model.layers.0.mlp.shared_expert.up_proj.weight"],
        weights["model.layers.1.mlp.experts.5.down_proj.weight"],
    )
    with pytest.raises(UsageError, match=r"model\.layers\.1\.mlp\.experts\.5\.down_proj\.weight"):
        from_hf_state_dict(config, weights)


def test_deepseek_v3_moe_block_matches_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from megakit.core.moe_config import MoEConfig
    from megakit.nn.moe.layer import MoE

    hf_config = transformers.DeepseekV3Config(
        hidden_size=32,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=4,
        topk_group=2,
        n_shared_experts=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=0,
        num_hidden_layers=2,
        intermediate_size=48,
    )
    torch.manual_seed(0)
    hf = DeepseekV3MoE(hf_config).float().eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.5)  # large enough to change the choices
    config = MoEConfig.from_hf(hf_config.to_dict(), layers=2)
    assert (config.score, config.groups, config.group_top_k, config.expert_bias) == ("sigmoid", 4, 2, True)
    ours = MoE(config, 32).eval()
    state = {k.replace("shared_experts.", "shared_expert."): v for k, v in hf.state_dict().items()}
    assert set(state) == set(ours.state_dict()), set(state) ^ set(ours.state_dict())
    ours.load_state_dict(state)
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2))  # (B, S, H)
    with torch.no_grad():
        want = hf(x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
        unbiased = MoE(config, 32).eval()
        unbiased.load_state_dict({**state, "gate.e_score_correction_bias": torch.zeros(8)})
        moved = (unbiased(x.transpose(0, 1)).transpose(0, 1) - want).abs().max()
    assert moved > 1e-2  # the bias does change the routing here
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()
