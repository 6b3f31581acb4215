"""Hugging Face configs whose attention is more than plain RoPE: RoPE variants in both config forms
(transformers 4's top-level ``rope_theta``/``rope_scaling``, 5's ``rope_parameters``), sliding windows,
GPT-2's score scaling. megakit's logits equal transformers' own within 1e-5, a control shows the field
changes the logits far more than that, and whatever megakit does not implement is refused in one line.
(After a TP2 x PP2 training step: ``test_hf_import.py``, whose model carries the llama3 scaling.)"""

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hf_reference import megakit_copy  # noqa: E402

from megakit.commands.cli import main  # noqa: E402
from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.errors import UsageError  # noqa: E402
from megakit.interop.checkpoint import load_checkpoint  # noqa: E402
from megakit.interop.checkpoint_format import manifest_config, read_manifest  # noqa: E402
from megakit.nn.model import Transformer, full_state_dict, load_full_state_dict  # noqa: E402

torch.set_num_threads(1)
TOL = 1e-5
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.1,
)  # head_dim 16
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
IDS = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))  # every position up to 64


def _hf(kind: str = "Llama", **fields):
    """A tiny transformers model of ``kind`` (seeded), in eval mode."""
    config = getattr(transformers, f"{kind}Config")(**fields)
    torch.manual_seed(0)
    return getattr(transformers, "GPT2LMHeadModel" if kind == "GPT2" else f"{kind}ForCausalLM")(config).eval()


@torch.no_grad()
def _diff(a, b, positions=slice(None)) -> float:
    return (a(IDS)[:, positions] - b(IDS).logits[:, positions]).abs().max().item()


def _to_v4(directory) -> dict:
    """Rewrite a saved config.json as transformers 4 wrote it: top-level rope_theta and rope_scaling."""
    path = directory / "config.json"
    data = json.loads(path.read_text())
    params = data.pop("rope_parameters")
    data["rope_theta"] = params.pop("rope_theta")
    data["rope_scaling"] = None if params["rope_type"] == "default" else params
    path.write_text(json.dumps(data))
    return data


@pytest.mark.parametrize("form", ["v4", "v5"])
@pytest.mark.parametrize("original", [16, 40])  # 40: every llama3 branch (kept, smoothed, slowed channels)
def test_llama3_rope_imports_and_exports_as_transformers_has_it(tmp_path, form, original):
    hf = _hf(**BASE, rope_parameters={**LLAMA3, "original_max_position_embeddings": original})
    hf.save_pretrained(tmp_path / "hf")
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert "rope_theta" not in saved and saved["rope_parameters"]["rope_theta"] == 500000  # transformers 5's form
    if form == "v4":
        _to_v4(tmp_path / "hf")
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert reference.config.rope_parameters == hf.config.rope_parameters  # the file is this model to transformers

    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 0
    config = manifest_config(read_manifest(tmp_path / "ck"))  # the rope variant survives the manifest
    assert config.rope_theta == 500000 and config.rope_scaling.type == "llama3"
    ours = Transformer(config).eval()
    load_checkpoint(tmp_path / "ck", ours)
    beyond = _diff(ours, reference, slice(original, None))
    print(f"llama3 {form} original {original}: max |logit diff| {_diff(ours, reference):.2e}, beyond {beyond:.2e}")
    assert _diff(ours, reference) < TOL and beyond < TOL
    for wrong in (config.replace(rope_scaling=None), config.replace(rope_theta=10000.0)):  # what was imported before
        plain = Transformer(wrong).eval()
        load_full_state_dict(plain, full_state_dict(ours))
        assert _diff(plain, reference, slice(original, None)) > 1e-3

    assert main(["convert", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert back.config.rope_parameters == hf.config.rope_parameters
    with torch.no_grad():
        assert torch.equal(back(IDS).logits, reference(IDS).logits)
    written = json.loads((tmp_path / "back" / "config.json").read_text())  # both forms, saying the same
    v4 = {k: v for k, v in written.items() if k != "rope_parameters"}
    v5 = {k: v for k, v in written.items() if k not in ("rope_theta", "rope_scaling")}
    assert written["rope_scaling"]["rope_type"] == "llama3" and written["rope_theta"] == 500000
    assert ModelConfig.from_hf(v4) == ModelConfig.from_hf(v5) == config


VARIANTS = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {
        "rope_type": "yarn",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "original_max_position_embeddings": 16,
        "mscale": 2.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": None,
        "original_max_position_embeddings": 16,
        "attention_factor": 1.3,
    },
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_rope_variants_match_transformers(name):
    hf = _hf(**BASE, rope_parameters=dict(VARIANTS[name]))
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert transformers.AutoConfig.for_model(**config.to_hf()).rope_parameters == hf.config.rope_parameters
    diff = _diff(megakit_copy(config, hf), hf)
    control = _diff(megakit_copy(config.replace(rope_scaling=None), hf), hf)
    print(f"{name}: max |logit diff| {diff:.2e}; as plain RoPE {control:.2e}")
    assert diff < TOL
    # dynamic NTK changes theta only past max_position_embeddings, which megakit never runs (check_seq_len)
    assert control < TOL if name == "dynamic" else control > 1e-3


@pytest.mark.parametrize(
    "kind,fields,sliding",
    [
        ("Mistral", dict(sliding_window=8), [8, 8]),
        ("Mistral", dict(sliding_window=64), [64, 64]),  # not shorter than any sequence: plain causal attention
        ("Qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1), [0, 8]),
        ("Qwen2", dict(sliding_window=8, use_sliding_window=False), [0, 0]),
        # a per-block schedule transformers 5 writes as layer_types: the window on block 0 only (not a run of last ones)
        (
            "Qwen2",
            dict(sliding_window=8, use_sliding_window=True, layer_types=["sliding_attention", "full_attention"]),
            [8, 0],
        ),
    ],
)
def test_sliding_windows_match_transformers(kind, fields, sliding):
    hf = _hf(kind, **BASE, **fields)
    config = ModelConfig.from_hf(hf.config.to_dict())  # transformers 5 writes Qwen2's layer_types too
    assert [config.attention_window(i) for i in range(2)] == sliding
    assert ModelConfig.from_hf(config.to_hf()) == config
    again = transformers.AutoConfig.for_model(**config.to_hf())
    assert again.sliding_window == hf.config.sliding_window and getattr(again, "layer_types", None) == getattr(
        hf.config, "layer_types", None
    )
    diff, control = (
        _diff(megakit_copy(config, hf), hf),
        _diff(megakit_copy(config.replace(sliding_window=0, layer_types=()), hf), hf),
    )
    print(f"{kind} {fields}: max |logit diff| {diff:.2e}; without the window {control:.2e}")
    assert diff < TOL
    assert control < TOL if max(sliding) in (0, 64) else control > 1e-3


@pytest.mark.parametrize(
    "flags",
    [
        dict(scale_attn_by_inverse_layer_idx=True),
        dict(scale_attn_weights=False),
        dict(scale_attn_by_inverse_layer_idx=True, scale_attn_weights=False),
        dict(reorder_and_upcast_attn=True),
    ],
)  # precision only: accepted, nothing to do
def test_gpt2_attention_scaling_matches_transformers(flags):
    hf = _hf("GPT2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, initializer_range=0.1, **flags)
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert ModelConfig.from_hf(config.to_hf()) == config
    plain = config.replace(scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False)
    diff, control = _diff(megakit_copy(config, hf), hf), _diff(megakit_copy(plain, hf), hf)
    print(f"gpt2 {flags}: max |logit diff| {diff:.2e}; unscaled {control:.2e}")
    assert diff < TOL
    assert control < TOL if "reorder_and_upcast_attn" in flags else control > 1e-3


LLAMA = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
GPT2 = dict(model_type="gpt2", vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)


@pytest.mark.parametrize(
    "data,named",
    [
        ({**LLAMA, "partial_rotary_factor": 0.5}, "partial_rotary_factor 0.5"),
        (
            {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25}},
            "partial_rotary_factor 0.25",
        ),
        (
            {**LLAMA, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}},
            "rope_type 'longrope'",
        ),
        ({**LLAMA, "rope_scaling": {"type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}}, "low_freq_factor None"),
        ({**LLAMA, "rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        (
            {
                **LLAMA,
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["chunked_attention", "full_attention"],
            },
            "layer_types has 'chunked_attention'",
        ),
        (
            {
                **LLAMA,
                "model_type": "gemma3_text",
                "head_dim": 16,
                "layer_types": ["linear_attention", "full_attention"],
            },
            "it runs full_attention and sliding_attention",
        ),
        ({**LLAMA, "model_type": "gemma3_text", "head_dim": 16, "attn_logit_softcapping": 50.0}, "soft-capping"),
        ({**LLAMA, "model_type": "mistral", "sliding_window": 0}, "sliding_window 0"),
        ({**GPT2, "attn_pdrop": 0.0}, "attn_pdrop 0.0"),
        ({**GPT2, "add_cross_attention": True}, "add_cross_attention"),
    ],
)
def test_math_megakit_does_not_implement_is_refused_in_one_line(data, named):
    with pytest.raises(UsageError) as error:
        ModelConfig.from_hf(data, source="config.json")
    assert named in str(error.value) and "\n" not in str(error.value), str(error.value)


def test_convert_refuses_partial_rotary_with_exit_2_and_writes_nothing(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**LLAMA, "partial_rotary_factor": 0.5}))
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 2
    err = capsys.readouterr().err.strip()
    assert "partial_rotary_factor" in err and len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "kind,fields,sliding",
    [
        ("Mixtral", dict(sliding_window=8), [8, 8]),
        ("Mixtral", {}, [0, 0]),  # transformers' Mixtral default: no window
        ("Qwen3", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1), [0, 8]),
        ("Qwen3Moe", dict(sliding_window=8, use_sliding_window=True), [8, 8]),
    ],
)
def test_sliding_windows_of_the_other_model_types_read_and_write_back(kind, fields, sliding):
    """(megakit's model does not run these types yet: their configs must still carry the window.)"""
    hf = getattr(transformers, f"{kind}Config")(**BASE, **fields)
    config = ModelConfig.from_hf(hf.to_dict())
    assert [config.attention_window(i) for i in range(2)] == sliding
    assert ModelConfig.from_hf(config.to_hf()) == config
    again = transformers.AutoConfig.for_model(**config.to_hf())
    assert again.sliding_window == hf.sliding_window and getattr(again, "layer_types", None) == getattr(
        hf, "layer_types", None
    )


def test_qwen2_moe_alternating_window_reads_as_transformers_5_does_and_writes_back():
    hf = transformers.Qwen2MoeConfig(**BASE, sliding_window=8, use_sliding_window=True, max_window_layers=2)
    assert hf.layer_types == ["sliding_attention", "full_attention"]  # its even blocks below max_window_layers
    config = ModelConfig.from_hf(hf.to_dict(), source="c")
    assert [config.attention_window(i) for i in range(2)] == [8, 0] and ModelConfig.from_hf(config.to_hf()) == config
    assert transformers.AutoConfig.for_model(**config.to_hf()).layer_types == hf.layer_types
    del hf.layer_types  # the same from transformers' own rule, without the written list
    assert ModelConfig.from_hf({k: v for k, v in hf.to_dict().items() if k != "layer_types"}) == config
