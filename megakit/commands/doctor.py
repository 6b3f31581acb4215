"""``megakit doctor``: why won't my loss go down? FAQ 6's checks, run on a short real job.

    megakit doctor --nproc 2 --ds_config ds_configs/zero1.json --model gpt-mini --base-lr 1e-3 --base-batch 8

It starts ``scripts/train.py`` with the trainer's flags through the ``deepspeed`` launcher
for a few steps with ``--doctor-out`` (every rank records what it built, read, computed
and waited for; ``megakit.train.doctor.diagnostics``), then judges the facts
(``megakit.train.doctor.checks``) and prints one row per check: pass or fail, its
numbers, and on failure what to change. Exit status 0 when every check passed, 1 when
one failed, 2 for bad input (before any process starts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from megakit.errors import UsageError, finite_float

PASSES_UNKNOWN_FLAGS = True  # every flag the doctor does not know goes to scripts/train.py
TRAIN_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "train.py"


def configure(parser: argparse.ArgumentParser) -> None:
    """Adds ``megakit doctor``'s own flags; the rest are passed on to scripts/train.py."""
    parser.epilog = (
        "Every other flag goes to scripts/train.py (its --ds_config, --model, --tp, --pp, ...). Exit status "
        "0 when every check passed, 1 when one failed, 2 for bad input."
    )
    parser.usage = "megakit doctor --nproc N [doctor flags] [scripts/train.py flags]"
    parser.add_argument("--nproc", type=int, default=2, help="processes to start (one per GPU, or CPU processes)")
    parser.add_argument("--steps", type=int, default=6, help="steps to run and to compare with one process")
    parser.add_argument(
        "--base-lr",
        type=finite_float,
        help="an LR known to train well at --base-batch (e.g. the "
        "single-GPU run's): the LR check then judges linear scaling and warm-up against it",
    )
    parser.add_argument("--base-batch", type=int, help="sequences per step at which --base-lr was used")
    parser.add_argument("--facts-out", metavar="FILE", help="keep the facts the job gathered (JSON)")
    parser.add_argument("--report-out", metavar="FILE", help="write the verdicts as JSON")
    parser.add_argument("--timeout", type=finite_float, default=1800, help="seconds the job may take")


def _check(args, train_args: list[str]) -> None:
    """Every mistake the doctor can see before starting processes: its own flags, the fault list, and the
    trainer's flags as the trainer resolves them (layout, ds_config, model)."""
    if args.nproc < 2:
        raise UsageError(f"--nproc {args.nproc}: the doctor compares ranks with each other; start at least 2")
    if args.steps < 2:
        raise UsageError(f"--steps {args.steps}: the doctor needs at least 2 steps (the first one warms up)")
    if (args.base_lr is None) != (args.base_batch is None) or (args.base_lr or 1) <= 0 or (args.base_batch or 1) < 1:
        raise UsageError(
            "--base-lr and --base-batch go together: a positive LR and the batch (sequences) it was "
            "tuned at, e.g. --base-lr 1e-3 --base-batch 8"
        )
    if any(a.split("=")[0] == "--doctor-out" for a in train_args):
        raise UsageError("--doctor-out is the doctor's to set; drop it")
    if not TRAIN_SCRIPT.exists():
        raise UsageError(f"{TRAIN_SCRIPT} is missing: megakit doctor runs from a source checkout of megakit")
    import torch

    if torch.cuda.is_available() and args.nproc > torch.cuda.device_count():
        raise UsageError(f"--nproc {args.nproc} exceeds the {torch.cuda.device_count()} GPUs here; use at most that")
    from megakit.train.doctor.fault_injection import VARIABLE, parse

    parse(os.environ.get(VARIABLE, ""))
    _resolve_trainer_flags(train_args, args)


def _resolve_trainer_flags(train_args: list[str], args) -> None:
    """Read the trainer's flags as scripts/train.py reads them (its parser and ``config``) and resolve them for
    ``--nproc`` ranks."""
    import importlib.util

    from megakit.train.run import resolve

    spec = importlib.util.spec_from_file_location("megakit_train_script", TRAIN_SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    try:
        parsed = script.parse_args([*train_args, "--steps", str(args.steps)])
    except SystemExit as exit_:  # the trainer's parser printed its one line
        raise SystemExit(2) from exit_
    resolve(script.config(parsed), args.nproc, say=lambda *_: None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, train_args: list[str], facts: Path) -> subprocess.CompletedProcess:
    cmd = [
        "deepspeed",
        "--num_gpus",
        str(args.nproc),
        "--master_port",
        str(_free_port()),
        str(TRAIN_SCRIPT),
        *train_args,
        "--steps",
        str(args.steps),
        "--no-progress",
        "--doctor-out",
        str(facts),
    ]
    print(f"megakit doctor: {' '.join(cmd)}", flush=True)
    try:
        return subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            check=False,
            timeout=args.timeout,
            env=dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1")),
        )
    except FileNotFoundError:
        raise UsageError("the deepspeed launcher is not on PATH; pip install deepspeed") from None
    except subprocess.TimeoutExpired:
        raise UsageError(
            f"the job took longer than --timeout {args.timeout:g} s; fewer --steps or a longer --timeout"
        ) from None


def _job_ending(out: subprocess.CompletedProcess) -> str:
    """The job's own last word when it failed (the trainer's ``train.py:`` line, else the tail)."""
    lines = (out.stdout + out.stderr).splitlines()
    said = [line for line in lines if line.startswith("train.py:")]
    return said[-1] if said else "\n".join(lines[-20:])


def run(args) -> int:
    """Runs the job a few steps in a scratch directory and prints each check's verdict (0 all passed, 1 one failed)."""
    train_args = list(getattr(args, "passed_on", []))
    _check(args, train_args)
    from megakit.commands.doctor_render import render
    from megakit.train.doctor.checks import judge

    with tempfile.TemporaryDirectory(prefix="megakit-doctor-") as work:
        facts_path = Path(args.facts_out or Path(work) / "facts.json")
        out = _launch(args, train_args, facts_path)
        if out.returncode == 2:
            print(_job_ending(out), file=sys.stderr)
            return 2
        if not facts_path.exists() or not json.loads(facts_path.read_text())["steps"]:
            print(
                f"megakit doctor: the job failed (status {out.returncode}) before its first step:\n{_job_ending(out)}",
                file=sys.stderr,
            )
            return 1
        facts = json.loads(facts_path.read_text())
    verdicts = judge(facts, base_lr=args.base_lr, base_batch=args.base_batch)
    ended = "" if out.returncode == 0 else f"the job ended with status {out.returncode}: {_job_ending(out)}"
    render(facts, verdicts, ended=ended)
    if args.report_out:
        Path(args.report_out).write_text(
            json.dumps({"checks": [v.to_dict() for v in verdicts], "job_status": out.returncode}, indent=1)
        )
    return 0 if all(v.passed is not False for v in verdicts) else 1
