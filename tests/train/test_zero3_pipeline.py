"""ZeRO 3 under megakit's own pipeline executor (``megakit.train.engine.zero3_pipeline``), through the real
launcher, against one process.

One 4-process job (``tests/helpers/launch_sweep.py``), 4 micro-batches per step:

- ``gpt-tiny`` (tied embeddings: one copy on each stage) at PP 2 x DP 2 under ZeRO 3, 1F1B (warm-up forwards on
  the first stage, then one forward and one backward in turn);
- ``moe-tiny`` at PP 2 x EP 2, EP folded over DP 2 (each expert on one rank of its stage), under ZeRO 3, GPipe
  (every forward, then every backward).

Before the fix the first job hung in its first forward (DeepSpeed's trace check broadcasts over the world while
the other stage waits for activations); without the copy-or-add fix the first stage's second backward replaced
the first's gradients (GPipe's backwards all replaced each other's); without megakit's norm the tied copy counted
twice and the experts' norm missed the other stage. Losses and clipped gradient norms follow the single-process
model's within the fp32 bound of a step's tokens (``tests/helpers/tolerance.py``). Schedules whose chunks bypass
DeepSpeed's engine get one line before any process.
"""

import json
import re

import pytest
from jobs import ds_config, sweep
from paths import ROOT
from tolerance import fp32_bound

from megakit.errors import UsageError
from megakit.train.run import TrainConfig, resolve

STEPS, MICRO, ACCUMULATION = 4, 2, 4
TOKENS = MICRO * ACCUMULATION * 2 * 32  # a step's global batch at DP 2: 16 sequences of 32 tokens


def test_zero3_pipeline_schedules_outside_the_engine_are_refused(tmp_path):
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    zero3 = json.loads((ROOT / "ds_configs" / "zero3.json").read_text())
    assert resolve(TrainConfig(ds_config=zero3, data=str(data), model="gpt-tiny", pp=2), 4).schedule == "1f1b"
    for flags, message in (
        (dict(vpp=2), "--schedule interleaved with ZeRO 3"),
        (dict(schedule="zb-h1"), "--schedule zb-h1 with ZeRO 3"),
    ):
        with pytest.raises(UsageError, match=re.escape(message) + ".* use --schedule 1f1b"):
            resolve(TrainConfig(ds_config=zero3, data=str(data), model="gpt-tiny", pp=2, **flags), 4)


@pytest.mark.slow
def test_zero3_pipeline_follows_the_single_process(tmp_path_factory):
    from megakit.train.doctor.reference import reference_run

    config = ds_config(3, micro=MICRO, accumulation=ACCUMULATION)
    cases = [
        dict(ds_config=config, model="gpt-tiny", steps=STEPS, seq_len=32, pp=2),  # PP 2 x DP 2
        dict(ds_config=config, model="moe-tiny", steps=STEPS, seq_len=32, pp=2, ep=2, schedule="gpipe"),
    ]  # EP 2
    results = sweep(tmp_path_factory, 4, cases, timeout=600)
    for case, result in zip(cases, results):
        ref = reference_run(config, model=case["model"], steps=STEPS, dp=2, seq_len=32)
        assert len(result["loss"]) == STEPS, (case["model"], result)
        for step, (got, want) in enumerate(zip(result["loss"], ref["loss"])):
            assert abs(got - want) <= fp32_bound(want, TOKENS), (case["model"], step, got, want)
        for step, (got, want) in enumerate(zip(result["grad_norm"], ref["grad_norm"])):
            assert abs(got - want) <= fp32_bound(want, TOKENS), (case["model"], step, got, want)  # clipped at 1.0
