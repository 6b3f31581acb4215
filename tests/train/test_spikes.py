"""The loss-spike guard through the launcher: a spike injected at step 8 rolls back to the step-6 checkpoint,
skips the batches read since (those of steps 6-8), and goes on to the end; its checkpoints keep the skip.

DP 2, ZeRO 1, dropout 0.1 (its masks follow the data position too), ``--save-every 3 --async-save``. The run
that rolled back is checked against two resumes in a second job: from its own step-9 checkpoint (a resume keeps
the skip), and from its step-6 checkpoint with the skip written into the manifest by hand (the run that never
spiked and skipped those batches): the losses are the same, bit for bit.
"""

import glob
import json
import shutil

import pytest
from jobs import dropout_model, ds_config
from multiproc import free_port

from megakit.train.doctor.fault_injection import VARIABLE
from megakit.train.observe.metrics import read_metrics


def _launch(tmp_path, name: str, cases: list[dict], monkeypatch, fault: str = "") -> tuple[list[dict], str]:
    from jobs import deepspeed

    monkeypatch.setenv(VARIABLE, fault)
    (tmp_path / f"{name}.json").write_text(json.dumps(cases))
    port = free_port()
    out = deepspeed(
        2,
        "tests/helpers/guard_sweep.py",
        str(tmp_path / f"{name}.json"),
        str(tmp_path / f"{name}-results.json"),
        port=port,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    return json.loads((tmp_path / f"{name}-results.json").read_text()), out.stdout + out.stderr


def _extra(checkpoint) -> dict:
    return json.loads((checkpoint / "manifest.json").read_text())["extra"]


@pytest.mark.slow
def test_a_spike_rolls_back_skips_its_batches_and_a_resume_keeps_the_skip(tmp_path, monkeypatch):
    model, save = dropout_model(tmp_path), tmp_path / "spiked"
    common = dict(ds_config=ds_config(1), model=model, steps=12, seq_len=32)
    spiked = dict(
        common,
        save=str(save),
        save_every=3,
        keep=10,
        spike_guard=4.0,
        async_save=True,
        metrics_out=str(tmp_path / "metrics.json"),
        tensorboard=str(tmp_path / "tb"),
    )
    (a,), log = _launch(tmp_path, "spiked", [spiked], monkeypatch, fault="spike@8")
    assert a["step"] == [*range(9), *range(6, 12)], a  # steps 6-8 again, after the rollback
    assert a["loss"][8] > 100 * a["loss"][7]  # the injected spike
    (event,) = a["events"]
    assert {k: event[k] for k in ("step", "kind", "rollback_to", "skipped_batches", "data_offset")} == {
        "step": 8,
        "kind": "rollback",
        "rollback_to": 6,
        "skipped_batches": 3,
        "data_offset": 3,
    }, event
    assert log.count("megakit: loss spike at step 8: ") == 1, log[-3000:]  # one line, rank 0's
    assert f"rolled back to {save / 'step-0000006'} (step 6), skipping the batches of steps 6-8 (3)" in event["text"]
    assert read_metrics(tmp_path / "metrics.json")["events"] == [event]
    assert any(b"guard/skipped_batches" in f.read_bytes() for f in (tmp_path / "tb").iterdir())
    assert sorted(p.name for p in save.iterdir()) == ["latest", *(f"step-{n:07d}" for n in (3, 6, 9, 12))]
    end = _extra(save / "step-0000012")  # written in the background, after the rollback
    assert end["optimizer_step"] == 12 and end["data"]["skipped_batches"] == 3, end  # 12 updates; the skip kept
    assert end["data"]["samples"] == 15 * end["global_batch"]

    never = tmp_path / "never-spiked"  # the step-6 checkpoint, told to skip batches 6-8
    shutil.copytree(save / "step-0000006", never)
    manifest = json.loads((never / "manifest.json").read_text())
    assert manifest["extra"]["data"]["skipped_batches"] == 0
    manifest["extra"]["data"]["skipped_batches"] = 3
    (never / "manifest.json").write_text(json.dumps(manifest))
    resumed, unspiked = (
        dict(common, load=str(save / "step-0000009"), save=str(tmp_path / "resumed")),
        dict(common, load=str(never)),
    )
    (b, c), _ = _launch(tmp_path, "resumed", [resumed, unspiked], monkeypatch)
    after = dict(zip(a["step"][9:], a["loss"][9:]))  # the run after its rollback
    assert b["step"] == [9, 10, 11] and c["step"] == [*range(6, 12)]
    assert b["loss"] == [after[s] for s in b["step"]], (b, after)  # bitwise
    assert c["loss"] == [after[s] for s in c["step"]], (c, after)
    assert _extra(tmp_path / "resumed")["data"]["skipped_batches"] == 3  # and the resumed run's checkpoint keeps it
    assert not b["events"] and not c["events"]


def test_the_spike_rule_arms_after_8_losses_and_keeps_the_last_50():
    from megakit.train.resilience.spikes import ARMED_AFTER, WINDOW, SpikeGuard

    guard = SpikeGuard(3.0)
    for step in range(ARMED_AFTER):  # not armed: even a huge loss joins the window
        assert guard.check(step, 100.0 if step == 3 else 5.0 + 0.01 * (step % 2)) is None
    guard = SpikeGuard(3.0, saved=[[s, 5.0 + 0.1 * (s % 2)] for s in range(ARMED_AFTER)])  # mean 5.05, std 0.05
    assert guard.check(8, 5.19) is None  # 2.8 standard deviations
    why = guard.check(9, 5.3)  # the window now holds 5.19 too
    assert why is not None and "above the mean" in why and "(--spike-guard 3)" in why, why
    assert [s for s, _ in guard.recent] == list(range(9))  # a spike does not join the window
    assert guard.check(10, float("nan")) is None and len(guard.recent) == 9  # a NaN is the NaN guard's
    for step in range(10, 100):
        guard.check(step, 5.0)
    assert len(guard.recent) == WINDOW and guard.recent[0][0] == 100 - WINDOW
    flat = SpikeGuard(3.0, saved=[[s, 2.0] for s in range(10)])  # no spread: the floor, 0.1 % of the mean
    assert flat.check(10, 2.005) is None and flat.check(11, 2.01) is not None


def test_spike_flags_are_refused_in_one_line():
    from megakit.errors import UsageError
    from megakit.train.doctor.fault_injection import parse
    from megakit.train.trainer import TrainConfig

    with pytest.raises(UsageError, match="--spike-guard 4 rolls back to the newest checkpoint of --save DIR; pass"):
        TrainConfig(ds_config={}, spike_guard=4)
    with pytest.raises(UsageError, match="a Z above 0"):
        TrainConfig(ds_config={}, spike_guard=-1, save="x", save_every=2)
    with pytest.raises(UsageError, match="--async-save writes the checkpoints of --save DIR in the background"):
        TrainConfig(ds_config={}, async_save=True)
    assert parse("spike@8")[-1].spike_step == 8
    for bad in ("spike@1:8", "spike"):
        with pytest.raises(UsageError, match=f"cannot read '{bad}'.*spike@STEP plays on every rank"):
            parse(bad)
