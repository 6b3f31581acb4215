"""``--loss-chunks``: the head and loss over token chunks give the unchunked model's loss and gradients.

fp32; in process, plus one gloo spawn at TP 2 (with and without sequence parallelism, a padded vocab shard,
ignored labels) against the TP = 1 model. Chunking changes only the order in which the tokens' losses and the
head weight's gradient are summed, so the loss and each gradient are compared within fp32 rounding of their own
magnitude over that many tokens (``tolerance.fp32_bound``); a chunk left out or scaled wrongly moves them by
whole percents.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_ranks
from tolerance import assert_fp32_close, grad_scale

from megakit.errors import UsageError
from megakit.nn.model import ModelConfig, Transformer, full_state_dict
from megakit.nn.pipeline import split_backward
from megakit.nn.tensor_parallel.chunked_loss import chunked_head_loss
from megakit.nn.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def _batch(vocab: int, seed: int = 0, shape=(2, 16)):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, shape, generator=gen)
    labels = torch.randint(0, vocab, shape, generator=gen)
    labels[0, :3] = -100  # ignored tokens are left out of the mean
    return ids, labels


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_close(got: dict, want: dict, what: str, *, terms: int) -> float:
    """Every gradient within fp32 rounding of the whole gradient's norm; the worst share of the bound used."""
    assert got.keys() == want.keys()
    scale = grad_scale(want)
    return max(assert_fp32_close(got[n], want[n], terms=terms, scale=scale, what=f"{what}: {n}") for n in want)


def test_the_function_equals_the_unchunked_loss_and_gradients():
    gen = torch.Generator().manual_seed(1)
    h = torch.randn(13, 8, generator=gen, requires_grad=True)
    w = torch.randn(40, 8, generator=gen, requires_grad=True)
    target = torch.randint(0, 37, (13,), generator=gen)  # columns 37..39: padding, never counted
    target[2] = -100
    want = vocab_parallel_cross_entropy(F.linear(h, w), target, vocab_size=37, reduction="sum")
    want.backward()
    ref = (h.grad.clone(), w.grad.clone())
    for chunks in (1, 2, 5, 13, 20):  # 20 > tokens: empty chunks are skipped
        h.grad = w.grad = None
        got = chunked_head_loss(h, w, target, chunks=chunks, vocab_size=37)
        (got * 3).backward()  # the incoming gradient scales both
        assert_fp32_close(got.item(), want.item(), terms=13, what=f"loss, {chunks} chunks")  # summed over 13 tokens
        assert_fp32_close(h.grad, 3 * ref[0], terms=37, what=f"dh, {chunks} chunks")  # one GEMM over the vocab
        assert_fp32_close(w.grad, 3 * ref[1], terms=13, what=f"dW, {chunks} chunks")  # summed over the tokens
    with torch.no_grad():  # evaluation: the loss only, no gradient computed or kept
        assert_fp32_close(chunked_head_loss(h, w, target, chunks=4, vocab_size=37).item(), want.item(), terms=13)
    with pytest.raises(ValueError, match="chunks must be at least 1"):
        chunked_head_loss(h, w, target, chunks=0, vocab_size=37)


@pytest.mark.parametrize("preset", ["gpt-tiny", "llama-tiny"])  # tied and untied head
def test_model_with_loss_chunks_equals_the_unchunked_model(preset):
    config = ModelConfig.load(preset).replace(vocab_size=250)
    ids, labels = _batch(250)
    ref, chunked = Transformer(config, seed=4), Transformer(config, seed=4, loss_chunks=3)
    loss_ref, loss = ref(ids, labels), chunked(ids, labels)
    loss_ref.backward()
    loss.backward()
    tokens = ids.numel()
    assert_fp32_close(loss.item(), loss_ref.item(), terms=tokens, what="loss")
    _assert_close(_grads(chunked), _grads(ref), preset, terms=tokens)
    with torch.no_grad():  # evaluation and the logits path (generate) are unchanged
        assert_fp32_close(chunked.eval()(ids, labels).item(), ref.eval()(ids, labels).item(), terms=tokens)
        assert torch.equal(chunked(ids), ref(ids))
    with pytest.raises(UsageError, match="loss_chunks must be at least 1"):
        Transformer(config, loss_chunks=0)


def test_last_pipeline_stage_under_zero_bubble_split_backward():
    """A last stage (hidden in, loss out) with B and W split: the deferred W reruns the chunked backward."""
    config = ModelConfig.load("llama-tiny")
    x = torch.randn(16, 2, config.hidden, generator=torch.Generator().manual_seed(2))
    _, labels = _batch(config.vocab_size)
    ref = Transformer(config, layers=range(2, 4), pre=False, seed=5)
    x_ref = x.clone().requires_grad_()
    ref(x_ref, labels).backward()
    stage = Transformer(config, layers=range(2, 4), pre=False, seed=5, loss_chunks=4)
    x_in = x.clone().requires_grad_()
    dx, deferred = split_backward.backward_input(stage, x_in, stage(x_in, labels), None)
    assert all(p.grad is None for p in stage.parameters())
    split_backward.backward_weight(stage, deferred)
    assert_fp32_close(dx, x_ref.grad, terms=x.shape[0] * x.shape[1], what="dx")
    _assert_close(_grads(stage), _grads(ref), "zero bubble", terms=x.shape[0] * x.shape[1])


def _tp_worker(rank: int, world_size: int) -> float:
    from megakit.nn.topology import Topology

    topo = Topology.from_world(tp=world_size)
    worst = 0.0
    for preset, sp in (("gpt-tiny", True), ("llama-tiny", False)):
        config = ModelConfig.load(preset).replace(vocab_size=253)  # the last rank's shard has padded rows
        ids, labels = _batch(253, seed=rank * 0 + 7)
        ref = Transformer(config, seed=6)
        ref(ids, labels).backward()
        model = Transformer(config, topo, seed=6, sequence_parallel=sp, loss_chunks=5)
        loss = model(ids, labels)
        loss.backward()
        assert_fp32_close(loss.item(), ref(ids, labels).item(), terms=ids.numel(), what=f"{preset} tp2 loss")
        worst = max(
            worst,
            _assert_close(full_state_dict(model, topo, grads=True), _grads(ref), f"{preset} tp2", terms=ids.numel()),
        )
    return worst


def test_tp2_with_loss_chunks_matches_single_process():
    worst = run_ranks(_tp_worker, 2)
    assert max(worst) <= 1.0  # each rank's worst gradient, as a share of its fp32 bound


def test_planner_logits_item_follows_the_chunk_count():
    """TinyLlama at seq 2048 x 4 (1 GiB of fp32 logits): auto picks 4 chunks; the item shrinks to the norm's input,
    the head input's gradient, the head weight's fp32 gradient and one chunk's logits."""
    from megakit.core.planner.activations import auto_loss_chunks, parse_loss_chunks
    from megakit.core.planner.memory import estimate_memory
    from megakit.core.planner.model_spec import ModelSpec

    spec = ModelSpec.from_config("tinyllama-1.1b")
    one, auto = (estimate_memory(spec, micro_batch=4, seq_len=2048, loss_chunks=k).items["logits"] for k in (1, 0))
    assert auto_loss_chunks(4 * 2048, spec.padded_vocab(1)) == 4 and auto_loss_chunks(64, 256) == 1
    assert one / auto > 2.5, (one, auto)
    assert estimate_memory(spec, micro_batch=4, seq_len=2048, loss_chunks=4).items["logits"] == auto
    assert parse_loss_chunks("auto") == 0 and parse_loss_chunks("8") == 8
    for bad in ("0", "-2", "many"):
        with pytest.raises(UsageError, match=f"--loss-chunks {bad}: give a count of at least 1"):
            parse_loss_chunks(bad)
