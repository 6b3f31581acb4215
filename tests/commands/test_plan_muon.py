"""``megakit plan --optimizer muon`` end to end: its memory table and lines, the ds_config and launch it emits (the
trainer's ``check_muon`` takes them), and the layouts the trainer cannot run Muon at, each refused in one line."""

import json
import shlex

import pytest

from megakit.commands import cli


def plan(capsys, *argv):
    try:
        code = cli.main(["plan", *argv])
    except SystemExit as stop:  # argparse's own refusals exit, with status 2
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def _flag(launch: str, name: str) -> str:
    words = shlex.split(launch)
    return words[words.index(name) + 1]


@pytest.mark.parametrize(
    "precision, zero, want_zero",
    [("fp32", None, 0), ("bf16", "1", 1), ("bf16", "2", 2)],
)
def test_the_emitted_ds_config_and_launch_run_muon_as_planned(tmp_path, capsys, precision, zero, want_zero):
    """No "optimizer" section (the trainer refuses one), the plan's ZeRO stage and precision, and --optimizer muon
    with the plan's LR in the launch line: the trainer's check_muon and ds_config reader accept them (ZeRO 1-2 in
    bf16 once the trainer runs Muon there, megakit.train.engine.muon_zero)."""
    from megakit.train.engine.ds_config import load_ds_config
    from megakit.train.engine.muon import check_muon

    target = tmp_path / "muon.json"
    argv = ["--model", "llama-tiny", "--gpus", "4", "--precision", precision, "--optimizer", "muon"]
    argv += ["--zero", zero] if zero else []
    code, out, err = plan(capsys, *argv, "--emit-config", str(target), "--json")
    assert code == 0, err
    report = json.loads(out)
    p, launch = report["plan"], report["assumptions"]["launch"]
    config = json.loads(target.read_text())
    assert "optimizer" not in config and config["zero_optimization"]["stage"] == p["zero_stage"] == want_zero
    assert ("bf16" in config) == (precision == "bf16")
    assert _flag(launch, "--optimizer") == "muon" and float(_flag(launch, "--muon-lr")) == pytest.approx(p["lr"], 1e-2)
    assert _flag(launch, "--muon-weight-decay") == "0.1"
    assert load_ds_config(str(target), dp=p["dp"], pp=p["pp"])["train_batch_size"] == p["global_batch"]
    if want_zero:
        pytest.importorskip("megakit.train.engine.muon_zero", reason="the trainer runs Muon at ZeRO 0 only here")
    check_muon(config, lr=float(_flag(launch, "--muon-lr")), weight_decay=float(_flag(launch, "--muon-weight-decay")))
    capsys.readouterr()  # what DeepSpeed printed when the trainer's reader imported it
    # AdamW's plan of the same flags keeps its optimizer section and launches without --optimizer
    adamw = [a for a in argv if a not in ("--optimizer", "muon")]
    code, out, _ = plan(capsys, *adamw, "--emit-config", str(tmp_path / "adamw.json"), "--json")
    assert code == 0 and "--optimizer" not in json.loads(out)["assumptions"]["launch"]
    assert json.loads((tmp_path / "adamw.json").read_text())["optimizer"]["type"] == "AdamW"


def test_the_report_says_muon_momentum_and_adam_moments_line_by_line(capsys):
    """The memory table's rows name Muon's momentum and its step apart from Adam's moments, the checkpoint's size
    counts one momentum for Muon's 6.98 B weights (14 - 4 x 6.98 / 8.03 B/param), and the Muon lines give the plan's
    own Newton-Schulz, TP and DP exchange times and their share of the step it was ranked by."""
    code, out, err = plan(capsys, "--model", "llama-3-8b", "--gpus", "8", "--gpu", "h100-80gb", "--optimizer", "muon")
    assert code == 0, err
    for needle in ("Adam moments (m, v)", "Muon momentum (one fp32 per hidden-matrix weight)", "Muon step: updates"):
        assert needle in out, needle
    assert "--optimizer muon --muon-lr" in out
    flat = " ".join(out.split())  # the save tip: Muon's weights save one momentum, not Adam's two moments
    assert "(10.5 B/param: weights + fp32 master + Adam m, v or Muon momentum)" in flat
    lines = out[out.index("Muon (--optimizer muon), per GPU and step") :]
    for needle in ("Newton-Schulz:", "TP exchange of the split", "DP exchange of the partitions", "which the search"):
        assert needle in lines, needle


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--zero", "3"], "--optimizer muon --zero 3: ZeRO 3 partitions each weight over DP"),
        (["--zero", "0"], "--optimizer muon --zero 0 in bf16: DeepSpeed's bf16 optimizer steps flat copies"),
        (["--offload", "optimizer"], "--optimizer muon --offload optimizer: Muon steps on the GPU"),
        (["--runtime", "megatron"], "--optimizer muon prices megakit's trainer's Muon, not --runtime megatron's"),
    ],
)
def test_what_the_trainer_cannot_run_muon_at_is_one_line(tmp_path, capsys, flags, message):
    target = tmp_path / "never.json"
    code, out, err = plan(
        capsys, "--params", "1.3B", "--gpus", "8", "--optimizer", "muon", *flags, "--emit-config", str(target)
    )
    assert code == 2 and message in err and err.count("\n") == 1 and not out, err
    assert not target.exists()


def test_a_pinned_muon_layout_that_does_not_fit_is_fixed_by_what_the_trainer_runs(capsys):
    """Llama-3-8B pinned at TP 1 x DP 2, ZeRO 1 on 2 H100: neither fits; AdamW's fix is to offload its optimizer,
    Muon's a change Muon runs with (TP 2), never ZeRO 3 or offload, which its memory model refuses."""
    argv = ["--model", "llama-3-8b", "--gpus", "2", "--gpu", "h100-80gb", "--tp", "1", "--pp", "1", "--zero", "1"]
    argv += ["--micro-batch", "1", "--recompute", "full"]
    code, _, err = plan(capsys, *argv)
    assert code == 2 and "fix: --offload optimizer" in err, err
    code, out, err = plan(capsys, *argv, "--optimizer", "muon")
    assert code == 2 and err.count("\n") == 1 and "Muon does not fit" in err, err
    assert "fix: --tp 2" in err and "--zero 3" not in err and "--offload" not in err
