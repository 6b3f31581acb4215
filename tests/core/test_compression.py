"""Compressed DP gradient averaging: the spec, each codec over real gloo, error feedback, bytes counted.

Every multi-process worker of this module runs in one gloo job per world size (the ``jobs`` fixture):
starting processes costs far more than the workers."""

from __future__ import annotations

import pytest
import torch
from multiproc import run_many

from megakit.core.compression import Compression, parse_compression
from megakit.errors import UsageError


@pytest.mark.parametrize("text", ["topk:0", "topk:2", "topk:1", "topk:x", "topk", "int9", "fp16:3", ""])
def test_bad_specs_are_refused_in_one_line(text):
    with pytest.raises(UsageError) as error:
        parse_compression(text)
    assert "\n" not in str(error.value) and "--compress" in str(error.value)


def test_wire_bytes():
    assert parse_compression("topk:0.01") == Compression("topk", 0.01)
    assert parse_compression("none").wire_fraction() == 1.0
    assert parse_compression("fp16").wire_fraction() == 0.5
    assert parse_compression("int8").wire_fraction() <= 0.30
    assert parse_compression("sign").wire_fraction() <= 0.05
    assert parse_compression("topk:0.01").wire_fraction() <= 0.10
    # int8 and sign reduce in two compressed phases: their share does not grow with DP; Top-K's pairs are gathered
    assert parse_compression("int8").wire_fraction(64) == parse_compression("int8").wire_fraction(2)
    assert parse_compression("topk:0.01").wire_fraction(64) > 10 * parse_compression("topk:0.01").wire_fraction(2)


def _reduce_rounds(rank, world, spec, feedback, rounds):
    """Each rank reduces its own fixed gradient ``rounds`` times; returns what it got and the bytes it counted."""
    import torch
    import torch.distributed as dist

    from megakit.core.compression import parse_compression
    from megakit.nn import comm
    from megakit.nn.compression import GradientReducer

    reducer = GradientReducer(parse_compression(spec), comm.WORLD, error_feedback=feedback)
    gen = torch.Generator().manual_seed(rank)
    shapes = [(37, 29), (1000,), (3,)]
    local = [torch.randn(s, generator=gen) for s in shapes]
    outs = []
    for _ in range(rounds):
        grads = [g.clone() for g in local]
        reducer.reduce(grads)
        outs.append(torch.cat([g.reshape(-1) for g in grads]))
    exact = torch.cat([g.reshape(-1) for g in local]).clone()
    dist.all_reduce(exact)
    return {"outs": [o.tolist() for o in outs], "exact": (exact / world).tolist(), "bytes": reducer.take_bytes()}


def _local_tensors(rank: int, shapes) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randn(s, generator=gen) for s in shapes]


def _expected_mean(spec: str, per_rank: list[list[torch.Tensor]]) -> torch.Tensor:
    """The codec's first average written out from its definition, tensor by tensor (not through the codec): Top-K
    keeps each tensor's largest ``ratio`` share on every rank and averages; sign gives each chunk of ``CHUNK``
    elements of a tensor the signs times their mean magnitude on every rank, sums, and does the same to the sum."""
    from megakit.core.compression import CHUNK

    world, spec = len(per_rank), parse_compression(spec)
    out = []
    for tensors in zip(*per_rank):  # one tensor, as every rank holds it
        flats = [t.reshape(-1).double() for t in tensors]
        if spec.kind == "topk":
            kept = []
            for x in flats:
                k = max(1, int(x.numel() * spec.ratio))
                keep = torch.zeros_like(x)
                index = x.abs().argsort(descending=True)[:k]
                keep[index] = x[index]
                kept.append(keep)
            out.append(sum(kept) / world)
            continue
        assert spec.kind == "sign"
        sums = []
        for start in range(0, flats[0].numel(), CHUNK):
            chunks = [x[start : start + CHUNK] for x in flats]
            total = sum(torch.where(c >= 0, 1.0, -1.0) * c.abs().mean() for c in chunks)
            sums.append(torch.where(total >= 0, 1.0, -1.0) * total.abs().mean())
        out.append(torch.cat(sums) / world)
    return torch.cat(out).float()


SHAPES = [(37, 29), (1000,), (3,)]
CODECS = [("none", 1e-6), ("fp16", 2e-3), ("int8", 0.03), ("sign", 1e-5), ("topk:0.1", 1e-6)]
FEEDBACK_ROUNDS = 60
NEIGHBOURS, UPDATES, OVERFLOWS = ["int8", "sign", "topk:0.05"], ["sign", "topk:0.01"], ["fp16", "int8"]


def _calls(world: int) -> dict:
    """Every worker of this module at ``world`` ranks, by (test, parameter): all run in one job per world size."""
    calls = {("codec", spec): (_reduce_rounds, (spec, True, 1)) for spec, _ in CODECS}
    if world == 2:
        calls |= {("feedback", fb): (_reduce_rounds, ("topk:0.1", fb, FEEDBACK_ROUNDS)) for fb in (True, False)}
        calls |= {("neighbours", spec): (_compress_shared_beside_own, (spec,)) for spec in NEIGHBOURS}
        calls |= {("update", spec): (_update_rounds, (spec, 5)) for spec in UPDATES}
        calls |= {("overflow", spec): (_overflow_then_finite, (spec,)) for spec in OVERFLOWS}
    return calls


@pytest.fixture(scope="module")
def jobs():
    """``jobs(world)[(test, parameter)]``: that worker's results by rank; one gloo job per world size, started once."""
    done: dict = {}

    def results(world: int) -> dict:
        if world not in done:
            calls = _calls(world)
            done[world] = dict(zip(calls, run_many(list(calls.values()), world)))
        return done[world]

    return results


@pytest.mark.parametrize("world", [2, 4])
def test_codecs_average_over_ranks_and_agree_everywhere(world, jobs):
    """Every codec's average against one computed without it: the exact mean within the codec's precision (none,
    fp16, int8), or the lossy codec's definition (sign, Top-K) within fp32 rounding (sign averages 512 elements
    per scale); and the bytes each rank put on the wire are what the codec sends, bounded from above and from
    below (a codec that sends nothing fails)."""
    local = [_local_tensors(r, SHAPES) for r in range(world)]
    for spec, tolerance in CODECS:
        results = jobs(world)[("codec", spec)]
        first = results[0]["outs"][0]
        for r in results[1:]:  # every rank applies the same averaged gradient
            assert r["outs"][0] == first, spec
        first, exact = torch.tensor(first), torch.tensor(results[0]["exact"])
        assert torch.allclose(exact, torch.cat([sum(ts).reshape(-1) for ts in zip(*local)]) / world, atol=1e-6)
        want = exact if spec in ("none", "fp16", "int8") else _expected_mean(spec, local)
        assert want.abs().max() > 0.1
        assert (first - want).abs().max() <= tolerance * want.abs().max(), (spec, (first - want).abs().max())
        sent, dense = results[0]["bytes"]  # on the wire: a ring all-reduce sends 2 (n-1)/n of its buffer
        n, ring = exact.numel(), 2 * (world - 1) / world
        assert dense == round(4 * n * ring)
        nominal = parse_compression(spec).wire_fraction(world) * dense
        assert 0.95 * nominal <= sent <= nominal + 4 * 512 * world, (spec, sent, nominal)


def test_error_feedback_sends_what_was_dropped(jobs):
    """With a fixed gradient, the running mean of Top-K + error feedback's outputs converges to the true
    average (nothing is lost, only delayed); without feedback the small coordinates are never sent."""
    with_fb, without = (jobs(2)[("feedback", fb)][0] for fb in (True, False))
    assert len(with_fb["outs"]) == len(without["outs"]) == FEEDBACK_ROUNDS
    exact = torch.tensor(with_fb["exact"])
    mean_fb = torch.tensor(with_fb["outs"]).mean(0)
    mean_plain = torch.tensor(without["outs"]).mean(0)
    err_fb = float((mean_fb - exact).norm() / exact.norm())
    err_plain = float((mean_plain - exact).norm() / exact.norm())
    assert err_fb < 0.15 and err_plain > 0.6, (err_fb, err_plain)


def _compress_shared_beside_own(rank, world, spec):
    """Each rank compresses [shared, its own]: what it keeps of ``shared`` must not depend on the neighbour."""
    import torch

    from megakit.core.compression import parse_compression
    from megakit.nn import comm
    from megakit.nn.compression import GradientReducer

    shared = torch.randn(700, generator=torch.Generator().manual_seed(0))
    own = 100 * torch.randn(900, generator=torch.Generator().manual_seed(rank + 1))
    codec = GradientReducer(parse_compression(spec), comm.WORLD)
    _, kept = codec.exchange(torch.cat([shared, own]), (700, 900))
    return kept[:700].tolist()


@pytest.mark.parametrize("spec", NEIGHBOURS)
def test_a_tensor_compresses_alike_whatever_its_neighbours(spec, jobs):
    """A TP-replicated norm weight sits beside different shards on each TP rank (an embedding tied over PP, beside
    different stages): no scale chunk and no Top-K choice may span two tensors, or the replicas drift apart."""
    first, second = jobs(2)[("neighbours", spec)]
    assert first == second


def _update_rounds(rank, world, spec, rounds):
    """Each rank takes its own fixed 'optimizer step' ``rounds`` times through an UpdateReducer."""
    import torch

    from megakit.core.compression import parse_compression
    from megakit.nn import comm
    from megakit.nn.compression import UpdateReducer

    params = [torch.zeros(40, 30), torch.zeros(50)]
    reducer = UpdateReducer(parse_compression(spec), comm.WORLD, params)
    gen = torch.Generator().manual_seed(rank)
    steps = [torch.randn(p.shape, generator=gen) for p in params]
    means, first = [], {}
    held = torch.zeros(sum(p.numel() for p in params))
    for _ in range(rounds):
        for p, s in zip(params, steps):
            p.add_(s)
        before = torch.cat([p.reshape(-1) for p in params]) + held
        reducer.after_step(params)
        if not first:  # what the first exchange made common, and what it cost
            first = {
                "shared": torch.cat([p.reshape(-1) for p in reducer.shared]).tolist(),
                "bytes": reducer.take_bytes(),
            }
        held = reducer.held_back(held.numel())  # what sign's second compression keeps for the next sum
        after = torch.cat([p.reshape(-1) for p in params]) + held
        moved = comm.all_reduce(before.clone(), comm.WORLD) - comm.all_reduce(after.clone(), comm.WORLD)
        means.append(moved.abs().max().item())
    reducer.synchronize(params)
    return {
        "mean_moved": max(means),
        "final": torch.cat([p.reshape(-1) for p in params]).tolist(),
        **first,
        "expected": (rounds * comm.all_reduce(torch.cat([s.reshape(-1) for s in steps]), comm.WORLD) / world).tolist(),
    }


@pytest.mark.parametrize("spec", UPDATES)
def test_update_reducer_keeps_the_mean_model_and_synchronizes_to_it(spec, jobs):
    """The first exchange makes common the compressed mean of the ranks' updates, as the codec defines it, and
    sends its bytes; each rank's weights keep its unsent updates, so the exchange never changes the mean over
    ranks of the weights plus what sign's second compression holds back (nothing is lost, only delayed);
    ``synchronize`` then gives every rank that mean: the exact sum of all steps."""
    first, second = jobs(2)[("update", spec)]
    want = _expected_mean(spec, [_local_tensors(r, [(40, 30), (50,)]) for r in range(2)])
    for result in (first, second):
        assert torch.allclose(torch.tensor(result["shared"]), want, rtol=1e-5, atol=1e-5), spec
        sent, dense = result["bytes"]
        assert 0.95 * parse_compression(spec).wire_fraction(2) * dense <= sent < 0.1 * dense, (sent, dense)
    assert first["mean_moved"] < 1e-4 and second["mean_moved"] < 1e-4
    assert first["final"] == second["final"]
    assert torch.allclose(torch.tensor(first["final"]), torch.tensor(first["expected"]), atol=1e-4)


def _overflow_then_finite(rank, world, spec):
    """Round 1: rank 0 holds an inf (a loss-scaled fp16 overflow, whose step DeepSpeed skips); round 2 is finite."""
    import torch

    from megakit.core.compression import parse_compression
    from megakit.nn import comm
    from megakit.nn.compression import GradientReducer

    reducer = GradientReducer(parse_compression(spec), comm.WORLD)
    gen = torch.Generator().manual_seed(rank)
    outs = []
    for step in range(2):
        grads = [torch.randn(700, generator=gen), torch.randn(300, generator=gen)]
        if step == 0 and rank == 0:
            grads[0][5] = float("inf")
        reducer.reduce(grads)
        outs.append(bool(torch.isfinite(torch.cat(grads)).all()))
    return outs


@pytest.mark.parametrize("spec", OVERFLOWS)
def test_an_overflowing_step_does_not_poison_the_residuals(spec, jobs):
    """The overflowing step reaches DeepSpeed non-finite (so it is skipped), and leaves no residual behind: the
    next step is finite on every rank."""
    for outs in jobs(2)[("overflow", spec)]:
        assert outs == [False, True], outs
