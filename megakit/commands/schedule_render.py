"""Draw a simulated schedule: a terminal timeline (rich) and a PNG (matplotlib).

Both show stages as rows and time as columns; forward cells F are blue, backward
cells B green (a lighter shade for later chunks when interleaved; with zero bubble the
input-gradient B green and the deferred weight-gradient W yellow), each labelled with
its micro-batch, and idle time — the bubble — is left grey and empty. Both take their
legend from ``legend``. Where the terminal shows no colour (a pipe, a log file,
``NO_COLOR``) each stage gets a second row of letters, F, B, W (lower case for later
chunks), so that forward and backward still differ. The title carries the bubble
fraction measured by the simulator next to the textbook formula.
"""

from __future__ import annotations

import math
import os
import tempfile

from megakit.core.schedules import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    bubble_formula,
)
from megakit.core.simulator import Report

_TERMINAL = {
    Forward: ("white on blue", "black on bright_blue"),
    Backward: ("black on green", "black on bright_green"),
    BackwardInput: ("black on green", "black on bright_green"),
    BackwardWeight: ("black on yellow", "black on bright_yellow"),
}
_LETTER = {Forward: "F", Backward: "B", BackwardInput: "B", BackwardWeight: "W"}
_PNG = {
    Forward: ("#2f6fd0", "#89aef0"),
    Backward: ("#2e9e49", "#8fd6a0"),
    BackwardInput: ("#2e9e49", "#8fd6a0"),
    BackwardWeight: ("#e0a800", "#f0d070"),
}


def legend(schedule) -> list[tuple[type | None, str]]:
    """(kind, name) of what a timeline shows, idle last (kind None): the terminal's and the PNG's legend."""
    if schedule.split_backward:
        kinds = [(Forward, "forward F"), (BackwardInput, "input gradient B"), (BackwardWeight, "weight gradient W")]
    else:
        kinds = [(Forward, "forward F"), (Backward, "backward B")]
    return [*kinds, (None, "idle (bubble)")]


LATER_CHUNKS = "lighter = later model chunks"


def _label(mb: int) -> str:
    return "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"[mb % 62]


def title(report: Report, weight_share: float = 0.5) -> str:
    """The timeline's heading: the simulated bubble next to the textbook formula, so a mismatch shows."""
    s = report.schedule
    name = s.name.split("(")[0]
    formula = bubble_formula(name, s.pp, s.micro_batches, s.vpp, weight_share=weight_share)
    return (
        f"{s.name}  pp={s.pp} micro-batches={s.micro_batches}: bubble {report.bubble:.1%} "
        f"(formula {formula:.1%}), step time {report.step_time:g}"
    )


def timeline_text(report: Report, *, width: int = 120, weight_share: float = 0.5, colour: bool = True):
    """A ``rich.text.Text`` with one row per stage; one column is one time unit (scaled to fit ``width``).
    Without ``colour`` a row of kind letters under each stage's row tells forward from backward."""
    from rich.text import Text

    durations = [e.end - e.start for e in report.events if e.end > e.start]
    unit = min(durations) if durations else 1.0
    columns = max(1, math.ceil(report.step_time / unit - 1e-9))
    if columns > width:
        unit *= columns / width
        columns = width
    rows = {stage: [None] * columns for stage in range(report.schedule.pp)}
    for e in (e for e in report.events if e.end > e.start):  # a chunk with no work (--forward-cost 0,...) has no cell
        first, last = int(e.start / unit + 1e-9), math.ceil(e.end / unit - 1e-9)
        for col in range(first, min(max(last, first + 1), columns)):
            rows[e.stage][col] = e
    text = Text()
    text.append(title(report, weight_share) + "\n", style="bold")
    for stage, cells in rows.items():
        text.append(f"stage {stage:>2} │")
        for cell in cells:
            if cell is None:
                text.append("·", style="grey42")
            else:
                text.append(_label(cell.micro_batch), style=_TERMINAL[cell.kind][min(cell.chunk, 1)])
        text.append(f"│ idle {report.bubble_per_stage[stage]:.0%}, peak in flight {report.peak_in_flight[stage]}\n")
        if not colour:
            letters = ("·" if c is None else _LETTER[c.kind].lower() if c.chunk else _LETTER[c.kind] for c in cells)
            text.append(f"{'':>8} │{''.join(letters)}│\n")
    for i, (kind, name) in enumerate(legend(report.schedule)):
        text.append(" " if i else "")
        text.append(name if kind else f"· {name}", style=_TERMINAL[kind][0] if kind and colour else "")
    text.append("; cells: micro-batch ids" + (", the row below each stage its kinds" if not colour else ""))
    if report.schedule.vpp > 1:
        text.append(f"; {LATER_CHUNKS}" + (" (lower case)" if not colour else ""))
    return text


def print_timeline(report: Report, console=None, *, weight_share: float = 0.5) -> None:
    """Prints the schedule's timeline unwrapped, since a wrapped row no longer lines up with the others."""
    from rich.console import Console

    console = console or Console(soft_wrap=True)  # long rows overflow rather than wrap mid-timeline
    text = timeline_text(report, width=160, weight_share=weight_share, colour=console.color_system is not None)
    console.print(text, soft_wrap=True)


def save_png(report: Report, path: str, *, weight_share: float = 0.5) -> None:
    """Draw the timeline to ``path``; written to a temporary file first, so a failure leaves nothing half-written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pp = report.schedule.pp
    fig, ax = plt.subplots(figsize=(min(24, 4 + report.step_time * 0.25), 1 + 0.6 * pp))
    for stage in range(pp):
        ax.broken_barh([(0, report.step_time)], (stage - 0.4, 0.8), facecolors="#e6e6e6")  # idle = bubble
    spans: dict = {}  # one broken_barh per (stage, kind, shade): thousands of events draw in a second
    for e in report.events:
        spans.setdefault((e.stage, e.kind, min(e.chunk, 1)), []).append((e.start, e.end - e.start))
    for (stage, kind, shade), bars in spans.items():
        edge = "white" if len(report.events) < 4000 else "none"
        ax.broken_barh(bars, (stage - 0.4, 0.8), facecolors=_PNG[kind][shade], edgecolors=edge, linewidth=0.5)
    per_unit = fig.get_size_inches()[0] * 72 / max(report.step_time, 1e-9)
    for e in report.events if len(report.events) <= 2000 else ():
        if (e.end - e.start) * per_unit > 9:  # label a cell with its micro-batch only where it fits
            ax.text(
                (e.start + e.end) / 2, e.stage, str(e.micro_batch), ha="center", va="center", fontsize=7, color="white"
            )
    ax.set_yticks(range(pp), [f"stage {s}" for s in range(pp)])
    ax.invert_yaxis()
    ax.set_xlim(0, report.step_time)
    chunks = f"; {LATER_CHUNKS}" if report.schedule.vpp > 1 else ""
    ax.set_xlabel(f"time (units of the per-op costs){chunks}")
    ax.set_title(title(report, weight_share), fontsize=10)
    ax.legend(
        handles=[
            Patch(color=_PNG[kind][0] if kind else "#e6e6e6", label=name) for kind, name in legend(report.schedule)
        ],
        loc="upper left",
        fontsize=7,
        bbox_to_anchor=(1.0, 1.0),
    )
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(suffix=".png", dir=directory)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=120)
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
