"""Interleaved in-flight work counted chunk by chunk, against the schedule the trainer runs."""

import itertools

import pytest

from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.stages import (
    in_flight_chunks,
    in_flight_micro_batches,
    stage_chunk_layers,
)
from megakit.core.schedules import Forward, interleaved_compute


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
            assert {sum(p) for p in peaks} == {in_flight_micro_batches(pp=pp, stage=stage, accumulation=m, vpp=vpp)
                                               * vpp}


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
    heaviest = max(sum(n * l for n, l in zip(c, layers)) for c in counts)
    assert est.items["activations"] >= heaviest * per_block
    equal = in_flight_micro_batches(pp=pp, stage=0, accumulation=m, vpp=vpp) * sum(layers) * per_block
    assert heaviest * per_block != pytest.approx(equal)  # whole-stage units would be off here
