"""The planner knows Mixture-of-Experts: total vs active parameters (against transformers' exact count),
active-expert FLOPs in the three conventions, the expert states over EP and EDP, the routing
activations, the dispatch/combine all-to-alls, EP searched and pinned, and the CLI's report and errors."""

import dataclasses
import json

import pytest

from megakit.commands import cli
from megakit.core.model_config import PRESETS, ModelConfig
from megakit.core.planner import emit
from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import GIB, estimate_memory, peak_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.pins import Pins
from megakit.core.planner.plan import ROUTING, Plan
from megakit.core.planner.search import OVERHEAD_BYTES, search
from megakit.core.planner.sharding import A2A_LINK_EFFICIENCY, all_to_all_time
from megakit.interop.hf import exact_param_count

H100 = gpu_preset("h100-80gb")
QWEN2_MOE_TINY = {
    "model_type": "qwen2_moe",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [1],
    "decoder_sparse_step": 1,
    "norm_topk_prob": False,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
QWEN3_DENSE_TINY = {
    "model_type": "qwen3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


def _preset(name):
    return json.loads((PRESETS / f"{name}.json").read_text())


@pytest.mark.parametrize(
    "raw",
    ["mixtral-8x7b", "qwen3-30b-a3b", "nemotron-3-nano-30b-a3b", QWEN2_MOE_TINY, QWEN3_DENSE_TINY],
    ids=["mixtral-8x7b", "qwen3-30b-a3b", "nemotron-3-nano", "qwen2-moe-shared-gate-dense-layer", "qwen3-dense"],
)
def test_total_parameters_equal_transformers_exact_count(raw):
    raw = _preset(raw) if isinstance(raw, str) else raw
    assert ModelConfig.from_hf(raw).num_params() == exact_param_count(raw)


def test_active_parameters_are_the_published_ones():
    """Mixtral-8x7B: 46.7B total, 12.9B active (Mistral's model card); Qwen3-30B-A3B: 30.5B, 3.3B."""
    mixtral, qwen = ModelConfig.load("mixtral-8x7b"), ModelConfig.load("qwen3-30b-a3b")
    assert round(mixtral.num_params() / 1e9, 1) == 46.7 and round(mixtral.active_params() / 1e9, 1) == 12.9
    assert round(qwen.num_params() / 1e9, 1) == 30.5 and round(qwen.active_params() / 1e9, 1) == 3.4
    dense = ModelConfig.load("mistral-7b")
    assert dense.active_params() == dense.num_params() and dense.moe_layers == 0


@pytest.mark.parametrize("convention", ["palm", "megatron", "matmul"])
def test_moe_flops_are_a_dense_mlp_of_top_k_experts_plus_the_router(convention):
    """Top-k SwiGLU experts of width F cost what one SwiGLU MLP of width k x F costs; the router adds
    2 x E x H per token forward, in each convention; the experts a token skips cost nothing."""
    moe = ModelConfig.load("mixtral-8x7b")
    m = moe.moe
    dense = moe.replace(moe=None, ffn=m.top_k * m.ffn, hf_type="")
    for recompute in ("none", "full"):
        got = moe.flops_per_token(4096, convention=convention, recompute=recompute)
        want = dense.flops_per_token(4096, convention=convention, recompute=recompute)
        router = 2 * m.experts * moe.hidden * moe.layers * (4 if recompute == "full" else 3)
        assert got == pytest.approx(want + router, rel=1e-12)
    assert moe.replace(moe=dataclasses.replace(m, experts=64)).flops_per_token(4096) == pytest.approx(
        moe.flops_per_token(4096) + 3 * 2 * 56 * moe.hidden * moe.layers
    )


def test_qwen2_moe_dense_layers_and_shared_experts_are_counted_per_layer():
    config = ModelConfig.from_hf(QWEN2_MOE_TINY)
    assert config.moe_layers == 2 and not config.is_moe_layer(1)
    moe, dense = config.block_params(moe=True), config.block_params(moe=False)
    h = 64
    assert moe.experts == 8 * 3 * h * 32 and moe.active_experts == 2 * 3 * h * 32
    assert moe.router == 8 * h + h  # the router and Qwen2's shared-expert gate
    assert moe.matmul - dense.matmul == 3 * h * (48 - 96)  # shared experts in place of the dense MLP
    assert config.num_params() == 2 * moe.total + dense.total + config.embedding_params() + config.head_params()


# ---- memory --------------------------------------------------------------------------------------
def mixtral(seq_len=4096):
    return ModelSpec.from_config("mixtral-8x7b").with_overrides(seq_len=seq_len)


def test_expert_states_are_sharded_over_ep_and_zero_shards_them_over_edp():
    model = mixtral()
    per_layer = 8 * 3 * 4096 * 14336
    layers = {"tp": 1, "pp": 4, "stage": 1, "micro_batch": 1, "recompute": "full"}
    for ep, dp, zero in ((1, 8, 0), (8, 8, 0), (4, 8, 1), (2, 8, 2), (8, 16, 1)):
        est = estimate_memory(model, dp=dp, ep=ep, zero_stage=zero, **layers)
        psi = est.layers * per_layer / ep
        edp = dp // ep
        # memory.py's table (bf16 + Adam), DP -> EDP, each item on its own line; DeepSpeed's fp32 step gradients
        # join the dense ones (the step phase)
        per_param = {0: 16, 1: 4 + 12 / edp, 2: 2 + 14 / edp}[zero]
        assert est.expert_states == pytest.approx(psi * per_param), (ep, dp, zero)
        assert est.items["expert_grads"] == pytest.approx(psi * 2 / (edp if zero == 2 else 1)), (ep, dp, zero)
        dense_step = 4 * est.params_local / (dp if zero else 1)
        assert est.items["fp32_step_grads"] == pytest.approx(dense_step + 4 * psi / (edp if zero else 1))
        # the dense part (attention, norms, router) shards over all of DP as before
        assert est.items["optimizer"] == pytest.approx(8 * est.params_local / (dp if zero else 1))
    with pytest.raises(Exception, match="EP 3"):
        estimate_memory(model, dp=8, ep=3, **layers)


def test_routing_activations_scale_with_the_imbalance_and_vanish_under_full_recompute():
    model = mixtral()
    kw = dict(tp=2, pp=1, dp=8, ep=8, micro_batch=1, sequence_parallel=True)
    balanced = estimate_memory(model, recompute="none", moe_imbalance=1.0, **kw)
    real = estimate_memory(model, recompute="none", moe_imbalance=1.5, **kw)
    s, h, f, k, e = 4096, 4096, 14336, 2, 8
    # per MoE layer and token of the rank's s/2 (megakit's tensors, ``routing_tensors``): the router's fp32 input
    # copy, logits and scores; the top-k indices, probabilities, their sum, the bf16 combine weights; the z-loss's
    # log-sum-exp; the sort order and its inverse; the expert outputs at home. On the expert side, top-k copies:
    # the received rows' regroup order and inverse, the permuted token, fc1's output, the SwiGLU, fc2's input.
    fixed = s / 2 * (4 * h + 2 * 4 * e + 8 * k + 4 * k + 4 + 2 * k + 4 + 2 * 8 * k + 2 * k * h)
    expert_side = s / 2 * k * (2 * 8 + 2 * (h + 2 * f + f + f))
    assert balanced.items["moe_routing"] == pytest.approx(32 * (fixed + expert_side))
    assert real.items["moe_routing"] == pytest.approx(32 * (fixed + 1.5 * expert_side))
    assert estimate_memory(model, recompute="full", **kw).items["moe_routing"] == 0.0
    capped = dataclasses.replace(
        model, config=model.config.replace(moe=dataclasses.replace(model.config.moe, capacity_factor=1.25))
    )
    assert estimate_memory(capped, recompute="none", moe_imbalance=1.5, **kw).items["moe_routing"] == pytest.approx(
        32 * (fixed + 1.25 * expert_side)
    )
    # with all experts on one rank, routing cannot overload it
    single = estimate_memory(model, recompute="none", moe_imbalance=1.5, **{**kw, "ep": 1})
    assert single.items["moe_routing"] == pytest.approx(balanced.items["moe_routing"] - 32 * s / 2 * k * 2 * 8)


# ---- all-to-all ----------------------------------------------------------------------------------
def test_all_to_all_runs_on_nvlink_inside_a_node_and_pays_the_network_beyond():
    cluster = Cluster(gpu=H100, num_gpus=64)
    one_gb = 1e9
    inside = all_to_all_time(cluster, one_gb, 8, 1)
    assert inside == pytest.approx(one_gb * 7 / 8 / (450e9 * A2A_LINK_EFFICIENCY["intra"]))
    spans = all_to_all_time(cluster, one_gb, 8, 2)  # EP 8 strided by TP 2: four peers in the node, four outside
    assert spans == pytest.approx(one_gb * 4 / 8 / (50e9 * A2A_LINK_EFFICIENCY["inter"]))
    assert spans > 5 * inside and all_to_all_time(cluster, one_gb, 1, 1) == 0.0


def test_all_to_all_across_nodes_runs_at_the_rdma_rate_deepep_measured():
    """Qwen3-235B's dispatch at EP 32 over 4 nodes (TP 1 here): what leaves the node goes at 45 GB/s of each GPU's
    50 GB/s NIC, inside DeepEP's measured 43-58 GB/s (H800 + CX7 400 Gb/s), not at the 31.5 GB/s a ring all-reduce
    reaches across nodes (``LINK_EFFICIENCY``), which priced cross-node expert parallelism up to 45 % slow."""
    cluster = Cluster(gpu=H100, num_gpus=256)
    one_gb = 1e9
    crossing = one_gb * 24 / 32  # the 24 of 32 peers outside this GPU's node
    rate = crossing / all_to_all_time(cluster, one_gb, 32, 1) / 1e9
    assert 43 <= rate <= 50
    model = ModelSpec.from_config("qwen3-235b-a22b").with_overrides(seq_len=4096)
    plan = Plan(
        tp=2,
        pp=8,
        dp=16,
        vpp=4,
        ep=32,
        zero_stage=1,
        micro_batch=1,
        accumulation=128,
        sequence_parallel=True,
        dispatcher="deepep",
    )
    cost = estimate_cost(model, cluster, plan)
    assert cost.a2a_s < 0.3 * cost.step_time_s


def test_fp8_runs_the_experts_grouped_gemms_on_fp8_tensor_cores():
    """An MoE's linears are mostly its experts: with --fp8 their grouped GEMMs run in FP8 as the attention's do
    (Megatron's and torchao's recipes quantize them), so Qwen3-235B's expert time falls on an H100, under torchao's
    compiled casts and more under Transformer Engine's; without FP8 tensor cores (A100) nothing changes."""
    from megakit.core.planner.compute import expert_gemm_time

    model = ModelSpec.from_config("qwen3-235b-a22b").with_overrides(seq_len=4096)
    for runtime, gain in (({}, 0.95), ({"megatron": True}, 0.7)):
        base = Plan(tp=2, pp=8, dp=16, ep=32, micro_batch=1, accumulation=128, fused_kernels=True, **runtime)
        bf16, fp8 = (
            expert_gemm_time(model, H100, dataclasses.replace(base, fp8=r), tokens=4096, peak=989e12)
            for r in ("none", "tensorwise")
        )
        assert fp8 < gain * bf16, (runtime, fp8 / bf16)
    a100 = gpu_preset("a100-80gb")
    assert expert_gemm_time(
        model, a100, dataclasses.replace(base, fp8="tensorwise"), tokens=4096, peak=312e12
    ) == expert_gemm_time(model, a100, base, tokens=4096, peak=312e12)


def test_four_all_to_alls_per_moe_layer_and_micro_batch_six_when_recomputed():
    model = mixtral()
    cluster = Cluster(gpu=H100, num_gpus=16)
    base = Plan(tp=1, pp=2, dp=8, ep=8, zero_stage=1, micro_batch=1, accumulation=8, recompute="none")
    plain = estimate_cost(model, cluster, base)
    tokens, h = 4096, 4096
    one = all_to_all_time(cluster, tokens * 2 * h * 2 * ROUTING["balanced"], 8, 1)
    layers = 16  # the slowest stage's MoE blocks
    assert plain.a2a_s == pytest.approx(8 * layers * 4 * one)
    full = estimate_cost(model, cluster, dataclasses.replace(base, recompute="full"))
    assert full.a2a_s == pytest.approx(1.5 * plain.a2a_s)
    assert estimate_cost(model, cluster, dataclasses.replace(base, ep=1)).a2a_s == 0.0
    real = estimate_cost(model, cluster, dataclasses.replace(base, moe_imbalance=1.2))
    assert real.a2a_s == pytest.approx(1.2 * plain.a2a_s) and real.tokens_per_s < plain.tokens_per_s


def test_forced_balance_is_faster_by_what_megatron_measured():
    """Dropless ('real') routing against forced balance: Megatron measured 3 % (Mixtral-8x22B, capacity 1.0
    vs dropless) to 9-25 % (Qwen3-235B, forced vs dropless; Megatron-MoE-ModelZoo best_practice/); the
    planner's two regimes sit in that range."""
    model = ModelSpec.from_config("qwen3-30b-a3b").with_overrides(seq_len=4096)
    cluster = Cluster(gpu=H100, num_gpus=64)
    for plan in (
        Plan(tp=1, pp=1, dp=64, ep=8, zero_stage=1, micro_batch=2, accumulation=4, recompute="selective"),
        Plan(
            tp=2,
            pp=2,
            dp=16,
            ep=16,
            zero_stage=1,
            micro_batch=1,
            accumulation=16,
            recompute="full",
            sequence_parallel=True,
        ),
    ):
        forced = estimate_cost(model, cluster, plan).tokens_per_s
        real = estimate_cost(model, cluster, dataclasses.replace(plan, moe_imbalance=ROUTING["real"])).tokens_per_s
        assert 1.03 <= forced / real <= 1.25, forced / real


# ---- search and pins -----------------------------------------------------------------------------
def test_mixtral_on_16_h100s_gets_expert_parallelism_under_the_line():
    cluster = Cluster(gpu=H100, num_gpus=16)
    result = search(mixtral(), cluster, global_batch=256, moe_imbalance=ROUTING["real"])
    best = result.best
    assert best.plan.ep > 1 and best.memory.total <= 0.8 * 80 * GIB
    assert best.memory.expert_states > 0.5 * best.memory.total  # the experts dominate the memory
    assert all(c.plan.zero_stage < 3 for c in result.ranked)
    assert {c.plan.ep for c in result.ranked} - {1} and all(
        (c.plan.tp * c.plan.dp * c.plan.cp) % c.plan.ep == 0 for c in result.ranked
    )
    # without EP nothing this fast fits: the experts would be whole on every GPU of a stage
    ep1 = [c for c in result.ranked if c.plan.ep == 1]
    assert all(c.cost.tokens_per_s < best.cost.tokens_per_s for c in ep1)


def test_pinned_ep_is_kept_and_a_dense_model_searches_no_ep():
    cluster = Cluster(gpu=H100, num_gpus=16)
    pinned = search(mixtral(), cluster, global_batch=256, pins=Pins(ep=4, pp=4))
    assert {c.plan.ep for c in pinned.ranked} == {4} and pinned.best.plan.pp == 4
    dense = search(ModelSpec.from_config("mistral-7b").with_overrides(seq_len=4096), cluster, global_batch=256)
    assert {c.plan.ep for c in dense.ranked} == {1}


def test_published_mixtral_layout_fits_its_gpus():
    """Megatron-MoE-ModelZoo runtime.conf benchmarks Mixtral-8x7B at TP1 PP4 EP8 VPP8 on 8 H100 nodes."""
    plan = Plan(tp=1, pp=4, dp=16, ep=8, vpp=8, zero_stage=1, micro_batch=1, accumulation=16, recompute="full")
    peak = peak_memory(mixtral(), seq_len=4096, overhead_bytes=OVERHEAD_BYTES, **plan.memory_kwargs())
    assert peak.total <= 80 * GIB


# ---- the CLI ------------------------------------------------------------------------------------
def plan_cli(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_reports_experts_routing_and_all_to_all(capsys, tmp_path):
    code, out, _ = plan_cli(
        capsys, "--model", "models/mixtral-8x7b.json", "--gpu", "h100-80gb", "--gpus", "16", "--json"
    )
    assert code == 0
    report = json.loads(out)
    p, moe = report["plan"], report["assumptions"]["moe"]
    assert p["ep"] > 1 and p["edp"] * p["ep"] == p["tp"] * p["dp"] * p["cp"]
    assert p["peak_memory_gib"] <= 0.8 * 80 and p["memory"]["expert_grads"] > 0
    assert p["all_to_all_s"] > 0 and 0 < p["all_to_all_fraction"] < p["comm_fraction"] + 1e-9
    assert moe["routing"] == "real" and moe["imbalance"] == ROUTING["real"]
    assert report["assumptions"]["model"]["params"] == 46702792704
    assert round(moe["active_params"] / 1e9, 1) == 12.9
    assert f"--ep {p['ep']}" in report["assumptions"]["launch"]
    target = tmp_path / "moe.json"
    code, out, _ = plan_cli(
        capsys,
        "--model",
        "models/mixtral-8x7b.json",
        "--gpu",
        "h100-80gb",
        "--gpus",
        "16",
        "--moe-routing",
        "balanced",
        "--emit-config",
        str(target),
    )
    assert code == 0
    written = json.loads(target.read_text())  # DeepSpeed's keys only: EP travels in the launch command
    stage = written["zero_optimization"]["stage"]  # the plan's (ZeRO 0 since the experts' step copy is step-only)
    dense = emit.ds_config(Plan(dp=4, zero_stage=stage, accumulation=2, pp=2), lr=1e-4, total_steps=10, warmup_steps=1)
    assert set(written) == set(dense) and set(written["zero_optimization"]) == set(dense["zero_optimization"])
    assert written["train_batch_size"] == 256 and written["zero_optimization"]["stage"] in (0, 1, 2)
    out = " ".join(out.split())  # rich wraps lines at the terminal's width
    for needle in (
        "12.88B active",
        "experts: gradients",
        "MoE routing",
        "MoE all-to-all",
        "EP x EDP",
        "balanced",
        "--ep ",
    ):
        assert needle in out, needle


def test_nemotron_3_nano_plans_on_16_h100s_and_at_megatron_bridges_layout(capsys):
    """Nemotron-3-Nano-30B-A3B (23 'E' blocks among 23 Mamba-2 and 6 attention blocks): 31.58B parameters, 3.58B
    active (embedding and head included; 3.23B without the embedding); each 'E' block adds its routed experts
    (128 x 2 x H x F, non-gated) to the hybrid's mean block. The free search on 16 H100s fits at EP 8, with TP 1 x
    PP 1 and full recompute within 5 % of its best; Megatron-Bridge's H100 performance recipe
    (``nemotron_3_nano_pretrain_16gpu_h100_bf16_config``: TP 1, PP 1, EP 8, micro-batch 1, 1024 x 8k tokens,
    recompute of its MoE layers and norms) fits with megakit's full recompute, and megakit's selective one
    (attention's and the mixers' cores) is refused naming that fix."""
    config = ModelConfig.load("nemotron-3-nano-30b-a3b")
    assert config.num_params() == 31_577_937_344 and config.active_params() == 3_580_073_408
    assert config.moe_layers == 23 and [config.is_moe_layer(i) for i in range(6)] == [0, 1, 0, 1, 0, 0]
    moe, mean = config.block_params(moe=True), config.block_params(moe=False)
    assert moe.experts == 128 * 2 * 2688 * 1856 and moe.active_experts == 6 * 2 * 2688 * 1856
    assert moe.total - moe.experts == mean.total  # the routed experts on top of the mean block
    code, out, _ = plan_cli(
        capsys, "--model", "nemotron-3-nano-30b-a3b", "--gpu", "h100-80gb", "--gpus", "16", "--json"
    )
    assert code == 0
    p = json.loads(out)["plan"]
    assert (p["ep"], p["fits"]) == (8, "yes") and p["memory"]["expert_params"] > 0
    # the free search's best and TP 1 x PP 1 with full recompute are within a few percent of each other
    alternatives = [a for a in json.loads(out)["alternatives"] if (a["tp"], a["pp"], a["recompute"]) == (1, 1, "full")]
    assert alternatives and alternatives[0]["tokens_per_s"] > 0.95 * p["tokens_per_s"]
    pinned = ["--model", "nemotron-3-nano-30b-a3b", "--gpu", "h100-80gb", "--gpus", "16", "--seq-len", "8192"]
    pinned += ["--tp", "1", "--pp", "1", "--ep", "8", "--micro-batch", "1", "--global-batch", "1024", "--zero", "1"]
    code, out, _ = plan_cli(capsys, *pinned, "--recompute", "full", "--json")
    assert code == 0 and json.loads(out)["plan"]["fits"] == "yes"
    code, _, err = plan_cli(capsys, *pinned, "--recompute", "selective")
    assert code == 2 and "fix: --recompute full" in err and len(err.strip().splitlines()) == 1, err


def test_qwen3_235b_at_megatron_bridges_layout_plans_with_ep_folded_over_tp(capsys):
    """Megatron-Bridge's public Qwen3-235B-A22B recipe (TP 2, PP 8, EP 32 on 256 H100s): EP 32 exceeds DP x CP = 16,
    so it folds over TP too: 16 TP pairs, 4 nodes; EDP 1."""
    pinned = (
        "--model",
        "models/qwen3-235b-a22b.json",
        "--gpu",
        "h100-80gb",
        "--gpus",
        "256",
        "--tp",
        "2",
        "--pp",
        "8",
        "--ep",
        "32",
        "--vpp",
        "4",
    )
    code, out, _ = plan_cli(capsys, *pinned, "--json")
    assert code == 0
    p = json.loads(out)["plan"]
    assert (p["tp"], p["pp"], p["dp"], p["ep"], p["edp"]) == (2, 8, 16, 32, 1)
    assert p["ep_group"] == {
        "ranks": 32,
        "consecutive": True,
        "tp_groups": 16,
        "nodes": 4,
        "edp_stride": 32,
        "link": "4 nodes (75% of each rank's tokens leave its node)",
    }
    assert p["memory"]["expert_params"] > 0 and p["all_to_all_s"] > 0 and p["peak_memory_gib"] <= 80
    code, out, _ = plan_cli(capsys, *pinned)
    out = " ".join(out.split())
    for needle in (
        "EP x EDP │ 32 x 1",
        "EP group (all-to-all) │ 32 consecutive ranks, 16 TP group(s), 4 nodes",
        "experts: gradients",
        "MoE all-to-all (dispatch + combine)",
    ):
        assert needle in out, needle


MOE_BAD = [
    (["--model", "mixtral-8x7b", "--gpus", "16", "--ep", "3"], "--ep 3 must divide the 8 experts and the 16 GPUs"),
    (
        ["--model", "mixtral-8x7b", "--gpus", "16", "--tp", "1", "--pp", "4", "--ep", "8"],
        "TP x CP x DP = 4 (the 16 GPUs over --pp 4), the ranks expert parallelism folds over; pick --ep 1, 2, 4",
    ),
    (
        [
            "--model",
            "models/qwen3-235b-a22b.json",
            "--gpu",
            "h100-80gb",
            "--gpus",
            "256",
            "--tp",
            "2",
            "--pp",
            "8",
            "--ep",
            "3",
        ],
        "pick --ep 1, 2, 4, 8, 16, 32",
    ),
    (["--model", "mistral-7b", "--gpus", "16", "--ep", "2"], "dense"),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--moe-imbalance", "0.5"], "--moe-imbalance"),
    (["--model", "mixtral-8x7b", "--gpus", "16", "--ep", "0"], "--ep"),
]


@pytest.mark.parametrize("argv,needle", MOE_BAD, ids=[" ".join(a) for a, _ in MOE_BAD])
def test_bad_ep_is_one_line_and_exit_2(argv, needle, tmp_path, capsys):
    target = tmp_path / "out.json"
    code, _, err = plan_cli(capsys, *argv, "--emit-config", str(target))
    assert code == 2 and err.startswith("megakit plan: error: ") and err.count("\n") == 1 and needle in err, err
    assert not target.exists()


def test_plan_prices_transformer_engines_block_scaled_fp8_under_megatron_and_refuses_it_elsewhere(plan_json, capsys):
    """``--fp8 blockwise`` (DeepSeek-V3's scales, Megatron's FP8-SC) prices Qwen3-30B-A3B's published EP 16 layout
    faster than BF16 under --runtime megatron-core, and its launch command asks train.py for no FP8 it cannot run. Under
    megakit's runtime, and ``mxfp8`` on a Hopper GPU, are one line each, exit 2."""
    argv = [
        "--model",
        PRESETS / "qwen3-30b-a3b.json",
        "--gpu",
        "h100-80gb",
        "--gpus",
        16,
        "--seq-len",
        4096,
        "--tp",
        1,
        "--pp",
        1,
        "--ep",
        16,
        "--zero",
        1,
        "--micro-batch",
        1,
        "--global-batch",
        1024,
        "--recompute",
        "none",
    ]
    bf16 = plan_json(*argv, "--runtime", "megatron-core")
    fp8 = plan_json(*argv, "--runtime", "megatron-core", "--fp8", "blockwise")
    assert fp8["tokens_per_s"] > 1.1 * bf16["tokens_per_s"] and fp8["fp8"] == "blockwise"
    flags = emit.train_flags(
        Plan(ep=16, dp=16, fp8="blockwise", megatron=True), config_path="c.json", model_arg="m", seq_len=4096
    )
    assert "--fp8" not in flags
    for extra, needle in (
        (["--fp8", "blockwise"], "add --runtime megatron-core"),
        (["--fp8", "mxfp8", "--runtime", "megatron-core"], "Blackwell has them"),
    ):
        assert cli.main(["plan", *map(str, argv + extra)]) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err


def test_offloaded_host_memory_holds_the_experts_master_and_adam():
    """``--offload optimizer`` moves the experts' fp32 master and Adam states to the host with the dense ones: the
    host-RAM check counts both."""
    from megakit.core.planner.search import _host_bytes

    model = ModelSpec.from_config("mixtral-8x7b")
    plan = Plan(tp=1, pp=1, dp=8, ep=8, zero_stage=2, micro_batch=1, recompute="full", offload="optimizer")
    on_gpu = estimate_memory(model, seq_len=4096, **dataclasses.replace(plan, offload="none").memory_kwargs())
    experts = on_gpu.items["expert_master_params"] + on_gpu.items["expert_optimizer"]
    assert experts > 0 and _host_bytes(model, plan, 4096) >= experts + on_gpu.items["optimizer"]
