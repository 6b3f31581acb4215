"""ModelSpec: sizes from the table, shapes from HF config.json files with exact counts, no torch at import."""

import json
import subprocess
import sys

import pytest

from megakit.core.planner.model_spec import (
    ModelSpec,
    known_shape,
    parse_count,
    preset_names,
)
from megakit.errors import UsageError
from megakit.interop.hf import exact_param_count


@pytest.mark.parametrize(
    "text,value", [("125M", 125e6), ("1.3B", 1.3e9), ("70b", 70e9), ("175e9", 175e9), ("1T", 1e12), (" 6.7 B ", 6.7e9)]
)
def test_sizes_parse(text, value):
    assert parse_count(text) == pytest.approx(value)


@pytest.mark.parametrize("text", ["abc", "-5B", "0", "", "1.2.3B", "5X", "nan"])
def test_bad_sizes_are_usage_errors(text):
    with pytest.raises(UsageError):
        parse_count(text)


@pytest.mark.parametrize(
    "size,name",
    [
        ("125M", "gpt3-125m"),
        ("1.3B", "gpt3-1.3b"),
        ("175B", "gpt3-175b"),
        ("70b", "llama-2-70b"),
        ("1T", "megatron-1t"),
        ("8B", "llama-3-8b"),
        ("529.6B", "megatron-529.6b"),
    ],
)
def test_params_map_to_well_known_shapes(size, name):
    spec = ModelSpec.from_params(size)
    assert spec.name == name and name in spec.assumed
    assert spec.params == pytest.approx(parse_count(size), rel=0.10)


def test_sizes_between_table_rows_scale_the_layer_count():
    spec = ModelSpec.from_params("3T")
    assert spec.name == "3T-scaled" and "not in the table" in spec.assumed
    assert spec.params == pytest.approx(3e12, rel=0.02)
    assert spec.hidden == known_shape("megatron-1t").hidden


def test_megatron_table_sizes_reproduce_the_published_counts():
    for name, published in (
        ("megatron-1.7b", 1.7e9),
        ("megatron-18.4b", 18.4e9),
        ("megatron-145.6b", 145.6e9),
        ("megatron-1t", 1008e9),
        ("gpt3-175b", 174.6e9),
    ):
        assert known_shape(name).params == pytest.approx(published, rel=0.03), name


def test_presets_exact_counts_from_transformers_match_the_analytic_count():
    assert {"gpt3-175b", "megatron-1t", "llama-2-70b", "llama-3-8b", "gpt2", "gpt-tiny"} <= set(preset_names())
    for name in (
        "gpt2",
        "gpt-tiny",
        "llama-tiny",
        "llama-2-70b",
        "llama-3-8b",
        "mistral-7b",
        "qwen2-7b",
        "gpt3-175b",
    ):  # megatron-1t: same family and code path as gpt3-175b, 2 s more
        spec = ModelSpec.from_config(name, count_params=exact_param_count)
        assert spec.exact_params == spec.analytic_params(), name
    llama = ModelSpec.from_config("llama-2-70b", count_params=exact_param_count)
    assert llama.params == 68_976_648_192  # the published Llama-2-70B count
    assert ModelSpec.from_config("gpt2", count_params=exact_param_count).params == 124_439_808  # GPT-2 small
    qwen = ModelSpec.from_config("qwen2-7b", count_params=exact_param_count)
    assert qwen.qkv_bias and qwen.kv_heads == 4


def test_planner_runs_without_importing_torch():
    code = (
        "import sys; from megakit.commands import cli; rc = cli.main(['plan', '--params', '1.3B', '--gpus', '8', "
        "'--json']); assert rc == 0; assert 'torch' not in sys.modules, 'torch imported'; "
        "assert 'transformers' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_config_is_read_by_the_model_code_parser_with_head_dim(tmp_path):
    from megakit.core.model_config import ModelConfig

    raw = {
        "model_type": "llama",
        "vocab_size": 512,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    spec = ModelSpec.from_config(str(path), count_params=exact_param_count)
    assert spec.head_dim == 128
    assert spec.exact_params == spec.analytic_params() == ModelConfig.load(path).num_params()
    # the same families and messages as the model code: qwen3 and a missing key are refused alike
    for change, needle in (({"model_type": "falcon"}, "has model_type 'falcon'"), ({"hidden_size": None}, "hidden")):
        bad = {k: v for k, v in {**raw, **change}.items() if v is not None}
        path.write_text(json.dumps(bad))
        with pytest.raises(UsageError) as planner_error:
            ModelSpec.from_config(str(path), count_params=exact_param_count)
        with pytest.raises(UsageError) as model_error:
            ModelConfig.load(path)
        assert str(planner_error.value) == str(model_error.value) and needle in str(planner_error.value)
