"""The planner's price of preference tuning (``megakit.core.planner.preference``): the reference pass over the run's
windows as the forward's share of the plan's steps, the fp64 log-probabilities it keeps, nothing for SimPO, and
``megakit plan --objective`` (its JSON, its launch line, bad input in one line)."""

import json

import pytest

from megakit.commands import cli
from megakit.core.planner.preference import preference_cost


def test_the_reference_pass_is_the_forward_share_of_the_steps_over_the_windows():
    dpo = preference_cost("dpo", windows=1000, pairs_per_window=2, step_time_s=2.0, global_batch=100)
    assert dpo.reference_s == pytest.approx(10 * 2.0 / 3)  # 10 steps' windows, a forward a third of each
    assert dpo.stored_bytes == 1000 * 4 * 8  # two pairs a window: four sequences, one fp64 each
    recomputed = preference_cost(
        "ipo", windows=1000, pairs_per_window=1, step_time_s=2.0, global_batch=100, recompute_fraction=1.0
    )
    assert recomputed.reference_s == pytest.approx(10 * 2.0 / 4)  # a full recompute makes the step's forward twice
    simpo = preference_cost("simpo", windows=1000, pairs_per_window=1, step_time_s=2.0, global_batch=100)
    assert (simpo.reference_s, simpo.stored_bytes) == (0.0, 0.0)
    assert "no reference" in " ".join(simpo.lines())


def test_plan_objective_prices_the_reference_and_launches_with_it(capsys):
    flags = ["plan", "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--tokens", "1B", "--json"]
    assert cli.main(flags + ["--objective", "dpo"]) == 0
    report = json.loads(capsys.readouterr().out)
    plan, found = report["plan"], report["plan"]["preference"]
    assert found["windows"] == -(-1_000_000_000 // 8192)  # llama-3-8b's planned window
    steps_over_data = found["windows"] / plan["global_batch"]
    assert found["reference_s"] == pytest.approx(steps_over_data * plan["step_time_s"] / 3, rel=1e-9)
    assert found["stored_bytes"] == found["windows"] * 2 * 8
    assert "--objective dpo" in report["assumptions"]["launch"]
    assert cli.main(flags[:-1] + ["--objective", "dpo"]) == 0
    out = capsys.readouterr().out
    assert "--objective dpo" in out and "reference pass" in out
    assert cli.main(flags + ["--objective", "dpo", "--pairs-per-window", "0"]) == 2
    assert "--pairs-per-window must be positive" in capsys.readouterr().err
