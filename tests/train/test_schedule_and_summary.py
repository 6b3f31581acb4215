"""A run's LR schedule follows --steps unless the ds_config pins it, the banner says which, and the run ends on a
summary (issue 55 items 3 and 4).

The schedule is DeepSpeed's own class, built from the ds_config as the trainer and the single-process reference
build it; one launcher job runs the shipped fine-tuning preset and reads what the user reads: the banner, the
per-step lr, the closing lines, and none of DeepSpeed's per-rank start-up noise.
"""

import json
import re

import pytest
import torch
from deepspeed.runtime import lr_schedules
from jobs import deepspeed
from paths import ROOT

from megakit.train.engine.ds_config import schedule_over_steps
from megakit.train.engine.optim import start_schedule

PRESETS = sorted((ROOT / "ds_configs").glob("*.json"))


def lrs(config: dict, steps: int) -> list[float]:
    """The lr of each of ``steps`` optimizer steps, with the schedule placed as the trainer places it."""
    optimizer = torch.optim.AdamW(
        [torch.nn.Parameter(torch.zeros(1))],
        **{k: v for k, v in config["optimizer"]["params"].items() if k != "torch_adam"},
    )
    scheduler = getattr(lr_schedules, config["scheduler"]["type"])(optimizer, **config["scheduler"]["params"])
    out = []
    for step in range(steps):
        start_schedule(scheduler, step)
        out.append(optimizer.param_groups[0]["lr"])
    return out


def preset(name: str) -> dict:
    return json.loads((ROOT / "ds_configs" / name).read_text())


@pytest.mark.parametrize("path", PRESETS, ids=[p.stem for p in PRESETS])
def test_no_preset_pins_the_schedule_length(path):
    """The shipped presets leave total_num_steps out: a run of any length decays over its own steps."""
    params = json.loads(path.read_text()).get("scheduler", {}).get("params", {})
    assert "total_num_steps" not in params


def test_the_schedule_decays_over_steps_and_ends_at_its_floor():
    config = preset("finetune.json")
    line = schedule_over_steps(config, steps=200)
    assert config["scheduler"]["params"]["total_num_steps"] == 200
    assert line == (
        "megakit: LR schedule: WarmupCosineLR, lr 2e-05, 10 warm-up steps, cosine to 0.1 x at step 200 (--steps)"
    )
    got = lrs(config, 200)
    peak = 2e-5
    assert got[0] == pytest.approx(peak / 10) and got[8] == pytest.approx(0.9 * peak)  # linear warm-up from step 0
    assert got[9] == pytest.approx(peak, rel=1e-3)  # the cosine's first step
    assert got[-1] == pytest.approx(0.1 * peak)  # the floor at the last step: the decay spans the run
    assert all(a >= b for a, b in zip(got[9:], got[10:]))  # and falls all the way
    assert got[100] > 0.5 * peak  # not already over (a 2,000-step cosine would sit at 0.98 peak at the end)


def test_a_total_the_ds_config_sets_is_kept_and_named():
    config = preset("zero1.json")
    config["scheduler"]["params"]["total_num_steps"] = 2000
    line = schedule_over_steps(config, steps=200)
    assert config["scheduler"]["params"]["total_num_steps"] == 2000
    assert "the ds_config pins total_num_steps 2000, not --steps 200" in line
    pinned = preset("zero1.json")
    pinned["scheduler"]["params"]["total_num_steps"] = 200
    assert schedule_over_steps(pinned, steps=200).endswith("(the ds_config's total_num_steps)")


def test_schedules_without_an_end_and_no_schedule_are_said_as_they_are():
    config = preset("zero1.json")
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}
    assert "WarmupLR (lr 0.002); it has no end" in schedule_over_steps(config, steps=10)
    assert "total_num_steps" not in config["scheduler"]["params"]  # WarmupLR takes no such argument
    del config["scheduler"]
    assert schedule_over_steps(config, steps=10) == "megakit: LR schedule: none in the ds_config (lr 0.002, constant)"


def test_a_warm_up_longer_than_the_run_is_said():
    config = preset("zero1.json")  # 20 warm-up steps
    assert schedule_over_steps(config, steps=5).endswith(
        "; the warm-up is not over by step 5: lower warmup_num_steps in the ds_config"
    )


def test_a_resume_keeps_the_schedule_its_checkpoint_was_trained_on(tmp_path):
    """--steps 400 from a checkpoint of a 200-step schedule: the schedule continues (the lr would otherwise jump from
    its decayed value back up a new curve), and the banner says so and how to schedule again."""
    from megakit.core.model_config import ModelConfig
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import Transformer
    from megakit.train.run import TrainConfig, resolve

    config = ModelConfig.load("gpt-tiny")
    save_checkpoint(
        tmp_path / "ckpt",
        Transformer(config, seed=0),
        step=150,
        config=config,
        extra={"seed": 0, "lr_total_steps": 200},
    )
    run = resolve(
        TrainConfig(ds_config=preset("finetune.json"), model="gpt-tiny", steps=400, load=str(tmp_path / "ckpt")),
        1,
        say=lambda *_: None,
    )
    assert run.start_step == 150 and run.ds_config["scheduler"]["params"]["total_num_steps"] == 200
    assert run.lr_schedule.endswith(
        "at step 200 (the loaded checkpoint's schedule, kept: --steps is 400; set "
        "total_num_steps in the ds_config to schedule again)"
    ), run.lr_schedule
    pinned = preset("finetune.json")
    pinned["scheduler"]["params"]["total_num_steps"] = 400  # the user's way to stretch it
    run = resolve(
        TrainConfig(ds_config=pinned, model="gpt-tiny", steps=400, load=str(tmp_path / "ckpt")), 1, say=lambda *_: None
    )
    assert run.ds_config["scheduler"]["params"]["total_num_steps"] == 400


def test_the_summary_counts_what_ran_and_says_minutes():
    """Minutes and seconds from one rounding (119.6 s is 2 min 00 s, not 1 min 60 s); a --spike-guard rollback's
    redone steps are named, not counted as steps past the end; skipped (NaN) steps leave the losses alone."""
    from megakit.train.observe.metrics import StepMetrics
    from megakit.train.observe.reporting import RunSummary

    now = [0.0]
    summary = RunSummary(start=10, clock=lambda: now[0])

    def step(i: int, loss: float) -> None:
        summary.step(
            StepMetrics(
                step=i,
                loss=loss,
                lr=1e-3,
                grad_norm=1.0,
                seconds=0.1,
                samples=2,
                tokens=64,
                flops=1.0,
                comm_seconds=None,
                comm_calls=None,
                world_size=1,
                peak_tflops=None,
            )
        )

    for i, loss in ((10, 3.0), (11, 2.5), (12, float("nan")), (11, 2.6), (12, 2.4)):  # 11-12 redone after a rollback
        step(i, loss)
    summary.evaluated(13, 2.7)
    now[0] = 119.6
    assert summary.lines(checkpoint=None, save=None) == [
        "megakit: done: steps 10 to 12 (2 redone after a rollback), 320 tokens in 2 min 00 s of training | loss "
        "3.0000 at step 10 -> 2.4000 at step 12, best 2.4000 at step 12 | best val loss 2.7000 after 13 steps | no "
        "checkpoint (no --save)"
    ]
    now[0] = 5.25
    assert summary.lines(checkpoint="ck/step-0000013", save="ck")[1] == (
        "megakit: last checkpoint ck/step-0000013; export it to transformers with: megakit convert ck ck-hf --to-hf"
    )


def test_the_reference_follows_steps_as_the_trainer_does():
    """The single-process reference gets the raw preset and must run the trainer's schedule; the caller's dict is
    left as it was."""
    from megakit.train.doctor.reference import reference_run

    config = preset("finetune.json")
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    config["scheduler"]["params"]["warmup_num_steps"] = 2
    ref = reference_run(config, model="gpt-tiny", steps=4, seq_len=16)
    assert "total_num_steps" not in config["scheduler"]["params"]
    filled = json.loads(json.dumps(config))
    schedule_over_steps(filled, steps=4)
    assert ref["lr"] == pytest.approx(lrs(filled, 4), rel=1e-12)


@pytest.mark.slow
def test_a_fine_tune_says_its_schedule_and_ends_on_a_summary(tmp_path):
    """2 processes, the fine-tuning preset as shipped, 12 steps: the banner names the schedule over --steps, the
    last step trains at the floor (2e-6), the run ends on the summary and the export command, and the workers
    print none of DeepSpeed's start-up lines (the launcher's own stay: they follow its --log_level)."""
    save = tmp_path / "tuned"
    done = deepspeed(
        2,
        "scripts/train.py",
        "--ds_config",
        "ds_configs/finetune.json",
        "--model",
        "gpt-tiny",
        "--seq-len",
        "32",
        "--steps",
        "12",
        "--save",
        str(save),
        "--no-progress",
        "--log-every",
        "1",
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert (
        "megakit: LR schedule: WarmupCosineLR, lr 2e-05, 10 warm-up steps, cosine to 0.1 x at step 12 (--steps)" in out
    ), out[-3000:]
    steps = re.findall(r"^step +(\d+) \| loss ([\d.]+) \| lr ([\d.e+-]+)", done.stdout, re.M)
    assert [int(s) for s, _, _ in steps] == list(range(12)), steps
    assert float(steps[0][2]) == pytest.approx(2e-6, rel=1e-2) and float(steps[-1][2]) == pytest.approx(2e-6, rel=1e-2)
    assert float(steps[8][2]) == pytest.approx(1.8e-5, rel=1e-2)  # warm-up: (step + 1) / 10 of 2e-5
    assert float(steps[9][2]) == pytest.approx(1.1e-5, rel=1e-2)  # half-way down the 2-step cosine to 0.1 x
    tokens = 4 * 2 * 2 * 32 * 12  # the preset's micro-batch x accumulation, DP 2, --seq-len, --steps
    summary = re.search(
        rf"^megakit: done: steps 0 to 11, {tokens:,} tokens in [\d.]+ s of training \| loss "
        r"([\d.]+) at step 0 -> ([\d.]+) at step 11, best ([\d.]+) at step (\d+)$",
        done.stdout,
        re.M,
    )
    assert summary, done.stdout[-2000:]
    losses = [float(loss) for _, loss, _ in steps]
    assert float(summary[1]) == pytest.approx(losses[0], abs=1e-4) and float(summary[2]) == pytest.approx(
        losses[-1], abs=1e-4
    )
    assert float(summary[3]) == pytest.approx(min(losses), abs=1e-4) and int(summary[4]) == losses.index(min(losses))
    assert (
        f"megakit: last checkpoint {save}; export it to transformers with: megakit convert {save} {save}-hf --to-hf"
    ) in done.stdout
    saved = json.loads((save / "manifest.json").read_text())["extra"]
    assert saved["lr_total_steps"] == 12  # what a resume continues
    assert "built successfully" not in out  # DeepSpeed's CPU op, once per rank
    # the launcher's runner and launch.py each detect the accelerator once; the two ranks no longer do
    assert out.count("Setting accelerator to CPU") <= 2, out[:3000]
