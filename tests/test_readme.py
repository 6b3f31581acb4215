"""The front page's commands work: each ``bash``/``sh`` block of README.md that a CPU can run is run, as written,
in a temporary directory; the others are skipped by name, with the reason.

A block is named by the heading above it (GitHub's anchor for it), with ``-2``, ``-3`` ... for the second and later
blocks under one heading. The only change made to a command is a free ``--master_port`` for the ``deepspeed``
launcher, so that a job cannot meet another's rendezvous. ``scripts/``, ``models/`` and ``ds_configs/`` are linked
into the directory, so the commands read as they do from the checkout and write only there.

Also: the test command is the one CI runs, and every relative link of README.md and docs/ resolves.
"""

import os
import re
import subprocess
from pathlib import Path

import pytest
from multiproc import THREADS, free_port

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"

SKIPPED = {  # block name -> why it is not run here
    "install": "installs packages with pip; the suite runs in the environment that installed them",
    "tests": "the test command: it is this suite",
    "a-five-minute-tour-2": "submits the plan's job to Slurm: needs a cluster of GPU nodes",
}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def shell_blocks(text: str) -> dict[str, str]:
    """name -> the block's text, for every ```bash / ```sh block, in order."""
    blocks, heading, count, body = {}, "", {}, None
    for line in text.splitlines():
        if body is not None:
            if line.startswith("```"):
                count[heading] = count.get(heading, 0) + 1
                blocks[heading + (f"-{count[heading]}" if count[heading] > 1 else "")] = "\n".join(body) + "\n"
                body = None
            else:
                body.append(line)
        elif line.startswith("#"):
            heading = slug(line.lstrip("#"))
        elif line.strip() in ("```bash", "```sh"):
            body = []
    return blocks


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
        marks = [pytest.mark.slow] if re.search(r"^deepspeed ", block, re.M) else []
        yield pytest.param(name, block, id=name, marks=marks)


@pytest.mark.parametrize("name, block", params())
def test_front_page_block_runs_on_cpu(name, block, tmp_path):
    if name in SKIPPED:
        pytest.skip(f"README block {name!r}: {SKIPPED[name]}")
    for folder in ("scripts", "models", "ds_configs"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    script = re.sub(r"^deepspeed ", lambda _: f"deepspeed --master_port {free_port()} ", block, flags=re.M)
    env = dict(os.environ, OMP_NUM_THREADS=THREADS,
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=900)
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"README block {name!r} failed (exit {run.returncode}):\n{script}\n{out[-6000:]}"
    check = CHECKS.get(name)
    assert check is None or check(out, tmp_path) is not False, out[-6000:]


def test_every_skip_names_a_block_and_every_check_one_that_runs():
    assert set(SKIPPED) <= set(BLOCKS), f"skips of blocks the README no longer has: {set(SKIPPED) - set(BLOCKS)}"
    assert set(CHECKS) <= set(BLOCKS) - set(SKIPPED), set(CHECKS) - (set(BLOCKS) - set(SKIPPED))


def test_the_readme_gives_the_test_command_ci_runs():
    ci = [line.split("#")[0].strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.startswith("python -m pytest")]
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
