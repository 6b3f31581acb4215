"""``prepare-data --pack N``: fine-tuning examples packed into windows of N tokens (best-fit decreasing), each
training as it would alone; ``--pad N`` (one example a window) the alternative; too-long examples cut or refused.

The check that matters: the token-weighted loss over every packed window, with the document mask and restarted
positions, equals the loss over the same examples one per window, and the examples' own losses computed alone.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from chat import CHATML, _tokenizer
from tolerance import fp32_bound

from megakit.commands import cli
from megakit.interop.packing import best_fit_decreasing

WINDOW = 64


def test_best_fit_decreasing_places_every_example_once_within_the_window():
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(1, WINDOW + 1, 300)]
    bins = best_fit_decreasing(lengths, WINDOW)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(sum(lengths[i] for i in b) <= WINDOW for b in bins)
    assert len(bins) <= 1.25 * sum(lengths) / WINDOW  # BFD: close to the lower bound on this spread of sizes
    assert bins == best_fit_decreasing(lengths, WINDOW)  # deterministic


def _records(n: int = 60) -> list[dict]:
    return [
        {"prompt": f"question {i}: " + "what is the weather? " * (i % 4), "completion": "sunny " * (1 + (i * 7) % 9)}
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def packed_and_padded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("packing")
    tokenizer = _tokenizer(tmp / "tok", CHATML)
    (tmp / "examples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records()))
    out = {}
    for how in ("pack", "pad"):
        code = cli.main(
            [
                "prepare-data",
                str(tmp / "examples.jsonl"),
                "--tokenizer",
                str(tokenizer),
                "--out",
                str(tmp / how),
                f"--{how}",
                str(WINDOW),
                "--val-fraction",
                "0",
                "--no-progress",
            ]
        )
        assert code == 0
        out[how] = str(tmp / how)
    return out, tmp, tokenizer


def _weighted_loss(data: str, documents: bool = True) -> tuple[float, int, int]:
    """sum(loss)/sum(tokens) over every window of ``data`` (one batch), its token count and windows."""
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus
    from megakit.train.run import TrainConfig

    corpus = open_corpus(data)
    cfg = TrainConfig(ds_config={}, reset_attention_mask=documents, reset_position_ids=documents)
    windows = (len(corpus.train[0]) - 1) // WINDOW
    batches = TokenBatches(corpus.train, BatchPlan(seq_len=WINDOW, micro_batch=windows), **corpus.loader_options(cfg))
    ((x, y),) = batches.micro_batches(0, 0)
    (extras,) = batches.forward_extras(0, 0)
    model = Transformer(ModelConfig.load("gpt-tiny").replace(vocab_size=corpus.vocab_size), seed=2)
    with torch.no_grad():
        return float(model(x, y, **extras)), int((y != -100).sum()), windows


def test_a_packed_loss_equals_the_examples_alone(packed_and_padded):
    (dirs, tmp, tokenizer) = packed_and_padded
    packed, tokens, windows = _weighted_loss(dirs["pack"])
    padded, padded_tokens, padded_windows = _weighted_loss(dirs["pad"])
    assert tokens == padded_tokens > 0 and windows < padded_windows == len(_records())  # packing saved windows
    assert abs(packed - padded) <= fp32_bound(padded, tokens), (packed, padded)
    leaky, _, _ = _weighted_loss(dirs["pack"], documents=False)  # without the mask, examples see each other
    assert abs(leaky - padded) > fp32_bound(padded, tokens), (leaky, padded)  # so the check above can fail
    summary = json.loads((tmp / "pack" / "index.json").read_text())
    assert summary["packed"] == {"seq_len": WINDOW, "strategy": "bfd"}


def test_too_long_examples_are_cut_or_refused_and_packed_data_asks_for_its_window(packed_and_padded, tmp_path, capsys):
    from megakit.errors import UsageError
    from megakit.train.data.corpus import open_corpus
    from megakit.train.run import TrainConfig

    dirs, tmp, tokenizer = packed_and_padded
    code = cli.main(
        [
            "prepare-data",
            str(tmp / "examples.jsonl"),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(tmp_path / "x"),
            "--pad",
            "16",
            "--too-long",
            "refuse",
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "does not fit the --pack/--pad window of 16" in err, err
    assert not (tmp_path / "x").exists()
    code = cli.main(
        [
            "prepare-data",
            str(tmp / "examples.jsonl"),
            "--tokenizer",
            str(tokenizer),
            "--out",
            str(tmp_path / "cut"),
            "--pad",
            "16",
            "--no-progress",
        ]
    )
    out = capsys.readouterr().out
    assert (
        code == 0
        and "cut to fit" in out
        and json.loads((tmp_path / "cut" / "index.json").read_text())["summary"]["packed"]["truncated"] > 0
    )
    corpus = open_corpus(dirs["pack"])
    with pytest.raises(
        UsageError, match=f"is packed into windows of {WINDOW} tokens; train it with --seq-len {WINDOW}"
    ):
        corpus.check_packed(TrainConfig(ds_config={}, reset_attention_mask=True, reset_position_ids=True), 32)
    with pytest.raises(UsageError, match="pass --reset-attention-mask --reset-position-ids"):
        corpus.check_packed(TrainConfig(ds_config={}), WINDOW)
