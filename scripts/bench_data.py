"""prepare-data's throughput against a plain tokenizers loop, and the loader's share of a training step.

    python scripts/bench_data.py [--files N] [--repeats R] [--workers W]

Both sides tokenize the same files (the Python standard library's sources) with the same
tokenizer (a byte-level BPE of 4096, trained once first):

- plain: one process reads the files and calls ``tokenizer.encode_batch`` on batches of 64
  documents (tokenizers' own thread pool on, as by default; also shown with it off),
  collecting each document's ids in a numpy array -- what a user writes without megakit;
- megakit: ``prepare-data --tokenizer`` end to end: reading, tokenizing in a pool of
  processes (forked from a clean fork server: forked from this process, which by then has
  run the plain loops, they spent 10-30 % more CPU copying its pages), writing the shards,
  the index and the tokenizer.

``--repeats`` runs of each, alternating; the ratio is the median over the repeats of each
megakit run against the plain run just before it (on a shared machine the speed drifts
by 10-20 % within a minute; pairs close in time cancel most of it), and the best runs are
shown too. The loader's share: the time
``TokenBatches`` takes to cut one step's batch from the memory-mapped shards, against one
single-process gpt-mini training step (forward, backward, AdamW) on it. The last line is
``ratio <megakit MB/s / plain MB/s>``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np


def plain(files: list[Path], tokenizer_file: Path, *, threads: bool = True) -> float:
    """Seconds for the plain loop over ``files`` (``threads``: tokenizers' thread pool on, its default)."""
    from tokenizers import Tokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true" if threads else "false"  # read by tokenizers at each call

    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    eos = tokenizer.token_to_id("<|endoftext|>")
    started = time.perf_counter()
    out = []
    for i in range(0, len(files), 64):
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i:i + 64]]
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            out.append(np.array([*encoding.ids, eos], dtype=np.uint16))
    np.concatenate(out)
    return time.perf_counter() - started


def megakit(files: list[Path], tokenizer_file: Path, out: Path, workers: int) -> float:
    from megakit.interop.prepare_data import PrepareConfig, prepare

    started = time.perf_counter()
    prepare(PrepareConfig(inputs=[str(p) for p in files], out=str(out), tokenizer=str(tokenizer_file),
                          val_fraction=0.0, workers=workers, progress=False), say=lambda *_: None)
    return time.perf_counter() - started


def loader_share(data: Path, steps: int = 5) -> tuple[float, float]:
    """(seconds to cut one step's batch, seconds of one single-process gpt-mini step) on the shards in ``data``."""
    import torch

    from megakit.core.model_config import ModelConfig
    from megakit.nn.model import Transformer
    from megakit.train.corpus import model_for_corpus, open_corpus
    from megakit.train.data import BatchPlan, TokenBatches

    corpus = open_corpus(str(data))
    config = model_for_corpus(ModelConfig.load("gpt-mini"), "gpt-mini", corpus)
    batches = TokenBatches(corpus.train, BatchPlan(seq_len=config.max_seq_len, micro_batch=8, accumulation=1))
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    load = train = 0.0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        (x, y), = batches.micro_batches(step, 0)
        t1 = time.perf_counter()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        if step:  # the first step warms up
            load, train = load + t1 - t0, train + t2 - t1
    return load / steps, train / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=0, help="the first N standard-library files (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side, alternating (default 5)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megakit.interop.prepare_data import PrepareConfig, prepare
    from megakit.train.data import stdlib_files

    files = stdlib_files()[: args.files or None]
    size = sum(p.stat().st_size for p in files) / 2**20
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        prepare(PrepareConfig(inputs=[str(p) for p in files[:100]], out=str(work / "bpe"), vocab_size=4096,
                              progress=False), say=lambda *_: None)
        tokenizer = work / "bpe" / "tokenizer.json"
        times = {"plain": [], "plain, one thread": [], "megakit": []}
        for r in range(args.repeats):
            times["plain"].append(plain(files, tokenizer))
            times["plain, one thread"].append(plain(files, tokenizer, threads=False))
            times["megakit"].append(megakit(files, tokenizer, work / f"out{r}", args.workers))
        load, step = loader_share(work / "out0")
    best = {k: min(v) for k, v in times.items()}  # wall seconds of the fastest run
    rates = {k: size / wall for k, wall in best.items()}
    print(f"{len(files)} files, {size:.1f} MiB, BPE 4096, {os.cpu_count()} cores, megakit with {args.workers} workers, "
          f"best of {args.repeats}")
    print(f"load average {os.getloadavg()[0]:.1f} (other work on the machine slows both sides)")
    print(f"{'':<42}{'MiB/s':>8}{'seconds':>10}  (every run)")
    for name, label in (("plain", "plain tokenizers encode_batch"), ("plain, one thread", "  the same, TOKENIZERS_PARALLELISM=false"),
                        ("megakit", "megakit prepare-data")):
        runs = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{label:<42}{rates[name]:>8.2f}{best[name]:>10.2f}  ({runs})")
    print(f"loader: {load * 1e3:.2f} ms to cut a step's batch (8 x 128 tokens) from the shards, a gpt-mini step "
          f"{step * 1e3:.0f} ms: {load / (load + step):.2%} of the step")
    paired = statistics.median(p / m for p, m in zip(times["plain"], times["megakit"]))
    print(f"best against best: {rates['megakit'] / rates['plain']:.2f}; run against the plain run just before it, "
          f"median of {args.repeats}: {paired:.2f} (steadier when the machine's speed drifts)")
    print(f"ratio {paired:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
