"""``megakit.core.lora.LoraSpec``: validation, scaling, target resolution and peft's config, without torch."""

import math

import pytest

from megakit.core.lora import LoraSpec, parse_targets
from megakit.errors import UsageError

LLAMA = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_scaling_is_alpha_over_rank_or_its_square_root():
    assert LoraSpec(rank=8, alpha=16).scaling == 2.0
    assert math.isclose(LoraSpec(rank=16, alpha=8, rslora=True).scaling, 2.0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(rank=0), "rank must be a positive integer"),
        (dict(rank=True), "rank must be a positive integer"),
        (dict(alpha=0), "alpha must be a positive"),
        (dict(alpha=float("nan")), "alpha must be a positive"),
        (dict(dropout=1.0), "dropout must be in"),
        (dict(targets=()), "targets must name modules"),
        (dict(targets=("q_proj", "")), "targets must name modules"),
        (dict(targets=("all-linear", "q_proj")), "give it alone"),
        (dict(targets=("gate_up_proj",)), "routed experts (gate_up_proj) is not supported"),
    ],
)
def test_bad_specs_are_one_line_usage_errors(kwargs, words):
    with pytest.raises(UsageError, match=None) as err:
        LoraSpec(**kwargs)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_resolve_keeps_the_models_order_and_lists_the_names_when_a_target_matches_none():
    assert LoraSpec(targets=("v_proj", "q_proj")).resolve(LLAMA) == ("q_proj", "v_proj")
    assert LoraSpec().resolve(LLAMA + ("q_proj",)) == LLAMA  # all-linear, each name once
    with pytest.raises(UsageError) as err:
        LoraSpec(targets=("q_proj", "c_attn")).resolve(LLAMA)
    assert "c_attn matches no module" in str(err.value) and "q_proj, k_proj, v_proj, o_proj" in str(err.value)
    assert LoraSpec(targets="q_proj").targets == ("q_proj",)


def test_peft_config_round_trips_and_refuses_what_megakit_cannot_reproduce():
    spec = LoraSpec(rank=4, alpha=8.0, dropout=0.1, targets=("q_proj", "down_proj"), rslora=True)
    config = spec.to_peft(targets=spec.resolve(LLAMA))
    assert config["r"] == 4 and config["target_modules"] == ["down_proj", "q_proj"] and config["use_rslora"]
    assert LoraSpec.from_peft(config) == LoraSpec(
        rank=4, alpha=8.0, dropout=0.1, targets=("down_proj", "q_proj"), rslora=True
    )
    with pytest.raises(UsageError, match="rank_pattern"):
        LoraSpec.from_peft({**config, "rank_pattern": {"q_proj": 8}})
    assert spec.params(32, 64) == 4 * 96 and LoraSpec(dora=True).params(32, 64) == 8 * 96 + 64
    assert parse_targets("q_proj, v_proj,") == ("q_proj", "v_proj")
