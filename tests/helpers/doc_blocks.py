"""The shell blocks of a Markdown page, and running one as a reader would: shared by the README's test and the guides'.

A block is named by the heading above it (GitHub's anchor for it), with ``-2``, ``-3`` ... for the second and later
blocks under one heading; a block indented inside a list item counts too, its indent removed. The only change made
to a command is a free ``--master_port`` for the ``deepspeed`` launcher, so that a job cannot meet another's
rendezvous. ``scripts/``, ``models/`` and ``ds_configs/`` are linked into the directory, so the commands read as they
do from the checkout and write only there.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from multiproc import THREADS, free_port
from paths import ROOT

LINKED = ("scripts", "models", "ds_configs")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def shell_blocks(text: str) -> dict[str, str]:
    """name -> the block's text, for every ```bash / ```sh block, in order."""
    blocks, heading, count, body, indent = {}, "", {}, None, ""
    for line in text.splitlines():
        if body is not None:
            if line.strip() == "```" and line.startswith(indent):
                count[heading] = count.get(heading, 0) + 1
                blocks[heading + (f"-{count[heading]}" if count[heading] > 1 else "")] = "\n".join(body) + "\n"
                body = None
            else:
                body.append(line.removeprefix(indent))
        elif line.startswith("#"):
            heading = slug(line.lstrip("#"))
        elif line.strip() in ("```bash", "```sh"):
            body, indent = [], line[: len(line) - len(line.lstrip())]
    return blocks


def uses_launcher(block: str) -> bool:
    return re.search(r"^(deepspeed|torchrun) ", block, re.M) is not None


def link_checkout(directory: Path) -> None:
    """``scripts/``, ``models/`` and ``ds_configs/`` of the checkout, linked into ``directory``."""
    for folder in LINKED:
        (directory / folder).symlink_to(ROOT / folder)


def run_block(block: str, directory: Path, *, timeout_s: float = 900) -> tuple[int, str, str]:
    """(exit status, output, the script as run): ``block`` run by ``bash -euo pipefail`` in ``directory``."""
    script = re.sub(r"^deepspeed ", lambda _: f"deepspeed --master_port {free_port()} ", block, flags=re.M)
    env = dict(
        os.environ,
        OMP_NUM_THREADS=THREADS,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    run = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    return run.returncode, run.stdout + run.stderr, script
