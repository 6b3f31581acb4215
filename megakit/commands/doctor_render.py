"""The ``megakit doctor`` report: the job in one line, then one table row per check."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from megakit.train.doctor.checks import grid

RESULT = {True: "[green]pass[/]", False: "[bold red]FAIL[/]", None: "[yellow]n/a[/]"}


def render(facts: dict, verdicts: list, *, ended: str = "") -> None:
    """Prints the doctor's report (job line, then one line per check) so a person sees what failed and why."""
    console = Console(highlight=False)
    c = facts["config"]
    console.print(
        f"[bold]Job[/]: {c['model']} on {c['world']} processes, {grid(c)}, "
        f"ZeRO {c['zero_stage']}, {c['precision']}, global batch {c['global_batch']} x {c['seq_len']} "
        f"tokens, {len(facts['steps'])} of {c['steps'] - c['start_step']} steps ran"
        + (f"; faults injected: {facts['faults']}" if facts["faults"] else "")
    )
    if ended:
        console.print(f"[bold]Job ended early[/]: {ended}")
    table = Table(title="FAQ 6: why the loss does not go down", show_lines=True)
    table.add_column("#", justify="right")
    table.add_column("check")
    table.add_column("result")
    table.add_column("numbers", ratio=3)
    table.add_column("what to change", ratio=2)
    for number, v in enumerate(verdicts, 1):
        table.add_row(str(number), v.name, RESULT[v.passed], v.numbers, v.fix if v.passed is False else "")
    console.print(table)
    failed = [str(n) for n, v in enumerate(verdicts, 1) if v.passed is False]
    console.print(f"[bold]{'failed: check ' + ', '.join(failed) if failed else 'every check passed'}[/]")
