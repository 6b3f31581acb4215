"""Nemotron-H and Nemotron-3 (Mamba-2 / attention / MLP / MoE layers) trained through the real launcher at several
layouts, against the single process; their logits against transformers' ``NemotronHForCausalLM``; bad input in one
line.

One 4-process job (``tests/helpers/launch_sweep.py``), 5 steps each on packed documents with the state, the conv and
attention restarting at each document: ``models/nemotron-h-tiny.json`` ("M-M*": 8 Mamba heads in 4 groups, chunk 8,
over 32 tokens) at TP 2 with SP x DP 2 (ZeRO 1) and TP 2 x CP 2 (ZeRO 3; the mixers' all-to-all of heads, attention's
ring); ``models/nemotron-3-tiny.json`` ("MEM*E", Nemotron-3's 'E' blocks) at PP 2 x CP 2 (ZeRO 1) and EP 2 x TP 2
with SP x DP 2 (ZeRO 1). Every loss follows the single process within 1e-5.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from jobs import ds_config, packed_documents, sweep
from paths import ROOT

from megakit.errors import UsageError

MODEL, STEPS, TOL = "nemotron-h-tiny", 5, 1e-5
NEMOTRON_3 = "nemotron-3-tiny"
DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True)


def _case(stage: int, **extra) -> dict:
    return dict(ds_config=ds_config(stage), model=MODEL, steps=STEPS, seq_len=32, **DOCUMENTS, **extra)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    data = packed_documents(tmp_path_factory.mktemp("nemotron"))
    cases = [
        _case(1, tp=2, sequence_parallel=True, data=data),
        _case(3, tp=2, cp=2, data=data),
        _case(1, pp=2, cp=2, data=data) | dict(model=NEMOTRON_3),
        _case(1, tp=2, ep=2, sequence_parallel=True, data=data) | dict(model=NEMOTRON_3),
    ]
    return cases, sweep(tmp_path_factory, 4, cases, timeout=600)


@pytest.mark.slow
def test_layouts_follow_the_single_process(layouts):
    """The module docstring's four layouts. Nemotron-3's tiny preset ("MEM*E": 8 experts in 2 groups, top-2, the
    score-correction bias moving each step): its 'E' blocks on both pipeline stages under CP, and at EP 2 x TP 2 its
    experts split over EP, its router and shared expert replicated over TP."""
    from megakit.train.doctor.reference import reference_run

    cases, results = layouts
    dps = (2, 1, 1, 2)
    refs = {}
    for case, result, dp in zip(cases, results, dps, strict=True):
        key = (case["model"], dp)
        if key not in refs:
            refs[key] = reference_run(
                case["ds_config"],
                model=case["model"],
                steps=STEPS,
                dp=dp,
                seq_len=32,
                data=case["data"],
                documents=DOCUMENTS,
            )
        want = refs[key]["loss"]
        assert len(result["loss"]) == len(want) == STEPS
        for step, (a, b) in enumerate(zip(result["loss"], want)):
            assert abs(a - b) < TOL, (case, step, a, b)
    assert refs[MODEL, 1]["loss"][-1] < refs[MODEL, 1]["loss"][0] - 0.05  # it trained (the warm-up's 5 steps)
    assert refs[NEMOTRON_3, 2]["loss"][-1] < refs[NEMOTRON_3, 2]["loss"][0] - 0.05


@pytest.mark.parametrize("model", [MODEL, NEMOTRON_3])
def test_logits_equal_transformers(model, tmp_path):
    """The tiny presets through transformers' ``NemotronHForCausalLM`` and megakit, with A_log, dt_bias, D and the
    conv taps away from their initial values, over 21 tokens (the mixers' chunk is 8); exported and read back, and
    saved as a megakit checkpoint, exported by ``export_hf`` and loaded by ``from_pretrained``.
    Nemotron-3's ("MEM*E"): its 'E' blocks' experts, shared expert and router scaled up (the routing and the experts
    weigh in the logits), the score-correction bias drawn, 8 experts in 2 groups (top-2 of the best group)."""
    transformers = pytest.importorskip("transformers")
    from megakit.core.model_config import ModelConfig
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.interop.hf import exact_param_count, from_hf_state_dict, to_hf_state_dict
    from megakit.interop.hf_export import export_hf
    from megakit.nn.model import Transformer, full_state_dict, load_full_state_dict
    from megakit.nn.moe.layer import Experts

    config = ModelConfig.load(model)
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.num_params() == sum(p.numel() for p in Transformer(config).parameters())
    assert config.num_params() == exact_param_count(config.to_hf())
    torch.manual_seed(0)
    ref = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**config.to_hf())).float().eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.rsplit(".", 1)[-1] in ("A_log", "dt_bias", "D") or "conv1d" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "experts" in name or name.endswith("gate.weight"):
                p.mul_(10)
        for name, b in ref.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    ours = Transformer(config, seed=1).eval()
    state = from_hf_state_dict(config, ref.state_dict())
    load_full_state_dict(ours, state)
    files = {}  # NVIDIA's files: ``backbone.``, one matrix per expert
    for k, v in ref.state_dict().items():
        k = k.replace("model.", "backbone.", 1)
        stack, _, name = k.rpartition(".")
        if name in ("up_proj", "down_proj") and stack.endswith(".experts"):
            files |= {f"{stack}.{j}.{name}.weight": w for j, w in enumerate(v)}
        else:
            files[k] = v
    again = from_hf_state_dict(config, files)
    assert again.keys() == state.keys() and all(torch.equal(again[k], v) for k, v in state.items())
    ids = torch.randint(0, config.vocab_size, (2, 21), generator=torch.Generator().manual_seed(3))
    want = ref(ids).logits
    experts = [m for m in ours.modules() if isinstance(m, Experts)]
    assert all(m.use_grouped(torch.zeros(1, config.hidden)) for m in experts)  # torch._grouped_mm, then the loop
    for grouped in (True, False) if experts else (True,):
        for m in experts:
            m.grouped = grouped
        err = (ours(ids)[..., : config.vocab_size] - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), (grouped, err)
    back = to_hf_state_dict(config, full_state_dict(ours))
    assert back.keys() == ref.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ref.state_dict().items())
    save_checkpoint(tmp_path / "ck", ours, None, step=0, config=config)  # ``megakit convert``'s export, block by block
    export_hf(tmp_path / "ck", tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    assert torch.equal(loaded(ids).logits, want)


def test_bad_input_gets_one_line(tmp_path):
    from megakit.core.model_config import ModelConfig
    from megakit.train.run import TrainConfig, resolve

    config = json.loads((ROOT / "models" / f"{MODEL}.json").read_text())
    with pytest.raises(UsageError, match=re.escape("layer type 'X' (unknown)")):
        ModelConfig.from_hf({**config, "hybrid_override_pattern": "M-X*"})
    nano = json.loads((ROOT / "models" / f"{NEMOTRON_3}.json").read_text())
    for extra, message in (
        (dict(moe_latent_size=16), "sets moe_latent_size (LatentMoE's projections, Nemotron-3 Super and Ultra)"),
        (dict(mlp_bias=True), "sets mlp_bias with 'E' blocks: megakit's shared expert has no biases"),
        (dict(moe_shared_expert_intermediate_size="32"), 'has moe_shared_expert_intermediate_size "32"'),
    ):
        with pytest.raises(UsageError, match=re.escape(message)):
            ModelConfig.from_hf({**nano, **extra})
    three = ModelConfig.from_hf(nano)
    for moe in (None, replace(three.moe, dense_layers=())):
        with pytest.raises(UsageError, match="layer_pattern's 'E' blocks and the experts \\(moe\\) go together"):
            three.replace(moe=moe)
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
