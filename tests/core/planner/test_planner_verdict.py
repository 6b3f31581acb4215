"""A fully pinned layout is judged against the GPU's memory (yes / above_threshold / no), not refused
by the 80 % line; the free search keeps the line."""

import json

import pytest

from megakit.commands import cli
from megakit.core.planner.verdict import verdict

PINNED = [
    "--params",
    "1.3B",
    "--gpus",
    "8",
    "--tp",
    "1",
    "--pp",
    "1",
    "--zero",
    "1",
    "--micro-batch",
    "4",
    "--recompute",
    "none",
    "--global-batch",
    "64",
]


def plan(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _peak_gib(capsys) -> float:
    code, out, err = plan(capsys, *PINNED, "--gpu-mem", "1000", "--json")
    assert code == 0, err
    report = json.loads(out)["plan"]
    assert report["fits"] == "yes" and report["mem_threshold"] == 0.8
    return report["peak_memory_gib"]


def test_verdict_thresholds():
    assert verdict(79, threshold_bytes=80, gpu_bytes=100) == "yes"
    assert verdict(83, threshold_bytes=80, gpu_bytes=100) == "above_threshold"
    assert verdict(101, threshold_bytes=80, gpu_bytes=100) == "no"


def test_pinned_layout_at_83_percent_runs_with_a_note_on_headroom(capsys):
    peak = _peak_gib(capsys)
    mem = f"{peak / 0.83:.3f}"
    code, out, err = plan(capsys, *PINNED, "--gpu-mem", mem, "--json")
    assert code == 0, err
    p = json.loads(out)["plan"]
    assert p["fits"] == "above_threshold" and p["mem_threshold"] == 0.8
    assert p["peak_memory_gib"] == pytest.approx(peak) and p["peak_memory_gib"] / p["gpu_memory_gib"] == pytest.approx(
        0.83, abs=1e-3
    )
    assert "fragmentation" in p["headroom"] and "NCCL" in p["headroom"]
    code, out, err = plan(capsys, *PINNED, "--gpu-mem", mem)  # the tables say it too
    assert code == 0 and "above the line" in out and "fragmentation" in out
    # The free search at the same memory keeps the 80 % rule: it picks a plan under the line.
    free = [a for a in PINNED if a not in ("--micro-batch", "4")]
    code, out, err = plan(capsys, *free, "--gpu-mem", mem, "--json")
    assert code == 0, err
    p = json.loads(out)["plan"]
    assert p["fits"] == "yes" and p["peak_memory_gib"] <= 0.8 * p["gpu_memory_gib"]


def test_pinned_layout_at_120_percent_exits_2_naming_the_fix(capsys):
    peak = _peak_gib(capsys)
    mem = f"{peak / 1.2:.3f}"
    code, out, err = plan(capsys, *PINNED, "--gpu-mem", mem)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "does not fit" in err and "fix: --micro-batch" in err, err
    code, out, err = plan(capsys, *PINNED, "--gpu-mem", mem, "--json")
    assert code == 2
    p = json.loads(out)["plan"]
    assert p["fits"] == "no" and p["fix"].startswith("--micro-batch") and p["peak_memory_gib"] > p["gpu_memory_gib"]


def test_no_single_change_is_named_when_none_is_enough(capsys):
    code, _, err = plan(
        capsys,
        "--params",
        "175B",
        "--gpus",
        "8",
        "--tp",
        "8",
        "--pp",
        "1",
        "--zero",
        "0",
        "--micro-batch",
        "1",
        "--recompute",
        "full",
        "--global-batch",
        "8",
    )
    assert code == 2 and err.count("\n") == 1 and "fix: " in err, err


def test_when_nothing_fits_the_search_offloads_the_optimizer_and_says_so(capsys):
    """6.7B on one 40 GB GPU: 16 bytes per parameter cannot fit; ZeRO-Offload (optimizer in host memory,
    PCIe traffic each step) can, and the plan says how much CPU memory it needs."""
    code, out, err = plan(
        capsys, "--params", "6.7B", "--gpu", "a100-40gb", "--gpus", "1", "--global-batch", "8", "--json"
    )
    assert code == 0, err
    report = json.loads(out)
    p, why = report["plan"], report["assumptions"]["rule"]["why"]
    assert p["offload"] == "optimizer" and p["zero_stage"] >= 1 and p["peak_memory_gib"] <= 0.8 * 40
    assert "ZeRO-Offload" in why and "GiB of CPU memory" in why
    # The 80 % line and the cluster size still rule: auto-sizing does not offload, it adds nodes.
    code, out, _ = plan(capsys, "--params", "6.7B", "--gpu", "a100-40gb", "--json")
    assert code == 0 and json.loads(out)["plan"]["offload"] == "none"


def test_a_pinned_split_of_the_layers_is_never_undone_by_the_fix():
    """--stage-layers fixes the number of virtual stages, so the fix never proposes another --pp."""
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.core.planner.plan import Plan
    from megakit.core.planner.verdict import _changes

    model = ModelSpec.from_params("1.3B", seq_len=2048)  # 24 layers
    plan_ = Plan(tp=1, pp=2, dp=4, zero_stage=1, micro_batch=1, accumulation=8, recompute="full")
    assert any(text.startswith("--pp") for text, _ in _changes(plan_, world=8, gpus_per_node=8, model=model))
    pinned = model.with_overrides(stage_layers=(11, 13))
    assert not any(text.startswith("--pp") for text, _ in _changes(plan_, world=8, gpus_per_node=8, model=pinned))


def test_fixes_under_a_pipeline_are_what_megakits_pipeline_runs():
    """ZeRO 3 runs under a 1F1B pipeline with one chunk per stage and no offload (megakit.train.engine.zero3_pipeline),
    ZeRO 2 under none: a fix offers ZeRO 3 and more stages where they run, and never an offload ZeRO 3 x PP refuses."""
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.core.planner.plan import Plan
    from megakit.core.planner.verdict import _changes

    model = ModelSpec.from_params("1.3B", seq_len=2048)

    def fixes(**layout):
        plan_ = Plan(tp=1, pp=2, dp=4, micro_batch=1, accumulation=8, recompute="full", **layout)
        return [text for text, _ in _changes(plan_, world=8, gpus_per_node=8, model=model)]

    assert "--zero 3" in fixes(zero_stage=1) and "--zero 2" not in fixes(zero_stage=1)
    assert "--zero 3" not in fixes(zero_stage=1, vpp=2)
    zero3 = fixes(zero_stage=3)
    assert "--pp 4" in zero3 and "--offload optimizer" not in zero3
