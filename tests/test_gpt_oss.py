"""gpt-oss (``GptOssForCausalLM``) against transformers' eager model, in fp32.

A tiny config where every piece of gpt-oss is made to act: 4 blocks alternating a window of 8 with full attention at
64 tokens; sinks drawn near the rows' log-sum-exp (at zero, ``sigmoid(lse - sink)`` is about 1 and a wrong sink
hides in rounding); non-zero router, attention and expert biases; expert weights large enough that the SwiGLU's
clamp at 7 acts; YaRN with ``truncate`` false. Each control turns one piece off in megakit and must move the logits
past 20 times megakit's own error, so each is shown to be read. Also: the config and the weights written back as
transformers reads them (gate and up interleaved, ``x @ W`` layout), and the parameter count.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import converted_logits, draw_gpt_oss, eager, megakit_copy  # noqa: E402

from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.interop.hf import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from megakit.nn.model import Transformer, full_state_dict, load_full_state_dict  # noqa: E402

TOL = 1e-5
FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    max_position_embeddings=256,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "rope_theta": 150000.0,
        "original_max_position_embeddings": 4096,
    },
)


def hf_gpt_oss(seed: int = 0):
    """The tiny gpt-oss above, its sinks, biases and expert weights drawn so that each acts (see the docstring)."""
    model = draw_gpt_oss(eager(transformers.GptOssForCausalLM, transformers.GptOssConfig(**FIELDS), seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
    return model


@torch.no_grad()
def test_gpt_oss_logits_match_transformers_and_each_piece_matters():
    hf = hf_gpt_oss()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="gpt-oss")
    assert [config.attention_window(i) for i in range(4)] == [8, 0, 8, 0] and config.attention_sinks
    ids = torch.randint(0, 128, (2, 128), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    diff = (megakit_copy(config, hf)(ids) - want).abs().max().item()
    print(f"gpt-oss: max |logit diff| {diff:.2e}")
    assert diff < TOL
    state = from_hf_state_dict(config, hf.state_dict())
    moe = config.moe
    controls = {
        "no sinks": (dict(attention_sinks=False), "sinks"),
        "no windows": (dict(layer_types=("full_attention",) * 4), None),
        "plain SwiGLU": (dict(moe=dataclasses.replace(moe, swiglu_limit=0.0)), None),
        "no clamp": (dict(moe=dataclasses.replace(moe, swiglu_limit=1e9)), None),
        "no router bias": (dict(moe=dataclasses.replace(moe, router_bias=False)), "gate.bias"),
        "YaRN truncated": (
            dict(
                rope_scaling=dataclasses.replace(
                    config.rope_scaling, params=tuple(p for p in config.rope_scaling.params if p[0] != "truncate")
                )
            ),
            None,
        ),
    }
    for what, (change, drop) in controls.items():
        model = Transformer(config.replace(**change)).eval()
        load_full_state_dict(model, {k: v for k, v in state.items() if drop is None or not k.endswith(drop)})
        gap = (model(ids) - want).abs().max().item()
        assert gap > max(20 * diff, TOL), (what, gap, diff)  # far past what megakit is off by


def test_gpt_oss_config_and_weights_round_trip_and_transformers_reads_them():
    hf = hf_gpt_oss()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="gpt-oss")
    assert ModelConfig.from_hf(config.to_hf()) == config
    original = hf.config.to_dict()
    for field, value in config.to_hf().items():  # field for field what transformers wrote, where it writes it
        if field in original and field not in ("architectures", "router_aux_loss_coef"):  # the coefficient: kept only
            # where transformers applies it (output_router_logits), as for Mixtral
            assert original[field] == value, (field, original[field], value)
    exported = to_hf_state_dict(config, full_state_dict(megakit_copy(config, hf)))
    want = hf.state_dict()
    assert exported.keys() == want.keys()
    assert all(torch.equal(exported[k], want[k]) for k in want)  # byte for byte, the interleaved experts included
    assert config.num_params() == sum(p.numel() for p in hf.parameters())


def test_the_planner_counts_gpt_oss_120b_at_32_6_gflop_per_token_and_plans_64_h100s(capsys):
    """Megatron-Bridge's 26.08 table (GPT OSS 120B: 1077 TFLOP/s at 33024 tokens/s) implies 32.6 GFLOP per token at
    4096 tokens; its formula counts a sliding block's window, ``w - w(w - 1)/(2s)`` keys a query (34.3 without)."""
    import json

    from megakit.commands import cli

    assert (
        cli.main(
            [
                "plan",
                "--model",
                "models/gpt-oss-120b.json",
                "--gpus",
                "64",
                "--gpu",
                "h100-80gb",
                "--seq-len",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    plan = report["plan"]
    assert round(plan["gflops_per_token"]["causal"], 1) == 32.6
    assert round(plan["gflops_per_token"]["windows_ignored"], 1) == 34.3
    assert plan["tp"] * plan["pp"] * plan["dp"] * plan["cp"] == 64 and plan["peak_memory_gib"] < 0.8 * 80
    assert f"--ep {plan['ep']}" in report["assumptions"]["launch"] and plan["ep"] > 1  # 128 experts: sharded
    config = ModelConfig.load("gpt-oss-120b")
    assert (
        round(config.num_params() / 1e9, 1) == 116.8
        and round(ModelConfig.load("gpt-oss-20b").num_params() / 1e9, 1) == 20.9
    )


def test_sinks_asked_of_an_sdpa_kernel_are_refused_in_one_line(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from multiproc import THREADS
    from test_trainer import ROOT

    (tmp_path / "gpt-oss").mkdir()
    config = transformers.GptOssConfig(**{**FIELDS, "vocab_size": 256})  # the byte-level default data
    (tmp_path / "gpt-oss" / "config.json").write_text(json.dumps(config.to_dict()))
    out = subprocess.run(
        [
            sys.executable,
            "scripts/train.py",
            "--model",
            str(tmp_path / "gpt-oss"),
            "--seq-len",
            "32",
            "--attention-kernel",
            "math",
            "--steps",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, OMP_NUM_THREADS=THREADS),
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "--attention-kernel math cannot take this model's attention sinks" in out.stderr


def _mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An in-memory ``(E, cols, rows)`` expert matrix in the released MXFP4 layout: ``(E, rows, cols/32, 16)`` codes,
    ``(E, rows, cols/32)`` scales (a test's own encoder: each block's scale puts its largest value at or under 6)."""
    from megakit.interop.quantized import E2M1

    w = weight.transpose(1, 2).float()  # (E, rows, cols)
    groups = w.reshape(*w.shape[:2], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp(min=1e-30) / 6.0)).clamp(-127, 127)
    codes = (
        ((groups / torch.exp2(exponent)[..., None])[..., None] - torch.tensor(E2M1)).abs().argmin(-1).to(torch.uint8)
    )  # the nearest of the 16 values
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def test_an_mxfp4_checkpoint_imports_to_the_logits_of_its_bf16_copy(tmp_path):
    """The bf16 copy is dequantized by transformers' own ``convert_moe_packed_tensors``, not megakit's: both
    directories convert with ``megakit convert --from-hf`` and give the same logits (each MXFP4 value is exact in
    bf16), and far from those of the unquantized weights (the quantization is real)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = hf_gpt_oss().to(torch.bfloat16)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    packed, plain = dict(state), dict(state)
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(state[key])
        del packed[key]
        packed[key + "_blocks"], packed[key + "_scales"] = blocks, scales
        plain[key] = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)
        assert plain[key].shape == state[key].shape
    config = ModelConfig.from_hf(hf.config.to_dict())
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(3))
    logits = {
        name: converted_logits(tmp_path / name, hf.config, tensors, config, ids)
        for name, tensors in (("mxfp4", packed), ("bf16", plain))
    }
    assert torch.equal(logits["mxfp4"], logits["bf16"])
    with torch.no_grad():
        unquantized = hf(ids).logits.float()
    assert (unquantized - logits["bf16"]).abs().max() > 1e-2
