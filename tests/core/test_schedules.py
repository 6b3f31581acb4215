"""Schedules as data: their order, bubble, memory and deadlock-freedom, checked without processes."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys

import pytest
from multiproc import THREADS

from megakit.core.schedules import (
    BACKWARD,
    FORWARD,
    RECV_ACT,
    SEND_ACT,
    Action,
    add_p2p,
    bubble_formula,
    build_schedule,
    gpipe_compute,
    interleaved_compute,
    one_f_one_b_compute,
    schedule_1f1b,
    schedule_gpipe,
    schedule_interleaved,
)
from megakit.core.simulator import Costs, ScheduleError, simulate
from megakit.errors import UsageError


def test_1f1b_compute_order_matches_deepspeed_train_schedule():
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule

    for pp in range(1, 9):
        for m in (1, 2, 3, pp, 2 * pp + 1, 16):
            ours = one_f_one_b_compute(pp, m)
            for stage in range(pp):
                ds = TrainSchedule(micro_batches=m, stages=pp, stage_id=stage)
                order = []
                for step_id, cmds in enumerate(ds.steps()):
                    mb, _ = ds._step_to_micro_batch(step_id)
                    order += [
                        (FORWARD if isinstance(c, ForwardPass) else BACKWARD, mb)
                        for c in cmds
                        if isinstance(c, (ForwardPass, BackwardPass))
                    ]
                assert order == [(a.kind, a.micro_batch) for a in ours.stages[stage]], (pp, m, stage)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (4, 16), (8, 8), (3, 1)])
def test_1f1b_and_gpipe_bubble_equal_formula(pp, m):
    for costs in (Costs(), Costs(forward=1.0, backward=1.0), Costs(forward=0.3, backward=0.7)):
        for schedule in (schedule_1f1b(pp, m), schedule_gpipe(pp, m)):
            report = simulate(schedule, costs)
            assert report.bubble == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
            f, b = costs.forward, costs.backward
            assert report.step_time == pytest.approx((m + pp - 1) * (f + b))


@pytest.mark.parametrize("pp,m,vpp", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 4, 3), (8, 16, 2)])
def test_interleaving_reduces_bubble_as_formula(pp, m, vpp):
    report = simulate(schedule_interleaved(pp, m, vpp), Costs(forward=1.0, backward=2.0))
    assert report.bubble == pytest.approx((pp - 1) / (vpp * m + pp - 1), abs=1e-9)
    assert report.bubble == pytest.approx(bubble_formula("interleaved", pp, m, vpp))
    assert report.bubble < simulate(schedule_1f1b(pp, m)).bubble


def test_costs_per_virtual_stage():
    """Costs given chunk by chunk (pp x vpp values): 1/vpp of each stage's cost is the per-stage run exactly; a split
    whose rank 1 holds all of virtual stage 1's work and rank 0 all of stage 2's (PP 2 x VPP 2, empty ends) is two
    plain stages run in interleaving's order: a third of the step idle, worse than 1F1B's ninth, not better."""
    pp, m, vpp = 4, 8, 2
    per_stage = simulate(
        schedule_interleaved(pp, m, vpp), Costs(forward=(1.0, 2.0, 1.5, 1.0), backward=(2.0, 4.0, 3.0, 2.0))
    )
    chunked = Costs(forward=(0.5, 1.0, 0.75, 0.5) * 2, backward=(1.0, 2.0, 1.5, 1.0) * 2)
    assert simulate(schedule_interleaved(pp, m, vpp), chunked).step_time == pytest.approx(per_stage.step_time)
    empty_ends = simulate(
        schedule_interleaved(2, 8, 2), Costs(forward=(0.0, 1.0, 1.0, 0.0), backward=(0.0, 2.0, 2.0, 0.0))
    )
    balanced = simulate(schedule_interleaved(2, 8, 2), Costs(forward=1.0, backward=2.0))
    assert balanced.bubble == pytest.approx(1 / (2 * 8 + 1))
    assert empty_ends.bubble == pytest.approx(1 / 3)
    assert simulate(schedule_1f1b(2, 8)).bubble == pytest.approx(1 / 9)
    with pytest.raises(UsageError, match="one per stage or one per virtual stage"):
        simulate(schedule_interleaved(2, 4, 2), Costs(forward=(1.0, 2.0, 3.0)))


def test_in_flight_bounds():
    for pp in range(1, 9):
        for m in (1, pp, 4 * pp):
            ones = simulate(schedule_1f1b(pp, m)).peak_in_flight
            assert ones == tuple(min(pp - s, m) for s in range(pp))  # stage 0 keeps at most p
            assert simulate(schedule_gpipe(pp, m)).peak_in_flight == (m,) * pp  # GPipe keeps all m


def every_schedule_up_to_p8_m32():
    """GPipe and 1F1B for every p <= 8, m <= 32, and interleaved (v = 2, 3) wherever m allows it."""
    for pp in range(1, 9):
        for m in range(1, 33):
            yield schedule_1f1b(pp, m)
            yield schedule_gpipe(pp, m)
            if m % pp == 0:
                yield from (schedule_interleaved(pp, m, vpp) for vpp in (2, 3))


def test_every_schedule_up_to_p8_m32_is_deadlock_free():
    count = 0
    for schedule in every_schedule_up_to_p8_m32():
        simulate(schedule)  # raises on deadlock, mismatch, missing or repeated work
        count += 1
    assert count > 500


def test_schedules_also_run_without_p2p_tags():
    """NCCL has no P2P tags: activations and gradients on one rank pair must agree in order too."""
    for pp in (2, 3, 4, 8):
        for m in (pp, 2 * pp, 3 * pp + (0 if pp > 1 else 1)):
            for schedule in (schedule_1f1b(pp, m), schedule_gpipe(pp, m), schedule_interleaved(pp, m, 2)):
                simulate(schedule, tagged=False)


def test_interleaved_visits_each_chunk_in_virtual_stage_order():
    s = schedule_interleaved(2, 4, 2)
    sends = [a for a in s.stages[1] if a.kind == SEND_ACT]
    assert {(a.chunk, a.peer) for a in sends} == {(0, 0)}  # chunk 0 of rank 1 feeds chunk 1 of rank 0
    recvs = [a for a in s.stages[0] if a.kind == RECV_ACT]
    assert {(a.chunk, a.peer) for a in recvs} == {(1, 1)}


def test_deadlock_is_reported_not_hung():
    good = one_f_one_b_compute(2, 2)
    # stage 1 waits for a gradient of micro-batch 1 first, stage 0 for micro-batch 0's: a cycle
    swapped = list(good.stages[0])
    swapped[2], swapped[3] = swapped[3], swapped[2]  # F0 F1 B1 B0
    bad = dataclasses.replace(good, stages=(tuple(swapped), good.stages[1]))
    with pytest.raises(ScheduleError, match="mismatched|deadlock"):
        simulate(bad)
    # stage 0 never sends its activations: stage 1 waits for them, stage 0 for gradients
    cyc = schedule_1f1b(2, 2)
    s0 = [a for a in cyc.stages[0] if a.kind != SEND_ACT]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(dataclasses.replace(cyc, stages=(tuple(s0), cyc.stages[1])))


def test_backward_before_forward_is_an_error():
    s = gpipe_compute(1, 2)
    bad = dataclasses.replace(s, stages=((Action(kind=BACKWARD, micro_batch=0),) + s.stages[0],))
    with pytest.raises(ScheduleError, match="backward before its forward"):
        simulate(bad)


def test_missing_work_and_unmatched_sends_are_errors():
    s = one_f_one_b_compute(2, 2)
    with pytest.raises(ScheduleError, match="exactly once"):
        simulate(dataclasses.replace(s, stages=(s.stages[0][:-1], s.stages[1][:-1])))
    full = schedule_1f1b(2, 2)
    extra = full.stages[0] + (Action(kind=SEND_ACT, micro_batch=0, chunk=0, peer=1),)
    with pytest.raises(ScheduleError, match="never received"):
        simulate(dataclasses.replace(full, stages=(extra, full.stages[1])))


def test_invalid_inputs_get_usage_errors():
    with pytest.raises(UsageError, match="divisible"):
        interleaved_compute(4, 6, 2)
    with pytest.raises(UsageError, match="positive"):
        schedule_1f1b(0, 4)
    with pytest.raises(UsageError, match="positive"):
        schedule_gpipe(2, 0)
    with pytest.raises(UsageError, match="interleaved"):
        build_schedule("1f1b", 2, 4, vpp=2)
    with pytest.raises(UsageError, match="unknown schedule"):
        build_schedule("zigzag", 2, 4)
    with pytest.raises(UsageError, match="one per stage"):
        simulate(schedule_1f1b(2, 2), Costs(forward=(1.0, 2.0, 3.0)))


def test_unequal_measured_costs_bound_step_by_slowest_stage():
    report = simulate(schedule_1f1b(2, 8), Costs(forward=(1.0, 3.0), backward=(2.0, 6.0)))
    assert report.step_time >= 8 * 9.0
    assert report.bubble_per_stage[1] < report.bubble_per_stage[0]


def test_cli_prints_timeline_and_writes_png(tmp_path):
    out = tmp_path / "s.png"
    env = {**os.environ, "OMP_NUM_THREADS": THREADS}
    cmd = [
        sys.executable,
        "-m",
        "megakit.commands.cli",
        "schedule",
        "--pp",
        "4",
        "--micro-batches",
        "8",
        "--schedule",
        "interleaved",
        "--vpp",
        "2",
        "--out",
        str(out),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "bubble 15.8%" in done.stdout and "stage  3" in done.stdout
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bad = subprocess.run(
        cmd[:6] + ["--micro-batches", "6", "--schedule", "interleaved", "--out", str(tmp_path / "b.png")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "divisible" in bad.stderr
    assert not (tmp_path / "b.png").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["s.png"]  # no temporary file left behind


def test_batched_rendezvous_p2p_proves_every_schedule():
    """NCCL: a send waits for its receive; runs of send/recv go out as one batch (batch_isend_irecv)."""
    for schedule in every_schedule_up_to_p8_m32():
        report = simulate(schedule, p2p="batched")  # raises on deadlock or mismatch
        assert report.step_time == pytest.approx(simulate(schedule).step_time)  # and costs nothing
    # interleaving needs its fused forward-backward pairs there: with the plain pass it deadlocks
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(add_p2p(interleaved_compute(2, 4, 2)), p2p="batched")
    with pytest.raises(UsageError, match="P2P mode"):
        simulate(schedule_1f1b(2, 2), p2p="eager")


def test_zb_h1_idles_a_third_of_1f1b_with_equal_f_b_w():
    """Qi et al. 2023: with F = B = W (1F1B's backward = B + W = 2F) ZB-H1 idles (p-1)(F+B-W) against (p-1)(F+B+W)."""
    costs = Costs(forward=1.0, backward=2.0, weight=0.5)
    one, zb = simulate(build_schedule("1f1b", 4, 8), costs), simulate(build_schedule("zb-h1", 4, 8), costs)
    idle_1f1b = [one.step_time - b for b in one.busy]
    idle_zb = [zb.step_time - b for b in zb.busy]
    assert idle_1f1b == [9.0] * 4 and idle_zb == [3.0] * 4  # (p-1)(F+B+W) and (p-1)(F+B-W)
    assert zb.step_time == 27.0 and one.step_time == 33.0
    assert zb.bubble == pytest.approx(bubble_formula("zb-h1", 4, 8)) and zb.bubble < one.bubble / 2
    # the deferred W's keep activations alive: every stage holds up to p, 1F1B's first stage's peak
    assert zb.peak_in_flight == (4, 4, 4, 4) and max(one.peak_in_flight) == 4
    # a cheaper W leaves more bubble: idle (p-1)(F+B-W) = 3 * (1 + 1.5 - 0.5)
    light = simulate(build_schedule("zb-h1", 4, 8), Costs(forward=1.0, backward=2.0, weight=0.25))
    assert light.step_time - light.busy[0] == pytest.approx(6.0)


def test_zb_h1_is_deadlock_free_and_splits_every_backward():
    for pp in range(1, 9):
        for m in range(1, 17):
            schedule = build_schedule("zb-h1", pp, m)
            for tagged, p2p in ((True, "async"), (False, "async"), (False, "batched")):
                simulate(schedule, tagged=tagged, p2p=p2p)  # checks each F, B and W runs once, W after its B
            names = [str(a) for a in schedule.stages[0] if str(a)[0] in "Fbw"]
            assert sorted(names) == sorted([f"{k}{i}" for k in "Fbw" for i in range(m)])
    with pytest.raises(UsageError, match="zb-h1 runs one chunk"):
        build_schedule("zb-h1", 4, 8, vpp=2)


def test_zero_bubble_under_rendezvous_p2p_is_never_slower_than_1f1b():
    """NCCL: a gradient send waits for its receive; running the W behind it first lets it go with the next receive."""
    from megakit.core.schedules import weights_before_grad_sends
    from megakit.core.simulator import fastest_order

    for pp in range(1, 9):
        for m in range(1, 17):
            zb = build_schedule("zb-h1", pp, m)
            chosen = fastest_order(zb, p2p="batched")
            assert chosen in (zb, weights_before_grad_sends(zb))
            step = simulate(chosen, p2p="batched").step_time
            assert step <= simulate(build_schedule("1f1b", pp, m), p2p="batched").step_time
            assert simulate(chosen).peak_in_flight == simulate(zb).peak_in_flight
    zb = build_schedule("zb-h1", 4, 8)
    assert simulate(zb, p2p="batched").step_time == 33.0  # as slow as 1F1B in its plain order
    assert simulate(fastest_order(zb, p2p="batched"), p2p="batched").step_time == 30.0
    assert fastest_order(zb, p2p="async") is zb


def test_cli_prints_zero_bubble(capsys):
    from megakit.commands import cli

    assert cli.main(["schedule", "--pp", "4", "--micro-batches", "8", "--schedule", "zb-h1"]) == 0
    out = capsys.readouterr().out
    assert "bubble 11.1% (3 idle per stage)  (formula 11.1%)" in out and "weight gradient W" in out
    assert "peak in-flight activations per stage [4, 4, 4, 4]" in out
    assert cli.main(["schedule", "--schedule", "zb-h1", "--weight-share", "0.25"]) == 0  # W cheaper: more bubble
    assert "bubble 20.0% (6 idle per stage)  (formula 20.0%)" in capsys.readouterr().out
    assert cli.main(["schedule", "--schedule", "zb-h1", "--vpp", "2"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_cli_takes_costs_per_virtual_stage(capsys):
    """Chunk costs on the command line: PP 2 x VPP 2 with empty end chunks idles a third of its step."""
    from megakit.commands import cli

    argv = ["schedule", "--pp", "2", "--micro-batches", "8", "--schedule", "interleaved"]
    assert cli.main([*argv, "--forward-cost", "0,1,1,0", "--backward-cost", "0,2,2,0"]) == 0
    out = capsys.readouterr().out
    assert "step time 36  bubble 33.3%" in out
    rows = [line.split("│")[1] for line in out.splitlines() if line.startswith("stage")]
    assert [len(row) - row.count("·") for row in rows] == [24, 24]  # 8 x (1 + 2) units of work each; empty chunks none
    for bad in (["--forward-cost", "1,2,3"], ["--forward-cost", "1,x"], ["--backward-cost", "2,-1"]):
        with pytest.raises(SystemExit) if "x" in bad[1] else contextlib.nullcontext():  # argparse's own exit
            assert cli.main([*argv, *bad]) == 2
        assert capsys.readouterr().err.strip().count("\n") <= 1


def test_the_timeline_tells_forward_from_backward_without_colour_and_shares_the_pngs_legend():
    """Piped or in a log file rich drops the colours: each stage then gets a row of kind letters under its
    micro-batch ids. The legend's names are the PNG's, and later chunks are lighter in both."""
    import io

    from rich.console import Console

    from megakit.commands.schedule_render import LATER_CHUNKS, legend, print_timeline

    report = simulate(build_schedule("interleaved", 2, 4, 2))
    plain = io.StringIO()
    print_timeline(report, Console(file=plain, width=200))  # not a terminal: no colour
    lines = plain.getvalue().splitlines()
    ids, kinds = lines[1].split("│")[1], lines[2].split("│")[1]
    assert ids == "0101··20031120031122·332233" and kinds == "FFff··FbbFbbfBBfBBbb·bbBBBB", lines
    assert [name for _, name in legend(report.schedule)] == ["forward F", "backward B", "idle (bubble)"]
    assert all(name in lines[-1] for _, name in legend(report.schedule)) and LATER_CHUNKS in lines[-1]
    coloured = io.StringIO()
    print_timeline(report, Console(file=coloured, width=200, force_terminal=True, color_system="standard"))
    out = coloured.getvalue()
    assert "\x1b[37;44m0" in out and "\x1b[30;42m0" in out and "FFff" not in out  # forward blue, backward green
    zero_bubble = [name for _, name in legend(simulate(build_schedule("zb-h1", 2, 4, 1)).schedule)]
    assert zero_bubble == ["forward F", "input gradient B", "weight gradient W", "idle (bubble)"]
