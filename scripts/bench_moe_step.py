"""The MoE step at GPU speed (issue 54), family by family, in one table: a row per family, a column per measure.

    python scripts/bench_moe_step.py                    # this tree against the tree issue 54 measured (704b7ee)
    python scripts/bench_moe_step.py --before none      # this tree only
    python scripts/bench_moe_step.py --before REV --sites

Host conversions per step (``scripts/host_syncs.py``: ``item``, ``tolist``, ``float(t)``, ``int(t)``, ``if t:``,
``range(t)`` in the trainer's processes, by call site, start-up and the last step left out), for each family of
``host_syncs.FAMILIES`` at 2 micro-batches and 2 layers, then at 4 and 4 (``a -> b``; on a GPU each is a wait for the
device), in one launcher job of 2 processes per tree: this one ("after") and, from ``git archive``, the revision
``--before`` ("before"). The most any rank makes. After: the dispatcher's share (``megakit/nn/moe/dispatch.py``),
the one allowed to grow, by at most one per MoE layer per micro-batch at EP > 1 and not at all at EP 1, and the
rest, which must not grow (``a == b``). ``--sites`` prints each family's calls by site. On a CPU some calls convert
host tensors: the counts are upper bounds.

Then, per MoE family at EP 1, one MoE layer forward + backward eager and compiled whole (``compiled_layers``, by
``scripts/bench_moe_block.py``): milliseconds (CPU time on a CPU), the compile's seconds, graphs and breaks.

A measure is a function of the options returning ``{column: {family: cell}}`` (``MEASURES``); a family without a
cell in a column shows ``-``, and a family no other measure has gets its own row.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from host_syncs import DISPATCH, FAMILIES, SETTINGS, by_family, write_cases  # noqa: E402

BEFORE = "704b7ee"  # the tree issue 54 measured (88 and 128 per step at EP 1, 106 at EP 2)


def _probe(tree: Path, work: Path) -> dict[str, list[list[dict]]]:
    """host_syncs.py's counts for every family and setting, with ``tree``'s megakit and scripts/train.py."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    out = work / "counts.json"
    done = subprocess.run(
        [
            "deepspeed",
            "--num_gpus",
            "2",
            "--master_port",
            str(port),
            str(ROOT / "scripts" / "host_syncs.py"),
            str(write_cases(work)),
            str(out),
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode:
        sys.exit(f"bench_moe_step.py: the probe failed in {tree}:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return by_family(json.loads(out.read_text()))


def _total(ranks: list[dict], *, dispatch: bool | None = None) -> float:
    """The most calls per step any rank makes (``dispatch``: only the dispatcher's, or all but them)."""

    def keep(site: str) -> bool:
        return dispatch is None or (DISPATCH in site) == dispatch

    return max(sum(n for site, n in sites.items() if keep(site)) for sites in ranks)


def _cell(settings: list[list[dict]], **kw) -> str:
    return " -> ".join(f"{_total(ranks, **kw):g}" for ranks in settings)


def host_syncs(options) -> dict[str, dict[str, str]]:
    """Columns: host conversions per step before and after, and the dispatcher's share after."""
    trees = {"after": ROOT}
    columns: dict[str, dict[str, str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if options.before != "none":
            before = Path(tmp) / "before"
            before.mkdir()
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", options.before], capture_output=True, check=True
            )
            subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
            trees = {"before": before, **trees}
        for name, tree in trees.items():
            work = Path(tmp) / f"work-{name}"
            work.mkdir()
            counts = _probe(tree, work)
            setting = ", ".join(f"{m} mb {n} L" for m, n in SETTINGS)
            columns[f"syncs/step {name} ({setting.replace(', ', ' -> ')})"] = {
                family: _cell(settings) for family, settings in counts.items()
            }
            if name == "after":  # the dispatcher's share (moe/dispatch.py), and the rest: constant is the target
                for label, dispatch in (("dispatcher", True), ("the rest", False)):
                    columns[f"after: {label}"] = {
                        family: _cell(settings, dispatch=dispatch) for family, settings in counts.items()
                    }
            if options.sites:
                _print_sites(name, counts)
    return columns


def _print_sites(tree: str, counts: dict[str, list[list[dict]]]) -> None:
    for family, settings in counts.items():
        print(
            f"\n{tree}, {family}: calls per step by site, rank by rank, at "
            + " and ".join(f"{m} micro-batches x {n} layers" for m, n in SETTINGS)
        )
        sites = sorted({site for ranks in settings for sites in ranks for site in sites})
        for site in sites:
            cells = " | ".join(" ".join(f"{sites_.get(site, 0):>4g}" for sites_ in ranks) for ranks in settings)
            print(f"  {cells}  {site}")


# host_syncs' MoE families at EP 1 -> (preset, MoEConfig changes) for one MoE layer compiled whole
COMPILED = {
    "moe-ep1": ("moe-tiny", None),
    "capacity": ("moe-tiny", {"capacity_factor": 1.0}),
    "mla": ("deepseek-v3-tiny", None),
    "gpt-oss": ("gpt-oss-tiny", None),
}


def compiled_layers(options) -> dict[str, dict[str, str]]:
    """Columns: one MoE layer of the family (``scripts/bench_moe_block.py``: hidden 256, 8 experts of 512, top-2,
    2048 tokens, fp32 here, bf16 on a GPU), forward + backward eager and compiled whole (Inductor), the first
    compiled call's seconds (compiling), and Dynamo's graphs and breaks: one graph, no break, no slower."""
    import torch
    from bench_moe_block import moe_block_rows

    cuda = torch.cuda.is_available()
    columns: dict[str, dict[str, str]] = {"layer eager ms": {}, "compiled ms": {}, "compile s": {}, "graphs/breaks": {}}
    for family, (preset, moe) in COMPILED.items():
        (row,) = moe_block_rows(
            families=(preset,),
            moe=moe,
            backend=options.backend,
            repeat=5,
            device="cuda" if cuda else "cpu",
            dtype=torch.bfloat16 if cuda else torch.float32,
        )
        columns["layer eager ms"][family] = f"{row['grouped_ms']:.1f}" if "grouped_ms" in row else "failed"
        if "compiled_ms" not in row:
            columns["compiled ms"][family] = "failed: " + row.get("compiled_error", "")[:40]
            continue
        columns["compiled ms"][family] = f"{row['compiled_ms']:.1f}"
        columns["compile s"][family] = f"{row['compile_s']:.1f}"
        columns["graphs/breaks"][family] = f"{row['graphs']}/{row['breaks']}"
    return columns


MEASURES = [host_syncs, compiled_layers]


def table(columns: dict[str, dict[str, str]]) -> str:
    """One row per family (``FAMILIES``' first, then any other a measure names), one column per measure."""
    header = ["family", *columns]
    families = list(dict.fromkeys([*FAMILIES, *(f for cells in columns.values() for f in cells)]))
    rows = [header] + [[family, *(columns[c].get(family, "-") for c in columns)] for family in families]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--before",
        default=BEFORE,
        help=f"the git revision to compare with, or none (default {BEFORE}, the tree issue 54 measured)",
    )
    p.add_argument("--sites", action="store_true", help="also print each family's calls per step by site")
    p.add_argument(
        "--backend",
        default="inductor",
        help="torch.compile's backend for the compiled MoE layers (default inductor; aot_eager needs no C++ compiler)",
    )
    options = p.parse_args(argv)
    known = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{options.before}^{{commit}}"],
        capture_output=True,
    )
    if options.before != "none" and known.returncode:
        print(
            f"bench_moe_step.py: error: --before {options.before} is no revision of this repository; name one "
            "(a commit, tag or branch), or --before none",
            file=sys.stderr,
        )
        return 2
    columns: dict[str, dict[str, str]] = {}
    for measure in MEASURES:
        columns.update(measure(options))
    print(table(columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
