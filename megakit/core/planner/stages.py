"""Where a pipeline's work sits: blocks per stage and per chunk as the trainer splits them, and the
micro-batches each stage (and each of its interleaved chunks) holds at its peak.

Pure arithmetic over ``partition_layers`` and the schedules' ordering, used by the memory and the
cost models; cached, because the search asks thousands of times.
"""

from __future__ import annotations

import functools

from megakit.core.partition import partition_layers
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.schedules import build_schedule
from megakit.core.simulator import Costs, simulate


def in_flight_micro_batches(
    *, pp: int, stage: int, accumulation: int, vpp: int = 1, zero_bubble: bool = False
) -> float:
    """Micro-batches of a stage's layers alive at the peak of a 1F1B (interleaved) schedule.

    Counted in whole-stage units: with ``vpp`` chunks each holding 1/vpp of the stage's layers.
    ZB-H1 (``zero_bubble``): every stage holds ``min(p, m)``, what 1F1B's first stage holds, since a
    micro-batch stays alive until its deferred W (``schedules.zb_h1_compute``; the simulator's peak)."""
    m = max(accumulation, 1)
    if zero_bubble:
        return min(pp, m)
    if vpp <= 1:
        return min(pp - stage, m)
    chunks = min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, m * vpp)
    return chunks / vpp


@functools.lru_cache(maxsize=4096)
def in_flight_chunks(
    *, pp: int, stage: int, accumulation: int, vpp: int = 1, zero_bubble: bool = False
) -> tuple[tuple[float, ...], ...]:
    """Live micro-batches of each of the stage's ``vpp`` chunks at the moments its total peaks, over one
    step of the trainer's schedule (as ``schedules.interleaved_compute`` orders it): the k-th forward runs chunk
    ``(k // pp) % vpp`` for its k-th forward, so earlier chunks hold more than later ones, and a stage
    whose chunks hold unequal layers peaks where its biggest chunks are most in flight."""
    m = max(accumulation, 1)
    if vpp <= 1:
        return ((min(pp if zero_bubble else pp - stage, m),),)
    if m % pp:  # the trainer refuses it; an even spread of the formula's count
        return ((min((pp - stage - 1) * 2 + (vpp - 1) * pp + 1, m * vpp) / vpp,) * vpp,)
    total = m * vpp
    warmup = total if m == pp else min(2 * (pp - stage - 1) + (vpp - 1) * pp, total)
    live = [0] * vpp
    for k in range(warmup):
        live[(k // pp) % vpp] += 1
    if warmup == total:
        return (tuple(live),)
    states = set()
    for i in range(min(total - warmup, pp * vpp)):  # steady state: forward warmup + i, then backward i;
        live[((warmup + i) // pp) % vpp] += 1  # the pattern repeats every pp * vpp forwards
        states.add(tuple(live))
        live[vpp - 1 - (i // pp) % vpp] -= 1
    return tuple(sorted(states))


def interleaved_step_time(
    chunk_times: tuple[float, ...], *, pp: int, vpp: int, micro_batches: int, forward_share: float, message_s: float
) -> float | None:
    """Seconds of an interleaved step whose chunks hold unequal work (``chunk_times``: forward + backward of one
    micro-batch per virtual stage; ``message_s``: one P2P send), from the trainer's schedule run in the simulator.

    The closed form ``(ΣT − T_slowest) / v`` assumes each chunk is 1/v of its rank's work. Unequal chunks also
    stall the steady state: at PP 2 x VPP 2, ``0,12,12,0`` takes 1.5x a rank's work per micro-batch, where the
    balanced split takes 1x. The schedule repeats every ``pp`` micro-batches once warmed up, so ``2pp`` and ``3pp``
    are simulated and longer steps extrapolated along that line (within 1e-3 of the whole step simulated:
    tests/core/planner/test_planner_stages.py). None where the schedule cannot run (micro-batches not a multiple
    of ``pp``).
    Cached on the costs relative to the slowest chunk, to 1e-3: the search prices one pinned split many times."""
    if micro_batches < pp or micro_batches % pp:
        return None
    scale = max(chunk_times)
    if scale <= 0:
        return 0.0
    key = (
        tuple(round(t / scale, 3) for t in chunk_times),
        pp,
        vpp,
        round(forward_share, 3),
        round(message_s / scale, 3),
    )
    if micro_batches <= 3 * pp:
        return _interleaved_time(*key, micro_batches) * scale
    two, three = _interleaved_time(*key, 2 * pp), _interleaved_time(*key, 3 * pp)
    return (three + (micro_batches - 3 * pp) * (three - two) / pp) * scale


@functools.lru_cache(maxsize=256)
def _interleaved_time(
    chunks: tuple[float, ...], pp: int, vpp: int, forward_share: float, p2p: float, micro_batches: int
) -> float:
    """The simulated step of ``micro_batches`` through the interleaved schedule, chunk costs as given."""
    costs = Costs(
        forward=tuple(t * forward_share for t in chunks),
        backward=tuple(t * (1 - forward_share) for t in chunks),
        p2p=p2p,
    )
    return simulate(build_schedule("interleaved", pp, micro_batches, vpp), costs).step_time


def zero_bubble_bubble_share(weight_share: float) -> float:
    """ZB-H1's bubble over 1F1B's at the same stage times (Qi et al. 2023, section 3.1).

    1F1B idles (p-1)(F+B+W) per stage (its backward is B+W); ZB-H1 runs each stage's W's
    in the cool-down where 1F1B waits and idles (p-1)(F+B-W). With T = F+B+W and W = w·T
    the ratio is 1 - 2w: a third when F = B = W (and never below 0)."""
    return max(0.0, 1.0 - 2.0 * weight_share)


@functools.lru_cache(maxsize=1024)
def virtual_stage_ranges(model: ModelSpec, pp: int, vpp: int = 1) -> tuple[range, ...]:
    """The blocks of each virtual stage (chunk ``c`` of PP rank ``r`` is ``c * pp + r``) as the trainer
    splits them: the model's pinned ``stage_layers`` when it has ``pp * vpp`` entries (other layouts,
    such as the one-GPU check, cannot hold that split), else ``partition_layers`` balanced by parameters
    (the last stage's MTP modules, ``model.mtp``, counted with its head)."""
    pinned = model.stage_layers is not None and len(model.stage_layers) == pp * vpp
    return tuple(partition_layers(model.config, pp, vpp, model.stage_layers if pinned else "params", mtp=model.mtp))


@functools.lru_cache(maxsize=1024)
def stage_chunk_layers(model: ModelSpec, pp: int, vpp: int = 1) -> tuple[tuple[int, ...], ...]:
    """Blocks of each chunk on each PP rank, as the trainer splits them (``virtual_stage_ranges``)."""
    ranges = virtual_stage_ranges(model, pp, vpp)
    return tuple(tuple(len(ranges[chunk * pp + rank]) for chunk in range(vpp)) for rank in range(pp))


@functools.lru_cache(maxsize=1024)
def stage_layer_counts(model: ModelSpec, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """Blocks on each PP rank as the trainer splits them (``virtual_stage_ranges``: balanced by parameters,
    embedding on the first stage, head on the last, unless pinned), a rank holding its ``vpp`` chunks.
    Cached: the dynamic programme costs ~10 ms for 100 layers, the search asks thousands of times."""
    ranges = virtual_stage_ranges(model, pp, vpp)
    return tuple(sum(len(ranges[chunk * pp + rank]) for chunk in range(vpp)) for rank in range(pp))


@functools.lru_cache(maxsize=1024)
def stage_chunk_moe_layers(model: ModelSpec, pp: int, vpp: int = 1) -> tuple[tuple[int, ...], ...]:
    """MoE blocks (those with routed experts) of each chunk on each PP rank, as the trainer splits them."""
    ranges = virtual_stage_ranges(model, pp, vpp)
    return tuple(
        tuple(sum(model.config.is_moe_layer(i) for i in ranges[chunk * pp + rank]) for chunk in range(vpp))
        for rank in range(pp)
    )


def stage_moe_layers(model: ModelSpec, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """MoE blocks on each PP rank (0 everywhere for a dense model)."""
    return tuple(sum(chunks) for chunks in stage_chunk_moe_layers(model, pp, vpp))
