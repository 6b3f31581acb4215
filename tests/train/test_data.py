"""The corpus and its deterministic split over DP ranks."""

import pytest
import torch

from megakit.errors import UsageError
from megakit.train.data.batches import BatchPlan, TokenBatches, load_tokens, stdlib_files


def test_default_corpus_is_the_local_standard_library():
    files = stdlib_files()
    assert any(f.name == "os.py" for f in files)
    tokens = load_tokens(max_bytes=200_000)
    assert tokens.dtype == torch.uint8 and len(tokens) == 200_000
    text = bytes(tokens[:5000].tolist()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_dp_ranks_get_equal_disjoint_slices_that_union_to_the_global_batch():
    tokens = load_tokens(max_bytes=100_000)
    plan = BatchPlan(seq_len=16, micro_batch=2, accumulation=3, dp=4, seed=7)
    batches = TokenBatches(tokens, plan)
    for step in (0, 1, batches.steps_per_epoch + 2):  # also across an epoch boundary
        inputs, labels = batches.global_batch(step)
        assert inputs.shape == (plan.global_batch, 16) and inputs.dtype == torch.int64
        assert torch.equal(inputs[:, 1:], labels[:, :-1])  # labels are the next tokens
        parts = [batches.micro_batches(step, r) for r in range(plan.dp)]
        assert all(len(p) == plan.accumulation for p in parts)
        glued = torch.cat([x for part in parts for x, _ in part])
        assert torch.equal(glued, inputs)
        idx = batches.global_indices(step)
        assert len(set(idx.tolist())) == plan.global_batch  # distinct samples


def test_one_epoch_visits_each_sample_once_and_is_reproducible():
    tokens = load_tokens(max_bytes=20_000)
    plan = BatchPlan(seq_len=32, micro_batch=4, dp=2, seed=1)
    a, b = TokenBatches(tokens, plan), TokenBatches(tokens, plan)
    seen = torch.cat([a.global_indices(s) for s in range(a.steps_per_epoch)])
    assert len(set(seen.tolist())) == len(seen) == a.steps_per_epoch * plan.global_batch
    assert torch.equal(a.global_batch(3)[0], b.global_batch(3)[0])
    other = TokenBatches(tokens, BatchPlan(seq_len=32, micro_batch=4, dp=2, seed=2))
    assert not torch.equal(a.global_batch(0)[0], other.global_batch(0)[0])


def test_user_data_files_and_directories(tmp_path):
    (tmp_path / "a.txt").write_text("hello world " * 200)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.md").write_text("more text " * 100)
    (tmp_path / "blob.bin").write_bytes(b"\0\1\2" * 100)  # binary: skipped
    tokens = load_tokens(tmp_path)
    assert len(tokens) == 2400 + 1000
    assert len(load_tokens(tmp_path / "a.txt")) == 2400


def test_bad_data_paths_are_usage_errors(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        load_tokens(tmp_path / "missing")
    with pytest.raises(UsageError, match="holds no files"):
        load_tokens(tmp_path)
    (tmp_path / "x.bin").write_bytes(b"\0" * 10)
    with pytest.raises(UsageError, match="holds no text"):
        load_tokens(tmp_path)
    (tmp_path / "small.txt").write_text("tiny")
    with pytest.raises(UsageError, match="fewer than one global batch"):
        TokenBatches(load_tokens(tmp_path / "small.txt"), BatchPlan(seq_len=8, micro_batch=1))
