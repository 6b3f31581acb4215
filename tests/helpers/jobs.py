"""Launcher plumbing shared by the trainer's tests: one ``deepspeed`` job of many cases (``launch_sweep.py``),
the DeepSpeed configs and the small models and data sets those jobs train on."""

import glob
import json
import os
import subprocess
from pathlib import Path

from multiproc import THREADS, free_port
from paths import ROOT

LOSS_TOL = 2e-5  # fp32: the distributed loss differs from the single process by summation order only


def dropout_model(directory: Path, name: str = "gpt-tiny", p: float = 0.1) -> str:
    """A copy of a preset with dropout ``p`` everywhere (as every Hugging Face GPT-2 config has)."""
    config = json.loads((ROOT / "models" / f"{name}.json").read_text())
    keys = ("resid_pdrop", "embd_pdrop", "attn_pdrop") if config["model_type"] == "gpt2" else ("attention_dropout",)
    config.update({key: p for key in keys})
    path = directory / f"{name}-dropout.json"
    path.write_text(json.dumps(config))
    return str(path)


def packed_documents(directory: Path, *, window: int = 32, documents: int = 1200, seed: int = 1) -> str:
    """Short documents of seeded random words (1-4 each), packed by ``prepare-data --pack`` into windows of
    ``window`` tokens: loss masks on the padding, a document start per example. Train with --seq-len ``window``
    --reset-attention-mask --reset-position-ids."""
    import random

    from megakit.commands import cli

    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(500)]
    lines = [
        json.dumps({"text": " ".join(rng.choice(words) for _ in range(rng.randint(1, 4)))}) for _ in range(documents)
    ]
    (directory / "docs.jsonl").write_text("\n".join(lines) + "\n")
    out = directory / "packed"
    assert (
        cli.main(
            [
                "prepare-data",
                str(directory / "docs.jsonl"),
                "--out",
                str(out),
                "--vocab-size",
                "300",
                "--pack",
                str(window),
                "--no-progress",
            ]
        )
        == 0
    )
    return str(out)


def ds_config(stage: int, *, micro: int = 2, accumulation: int = 2) -> dict:
    config = json.loads((ROOT / "ds_configs" / f"zero{stage}.json").read_text())
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)
    config["scheduler"]["params"].update(warmup_num_steps=5, total_num_steps=40)
    config["optimizer"]["params"]["lr"] = 3e-3
    return config


def deepspeed(nprocs: int, *args: str, timeout: float = 300, port: int | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=THREADS)
    cmd = ["deepspeed", "--num_gpus", str(nprocs), "--master_port", str(port or free_port()), *args]
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    return out


def sweep(
    tmp_path_factory, nprocs: int, cases: list[dict], *, timeout: float = 900, output: list | None = None
) -> list[dict]:
    """Run ``cases`` in one launcher job of ``nprocs`` processes; the job's stdout is appended to ``output``."""
    work = tmp_path_factory.mktemp(f"sweep{nprocs}")
    (work / "cases.json").write_text(json.dumps(cases))
    port = free_port()
    out = deepspeed(
        nprocs,
        "tests/helpers/launch_sweep.py",
        str(work / "cases.json"),
        str(work / "results.json"),
        port=port,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    if output is not None:
        output.append(out.stdout)
    left = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")  # the trainer unlinks DeepSpeed's buffers
    assert not left, left
    *results, last = json.loads((work / "results.json").read_text())
    assert last == {"replaced": []}, last  # communication is measured without replacing torch's functions
    return results


def _token_shards(tmp_path_factory) -> str:
    """40 standard-library sources through prepare-data: a BPE of 512 tokens, a tenth held out."""
    from megakit.interop.prepare_data import PrepareConfig, prepare
    from megakit.train.data.batches import stdlib_files

    out = tmp_path_factory.mktemp("tokens") / "stdlib"
    prepare(
        PrepareConfig(
            inputs=[str(p) for p in stdlib_files()[:40]], out=str(out), vocab_size=512, val_fraction=0.1, progress=False
        ),
        say=lambda *_: None,
    )
    return str(out)
