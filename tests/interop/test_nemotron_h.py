"""Nemotron-H (Mamba-2 / attention / MLP layers) trained through the real launcher at several layouts, against the
single process; its logits against transformers' ``NemotronHForCausalLM``; bad input in one line.

One 4-process job (``tests/helpers/launch_sweep.py``), 5 steps of ``models/nemotron-h-tiny.json`` ("M-M*": 8 Mamba
heads in 4 groups, chunk 8, over 32 tokens) on packed documents with the state, the conv and attention restarting at
each document: TP 2 with SP x DP 2 (ZeRO 1), TP 2 x CP 2 (ZeRO 3; the mixers' all-to-all of heads, attention's ring),
PP 2 x CP 2 (ZeRO 1). Every loss follows the single process within 1e-5.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from jobs import ds_config, packed_documents, sweep
from paths import ROOT

from megakit.errors import UsageError

MODEL, STEPS, TOL = "nemotron-h-tiny", 5, 1e-5
DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True)


def _case(stage: int, **extra) -> dict:
    return dict(ds_config=ds_config(stage), model=MODEL, steps=STEPS, seq_len=32, **DOCUMENTS, **extra)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    data = packed_documents(tmp_path_factory.mktemp("nemotron"))
    cases = [
        _case(1, tp=2, sequence_parallel=True, data=data),
        _case(3, tp=2, cp=2, data=data),
        _case(1, pp=2, cp=2, data=data),
    ]
    return cases, sweep(tmp_path_factory, 4, cases, timeout=600)


@pytest.mark.slow
def test_layouts_follow_the_single_process(layouts):
    from megakit.train.doctor.reference import reference_run

    cases, results = layouts
    dps = (2, 1, 1)
    refs = {}
    for case, result, dp in zip(cases, results, dps, strict=True):
        if dp not in refs:
            refs[dp] = reference_run(
                case["ds_config"], model=MODEL, steps=STEPS, dp=dp, seq_len=32, data=case["data"], documents=DOCUMENTS
            )
        want = refs[dp]["loss"]
        assert len(result["loss"]) == len(want) == STEPS
        for step, (a, b) in enumerate(zip(result["loss"], want)):
            assert abs(a - b) < TOL, (case, step, a, b)
    assert refs[1]["loss"][-1] < refs[1]["loss"][0] - 0.05  # it trained (the warm-up's 5 steps)


def test_logits_equal_transformers():
    """The tiny preset through transformers' ``NemotronHForCausalLM`` and megakit, with A_log, dt_bias, D and the
    conv taps away from their initial values, over 21 tokens (the mixers' chunk is 8); exported and read back."""
    transformers = pytest.importorskip("transformers")
    from megakit.core.model_config import ModelConfig
    from megakit.interop.hf import from_hf_state_dict, to_hf_state_dict
    from megakit.nn.model import Transformer, full_state_dict, load_full_state_dict

    config = ModelConfig.load(MODEL)
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.num_params() == sum(p.numel() for p in Transformer(config).parameters())
    torch.manual_seed(0)
    ref = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**config.to_hf())).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "D") or "conv1d" in name:
                p.add_(torch.randn_like(p) * 0.3)
    ours = Transformer(config, seed=1).eval()
    load_full_state_dict(ours, from_hf_state_dict(config, ref.state_dict()))
    ids = torch.randint(0, config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    want = ref(ids).logits
    err = (ours(ids)[..., : config.vocab_size] - want).abs().max().item()
    assert err <= 1e-5 * want.abs().max().item(), err
    back = to_hf_state_dict(config, full_state_dict(ours))
    assert back.keys() == ref.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())


def test_bad_input_gets_one_line(tmp_path):
    from megakit.core.model_config import ModelConfig
    from megakit.train.run import TrainConfig, resolve

    config = json.loads((ROOT / "models" / f"{MODEL}.json").read_text())
    for pattern, message in (
        ("M-E*", "layer type 'E' (an MoE block) in its pattern, which megakit does not build"),
        ("M-X*", "layer type 'X' (unknown)"),
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            ModelConfig.from_hf({**config, "hybrid_override_pattern": pattern})
    with pytest.raises(UsageError, match="layer type 'sliding_attention', which megakit does not build"):
        ModelConfig.from_hf(
            {
                **{k: v for k, v in config.items() if k != "hybrid_override_pattern"},
                "layers_block_type": ["linear_attention", "sliding_attention"],
            }
        )
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    for flags, world, message in (
        (dict(cp=8), 8, "TP x CP = 1 x 8 = 8 does not divide Mamba groups 4"),
        (dict(tp=2, cp=4), 8, "TP x CP = 2 x 4 = 8 does not divide Mamba groups 4"),
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            resolve(TrainConfig(ds_config=ds, data=str(data), model=MODEL, seq_len=32, **flags), world)


def test_the_planner_prices_mamba_and_plans_nemotron_h_8b_on_16_h100s():
    """Nemotron-H 8B (24 Mamba-2, 4 attention, 24 MLP layers): parameters as transformers counts them; FLOPs per token
    linear in the sequence but for its 4 attention blocks (Llama 3 8B's grow 8x as much from 8k to 64k); the CP
    all-to-alls of the mixers priced whatever attention's CP mode; it plans on 16 H100s at 64k tokens
    (only TP x CP that split the Mamba heads and groups)."""
    from megakit.core.model_config import ModelConfig
    from megakit.core.planner.cost import estimate_cost
    from megakit.core.planner.hardware import Cluster, gpu_preset
    from megakit.core.planner.memory import GIB
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.core.planner.plan import Plan
    from megakit.core.planner.search import search

    config = ModelConfig.load("nemotron-h-8b")
    assert config.num_params() == 8_100_852_736  # NemotronHForCausalLM's, on the meta device
    llama = ModelConfig.load("llama-3-8b")
    growth = config.causal_flops_per_token(65536) - config.causal_flops_per_token(8192)
    assert llama.causal_flops_per_token(65536) - llama.causal_flops_per_token(8192) > 7.9 * growth  # 32 vs 4 blocks
    assert config.attention_share(8192) == 4 / 52
    cluster = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=16)
    for seq in (65536,):  # at 8k: TP 2 x DP 8 (docs/models.md); searching it too costs 5 s
        result = search(ModelSpec.from_config("nemotron-h-8b").with_overrides(seq_len=seq), cluster, global_batch=32)
        best = result.best
        assert best.memory.total <= 0.8 * 80 * GIB and best.cost.mfu > 0.2, (seq, best.plan)
        assert all(not config.mamba.split_conflicts(c.plan.tp * c.plan.cp) for c in result.ranked)
    model = ModelSpec.from_config("nemotron-h-8b").with_overrides(seq_len=65536)
    ring = dict(tp=1, pp=1, dp=8, micro_batch=1, accumulation=4, recompute="full")
    cp2 = estimate_cost(model, cluster, Plan(cp=2, cp_mode="ring", **ring))
    assert cp2.cp_comm_s > 0  # the ring hides attention's K/V; the mixers' all-to-alls remain
