"""The search: the seed's rule, the 80 % line, pins, and pruning that never loses the optimum."""

import itertools

import pytest

from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import GIB, peak_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan
from megakit.core.planner.search import (
    OVERHEAD_BYTES,
    Pins,
    divisors,
    search,
    smallest_cluster,
    tp_choices,
)
from megakit.errors import UsageError

A100 = gpu_preset("a100-80gb")


def a100s(n):
    return Cluster(gpu=A100, num_gpus=n, gpus_per_node=8)


def test_125m_on_8_gpus_is_pure_data_parallel():
    result = search(ModelSpec.from_params("125M"), a100s(8), global_batch=256)
    plan = result.best.plan
    assert (plan.tp, plan.pp, plan.dp) == (1, 1, 8)
    assert plan.zero_stage == 0  # fits without ZeRO, and ZeRO only as memory requires
    assert result.branch == "data-parallel"


def test_175b_on_a100_gets_tp_inside_a_node_and_a_pipeline():
    model = ModelSpec.from_params("175B")
    result = search(model, a100s(1024), global_batch=1536)
    plan = result.best.plan
    assert 1 < plan.tp <= 8 and plan.pp > 1 and plan.zero_stage <= 1
    assert result.branch == "model-parallel"
    assert any("crosses the node" in r.reason for r in result.rejected)  # TP=16, 32 were considered, refused
    assert any("ZeRO-2 with PP" in r.reason for r in result.rejected)
    # with no cluster size: the fewest whole nodes, still TP x PP
    nodes, auto = smallest_cluster(model, lambda n: a100s(8 * n), global_batch=1536)
    assert auto.best.plan.world == 8 * nodes and 8 % auto.best.plan.tp == 0 and auto.best.plan.pp > 1
    with pytest.raises(UsageError, match="no layout fits"):
        search(model, a100s(8 * (nodes - 1)), global_batch=1536, zero3_fallback=False)


def test_every_feasible_plan_is_under_the_threshold_and_rejections_are_over():
    model = ModelSpec.from_params("13B")
    result = search(model, a100s(64), global_batch=1024, threshold=0.8)
    assert all(c.memory.total <= 0.8 * 80 * GIB for c in result.ranked)
    over = [r for r in result.rejected if r.reason.startswith("peak")]
    assert over and all(r.peak_gib > 64.0 for r in over)
    assert result.best.cost.tokens_per_s >= 0.99 * max(c.cost.tokens_per_s for c in result.ranked)
    # a lower threshold can only make the plan slower or equal
    tight = search(model, a100s(64), global_batch=1024, threshold=0.5)
    assert tight.best.memory.total <= 0.5 * 80 * GIB
    assert tight.best.cost.tokens_per_s <= result.best.cost.tokens_per_s * 1.0001


def test_pruned_search_finds_the_brute_force_optimum():
    model = ModelSpec.from_params("6.7B", seq_len=1024)
    cluster = a100s(32)
    batch, limit = 256, 0.8 * 80 * GIB
    result = search(model, cluster, global_batch=batch, flash_attention=True)
    best = 0.0
    for tp, pp in itertools.product([t for t in tp_choices(model, 32) if 8 % t == 0], divisors(32)):
        if 32 % (tp * pp) or pp > model.layers:
            continue
        dp = 32 // (tp * pp)
        if batch % dp:
            continue
        for zero, vpp, rc, sp in itertools.product((0, 1, 2), (1, 2, 4), ("none", "full"), (False, True)):
            if (zero >= 2 and pp > 1) or (vpp > 1 and (pp == 1 or model.layers % (pp * vpp))) or (sp and tp == 1):
                continue
            for mb in divisors(batch // dp):
                plan = Plan(
                    tp=tp,
                    pp=pp,
                    dp=dp,
                    vpp=vpp,
                    zero_stage=zero,
                    micro_batch=mb,
                    accumulation=batch // dp // mb,
                    recompute=rc,
                    sequence_parallel=sp,
                )
                if vpp > 1 and plan.accumulation % pp or mb > 64:
                    continue
                mem = peak_memory(model, seq_len=1024, overhead_bytes=OVERHEAD_BYTES, **plan.memory_kwargs())
                if mem.total <= limit:
                    best = max(best, estimate_cost(model, cluster, plan, seq_len=1024).tokens_per_s)
    assert max(c.cost.tokens_per_s for c in result.ranked) == pytest.approx(best, rel=1e-9)


def test_pins_fix_dimensions_and_bad_pins_name_the_dimension():
    model = ModelSpec.from_params("175B")
    result = search(model, a100s(1024), global_batch=1536, pins=Pins(tp=8, pp=16, recompute="full", micro_batch=1))
    assert all(
        (c.plan.tp, c.plan.pp, c.plan.recompute, c.plan.micro_batch) == (8, 16, "full", 1) for c in result.ranked
    )
    assert result.branch == "pinned"
    with pytest.raises(UsageError, match="--tp 5"):
        search(model, a100s(1024), global_batch=1536, pins=Pins(tp=5))
    with pytest.raises(UsageError, match="--pp 3"):
        search(model, a100s(1024), global_batch=1536, pins=Pins(tp=8, pp=3))
    with pytest.raises(UsageError, match="ZeRO-2/3|--zero 2"):
        search(model, a100s(1024), global_batch=1536, pins=Pins(pp=16, zero=2))
    with pytest.raises(UsageError, match="--vpp 7 = 112 virtual stages exceed the 96 layers"):  # 5 splits unevenly
        search(model, a100s(1024), global_batch=1536, pins=Pins(tp=8, pp=16, vpp=7))
    # A pinned layout that cannot fit is reported, not silently replaced.
    with pytest.raises(UsageError, match="no layout fits"):
        search(model, a100s(1024), global_batch=2048, pins=Pins(tp=1, pp=1, zero=0))
    with pytest.raises(UsageError, match="divides the global batch"):
        search(model, a100s(1024), global_batch=1536, pins=Pins(tp=1, pp=1))


def test_gqa_llama_and_long_sequences_with_flash_attention():
    """A 32k sequence: without fused attention its s x s scores cost memory in every layer. Pinned to --cp 1 (no
    context parallelism to spread them) that is the difference between a plan fitting or not: a quarter as many
    fit (a third as many), each fitting one fits with flash attention too, and every layout's peak is higher without it.
    With CP searched, splitting the sequence rescues nearly all of them."""
    model = ModelSpec.from_params("70B", seq_len=32768)
    assert model.family == "llama" and model.kv_heads == 8
    cluster = a100s(256)
    flash = search(model, cluster, global_batch=64, flash_attention=True, pins=Pins(cp=1))
    assert flash.best.plan.tp <= 8 and 8 % flash.best.plan.tp == 0
    standard = search(model, cluster, global_batch=64, flash_attention=False, pins=Pins(cp=1))
    assert 0 < len(standard.ranked) < len(flash.ranked) / 2, (len(standard.ranked), len(flash.ranked))  # 65 of 190
    fits = {_layout(c.plan): c for c in flash.ranked}
    for c in standard.ranked:
        assert _layout(c.plan) in fits, c.plan
        assert c.memory.total > fits[_layout(c.plan)].memory.total, c.plan
    searched = [len(search(model, cluster, global_batch=64, flash_attention=f).ranked) for f in (True, False)]
    assert searched[1] > 0.9 * searched[0] > 5 * len(flash.ranked), searched  # 1146 and 1138 with CP


def _layout(plan: Plan) -> tuple:
    return tuple(
        getattr(plan, k)
        for k in (
            "tp",
            "pp",
            "dp",
            "cp",
            "vpp",
            "zero_stage",
            "micro_batch",
            "recompute",
            "sequence_parallel",
            "offload",
        )
    )


def test_pins_the_trainer_cannot_run_are_refused_and_searched_tp_follows_the_model_rule():
    small = ModelSpec.from_params("1.3B")
    with pytest.raises(UsageError, match="--vpp 2 .*--pp is 1"):
        search(small, a100s(8), global_batch=512, pins=Pins(pp=1, vpp=2))
    # --vpp pinned, --pp searched: only pipelines are considered
    assert search(small, a100s(8), global_batch=512, pins=Pins(vpp=2)).best.plan.pp > 1
    big = ModelSpec.from_params("175B")
    with pytest.raises(UsageError, match="--tp 3 does not divide the 8 GPUs per node"):
        search(big, a100s(48), global_batch=1536, pins=Pins(tp=3))
    llama = ModelSpec.from_config("llama-2-70b")  # 64 heads, 8 KV heads
    with pytest.raises(UsageError, match="--tp 16 .*KV heads 8"):
        search(llama, Cluster(gpu=A100, num_gpus=64, gpus_per_node=16), global_batch=512, pins=Pins(tp=16))
    # the searched TP never replicates KV heads (megakit's model splits them), with wide nodes too
    assert tp_choices(llama, 64) == [1, 2, 4, 8]
    wide = search(llama, Cluster(gpu=A100, num_gpus=64, gpus_per_node=16), global_batch=512)
    assert all(llama.kv_heads % c.plan.tp == 0 for c in wide.ranked)


def test_zero3_under_a_pipeline_is_planned_with_one_chunk_per_stage():
    # the trainer runs ZeRO 3 under its pipeline with 1F1B (megakit.train.engine.zero3_pipeline), not ZeRO 2
    big = ModelSpec.from_params("175B")
    result = search(big, a100s(64), global_batch=1536, pins=Pins(pp=4, zero=3))
    assert {(c.plan.pp, c.plan.zero_stage, c.plan.vpp, c.plan.zero_bubble) for c in result.ranked} == {(4, 3, 1, False)}
    with pytest.raises(UsageError, match="--zero 3 with --pp 4 runs 1F1B with one model chunk per stage, not --vpp 2"):
        search(big, a100s(64), global_batch=1536, pins=Pins(pp=4, zero=3, vpp=2))
    with pytest.raises(UsageError, match="--zero 2 cannot run with --pp 4"):
        search(big, a100s(64), global_batch=1536, pins=Pins(pp=4, zero=2))
