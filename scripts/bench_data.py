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
single-process gpt-mini training step (forward, backward, AdamW) on it. Two fine-tuning rows: 20,000 chat
records of spread lengths prepared with ``--pack 128`` against ``--pad 128``, as loss tokens a gpt-mini trains per
second (document mask on); and ``prepare-data`` of the chat JSONL against a plain loop of transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)``. The last line is
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
        texts = [p.read_text(encoding="utf-8", errors="replace") for p in files[i : i + 64]]
        for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
            out.append(np.array([*encoding.ids, eos], dtype=np.uint16))
    np.concatenate(out)
    return time.perf_counter() - started


def megakit(files: list[Path], tokenizer_file: Path, out: Path, workers: int) -> float:
    from megakit.interop.prepare_data import PrepareConfig, prepare

    started = time.perf_counter()
    prepare(
        PrepareConfig(
            inputs=[str(p) for p in files],
            out=str(out),
            tokenizer=str(tokenizer_file),
            val_fraction=0.0,
            workers=workers,
            progress=False,
        ),
        say=lambda *_: None,
    )
    return time.perf_counter() - started


def loader_share(data: Path, steps: int = 5) -> tuple[float, float]:
    """(seconds to cut one step's batch, seconds of one single-process gpt-mini step) on the shards in ``data``."""
    import torch

    from megakit.core.model_config import ModelConfig
    from megakit.nn.model import Transformer
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import model_for_corpus, open_corpus

    corpus = open_corpus(str(data))
    config = model_for_corpus(ModelConfig.load("gpt-mini"), "gpt-mini", corpus)
    batches = TokenBatches(corpus.train, BatchPlan(seq_len=config.max_seq_len, micro_batch=8, accumulation=1))
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    load = train = 0.0
    for step in range(steps + 1):
        t0 = time.perf_counter()
        ((x, y),) = batches.micro_batches(step, 0)
        t1 = time.perf_counter()
        model(x, y).backward()
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        if step:  # the first step warms up
            load, train = load + t1 - t0, train + t2 - t1
    return load / steps, train / steps


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_records(files: list[Path], n: int, seed: int = 0) -> list[dict]:
    """``n`` two-turn conversations cut from the files' lines, of lengths spread from a few tokens to ~120."""
    rng = np.random.default_rng(seed)
    lines = [line for f in files[:200] for line in f.read_text(errors="replace").splitlines() if line.strip()]
    out, i = [], 0
    for _ in range(n):
        q, a = (int(k) for k in np.exp(rng.uniform(0, np.log(6), 2)))  # 1 to 5 lines each: short and long turns
        out.append(
            {
                "messages": [
                    {"role": "user", "content": "\n".join(lines[i : i + q])},
                    {"role": "assistant", "content": "\n".join(lines[i + q : i + q + a])},
                ]
            }
        )
        i = (i + q + a) % max(len(lines) - 12, 1)
    return out


def chat_tokenizer(bpe_dir: Path, out: Path) -> Path:
    """The benchmark's BPE with ChatML's special tokens and a template with generation markers."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, chat_template=CHATML, eos_token="<|endoftext|>"
    ).save_pretrained(str(out))
    return out


def plain_chat(records: list[dict], tokenizer_dir: Path) -> float:
    """Seconds for what a user writes without megakit: ``apply_chat_template`` with the assistant mask, per record."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    started = time.perf_counter()
    for record in records:
        out = tokenizer.apply_chat_template(
            record["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        np.array(out["input_ids"], dtype=np.uint16), np.array(out["assistant_masks"], dtype=np.uint8)
    return time.perf_counter() - started


def megakit_chat(chats: Path, tokenizer_dir: Path, out: Path, workers: int, **more) -> float:
    from megakit.interop.prepare_data import PrepareConfig, prepare

    started = time.perf_counter()
    prepare(
        PrepareConfig(
            inputs=[str(chats)],
            out=str(out),
            tokenizer=str(tokenizer_dir),
            val_fraction=0.0,
            workers=workers,
            progress=False,
            **more,
        ),
        say=lambda *_: None,
    )
    return time.perf_counter() - started


def useful_tokens_per_second(data: Path, steps: int = 6) -> float:
    """Loss tokens a single-process gpt-mini trains per second on ``data``'s windows (8 a step, 128 tokens each),
    with the document mask and restarted positions."""
    import torch

    from megakit.core.model_config import ModelConfig
    from megakit.nn.model import Transformer
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import model_for_corpus, open_corpus
    from megakit.train.run import TrainConfig

    corpus = open_corpus(str(data))
    config = model_for_corpus(ModelConfig.load("gpt-mini"), "gpt-mini", corpus)
    cfg = TrainConfig(ds_config={}, reset_attention_mask=True, reset_position_ids=True)
    batches = TokenBatches(
        corpus.train, BatchPlan(seq_len=config.max_seq_len, micro_batch=8), **corpus.loader_options(cfg)
    )
    model = Transformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    useful, seconds = 0, 0.0
    for step in range(steps + 1):
        ((x, y),) = batches.micro_batches(step, 0)
        (extras,) = batches.forward_extras(step, 0)
        t0 = time.perf_counter()
        model(x, y, **extras).backward()
        optimizer.step()
        optimizer.zero_grad()
        if step:  # the first step warms up
            seconds += time.perf_counter() - t0
            useful += int((y != -100).sum())
    return useful / seconds


def fine_tuning_rows(files: list[Path], bpe_dir: Path, work: Path, workers: int, repeats: int) -> list[tuple]:
    """``(label, megakit figure, reference figure, ratio)``: packed against padded fine-tuning, and prepare-data of
    chat JSONL against the plain ``apply_chat_template`` loop."""
    import json

    tokenizer = chat_tokenizer(bpe_dir, work / "chat-tok")
    records = chat_records(files, 20000)  # enough that the pool's start-up is a small share
    chats = work / "chats.jsonl"
    chats.write_text("".join(json.dumps(r) + "\n" for r in records))
    plain_s, megakit_s = [], []
    for r in range(repeats):
        plain_s.append(plain_chat(records, tokenizer))
        megakit_s.append(megakit_chat(chats, tokenizer, work / f"chat{r}", workers))
    paired = statistics.median(p / m for p, m in zip(plain_s, megakit_s))
    megakit_chat(chats, tokenizer, work / "packed", workers, pack=128)
    megakit_chat(chats, tokenizer, work / "padded", workers, pad=128)
    packed, padded = useful_tokens_per_second(work / "packed"), useful_tokens_per_second(work / "padded")
    return [
        ("fine-tuning, packed vs padded (loss tokens/s)", packed, padded, packed / padded),
        (
            f"prepare-data of chat JSONL vs apply_chat_template loop (records/s, {workers} workers)",
            len(records) / min(megakit_s),
            len(records) / min(plain_s),
            paired,
        ),
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=0, help="the first N standard-library files (default: all)")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each side, alternating (default 5)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from megakit.interop.prepare_data import PrepareConfig, prepare
    from megakit.train.data.batches import stdlib_files

    files = stdlib_files()[: args.files or None]
    size = sum(p.stat().st_size for p in files) / 2**20
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        prepare(
            PrepareConfig(inputs=[str(p) for p in files[:100]], out=str(work / "bpe"), vocab_size=4096, progress=False),
            say=lambda *_: None,
        )
        tokenizer = work / "bpe" / "tokenizer.json"
        times = {"plain": [], "plain, one thread": [], "megakit": []}
        for r in range(args.repeats):
            times["plain"].append(plain(files, tokenizer))
            times["plain, one thread"].append(plain(files, tokenizer, threads=False))
            times["megakit"].append(megakit(files, tokenizer, work / f"out{r}", args.workers))
        load, step = loader_share(work / "out0")
        rows = fine_tuning_rows(files, work / "bpe", work, args.workers, args.repeats)
    best = {k: min(v) for k, v in times.items()}  # wall seconds of the fastest run
    rates = {k: size / wall for k, wall in best.items()}
    print(
        f"{len(files)} files, {size:.1f} MiB, BPE 4096, {os.cpu_count()} cores, megakit with {args.workers} workers, "
        f"best of {args.repeats}"
    )
    print(f"load average {os.getloadavg()[0]:.1f} (other work on the machine slows both sides)")
    print(f"{'':<42}{'MiB/s':>8}{'seconds':>10}  (every run)")
    for name, label in (
        ("plain", "plain tokenizers encode_batch"),
        ("plain, one thread", "  the same, TOKENIZERS_PARALLELISM=false"),
        ("megakit", "megakit prepare-data"),
    ):
        runs = " ".join(f"{t:.2f}" for t in times[name])
        print(f"{label:<42}{rates[name]:>8.2f}{best[name]:>10.2f}  ({runs})")
    print(
        f"loader: {load * 1e3:.2f} ms to cut a step's batch (8 x 128 tokens) from the shards, a gpt-mini step "
        f"{step * 1e3:.0f} ms: {load / (load + step):.2%} of the step"
    )
    paired = statistics.median(p / m for p, m in zip(times["plain"], times["megakit"]))
    print(
        f"best against best: {rates['megakit'] / rates['plain']:.2f}; run against the plain run just before it, "
        f"median of {args.repeats}: {paired:.2f} (steadier when the machine's speed drifts)"
    )
    print(f"{'':<78}{'megakit':>10}{'reference':>11}{'ratio':>7}")
    for label, ours, reference, ratio in rows:
        print(f"{label:<78}{ours:>10,.0f}{reference:>11,.0f}{ratio:>7.2f}")
    print(f"ratio {paired:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
