"""``megakit schedule``: build a pipeline schedule, simulate it, print its timeline and draw it.

    megakit schedule --pp 4 --micro-batches 8 --schedule interleaved --vpp 2 --out schedule.png
    megakit schedule --pp 4 --micro-batches 8 --schedule zb-h1     # B and W split, W deferred (zero bubble)

Needs no torch and no processes: the schedule is data and the simulator runs it.
"""

from __future__ import annotations

import argparse
import os

from megakit.core.schedules import SCHEDULES, bubble_formula, build_schedule
from megakit.errors import UsageError, finite_float


def configure(parser: argparse.ArgumentParser) -> None:
    """The flags of ``megakit schedule``."""
    parser.add_argument("--pp", type=int, default=4, help="pipeline stages (default 4)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches per step (default 8)")
    parser.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="schedule (default 1f1b)")
    parser.add_argument(
        "--vpp", type=int, default=None, help="model chunks per stage for --schedule interleaved (default 2)"
    )
    parser.add_argument(
        "--forward-cost",
        type=_costs,
        default=1.0,
        help="time of one stage's forward (default 1); comma-separated, one per stage (e.g. 1,1,1,2) "
        "or one per virtual stage (chunk c of stage s is c x PP + s; e.g. 0,1,1,0 at PP 2 x VPP 2)",
    )
    parser.add_argument(
        "--backward-cost",
        type=_costs,
        default=2.0,
        help="time of one stage's backward (default 2); comma-separated as --forward-cost",
    )
    parser.add_argument(
        "--weight-share",
        type=finite_float,
        default=0.5,
        help="zb-h1: the share of the backward that is the weight gradient W (default 0.5: F = B = W)",
    )
    parser.add_argument(
        "--p2p-cost", type=finite_float, default=0.0, help="time for a message between stages (default 0)"
    )
    parser.add_argument(
        "--p2p",
        choices=("async", "batched"),
        default="async",
        help="P2P model: async sends (gloo) or batched rendezvous (NCCL) (default async)",
    )
    parser.add_argument("--out", default=None, help="also draw the timeline to this PNG file")


def _costs(text: str) -> float | tuple[float, ...]:
    """One number, or comma-separated numbers (per stage or per virtual stage; the simulator checks how many)."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number or comma-separated numbers, e.g. 1 or 1,1,2"
        ) from None
    return values[0] if len(values) == 1 else values


def run(args: argparse.Namespace) -> int:
    """Simulate the schedule, print its timeline and bubble, and draw it with ``--out``."""
    from megakit.commands.schedule_render import print_timeline, save_png
    from megakit.core.simulator import Costs, fastest_order, simulate

    vpp = args.vpp if args.vpp is not None else (2 if args.schedule == "interleaved" else 1)
    if args.out is not None:
        directory = os.path.dirname(os.path.abspath(args.out))
        if not os.path.isdir(directory):
            raise UsageError(f"--out {args.out}: directory {directory} does not exist; create it or pick another path")
        if not args.out.lower().endswith(".png"):
            raise UsageError(f"--out {args.out}: the picture is a PNG; give a path ending in .png")
    schedule = fastest_order(build_schedule(args.schedule, args.pp, args.micro_batches, vpp), p2p=args.p2p)
    for name in ("forward_cost", "backward_cost", "p2p_cost"):
        value = getattr(args, name)
        if min(value if isinstance(value, tuple) else (value,)) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
    report = simulate(
        schedule,
        Costs(forward=args.forward_cost, backward=args.backward_cost, p2p=args.p2p_cost, weight=args.weight_share),
        p2p=args.p2p,
    )
    print_timeline(report, weight_share=args.weight_share)
    formula = bubble_formula(args.schedule, args.pp, args.micro_batches, vpp, weight_share=args.weight_share)
    idle = report.step_time - min(report.busy)
    print(
        f"step time {report.step_time:g}  bubble {report.bubble:.1%} ({idle:g} idle per stage)  "
        f"(formula {formula:.1%})  "
        f"peak in-flight activations per stage {list(report.peak_in_flight)}"
    )
    if args.out:
        save_png(report, args.out, weight_share=args.weight_share)
        print(f"wrote {args.out}")
    return 0
