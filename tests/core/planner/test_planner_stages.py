"""Interleaved in-flight work counted chunk by chunk, against the schedule the trainer runs."""

import itertools
import re

import pytest

from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.stages import (
    in_flight_chunks,
    in_flight_micro_batches,
    stage_chunk_layers,
)
from megakit.core.schedules import Forward, interleaved_compute
from megakit.errors import UsageError


def _schedule_peaks(pp, m, vpp, stage):
    live, states = [0] * vpp, set()
    for action in interleaved_compute(pp, m, vpp).stages[stage]:
        live[action.chunk] += 1 if isinstance(action, Forward) else -1
        states.add(tuple(live))
    peak = max(sum(x) for x in states)
    return tuple(sorted(x for x in states if sum(x) == peak))


@pytest.mark.parametrize("pp,vpp", list(itertools.product((2, 3, 4, 8), (2, 3, 4))))
def test_per_chunk_counts_are_the_schedules(pp, vpp):
    for m, stage in itertools.product((pp, 2 * pp, 4 * pp), range(pp)):
        peaks = in_flight_chunks(pp=pp, stage=stage, accumulation=m, vpp=vpp)
        assert peaks == _schedule_peaks(pp, m, vpp, stage), (m, stage)
        if m > pp:  # with m == pp the trainer runs every forward first: all m * vpp chunks are in flight
            assert {sum(p) for p in peaks} == {
                in_flight_micro_batches(pp=pp, stage=stage, accumulation=m, vpp=vpp) * vpp
            }


def test_a_stage_peaks_where_its_biggest_chunks_are_in_flight():
    """The embedding makes the first virtual stage hold fewer blocks (the trainer's split by parameters);
    the estimate weighs each chunk's in-flight micro-batches by the blocks it holds."""
    model = ModelSpec.from_config("llama-3-8b").with_overrides(seq_len=2048)
    pp, vpp, m = 4, 2, 8
    layers = stage_chunk_layers(model, pp, vpp)[0]
    assert layers[0] < layers[1]
    est = estimate_memory(model, tp=1, pp=pp, vpp=vpp, accumulation=m, stage=0, recompute="full")
    per_block = est.activation_per_layer
    counts = in_flight_chunks(pp=pp, stage=0, accumulation=m, vpp=vpp)
    heaviest = max(sum(n * k for n, k in zip(c, layers)) for c in counts)
    assert est.items["activations"] >= heaviest * per_block
    equal = in_flight_micro_batches(pp=pp, stage=0, accumulation=m, vpp=vpp) * sum(layers) * per_block
    assert heaviest * per_block != pytest.approx(equal)  # whole-stage units would be off here


# -- uneven virtual stages: Llama 3.1 405B on 8192 H100s (126 layers, PP 16 x VPP 2) ----------------------------------
def _llama_405b_search(**pins):
    import dataclasses

    from megakit.core.planner.hardware import Cluster, gpu_preset
    from megakit.core.planner.search import Pins, search

    model = ModelSpec.from_config("models/llama-3.1-405b.json").with_overrides(seq_len=8192)
    cluster = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=8192, gpus_per_node=8)
    base = Pins(tp=8, pp=16, micro_batch=1, recompute="full")
    return model, search(model, cluster, global_batch=2048, pins=dataclasses.replace(base, **pins))  # 16M tokens


def test_405b_plans_uneven_virtual_stages_and_interleaving_divides_the_bubble():
    """126 layers do not divide into 16 x 2 virtual stages: the split balanced by parameters gives the first and
    the last virtual stage (with the 2.1B-parameter embedding and head) one block fewer, as Llama 3 405B ran, and
    the bubble over the busy time is (p - 1) / (v m), halved by VPP 2."""
    from megakit.core.planner.stages import virtual_stage_ranges

    model, interleaved = _llama_405b_search(vpp=2)
    _, plain = _llama_405b_search(vpp=1)
    assert [len(r) for r in virtual_stage_ranges(model, 16, 2)] == [3] + [4] * 30 + [3]
    assert stage_chunk_layers(model, 16, 2)[0] == (3, 4) and stage_chunk_layers(model, 16, 2)[15] == (4, 3)
    bubbles = {}
    for v, result in ((1, plain), (2, interleaved)):
        plan, cost = result.best.plan, result.best.cost
        assert (plan.tp, plan.pp, plan.dp, plan.vpp, plan.accumulation) == (8, 16, 64, v, 32)
        assert result.fits == "yes" and plan.zero_stage <= 1
        bubbles[v] = cost.bubble_s / (cost.pipeline_s - cost.bubble_s)  # idle over busy time
        assert bubbles[v] == pytest.approx((16 - 1) / (v * 32), rel=0.05), (v, bubbles[v])
    assert bubbles[2] == pytest.approx(bubbles[1] / 2, rel=0.02)
    assert interleaved.best.cost.tokens_per_s > 1.1 * plain.best.cost.tokens_per_s


def test_a_pinned_split_is_what_the_memory_and_cost_models_price():
    """--stage-layers moves blocks: two more on the last stage (virtual stage 31) and two fewer on the first make
    the last stage the slowest and the first stage's memory smaller, and the plan slower than the balanced one."""
    split = (1,) + (4,) * 30 + (5,)
    model, pinned = _llama_405b_search(stage_layers=split)  # VPP 2 follows from 32 counts over PP 16
    _, balanced = _llama_405b_search(vpp=2)
    assert pinned.best.plan.vpp == 2
    times, even = pinned.best.cost.stage_times, balanced.best.cost.stage_times
    assert times[-1] == max(times) > max(even) and times[0] < even[0]
    assert pinned.best.cost.tokens_per_s < balanced.best.cost.tokens_per_s
    first = estimate_memory(model.with_overrides(stage_layers=split), stage=0, **pinned.best.plan.memory_kwargs())
    assert (
        first.layers == 5 and first.total < estimate_memory(model, stage=0, **balanced.best.plan.memory_kwargs()).total
    )


def test_a_pinned_split_with_empty_end_chunks_is_priced_by_its_schedule():
    """Pinned chunks are timed by running the interleaved schedule in the simulator, chunk by chunk: 3,4,...,4,3
    (what the balanced split gives) keeps the closed form's bubble, while 0,4,...,4,7,7,4,...,4,0 (the embedding
    alone in the first chunk, the head alone in the last, ranks 0 and 15 each one 7-block chunk), at about the
    same per-rank work, stalls the schedule around its two big chunks: slower than the balanced split, and than
    plain 1F1B."""
    balanced_split = (3,) + (4,) * 30 + (3,)
    ends_apart = (0,) + (4,) * 14 + (7, 7) + (4,) * 14 + (0,)
    _, formula = _llama_405b_search(vpp=2)
    _, balanced = _llama_405b_search(stage_layers=balanced_split)
    _, ends = _llama_405b_search(stage_layers=ends_apart)
    _, plain = _llama_405b_search(vpp=1)
    assert balanced.best.cost.bubble_s == pytest.approx(formula.best.cost.bubble_s, rel=0.05)
    assert max(ends.best.cost.stage_times) == pytest.approx(max(balanced.best.cost.stage_times), rel=0.05)
    assert ends.best.cost.bubble_s > 2 * balanced.best.cost.bubble_s  # measured 9.0 s against 3.6 s
    assert ends.best.cost.tokens_per_s < plain.best.cost.tokens_per_s < balanced.best.cost.tokens_per_s


def test_qwen3_235b_plans_pp32_x_vpp3_with_an_embedding_and_a_loss_stage_of_their_own():
    """94 blocks on PP 32 x VPP 3 = 96 virtual stages (Megatron's layout with the embedding and the loss in virtual
    stages of their own) plans as balanced 0, 1 x 94, 0, priced like that split pinned: the chunk times through the
    simulator; the first rank's memory has the embedding's weights and states in place of a block's, the last rank's
    the head's and the logits, held while a micro-batch is in its loss-only chunk."""
    import dataclasses

    from megakit.core.planner.hardware import Cluster, gpu_preset
    from megakit.core.planner.search import Pins, search

    model = ModelSpec.from_config("qwen3-235b-a22b").with_overrides(seq_len=4096)
    cluster = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=256, gpus_per_node=8)
    pins = Pins(tp=2, pp=32, vpp=3, ep=8, zero=1, micro_batch=1, recompute="full", sequence_parallel=True)
    auto = search(model, cluster, global_batch=512, pins=pins)
    pinned = search(
        model, cluster, global_batch=512, pins=dataclasses.replace(pins, stage_layers=(0,) + (1,) * 94 + (0,))
    )
    assert auto.fits == "yes" and auto.best.plan.vpp == 3
    assert stage_chunk_layers(model, 32, 3)[0] == (0, 1, 1) and stage_chunk_layers(model, 32, 3)[-1] == (1, 1, 0)
    assert auto.best.cost.step_time_s == pytest.approx(pinned.best.cost.step_time_s, rel=1e-9)
    assert auto.best.cost.bubble_s == pytest.approx(pinned.best.cost.bubble_s, rel=1e-9)
    kwargs = auto.best.plan.memory_kwargs()
    first, middle, last = (estimate_memory(model, stage=s, **kwargs) for s in (0, 1, 31))
    block = sum(model.layer_params(2, moe=True))
    assert (first.layers, middle.layers, last.layers) == (2, 3, 2)
    assert first.params_local == middle.params_local - block + model.embedding_params(2)
    assert last.params_local == middle.params_local - block + model.head_params(2, separate=True)
    assert last.items["logits"] > last.items["activations"] > 0 and first.items["logits"] == 0
    with pytest.raises(
        UsageError,
        match=re.escape(
            "--pp 32 x --vpp 4 = 128 virtual stages exceed the 94 layers plus an embedding-only and a loss-only stage"
        ),
    ):
        search(model, cluster, global_batch=512, pins=dataclasses.replace(pins, vpp=4))


@pytest.mark.parametrize(
    "chunks, pp, vpp",
    [
        ((0, 3, 3, 0), 2, 2),
        ((3, 4, 4, 4, 4, 4, 4, 3), 4, 2),
        ((1, 2, 3, 4, 4, 3, 2, 1, 5, 1, 1, 1), 4, 3),
        ((0,) + (4,) * 6 + (7, 7) + (4,) * 6 + (0,), 8, 2),
    ],
)
def test_the_interleaved_step_extrapolates_what_the_simulator_runs(chunks, pp, vpp):
    """The planner simulates 2·PP and 3·PP micro-batches and extends the line; the whole step simulated agrees
    within the 1e-3 its cached relative costs are rounded to, at every length."""
    from megakit.core.planner.stages import interleaved_step_time
    from megakit.core.schedules import build_schedule
    from megakit.core.simulator import Costs, simulate

    for m in (pp, 2 * pp, 5 * pp, 13 * pp):
        got = interleaved_step_time(
            tuple(map(float, chunks)), pp=pp, vpp=vpp, micro_batches=m, forward_share=1 / 3, message_s=0.1
        )
        costs = Costs(forward=tuple(c / 3 for c in chunks), backward=tuple(2 * c / 3 for c in chunks), p2p=0.1)
        assert got == pytest.approx(simulate(build_schedule("interleaved", pp, m, vpp), costs).step_time, rel=1e-3)
    assert (
        interleaved_step_time(
            tuple(map(float, chunks)), pp=pp, vpp=vpp, micro_batches=pp + 1, forward_share=1 / 3, message_s=0.1
        )
        is None
    )  # the schedule needs m % pp == 0


@pytest.mark.parametrize(
    "pins, message",
    [
        (dict(stage_layers=(63, 63)), "gives 2 layer counts for --pp 16 x --vpp 1 = 16 virtual stages"),
        (dict(vpp=2, stage_layers=(4,) * 32), "sums to 128 layers but the model has 126"),
        (dict(vpp=2, stage_layers=(4, 0, 6) + (4,) * 29), "has an entry below 1 in the middle"),
        (dict(pp=None, stage_layers=(63, 63)), "needs the layout: pin --pp"),
    ],
)
def test_bad_stage_layer_pins_are_one_line(pins, message):

    with pytest.raises(UsageError, match=re.escape(message)):
        _llama_405b_search(**pins)
