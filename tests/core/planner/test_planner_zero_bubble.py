"""The planner's zero bubble (ZB-H1): its bubble, its extra memory, and the --schedule pin.

The bubble follows Qi et al. 2023: (p-1)(F+B-W) per stage against 1F1B's (p-1)(F+B+W), with W
the weight-gradient GEMMs' share of a stage's work; the micro-batches held follow the very
schedule the simulator runs.
"""

import json

import pytest

from megakit.commands import cli
from megakit.core.planner.cost import estimate_cost, weight_grad_share
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan
from megakit.core.planner.stages import (
    in_flight_micro_batches,
    zero_bubble_bubble_share,
)
from megakit.core.schedules import build_schedule
from megakit.core.simulator import simulate


def test_held_micro_batches_are_the_simulators():
    for pp, m in ((2, 8), (4, 8), (4, 2), (8, 16)):
        peaks = simulate(build_schedule("zb-h1", pp, m)).peak_in_flight
        assert (
            tuple(in_flight_micro_batches(pp=pp, stage=i, accumulation=m, zero_bubble=True) for i in range(pp)) == peaks
        )


def test_bubble_is_qi_et_al_with_the_weight_gradient_share():
    assert zero_bubble_bubble_share(1 / 3) == pytest.approx(1 / 3)  # F = B = W: a third of 1F1B's
    model = ModelSpec.from_params("175B", seq_len=2048)
    cluster = Cluster(gpu=gpu_preset("a100-80gb"), num_gpus=1024, gpus_per_node=8)
    base = Plan(tp=8, pp=16, dp=8, zero_stage=1, micro_batch=1, accumulation=32, sequence_parallel=True)
    for recompute, share in (("none", 1 / 3), ("full", 1 / 4)):  # the recomputed forward falls in B
        plan = Plan(**{**base.__dict__, "recompute": recompute})
        w = weight_grad_share(model, 2048, plan)
        assert w == pytest.approx(share, rel=0.05)
        one = estimate_cost(model, cluster, plan)
        zb = estimate_cost(model, cluster, Plan(**{**plan.__dict__, "zero_bubble": True}))
        assert zb.bubble_s == pytest.approx(one.bubble_s * (1 - 2 * w))
        assert zb.step_time_s == pytest.approx(one.step_time_s - one.bubble_s + zb.bubble_s)


def test_extra_memory_is_the_deferred_ws():
    model = ModelSpec.from_params("1.3B", seq_len=2048)
    kw = {"tp": 2, "pp": 4, "micro_batch": 1, "accumulation": 8, "sequence_parallel": True}
    for stage in range(4):
        one = estimate_memory(model, stage=stage, **kw)
        zb = estimate_memory(model, stage=stage, zero_bubble=True, **kw)
        assert "weight_grad_inputs" not in one.items
        assert zb.in_flight == 4 and one.in_flight == 4 - stage  # every stage holds p, as 1F1B's first does
        assert (zb.items["activations"] > one.items["activations"]) == (stage > 0)
        assert one.items["pipeline_outputs"] == 0  # freed once sent (sent_output); zero bubble's B takes the output
        assert (zb.items["pipeline_outputs"] > 0) == (
            stage < 3
        )  # itself, so it keeps them until B (the last sends none)
        # the first stage's B does nothing (no input gradient); later stages keep B's gradients per pending W
        assert (zb.items["weight_grad_inputs"] > 0) == (stage > 0)
        assert zb.total >= one.total


def test_schedule_pin(capsys):
    args = [
        "plan",
        "--params",
        "175B",
        "--gpus",
        "1024",
        "--tp",
        "8",
        "--pp",
        "16",
        "--zero",
        "1",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
        "--json",
    ]
    reports = {}
    for schedule in ("1f1b", "zb-h1"):
        assert cli.main([*args, "--schedule", schedule]) == 0
        reports[schedule] = json.loads(capsys.readouterr().out)["plan"]
    one, zb = reports["1f1b"], reports["zb-h1"]
    assert (one["schedule"], zb["schedule"]) == ("1f1b", "zb-h1")
    assert zb["bubble_fraction"] < 0.6 * one["bubble_fraction"] and zb["tokens_per_s"] > one["tokens_per_s"]
    assert zb["peak_memory_gib"] > one["peak_memory_gib"] and zb["memory"]["weight_grad_inputs"] > 0
    assert cli.main([*args[:-1], "--schedule", "zb-h1"]) == 0
    assert "--schedule zb-h1" in capsys.readouterr().out  # the launch command runs what was planned
    assert cli.main([*args, "--schedule", "zb-h1", "--vpp", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--schedule zb-h1 runs one model chunk per stage, got --vpp 2" in err
