"""The front page's commands work: each ``bash``/``sh`` block of README.md that a CPU can run is run, as written,
in a temporary directory; the others are skipped by name, with the reason.

The blocks are read and run by ``doc_blocks`` (shared with the guides' test, ``test_docs.py``).

Also: the test command is the one CI runs, and every relative link of README.md and docs/ resolves.
"""

import re
from pathlib import Path

import pytest
from doc_blocks import ROOT, link_checkout, run_block, shell_blocks, slug, uses_launcher

README = ROOT / "README.md"
DOCS = ROOT / "docs"

SKIPPED = {  # block name -> why it is not run here
    "install": "installs packages with pip; the suite runs in the environment that installed them",
    "tests": "the test command: it is this suite",
    "a-five-minute-tour-2": "submits the plan's job to Slurm: needs a cluster of GPU nodes",
}


BLOCKS = shell_blocks(README.read_text())


def check_tour(out: str, tmp: Path) -> None:
    """The tour did what the README says: a plan written, a model that learned, a transformers export that writes."""
    assert (tmp / "runs" / "job.sh").is_file() and (tmp / "runs" / "plan.json").is_file()
    evals = [float(v) for v in re.findall(r"eval after \d+ steps \| val loss ([\d.]+)", out)]
    assert len(evals) == 2 and evals[1] < evals[0] - 0.2, evals  # measured 5.77 -> 5.31
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp / "runs" / "hf").iterdir()}
    assert "def read_config(path):" in out


CHECKS = {"install-2": lambda out, tmp: "Launch" in out, "a-five-minute-tour": check_tour}


def params():
    for name, block in BLOCKS.items():
        marks = [pytest.mark.slow] if uses_launcher(block) else []
        yield pytest.param(name, block, id=name, marks=marks)


@pytest.mark.parametrize("name, block", params())
def test_front_page_block_runs_on_cpu(name, block, tmp_path):
    if name in SKIPPED:
        pytest.skip(f"README block {name!r}: {SKIPPED[name]}")
    link_checkout(tmp_path)
    code, out, script = run_block(block, tmp_path)
    assert code == 0, f"README block {name!r} failed (exit {code}):\n{script}\n{out[-6000:]}"
    check = CHECKS.get(name)
    assert check is None or check(out, tmp_path) is not False, out[-6000:]


def test_every_skip_names_a_block_and_every_check_one_that_runs():
    assert set(SKIPPED) <= set(BLOCKS), f"skips of blocks the README no longer has: {set(SKIPPED) - set(BLOCKS)}"
    assert set(CHECKS) <= set(BLOCKS) - set(SKIPPED), set(CHECKS) - (set(BLOCKS) - set(SKIPPED))


def test_the_readme_gives_the_test_command_ci_runs():
    ci = [
        line.split("#")[0].strip()
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if line.startswith("python -m pytest")
    ]
    assert ci == [BLOCKS["tests"].strip()] == ["python -m pytest -q tests -n 2 --dist loadgroup"], (ci, BLOCKS["tests"])


def headings(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {slug(line.lstrip("#")) for line in text.splitlines() if line.startswith("#")}


def test_links_of_the_readme_and_the_guides_resolve_and_every_guide_is_linked():
    pages = [README, *sorted(DOCS.glob("*.md"))]
    broken, linked = [], set()
    for page in pages:
        text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and anchor not in headings(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
            elif page == README:
                linked.add(file)
    assert not broken, "\n".join(broken)
    assert not set(DOCS.glob("*.md")) - linked, f"guides the README does not link: {set(DOCS.glob('*.md')) - linked}"
