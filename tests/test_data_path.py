"""The data path: prepare-data's shards and tokenizer, the loader's DP split and resume, and its errors.

Pure functions and in-process CLI calls (``main(argv)``); the trainer on shards through the
launcher is in test_trainer.py (case 6 of the TP x PP sweep).
"""

import importlib.util
import itertools
import json
import shutil

import numpy as np
import pytest
import torch
from test_trainer import ROOT

from megakit.commands.cli import main as megakit
from megakit.errors import UsageError
from megakit.interop.prepare_data import MIN_SPAN, PrepareConfig, prepare, read_documents
from megakit.interop.token_shards import open_shards
from megakit.train.data.batches import BatchPlan, TokenBatches, stdlib_files
from megakit.train.data.corpus import open_corpus
from megakit.train.run import TrainConfig


def _train_script():
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _corpus(directory, files=40):
    """Some stdlib sources, a JSONL file of records and a nested directory."""
    directory.mkdir()
    for path in stdlib_files()[:files]:
        shutil.copyfile(path, directory / path.name)
    (directory / "nested").mkdir()
    (directory / "nested" / "note.txt").write_text("héllo wörld, naïve café\n" * 20)
    records = [{"text": f"record {i}: " + "lorem ipsum " * (i % 7 + 1), "id": i} for i in range(30)]
    (directory / "records.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return directory


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    corpus = _corpus(base / "corpus")
    out = base / "tokens"
    cfg = PrepareConfig(
        inputs=[str(corpus)],
        out=str(out),
        vocab_size=400,
        val_fraction=0.1,
        workers=2,
        shard_tokens=20_000,
        progress=False,
    )
    return cfg, prepare(cfg, say=lambda *_: None), corpus


def test_shards_round_trip_to_the_tokenizers_own_ids(prepared):
    """Every document's ids in the shards are the tokenizer's ids of its text, then end-of-text; in order,
    whatever the number of workers; BPE training is deterministic, and a second run is a no-op."""
    cfg, summary, corpus = prepared
    from tokenizers import Tokenizer

    shards = open_shards(cfg.out, verify=True)
    tokenizer = Tokenizer.from_file(str(shards.directory / "tokenizer.json"))
    eos = shards.index["eos_id"]
    assert tokenizer.id_to_token(eos) == "<|endoftext|>" and shards.vocab_size == 400
    assert shards.index["dtype"] == "uint16" and len(shards.index["splits"]["train"]) > 1  # several shards
    got = []
    for split in ("train", "validation"):
        for tokens, starts in zip(shards.tokens(split), shards.documents(split)):
            ends = [*starts[1:], len(tokens)]
            got += [(split, tokens[s:e].tolist()) for s, e in zip(starts, ends)]
    docs = [
        tokenizer.encode(d, add_special_tokens=False).ids + [eos]
        for path in sorted(p for p in corpus.rglob("*") if p.is_file())
        for d in read_documents(path, "text")[0]
    ]
    want, seen, held = {"train": [], "validation": []}, 0, 0
    for i, ids in enumerate(docs):  # a document's end is held out once the split owes MIN_SPAN tokens, or at the last
        seen += len(ids)
        owed = int(0.1 * seen + 0.5) - held
        take = max(0, min(owed, len(ids), seen - held - 1)) if owed >= MIN_SPAN or i == len(docs) - 1 else 0
        held += take
        want["train"] += [ids[: len(ids) - take]] if take < len(ids) else []
        want["validation"] += [ids[len(ids) - take :]] if take else []
    for split in ("train", "validation"):
        assert [g for s, g in got if s == split] == want[split], split
        assert summary["tokens"][split] == sum(map(len, want[split]))
    assert summary["input_documents"] == len(docs) and summary["cut_documents"] > 0
    assert abs(held / seen - 0.1) < MIN_SPAN / seen, held / seen  # a tenth of the tokens, within one span

    again = prepare(PrepareConfig(**{**cfg.__dict__, "out": cfg.out + "-again", "workers": 1}), say=lambda *_: None)
    for name in ("tokenizer.json", "train-00000.bin", "validation-00000.bin"):  # one worker, same bytes
        assert (shards.directory / name).read_bytes() == (shards.directory.parent / "tokens-again" / name).read_bytes()
    assert not again["unchanged"] and prepare(cfg, say=lambda *_: None)["unchanged"]
    local = prepare(
        PrepareConfig(**{**cfg.__dict__, "out": cfg.out + "-local", "tokenizer": cfg.out}), say=lambda *_: None
    )  # --tokenizer: the saved transformers tokenizer directory
    assert local["vocab_size"] == 400
    assert (shards.directory / "train-00001.bin").read_bytes() == (
        shards.directory.parent / "tokens-local" / "train-00001.bin"
    ).read_bytes()
    assert not list(shards.directory.parent.glob(".tokens*"))  # no temporary directory left


def test_a_big_jsonl_is_cut_into_pieces_and_its_bad_lines_counted(prepared, tmp_path, monkeypatch):
    """One JSONL file bigger than a task is read and tokenized in line-aligned pieces over the workers, never
    whole; a line that is not UTF-8, not JSON or without the field is counted and skipped; the ids are the
    tokenizer's, in order."""
    from tokenizers import Tokenizer

    from megakit.interop import prepare_data

    monkeypatch.setattr(prepare_data.inputs, "TASK_BYTES", 700)  # read by pieces() and tasks()
    records = [json.dumps({"text": f"record {i} " + "naïve café " * (i % 5)}).encode() for i in range(60)]
    bad = {7: b'{"text": "\xff\xfe broken"}', 21: b"not json at all", 40: b'{"body": "no text field"}'}
    lines = [bad.get(i, r) for i, r in enumerate(records)]
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    cuts = prepare_data.pieces(path)
    assert len(cuts) > 4 and cuts[0][1] == 0 and cuts[-1][2] == path.stat().st_size
    assert all(a[2] == b[1] for a, b in itertools.pairwise(cuts))  # contiguous, each cut just after a newline
    assert all(path.read_bytes()[c[1] - 1] == ord("\n") for c in cuts[1:])
    said = []
    cfg = PrepareConfig(
        inputs=[str(path)],
        out=str(tmp_path / "out"),
        tokenizer=prepared[0].out,
        val_fraction=0.0,
        workers=2,
        progress=False,
    )
    summary = prepare(cfg, say=said.append)
    assert summary["bad_records"] == 3 and summary["documents"]["train"] == 57, summary
    assert any("skipped 3 JSONL lines" in line and "big.jsonl, the line at byte" in line for line in said), said
    shards = open_shards(cfg.out)
    tokenizer = Tokenizer.from_file(str(shards.directory / "tokenizer.json"))
    want = [
        t
        for i, r in enumerate(records)
        if i not in bad
        for t in tokenizer.encode(json.loads(r)["text"], add_special_tokens=False).ids + [shards.index["eos_id"]]
    ]
    assert np.concatenate([np.asarray(t) for t in shards.tokens("train")]).tolist() == want


def test_parquet_and_arrow_rows_are_named_as_rows_and_empty_ones_counted(prepared, tmp_path):
    """A null or non-string row is a bad record named by its file, row group (record batch) and row, not a "JSONL
    line"; an empty string is counted apart (5 rows: 3 documents, 1 bad, 1 empty)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = ["one two three", None, "", "four five", "six"]
    pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet", row_group_size=2)
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "saved"))
    for source, where in (
        ("rows.parquet", "rows.parquet, row group 0, row 1 ('text' is null)"),
        ("saved", "record batch 0, row 1 ('text' is null)"),
    ):
        said = []
        summary = prepare(
            PrepareConfig(
                inputs=[str(tmp_path / source)],
                out=str(tmp_path / f"out-{source}"),
                tokenizer=prepared[0].out,
                val_fraction=0.0,
                progress=False,
            ),
            say=said.append,
        )
        assert (summary["input_documents"], summary["bad_records"], summary["empty_records"]) == (3, 1, 1), summary
        assert not any("JSONL" in line for line in said), said
        assert any("skipped 1 Parquet/Arrow rows that are not objects" in line and where in line for line in said), said
        assert any("skipped 1 Parquet/Arrow rows whose 'text' is an empty string" in line for line in said), said


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_dp_ranks_take_disjoint_samples_whose_union_is_the_batch(prepared, dp):
    corpus = open_corpus(prepared[0].out)
    plan = BatchPlan(seq_len=16, micro_batch=8 // dp, accumulation=2, dp=dp, seed=3)
    batches = TokenBatches(corpus.train, plan)
    single = TokenBatches(corpus.train, BatchPlan(seq_len=16, micro_batch=16, seed=3))
    for step in (0, 5, batches.steps_per_epoch + 1):
        parts = [batches.rank_indices(step, r).tolist() for r in range(dp)]
        assert sum(map(len, parts)) == len(set().union(*parts)) == plan.global_batch  # disjoint
        assert sorted(i for p in parts for i in p) == sorted(single.global_indices(step).tolist())  # complete
        glued = torch.cat([x for r in range(dp) for x, _ in batches.micro_batches(step, r)])
        assert torch.equal(glued, single.global_batch(step)[0])
    windows = [np.asarray(t) for t in corpus.train]  # every sample is a window of one shard, labels shifted by one
    x, y = batches.global_batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < corpus.vocab_size and len(windows) > 1


def test_a_mid_epoch_resume_at_another_dp_sees_every_remaining_sample_once(prepared):
    corpus = open_corpus(prepared[0].out)
    before = TokenBatches(corpus.train, BatchPlan(seq_len=16, micro_batch=4, accumulation=1, dp=2, seed=5))
    after = TokenBatches(corpus.train, BatchPlan(seq_len=16, micro_batch=1, accumulation=2, dp=4, seed=5))
    epoch, stop = before.steps_per_epoch, before.steps_per_epoch // 3  # stopped a third into the epoch
    seen = [i for s in range(stop) for r in range(2) for i in before.rank_indices(s, r).tolist()]
    rest = [i for s in range(stop, epoch) for r in range(4) for i in after.rank_indices(s, r).tolist()]
    assert len(set(rest)) == len(rest) and not set(seen) & set(rest)
    assert sorted(seen + rest) == sorted(before._order(0)[: epoch * 8].tolist())


def _one_line(capsys, status, argv, runner=megakit):
    assert runner(argv) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_prepare_data_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("café au lait\n".encode("latin-1"))
    out = ["--out", str(tmp_path / "out"), "--vocab-size", "300", "--no-progress", "--workers", "1"]
    assert "hold no files" in _one_line(capsys, 2, ["prepare-data", str(tmp_path / "empty"), *out])
    assert "hold no text" in _one_line(capsys, 2, ["prepare-data", str(tmp_path / "empty.txt"), *out])
    line = _one_line(capsys, 2, ["prepare-data", str(tmp_path / "latin1.txt"), *out])
    assert "latin1.txt: not UTF-8" in line
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))  # nothing written half-way
    (tmp_path / "good.txt").write_text("plain text " * 500)  # among others, a bad file is skipped and counted
    assert megakit(["prepare-data", str(tmp_path / "good.txt"), str(tmp_path / "latin1.txt"), *out]) == 0
    assert "skipped 1 of 2 files that are not UTF-8 text" in capsys.readouterr().out
    line = _one_line(capsys, 2, ["prepare-data", str(tmp_path / "good.txt"), "--val-fraction", "1.5", *out])
    assert "--val-fraction must be in [0, 1), got 1.5" in line
    (tmp_path / "latin1.txt").unlink()
    (tmp_path / "empty.txt").unlink()
    inside = ["prepare-data", str(tmp_path), "--out", str(tmp_path / "out"), *out[2:]]  # --out under the input
    assert megakit(inside) == 0 and "wrote" in capsys.readouterr().out
    assert megakit(inside) == 0 and "up to date" in capsys.readouterr().out  # its own shards are not input


def test_trainer_data_errors_are_one_line(prepared, tmp_path, capsys):
    train = _train_script()
    data = tmp_path / "tokens"
    shutil.copytree(prepared[0].out, data)
    model = json.loads((ROOT / "models" / "gpt-tiny.json").read_text())  # a config of its own: vocab 256
    (tmp_path / "model.json").write_text(json.dumps(model))
    base = ["--data", str(data), "--steps", "1", "--no-progress"]
    line = _one_line(capsys, 2, [*base, "--model", str(tmp_path / "model.json")], train)
    assert "vocabulary of 256 but the tokenizer" in line and "has 400 tokens" in line
    line = _one_line(capsys, 2, ["--steps", "1", "--eval-every", "5"], train)  # raw text: no validation split
    assert "--eval-every needs a validation split" in line
    shard = data / "train-00001.bin"
    original = shard.read_bytes()
    shard.write_bytes(original + b"\0\0")
    assert "train-00001.bin is longer than index.json says" in _one_line(capsys, 2, base, train)
    damaged = bytearray(original)
    damaged[10:12] = b"\xff\xff"  # token 5 of the shard: id 65535 of a vocabulary of 400, in place (same size)
    shard.write_bytes(bytes(damaged))
    assert "train-00001.bin does not match its sha256 in index.json" in _one_line(capsys, 2, [*base, "--check"], train)
    corpus = open_corpus(str(data))  # the loader as the trainer builds it, one step reading every sample
    options = corpus.loader_options(TrainConfig(ds_config=str(ROOT / "ds_configs" / "zero1.json"), model="gpt-tiny"))
    samples = TokenBatches(corpus.train, BatchPlan(seq_len=64, micro_batch=1)).num_samples
    with pytest.raises(
        UsageError,
        match="train-00001.bin holds token id 65535 at token 5, outside the vocabulary of "
        "400: the shard is damaged; run train.py --check",
    ):
        TokenBatches(corpus.train, BatchPlan(seq_len=64, micro_batch=samples), **options).global_batch(0)
    shard.write_bytes(original[:-10])
    assert "train-00001.bin is truncated" in _one_line(capsys, 2, base, train)
    (data / "index.json").unlink()
    assert "has no index.json" in _one_line(capsys, 2, base, train)


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


def test_five_large_files_get_a_validation_split_of_the_val_fraction_of_tokens(tmp_path, capsys):
    """One document per file: 1 % of 5 documents rounds to none, 1 % of the tokens does not. Cut from documents'
    ends, the same split with 1 or 2 workers; a corpus too small for any says so at prepare time."""
    corpus = five_large_files(tmp_path / "plays")
    out = ["--vocab-size", "300", "--no-progress", "--val-fraction", "0.01"]
    assert megakit(["prepare-data", str(corpus), "--out", str(tmp_path / "a"), "--workers", "2", *out]) == 0
    said = capsys.readouterr().out
    assert "warning" not in said and "5 documents (3 cut between the two)" in said, said
    index = open_shards(tmp_path / "a").index
    tokens = index["summary"]["tokens"]
    share = tokens["validation"] / (tokens["train"] + tokens["validation"])
    assert tokens["validation"] >= MIN_SPAN and abs(share - 0.01) < 0.001, tokens
    assert megakit(["prepare-data", str(corpus), "--out", str(tmp_path / "b"), "--workers", "1", *out]) == 0
    assert [(tmp_path / d / "validation-00000.bin").read_bytes() for d in "ab"] == [
        (tmp_path / "a" / "validation-00000.bin").read_bytes()
    ] * 2  # deterministic
    (tmp_path / "tiny.txt").write_text("a few words only\n")
    assert megakit(["prepare-data", str(tmp_path / "tiny.txt"), "--out", str(tmp_path / "c"), *out]) == 0
    said = capsys.readouterr().out
    assert "warning: no validation split: " in said and "rounds to none; raise --val-fraction" in said, said
