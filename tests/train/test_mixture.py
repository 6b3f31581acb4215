"""Mixtures of data sets (``--data 0.7 A 0.3 B``): shares exact to a sample per step, deterministic, the same
samples at any DP size, the validation loss per data set, and one line for each bad mixture.

One launcher job of 2 processes trains a mixture at DP 2 and follows the single process step by step
(``megakit.train.doctor.reference``), its validation loss the token-weighted one over both data sets' splits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from corpora import SEQ, _short_documents
from jobs import ds_config, sweep
from tolerance import fp32_bound

from megakit.errors import UsageError
from megakit.train.data.batches import BatchPlan, Mixture, TokenBatches


@pytest.fixture(scope="module")
def two_sets(tmp_path_factory) -> tuple[str, str]:
    """Two prepared data sets with one tokenizer: short documents, and the json package's sources."""
    import sysconfig
    from pathlib import Path

    from megakit.interop.prepare_data import PrepareConfig, prepare

    first = _short_documents(tmp_path_factory)
    second = str(tmp_path_factory.mktemp("second") / "data")
    prepare(
        PrepareConfig(
            inputs=[str(Path(sysconfig.get_paths()["stdlib"]) / "json")],
            out=second,
            tokenizer=first,
            val_fraction=0.1,
            progress=False,
        ),
        say=lambda *_: None,
    )
    return first, second


def test_the_realised_shares_follow_the_weights_and_every_sample_is_one_data_sets():
    weights, sizes = [0.6, 0.3, 0.1], [500, 40, 7]  # small sets wrap around: their passes are reshuffled
    first = np.cumsum([0, *sizes])
    mixture = Mixture(weights, np.arange(4), first, seed=3)
    counts = np.zeros(3)
    for step in range(1000):
        picks = mixture.step_samples(step, 8).numpy()
        assert len(picks) == 8
        source = np.searchsorted(first, picks, side="right") - 1
        counts += np.bincount(source, minlength=3)
        if step < 5:  # the same arithmetic again gives the same samples
            assert torch.equal(torch.from_numpy(picks), Mixture(weights, np.arange(4), first, 3).step_samples(step, 8))
    shares = counts / counts.sum()
    assert np.abs(shares - weights).max() < 0.01 * max(weights), shares
    assert abs(shares[2] - 0.1) < 1e-3  # exact to a sample at every step: 800 of 8000
    assert (mixture.taken(1000, 8) == [4800, 2400, 800]).all()


def test_the_same_samples_at_any_dp_size(two_sets):
    from megakit.train.data.corpus import open_corpus
    from megakit.train.run import TrainConfig

    corpus = open_corpus([0.7, two_sets[0], 0.3, two_sets[1]])
    options = corpus.loader_options(TrainConfig(ds_config={}))
    one = TokenBatches(corpus.train, BatchPlan(seq_len=SEQ, micro_batch=4, accumulation=2, dp=1), **options)
    four = TokenBatches(corpus.train, BatchPlan(seq_len=SEQ, micro_batch=1, accumulation=2, dp=4), **options)
    for step in (0, 7, 31):
        whole = torch.cat([x for x, _ in one.micro_batches(step, 0)])
        parts = torch.cat([x for r in range(4) for x, _ in four.micro_batches(step, r)])
        assert sorted(map(tuple, whole.tolist())) == sorted(map(tuple, parts.tolist()))  # the same batch, resharded
        assert torch.equal(one.global_indices(step), four.global_indices(step))


def test_bad_mixtures_are_one_line(two_sets, tmp_path):
    from megakit.train.data.corpus import open_corpus

    a, b = two_sets
    cases = [
        ([0.7, a, 0, b], "mixture weight 0 must be a positive number"),
        ([0.7, a, -1, b], "mixture weight -1 must be a positive number"),
        ([0.7, a, 0.3], "a mixture is WEIGHT DIR pairs"),
        ([0.5, a, 0.5, str(tmp_path / "missing")], "no such file or directory"),
    ]
    for data, message in cases:
        with pytest.raises(UsageError, match=message):
            open_corpus([str(x) for x in data])
    (tmp_path / "bytes.txt").write_text("some raw text " * 500)
    with pytest.raises(UsageError, match="were tokenized differently; a mixture needs one tokenizer"):
        open_corpus(["0.5", a, "0.5", str(tmp_path / "bytes.txt")])


@pytest.mark.slow
def test_a_mixture_at_dp2_follows_one_process_with_a_validation_loss_per_data_set(two_sets, tmp_path_factory):
    from megakit.train.doctor.reference import reference_run

    data = [0.7, two_sets[0], 0.3, two_sets[1]]
    config = ds_config(1, micro=2, accumulation=2)
    config["optimizer"]["params"]["eps"] = 1e-4
    case = dict(ds_config=config, model="llama-tiny", steps=4, seq_len=SEQ, data=data, eval_every=2, eval_batches=1)
    (got,) = sweep(tmp_path_factory, 2, [case])
    want = reference_run(
        config, model="llama-tiny", steps=4, dp=2, seq_len=SEQ, data=data, eval_every=2, eval_batches=1
    )
    for step, (a, b) in enumerate(zip(got["loss"], want["loss"], strict=True)):
        assert abs(a - b) <= fp32_bound(b, 8 * SEQ), (step, a, b)
    for a, b in zip(got["evals"], want["evals"], strict=True):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) <= fp32_bound(b["loss"], 8 * SEQ), (a, b)
        assert set(a["sources"]) == {str(two_sets[0]), str(two_sets[1])}, a
        low, high = sorted(a["sources"].values())
        assert low <= a["loss"] <= high  # the mixture's loss lies between its data sets'
