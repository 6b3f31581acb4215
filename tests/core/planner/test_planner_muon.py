"""``megakit plan --optimizer muon`` prices Muon inside the plan: its weights split as the trainer splits them (one
fp32 moment for the hidden matrices, Adam's two for the rest), its step's buffers, its Newton-Schulz time and TP and
DP exchanges in the step time, and ZeRO 0-2 only (0 in fp32), as ``megakit.train.engine.muon`` runs it."""

import dataclasses

import pytest

from megakit.core.planner.cost import estimate_cost, muon_plan_cost, muon_times
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import estimate_memory, stage_expert_params, stage_params
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.muon import BUCKET_NUMEL, MOMENT_BYTES, muon_cost, stage_share, step_bytes
from megakit.core.planner.plan import Plan
from megakit.core.planner.search import search
from megakit.errors import UsageError

H100 = gpu_preset("h100-80gb")


@pytest.mark.parametrize(
    "name",
    [
        "gpt-tiny",
        "llama-tiny",
        "moe-tiny",
        "deepseek-v3-tiny",
        "gpt-oss-tiny",
        "qwen3-next-tiny",
        "nemotron-h-tiny",
        "nemotron-3-tiny",
    ],
)
def test_the_muon_weights_are_the_trainers(name):
    """The planner's Muon share (torch-free, from the config's counts) equals ``uses_muon`` on the built model: the
    hidden matrices (MLA's, the mixers' projections, the shared and routed experts'; DeepSeek-V3's MTP module too) on
    Muon, the embeddings, head, norms, biases, routers and conv taps on AdamW; and the two add up to the stage's
    parameters. The Newton-Schulz pricing walks the same matrices block by block (hybrids' mixers their own)."""
    from megakit.nn.model import Transformer
    from megakit.train.engine.muon import uses_muon

    mtp = name == "deepseek-v3-tiny"
    spec = ModelSpec.from_config(name).with_overrides(mtp=mtp)
    net = Transformer(spec.config, seed=0, mtp=mtp)
    named = list(net.named_parameters())
    dense = sum(p.numel() for n, p in named if uses_muon(n, p) and ".experts." not in n)
    experts = sum(p.numel() for n, p in named if uses_muon(n, p) and ".experts." in n)
    share = stage_share(spec, tp=1, pp=1, stage=0)
    assert (share.dense, share.experts) == (dense, experts)
    blocks = [(n, p.numel()) for n, p in named if uses_muon(n, p) and not n.startswith("mtp.")]  # FLOPs' matrices
    priced = muon_cost(spec.config)
    assert priced.params == sum(k for _, k in blocks)
    assert priced.expert_params == sum(k for n, k in blocks if ".experts." in n)
    counted = stage_params(spec, tp=1, pp=1, stage=0) + stage_expert_params(spec, pp=1, stage=0)
    rounding = spec.config.layers if spec.config.layer_pattern else 0  # Nemotron's mean block is rounded down
    assert 0 <= sum(p.numel() for _, p in named) - counted <= rounding


def test_memory_holds_one_moment_for_muons_weights_and_two_for_adamws():
    """Llama-3-8B at TP 1 in fp32, ZeRO 0: Muon's 6.98 B matrix weights keep 4 bytes, the embedding and head 8
    (Adam's m and v); ZeRO 1 over DP 8 shards both; the AdamW plan's items are as before. Muon's step adds its
    buffers (updates and results, 8 bytes a Muon weight at TP 1) in the activations' place."""
    model = ModelSpec.from_config("llama-3-8b")
    layout = dict(tp=1, pp=1, dp=8, precision="fp32", recompute="full")
    adamw = estimate_memory(model, zero_stage=0, **layout)
    muon = estimate_memory(model, zero_stage=0, optimizer="muon", **layout)
    hidden = 32 * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 4096 * 14336)
    psi = stage_params(model, tp=1, pp=1, stage=0)
    assert muon.items["muon_momentum"] == 4 * hidden
    assert muon.items["optimizer"] == 8 * (psi - hidden) == adamw.items["optimizer"] - 8 * hidden
    assert "muon_momentum" not in adamw.items and "muon_step" not in adamw.items
    assert muon.model_states == adamw.model_states - 4 * hidden
    assert muon.items["muon_step"] == 8 * hidden + 2 * (2 * 4096 * 14336 + 2 * 4096**2)  # + Newton-Schulz's
    sharded = estimate_memory(model, zero_stage=1, optimizer="muon", **layout)
    assert sharded.items["muon_momentum"] == 4 * hidden / 8 and sharded.items["optimizer"] == 8 * (psi - hidden) / 8


def test_moe_experts_keep_their_momentum_over_edp():
    """Mixtral-8x7B at TP 2 x EP 8 x DP 4, ZeRO 1: the experts' momentum over EDP = 1, the dense weights' over DP 4;
    the routers stay with the dense weights' Adam moments."""
    model = ModelSpec.from_config("mixtral-8x7b")
    mem = estimate_memory(model, tp=2, pp=4, dp=4, ep=8, zero_stage=1, optimizer="muon", recompute="full")
    share = stage_share(model, tp=2, pp=4, stage=0, ep=8)
    assert mem.items["expert_muon_momentum"] == 4 * share.experts  # EDP = TP x DP / EP = 1
    assert mem.items["muon_momentum"] == 4 * share.dense / 4
    assert share.experts == 8 * 8 * 3 * 4096 * 14336 / 8  # 8 blocks on the stage, 8 experts over EP 8
    assert mem.items["expert_optimizer"] == 0.0  # Mixtral's experts have no biases: no Adam moments there


def test_step_buffers_follow_the_trainers_exchanges():
    """ZeRO 0: every update and its result, and at TP > 1 the split matrices' five exchange buffers; ZeRO 1-2: the
    partition's update, then one bucket's pieces and an owner's share of it at a time, at least the largest matrix
    whole."""
    model = ModelSpec.from_config("llama-3-8b")
    tp1, tp8 = stage_share(model, tp=1, pp=1, stage=0), stage_share(model, tp=8, pp=1, stage=0)
    ns = 2 * (2 * 4096 * 14336 + 2 * 4096 * 4096)  # bf16 X, Gram, update and the next X of the largest matrix
    assert step_bytes(tp1, tp=1, zero_stage=0, dp=1, edp=1) == ns + 4 * 2 * tp1.dense
    assert tp8.split == tp8.dense == tp1.dense / 8
    assert step_bytes(tp8, tp=8, zero_stage=0, dp=1, edp=1) == ns + 4 * 6 * tp8.dense
    largest = 4096 * 14336
    p, o = tp8.dense / 4, max(BUCKET_NUMEL / 4, largest)  # a bucket's pieces and an owner's share: not all of p
    assert p > 2 * BUCKET_NUMEL
    assert step_bytes(tp8, tp=8, zero_stage=1, dp=4, edp=1) == ns + 4 * (p + max(BUCKET_NUMEL + 4 * o, 8 * o))
    assert step_bytes(tp8, tp=8, zero_stage=1, dp=4096, edp=1) == ns + 4 * (tp8.dense / 4096 + 8 * largest)


def test_zero_1_2_share_the_iterations_and_exchange_the_partitions_over_dp():
    """At ZeRO 1-2 the DP ranks share the Newton-Schulz FLOPs and the TP exchange (each owns 1/DP of the matrices)
    and each receives about twice its partition's (DP-1)/DP in the DP all-to-alls."""
    config = ModelSpec.from_config("llama-3-8b").config
    zero0, zero1 = muon_cost(config, tp=8), muon_cost(config, tp=8, dp=4)
    assert zero1.ns_flops == pytest.approx(zero0.ns_flops / 4) and zero1.gather_bytes == pytest.approx(
        zero0.gather_bytes / 4
    )
    assert zero0.dp_bytes == 0 and zero1.dp_bytes == pytest.approx(2 * 4 * zero0.params / 4 * 3 / 4)
    assert zero1.moment_bytes == zero0.moment_bytes / 4 == MOMENT_BYTES * zero0.params / 4


def test_the_step_time_holds_newton_schulz_and_both_exchanges():
    """A pinned layout: the Muon plan's step is the AdamW plan's plus ``muon_times`` exactly, which holds
    Newton-Schulz at the GPU's matmul rate and the TP and DP all-to-alls on the planner's links."""
    model = ModelSpec.from_config("llama-3-8b")
    cluster = Cluster(gpu=H100, num_gpus=16, gpus_per_node=8)
    plan = Plan(tp=4, pp=1, dp=4, zero_stage=1, micro_batch=1, accumulation=16, recompute="full")
    adamw = estimate_cost(model, cluster, plan)
    muon_plan = dataclasses.replace(plan, optimizer="muon")
    muon = estimate_cost(model, cluster, muon_plan)
    times = muon_times(model, cluster, muon_plan)
    assert set(times) == {"newton_schulz", "tp_exchange", "dp_exchange"} and min(times.values()) > 0
    assert muon.step_time_s == pytest.approx(adamw.step_time_s + sum(times.values())) and muon.muon_s > 0
    flops = muon_plan_cost(model, muon_plan).ns_flops
    assert times["newton_schulz"] == pytest.approx(flops / (H100.peak_tflops * 1e12 * H100.matmul_fraction))
    zero0 = muon_times(model, cluster, dataclasses.replace(muon_plan, zero_stage=0, precision="fp32"))
    assert "dp_exchange" not in zero0 and zero0["newton_schulz"] == pytest.approx(4 * times["newton_schulz"])


def test_the_search_runs_muon_at_zero_1_or_2_in_bf16_and_never_3():
    """Llama-3-8B on 8 H100 in bf16: the plan (and every alternative) is ZeRO 1 or 2, its peak holds Muon's items;
    in fp32 ZeRO 0 is back; ZeRO 3 is refused in one line."""
    model = ModelSpec.from_config("llama-3-8b")
    cluster = Cluster(gpu=H100, num_gpus=8, gpus_per_node=8)
    result = search(model, cluster, global_batch=256, execution={"optimizer": "muon"})
    assert {c.plan.zero_stage for c in result.ranked} <= {1, 2} and result.best.plan.optimizer == "muon"
    assert result.best.memory.items["muon_momentum"] > 0 and result.best.cost.muon_s > 0
    fp32 = search(
        ModelSpec.from_config("llama-tiny"), cluster, global_batch=8, precision="fp32", execution={"optimizer": "muon"}
    )
    assert fp32.best.plan.zero_stage == 0
    with pytest.raises(UsageError, match="Muon with ZeRO 3: each weight is partitioned over DP"):
        estimate_memory(model, dp=8, zero_stage=3, optimizer="muon")
