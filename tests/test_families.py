"""The family registry (``megakit.core.families``) is the one source of the supported ``model_type``\\ s.

Pure Python, no processes: every type in it reads a tiny config and writes it back unchanged, and the lists users
see (the unsupported-type error, docs/models.md's table) are exactly the registry's.
"""

import json
import re
from pathlib import Path

import pytest

from megakit.core.families import FAMILIES, MODEL_TYPES, family_for
from megakit.core.model_config import PRESETS, ModelConfig
from megakit.errors import UsageError

DOCS = Path(__file__).resolve().parents[1] / "docs"
# a type without a preset of its own borrows one of its family's (same fields, another name)
BORROWED = {
    "mistral": "llama-tiny",
    "qwen2": "llama-tiny",
    "qwen3": "llama-tiny",
    "mixtral": "gpt-oss-tiny",
    "qwen3_moe": "moe-tiny",
    "kimi_k2": "deepseek-v3-tiny",
}


def _tiny(model_type: str) -> dict:
    """A small config.json of ``model_type``: a ``*-tiny`` preset of that type, or a borrowed one renamed."""
    for path in sorted(PRESETS.glob("*-tiny.json")):
        data = json.loads(path.read_text())
        if data["model_type"] == model_type:
            return data
    data = json.loads((PRESETS / f"{BORROWED[model_type]}.json").read_text())
    if model_type == "mixtral":  # gpt-oss's router and expert biases, sinks and windows are its own
        data = {k: v for k, v in data.items() if k not in ("layer_types", "sliding_window", "swiglu_limit")}
    return {**data, "model_type": model_type}


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_every_registered_type_round_trips(model_type):
    config = ModelConfig.from_hf(_tiny(model_type), source=model_type)
    written = config.to_hf()
    assert written["model_type"] == model_type
    assert written["architectures"] == [family_for(model_type).architectures[model_type]]
    assert ModelConfig.from_hf(written) == config
    assert ModelConfig.from_hf(json.loads(json.dumps(written))).to_hf() == written  # as a file holds it


def test_every_preset_belongs_to_a_family_and_round_trips():
    for path in sorted(PRESETS.glob("*.json")):
        config = ModelConfig.load(path)
        assert config.to_hf()["model_type"] in MODEL_TYPES, path.name
        assert ModelConfig.from_hf(config.to_hf()) == config, path.name


def test_the_lists_users_see_are_the_registrys():
    with pytest.raises(UsageError) as error:
        ModelConfig.from_hf({"model_type": "bert"})
    listed = str(error.value).split("supported: ", 1)[1].split(", ")
    assert tuple(listed) == MODEL_TYPES
    table = (DOCS / "models.md").read_text().split("## Families", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")][1:]  # less the header
    documented = re.findall(r"`(\w+)`", "".join(rows))
    assert sorted(documented) == sorted(MODEL_TYPES)
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)
