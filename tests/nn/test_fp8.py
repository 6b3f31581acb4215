"""``--fp8``: refused in one line where float8 GEMMs cannot run; which linears get them; the layers stay plain.

The training run (TP 2, 20 steps within 2 % of fp32, plain checkpoints) is a case of test_trainer's DP sweep.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from multiproc import THREADS
from paths import ROOT

from megakit.errors import UsageError
from megakit.nn.model import ModelConfig, Transformer
from megakit.nn.tensor_parallel.fp8 import EMULATE_ENV, Float8Matmul, check_fp8, convert_to_fp8


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without float8 GEMMs")
def test_fp8_without_a_float8_gpu_is_refused_in_one_line_before_any_process_group():
    env = {k: v for k, v in os.environ.items() if k != EMULATE_ENV} | {"OMP_NUM_THREADS": THREADS}
    out = subprocess.run(
        [sys.executable, "scripts/train.py", "--fp8", "tensorwise", "--steps", "1"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("train.py")]
    assert lines == [
        "train.py: error: --fp8 tensorwise needs an NVIDIA GPU with float8 GEMMs (compute capability "
        "8.9+: Ada, Hopper, Blackwell) and this machine has none; drop --fp8 (or --fp8 none)"
    ], out.stderr
    assert "Traceback" not in out.stderr
    with pytest.raises(UsageError, match="--fp8 e4m3 is not one of none, tensorwise, rowwise"):
        check_fp8("e4m3")


def test_only_large_linears_get_float8(monkeypatch):
    """torchao's shape filter on each shard: at Llama-3-8B's width, q/o/gate/up/down qualify, k/v (1024 wide) do not,
    nor does the head; nothing at all in a tiny model."""
    monkeypatch.delenv(EMULATE_ENV, raising=False)
    config = ModelConfig.load("llama-3-8b").replace(layers=1)
    for recipe in ("tensorwise", "rowwise"):
        model = Transformer(config, device="meta")
        names = convert_to_fp8(model, recipe)
        assert sorted(n.rsplit(".", 1)[-1] for n in names) == ["down_proj", "gate_proj", "o_proj", "q_proj", "up_proj"]
        assert isinstance(model.layers["0"].mlp.up_proj.matmul, Float8Matmul)
        assert model.layers["0"].attn.k_proj.matmul is torch.nn.functional.linear
    assert convert_to_fp8(Transformer(ModelConfig.load("llama-tiny"), device="meta"), "tensorwise") == []
    assert convert_to_fp8(Transformer(config, device="meta"), "none") == []


def test_emulated_float8_model_stays_close_and_keeps_its_parameters(monkeypatch):
    monkeypatch.setenv(EMULATE_ENV, "1")
    config = ModelConfig.load("llama-tiny")
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    ref, model = Transformer(config, seed=1), Transformer(config, seed=1)
    params = dict(model.named_parameters())
    assert len(convert_to_fp8(model, "tensorwise")) == 4 * 7  # every linear: shard dims divide by 16
    assert dict(model.named_parameters()) == params and list(model.state_dict()) == list(ref.state_dict())
    loss, want = model(ids, ids), ref(ids, ids)
    loss.backward()
    want.backward()
    assert 0 < abs(loss.item() - want.item()) < 1e-3 * want.item()  # float8 did run, and stays close
    up, up_ref = model.layers["0"].mlp.up_proj.weight.grad, ref.layers["0"].mlp.up_proj.weight.grad
    assert (up - up_ref).norm() < 0.2 * up_ref.norm()
