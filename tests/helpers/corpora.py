"""Small corpora made on the spot for the data tests: short documents and five large text files."""

import json

import numpy as np

from megakit.interop.prepare_data import PrepareConfig, prepare
from megakit.train.data.batches import stdlib_files

SEQ = 32


def _short_documents(tmp_path_factory) -> str:
    """Standard-library lines as 1-8-line documents (a few to ~100 tokens): most windows hold a document boundary."""

    lines = [line for f in stdlib_files()[:30] for line in f.read_text().splitlines() if line.strip()]
    docs, i, gen = [], 0, np.random.default_rng(1)
    while i < len(lines):
        n = int(gen.integers(1, 9))
        docs.append("\n".join(lines[i : i + n]))
        i += n
    out = tmp_path_factory.mktemp("short")
    (out / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare(
        PrepareConfig(
            inputs=[str(out / "docs.jsonl")], out=str(out / "data"), vocab_size=512, val_fraction=0.1, progress=False
        ),
        say=lambda *_: None,
    )
    return str(out / "data")


def five_large_files(directory, words_per_file=30_000):
    """5 text files of made-up prose (~170 KB each, one document each), the same on every call: no downloads."""
    import random

    directory.mkdir()
    rng = random.Random(0)
    vocabulary = [
        "the",
        "king",
        "of",
        "a",
        "night",
        "speak",
        "my",
        "lord",
        "and",
        "thou",
        "art",
        "to",
        "be",
        "love",
        "death",
        "sweet",
        "what",
        "is",
        "in",
        "fair",
        "heaven",
        "tongue",
        "never",
        "again",
        "hath",
        "done",
    ]
    for i in range(5):
        lines = [
            " ".join(rng.choice(vocabulary) for _ in range(12)) + rng.choice(".,;!?")
            for _ in range(words_per_file // 12)
        ]
        (directory / f"play{i}.txt").write_text("\n".join(lines) + "\n")
    return directory
