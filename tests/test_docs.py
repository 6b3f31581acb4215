"""Every guide's commands work: the ``bash``/``sh`` blocks of each docs/*.md that a CPU can run are run, as written,
in the order written, one guide to a temporary directory (a later block reads what an earlier one wrote, as a reader
following the guide does); the others are skipped by name, with the reason.

Blocks are read and run as for the README (``doc_blocks``). Where a guide starts from the reader's own files (a
Hugging Face model, a JSONL of chats), ``GIVEN`` writes small ones first, named in the guide's own words. Each block
writes under names of its own, none into the checkout: a guide that wrote into ``ds_configs/`` would change what
other tests read. The blocks a cluster runs are still checked where a CPU can: their ``train.py`` flags, with
``--check`` for the cluster's world size in one process, as a Slurm job does before it starts its workers.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from doc_blocks import LINKED, ROOT, link_checkout, run_block, shell_blocks, uses_launcher

DOCS = ROOT / "docs"
GUIDES = {page.name: shell_blocks(page.read_text()) for page in sorted(DOCS.glob("*.md"))}

SKIPPED = {  # "guide#block" -> why it is not run here
    "clusters.md#deepspeeds-launcher-with-a-hostfile": "starts processes over ssh on two nodes of eight GPUs",
    "clusters.md#torchrun-on-each-node-under-slurm": "a Slurm batch script for four nodes of eight GPUs",
    "clusters.md#stopping-a-run-signals-preemption-a-lost-launcher": "the same Slurm script, requeued on notice",
    "gpus.md#measuring-them-scriptsbench_gpupy": "times kernels on a CUDA GPU",
    "testing.md#testing": "the test command: it is this suite",
    "testing.md#lint": "the linters: .ci/run runs them before this suite",
}
CHECKED = {  # "guide#block" skipped above -> the world size its train.py flags are checked for, with --check
    "clusters.md#deepspeeds-launcher-with-a-hostfile": 16,
    "clusters.md#torchrun-on-each-node-under-slurm": 32,
    "clusters.md#stopping-a-run-signals-preemption-a-lost-launcher": 32,
}

WARNS = {  # "guide#block" -> (the one warning a reader sees there, why it is expected); any other warning fails
    "training.md#training-deepspeed-scriptstrainpy": (
        "the warm-up is not over by step 3",
        "--verify-memory's 3 steps end inside the preset's 20-step warm-up; "
        "the memory it measures does not depend on the LR",
    ),
}
CHECKS = {  # "guide#block" -> what the guide says the block does, checked on its output and directory
    "parallelism.md#pipeline-schedules-megakit-schedule":  # the bubbles its comments give
    lambda out, tmp: "bubble 27.3%" in out and "bubble 11.1%" in out and (tmp / "schedule.png").is_file(),
    "checkpoints.md#checkpoints-and-hugging-face":  # resumed at another layout, saved, exported and imported back
    lambda out, tmp: (tmp / "ckpt" / "step-0000060").is_dir() and (tmp / "mk" / "run" / "manifest.json").is_file(),
}


def _chat_model(directory: Path) -> None:
    """my-model/: a tiny Llama chat model shaped as released ones are, as save_pretrained writes it."""
    from chat import released_chat_model

    model, _ = released_chat_model(directory)
    model.save_pretrained(directory)


def _given_data(tmp: Path) -> None:
    """data.md's: my-model/, chats.jsonl of 1,500 conversations (enough for a validation split of 1,024 tokens) and
    corpus.jsonl of ~1.5 MB of Python source."""
    from chat import _conversations

    _chat_model(tmp / "my-model")
    (tmp / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _conversations(1500)))  # 1 %: 1,413 tokens
    texts, size = [], 0
    for source in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        texts.append(json.dumps({"text": source.read_text(errors="replace")}) + "\n")
        size += len(texts[-1])
        if size > 1_500_000:  # a validation split of 1 % holds a global batch (16 x 129 tokens) for --eval-every
            break
    (tmp / "corpus.jsonl").write_text("".join(texts))


def _given_moe(tmp: Path) -> None:
    """parallelism.md's hf/qwen3-moe: a tiny Qwen3-MoE as save_pretrained writes it."""
    import torch
    import transformers

    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            vocab_size=256,
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp / "hf" / "qwen3-moe")


GIVEN = {"data.md": _given_data, "parallelism.md": _given_moe}  # guide -> writes the files its reader brings


def _runs(guide: str) -> list[tuple[str, str]]:
    return [(name, block) for name, block in GUIDES[guide].items() if f"{guide}#{name}" not in SKIPPED]


def params():
    for guide in GUIDES:
        runs = _runs(guide)
        if runs:
            marks = [pytest.mark.slow] if any(uses_launcher(block) for _, block in runs) else []
            yield pytest.param(guide, id=guide, marks=marks)


def _checkout_listing() -> set[str]:
    return {
        str(p.relative_to(ROOT))
        for folder in LINKED
        for p in (ROOT / folder).rglob("*")
        if "__pycache__" not in p.parts
    }


@pytest.mark.parametrize("guide", params())
def test_guide_runs_as_written_on_cpu(guide, tmp_path):
    link_checkout(tmp_path)
    before = _checkout_listing()
    if guide in GIVEN:
        GIVEN[guide](tmp_path)
    times = []
    for name, block in _runs(guide):
        start = time.perf_counter()
        code, out, script = run_block(block, tmp_path)
        times.append(f"{name} {time.perf_counter() - start:.1f} s")
        assert code == 0, f"{guide} block {name!r} failed (exit {code}):\n{script}\n{out[-6000:]}"
        warned = [
            line
            for line in out.splitlines()
            if "warm-up is not over" in line or re.match(r"(megakit|prepare-data|train\.py)[\w -]*: .*warn", line)
        ]
        expected = WARNS.get(f"{guide}#{name}", ("\0",))[0]
        warned = [line for line in warned if expected not in line]
        assert not warned, f"{guide} block {name!r} warns:\n" + "\n".join(warned)
        check = CHECKS.get(f"{guide}#{name}")
        assert check is None or check(out, tmp_path), f"{guide} block {name!r} did not do what it says:\n{out[-6000:]}"
    print(f"{guide}: " + ", ".join(times))
    written = _checkout_listing() - before
    for path in sorted(written, reverse=True):  # removed, so that the other tests read the checkout as it was
        if (ROOT / path).is_dir():
            (ROOT / path).rmdir()
        else:
            (ROOT / path).unlink()
    assert not written, f"{guide} wrote into the checkout: {written}"


def _train_flags(block: str) -> list[str]:
    """The flags a block passes to scripts/train.py (lines joined at their backslashes), up to the command's end."""
    line = next(line for line in block.replace("\\\n", " ").splitlines() if "scripts/train.py" in line)
    words = shlex.split(line, comments=True)
    flags = words[words.index("scripts/train.py") + 1 :]
    ends = [i for i, word in enumerate(flags) if word in ("&", "&&", "||", ";", "|")]
    return flags[: ends[0]] if ends else flags


@pytest.mark.parametrize("key", sorted(CHECKED))
def test_cluster_blocks_pass_the_trainers_check(key, tmp_path):
    guide, _, name = key.partition("#")
    link_checkout(tmp_path)
    env = dict(
        os.environ,
        WORLD_SIZE=str(CHECKED[key]),
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    )
    flags = _train_flags(GUIDES[guide][name])
    run = subprocess.run(
        [sys.executable, "scripts/train.py", *flags, "--check"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, f"{key}: train.py {' '.join(flags)} --check\n{run.stdout}{run.stderr}"


def test_every_skip_and_check_names_a_block():
    blocks = {f"{guide}#{name}" for guide, named in GUIDES.items() for name in named}
    assert set(SKIPPED) <= blocks, f"skips of blocks the guides no longer have: {set(SKIPPED) - blocks}"
    assert set(CHECKED) <= set(SKIPPED), set(CHECKED) - set(SKIPPED)
    assert set(CHECKS) | set(WARNS) <= blocks - set(SKIPPED), (set(CHECKS) | set(WARNS)) - (blocks - set(SKIPPED))
    assert set(GIVEN) <= {guide for guide in GUIDES if _runs(guide)}, GIVEN


def test_an_indented_block_in_a_list_is_a_block():
    text = "# Restarts\n\n- **resume**:\n\n  ```bash\n  torchrun a \\\n      b\n  ```\n\n  more\n```sh\nc\n```\n"
    assert shell_blocks(text) == {"restarts": "torchrun a \\\n    b\n", "restarts-2": "c\n"}


def test_train_help_gives_every_default_the_guides_rely_on():
    """``train.py --help`` says each flag's default (the guides send readers there for them), in its own words or
    as ``(default: X)``; flags that are off or unset by default have none to give."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    defaults = {
        dest: value
        for dest, value in vars(script.parse_args([])).items()
        if value is not None and value is not False and dest != "local_rank"
    }
    run = subprocess.run(
        [sys.executable, "scripts/train.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="100"),
        timeout=120,
    )
    entries = {m.group(1): m.group(2) for m in re.finditer(r"^  (--[\w-]+)(.*?)(?=^  -|\Z)", run.stdout, re.M | re.S)}
    lacking = [
        dest
        for dest in defaults
        if "default" not in entries.get(f"--{dest}", entries.get("--" + dest.replace("_", "-"), ""))
    ]
    assert not lacking, f"train.py --help gives no default for {lacking}"
    assert "(default: ds_configs/zero1.json)" in " ".join(entries["--ds_config"].split())
    assert "(default: 0)" in entries["--seed"]  # "default generators" in its text is not its default


def test_every_plan_flag_is_in_a_guide():
    run = subprocess.run(
        [sys.executable, "-m", "megakit.commands.cli", "plan", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    flags = set(re.findall(r"^\s+(--[a-z][\w-]*)", run.stdout, re.M)) - {"--help"}
    text = "".join(page.read_text() for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))])
    missing = sorted(flag for flag in flags if not re.search(re.escape(flag) + r"(?![\w-])", text))
    assert len(flags) > 40 and not missing, f"megakit plan flags in no guide: {missing}"
