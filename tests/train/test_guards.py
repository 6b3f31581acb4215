"""The NaN guard through the launcher: a NaN loss on one rank at step 4 is skipped on every rank, at ZeRO 0-3,
bf16 and PP 2, and for an MoE model with the expert bias at PP 2 and EP 2; the weights (and the expert bias) after
the skipped step are those before it; N skips in a row end the run."""

import json
import math

import pytest
from jobs import deepspeed, ds_config
from safetensors.torch import load_file

from megakit.train.doctor.fault_injection import VARIABLE


def _weights(directory) -> dict:
    return {f"{f.name}/{k}": v for f in sorted(directory.glob("model-*.safetensors")) for k, v in load_file(f).items()}


def _config(stage: int, **more) -> dict:
    config = {**ds_config(stage), **more}
    config["scheduler"]["params"]["warmup_num_steps"] = 20  # linear over the run: lr(step) = base (step + 1) / 20
    return config


def _cases(tmp_path) -> list[dict]:
    configs = {
        "zero0": (_config(0), {}),
        "zero1": (_config(1), {}),
        "zero2": (_config(2), {}),
        "zero3": (_config(3), {}),
        "zero1-bf16": (_config(1, bf16={"enabled": True}), {}),
        "pp2": (_config(1), {"pp": 2}),
    }
    moe = {"moe-pp2": {"pp": 2}, "moe-ep2": {"ep": 2}}  # the expert bias moves after the guard's verdict, or not at all
    return (
        [
            dict(
                ds_config=config,
                model="gpt-tiny",
                steps=7,
                seq_len=32,
                save=str(tmp_path / name),
                save_every=1,
                keep=10,
                **extra,
            )
            for name, (config, extra) in configs.items()
        ]
        + [
            dict(
                ds_config=_config(1),
                model="moe-tiny",
                steps=7,
                seq_len=32,
                save=str(tmp_path / name),
                save_every=1,
                keep=10,
                moe_expert_bias=True,
                **extra,
            )
            for name, extra in moe.items()
        ]
        + [dict(ds_config=_config(1), model="gpt-tiny", steps=7, seq_len=32, max_skipped_steps=0)]
    )  # ends at step 4


@pytest.mark.slow
def test_a_nan_loss_on_one_rank_is_skipped_everywhere(tmp_path, monkeypatch):
    cases = _cases(tmp_path)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    monkeypatch.setenv(VARIABLE, "nanloss@1:4")
    out = deepspeed(
        2, "tests/helpers/guard_sweep.py", str(tmp_path / "cases.json"), str(tmp_path / "results.json"), timeout=900
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    *results, ended = json.loads((tmp_path / "results.json").read_text())
    for case, result in zip(cases, results):
        name = case["save"].rsplit("/", 1)[1]
        assert result["skipped"] == [4], (name, result)
        assert [i for i, x in enumerate(result["loss"]) if not math.isfinite(x)] == [4], (name, result)
        (event,) = result["events"]
        assert event["step"] == 4 and event["skipped_steps"] == 1 and "rank 1 " in event["text"], event
        assert "non-finite loss and gradient" in event["text"] or "pp2" in name, event  # PP: rank 1 is the last stage
        lr = result["lr"]
        assert lr[5] / lr[3] == pytest.approx(6 / 4, rel=1e-9), (name, lr)  # the schedule went on (linear warm-up)
        before, after, earlier = (_weights(tmp_path / name / f"step-{n:07d}") for n in (4, 5, 3))
        assert before.keys() == after.keys()
        assert all(before[k].equal(after[k]) for k in before), name  # step 4 left the weights as they were
        assert any(not before[k].equal(earlier[k]) for k in before), name  # step 3 did move them
        if name.startswith("moe"):  # the expert bias too: bitwise unchanged by the skipped step, moved by step 3
            bias = [k for k in before if k.endswith("e_score_correction_bias")]
            assert bias and all(before[k].equal(after[k]) for k in bias), (name, bias)
            assert all(not before[k].equal(earlier[k]) for k in bias), name
        assert math.isfinite(result["loss"][6]) and result["loss"][6] != result["loss"][5]
    assert ended["error"].startswith(
        "NaN/inf at step 4: rank 0 (pp 0, dp 0, tp 0): non-finite gradient; "
        "rank 1 (pp 0, dp 1, tp 0): non-finite loss and gradient; "
        "1 non-finite step(s) in a row (--max-skipped-steps 0)"
    ), ended
    log = out.stdout + out.stderr
    assert log.count("megakit: step 4 skipped (1 in all): rank 0 ") == 8, log[-3000:]  # one line per case


def test_the_training_faults_are_read_and_refused_like_the_doctors():
    from megakit.errors import UsageError
    from megakit.train.doctor.fault_injection import parse

    faults = parse("nanloss@1:4,kill@0:7")
    assert faults[1].nan_loss_step == 4 and faults[0].kill_step == 7
    for bad in ("nanloss@1", "kill@0"):  # a step is required
        with pytest.raises(UsageError, match=f"cannot read '{bad}'"):
            parse(bad)


def test_a_negative_max_skipped_steps_is_one_line_and_exit_2():
    from megakit.errors import UsageError
    from megakit.train.trainer import TrainConfig

    with pytest.raises(UsageError, match="--max-skipped-steps must be 0 .* or more, got -1"):
        TrainConfig(ds_config={}, max_skipped_steps=-1)


def _guard_decisions(rank: int, world: int) -> list:
    """Rank 1 sees a NaN loss at steps 1 and 2 (its optimizer, like rank 0's, did not step); then a step
    only rank 0 applied."""
    from types import SimpleNamespace

    import torch

    from megakit.train.resilience.guards import StepGuard, TrainingDiverged

    topo = SimpleNamespace(rank=rank, is_last_stage=True)
    guard = StepGuard(topo, max_skipped=1, precision="fp32", describe=lambda r: f"rank {r}")
    out = []
    for step, bad in ((0, False), (1, True), (2, True)):
        loss = torch.tensor(float("nan") if bad and rank == 1 else 2.0 + rank)
        try:  # rank 1 is asked to stop (SIGTERM) at step 1: every rank learns it from the same all-reduce
            out.append(guard.check(step, loss, grads_finite=not bad, applied=not bad, stop=15 * (rank == step == 1)))
        except TrainingDiverged as error:
            out.append(str(error))
        out.append(guard.stops)
    try:
        guard.check(3, torch.tensor(1.0), grads_finite=True, applied=rank == 0)
    except RuntimeError as error:
        out.append(str(error))
    return out


def test_the_guard_decides_alike_on_every_rank_and_ends_after_the_limit():
    from multiproc import run_ranks

    for out in run_ranks(_guard_decisions, 2):
        out, stops = out[:6:2] + out[6:], out[1:6:2]
        assert stops == [{}, {1: 15}, {}], stops  # a stop asked on one rank, seen on every rank at that step
        assert out[0] == (2.5, None)  # the loss averaged over the job
        assert out[1] == (
            pytest.approx(float("nan"), nan_ok=True),
            "step 1 skipped (1 in all): rank 0: non-finite gradient; rank 1: non-finite loss and gradient",
        )
        assert out[2].startswith(
            "NaN/inf at step 2: rank 0: non-finite gradient; rank 1: non-finite loss and "
            "gradient; 2 non-finite step(s) in a row (--max-skipped-steps 1)"
        ), out[2]
        assert out[3] == "step 3: finite everywhere, but the optimizer did not step on ranks [1]", out[3]
