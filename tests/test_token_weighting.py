"""The step's loss is sum(loss x mask) / sum(mask) over the whole global batch, at every layout.

Data: prepared shards with a loss mask whose windows keep 0 %, 5 %, 30 % or all of their labels (counts
varying over 20x, whole micro-batches masked out). In process: the loader's labels follow the mask, the
model's token-weighted loss is the global sum over the global count (0, not NaN, for a micro-batch with no
valid token), and the mean of per-micro-batch means it replaces is far from it on this data. Through the
launcher, one job of 2 processes: DP 2 x GA 2, TP 2 x GA 4, PP 2 (4 micro-batches), CP 2 and ZeRO-3 each follow
the single process's sum/sum run (``train.doctor.reference``) step by step, and the step's gradient norm too; so do
packed documents (``--reset-attention-mask --reset-position-ids --eod-mask-loss``) at CP 2, PP 2 (GPT-2's learned
positions), TP 2 with SP, EP 2 (an MoE model), and in a job of 4 at TP 2 x CP 2 and CP 2 x PP 2.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from test_trainer import ds_config, sweep
from tolerance import fp32_bound

from megakit.errors import UsageError

SEQ = 32
KEEP = (0.0, 0.05, 0.3, 1.0)  # the share of a window's labels its mask keeps, cycling over the windows


def _mask_shards(directory: Path, seed: int = 0) -> None:
    """Give every shard of a prepared directory a loss mask, window by window (as chat data's would be)."""
    from megakit.interop.token_shards import read_index, write_index

    index, gen = read_index(directory), np.random.default_rng(seed)
    for entries in index["splits"].values():
        for entry in entries:
            n = entry["tokens"]
            keep = np.array([KEEP[(i // SEQ) % len(KEEP)] for i in range(n)])  # window w = tokens w*SEQ+1 .. (w+1)*SEQ
            mask = (gen.random(n) < keep).astype(np.uint8)
            name = entry["file"][:-4] + ".mask"
            (directory / name).write_bytes(mask.tobytes())
            entry.update(mask_file=name, mask_sha256=hashlib.sha256(mask.tobytes()).hexdigest())
    write_index(directory, {k: v for k, v in index.items() if k not in ("format", "version")})


def _short_documents(tmp_path_factory) -> str:
    """Standard-library lines as 1-8-line documents (a few to ~100 tokens): most windows hold a document boundary."""
    from megakit.interop.prepare_data import PrepareConfig, prepare
    from megakit.train.data.batches import stdlib_files

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


@pytest.fixture(scope="module")
def masked(tmp_path_factory) -> str:
    data = _short_documents(tmp_path_factory)
    _mask_shards(Path(data))
    return data


def test_the_loader_masks_labels_and_a_truncated_mask_is_one_line(masked, tmp_path):
    from megakit.interop.token_shards import open_shards
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus

    corpus = open_corpus(masked)
    assert corpus.train_masks is not None and corpus.validation_masks is not None
    batches = TokenBatches(corpus.train, BatchPlan(seq_len=SEQ, micro_batch=4), corpus.train_masks)
    plain = TokenBatches(corpus.train, BatchPlan(seq_len=SEQ, micro_batch=4))
    for step in range(3):
        (x, y), (x0, y0) = batches.global_batch(step), plain.global_batch(step)
        assert torch.equal(x, x0)  # inputs are the stream's, masked or not
        for row, sample in enumerate(batches.global_indices(step).tolist()):  # brute force: the mask of each target
            mask = np.asarray(corpus.train_masks[0][sample * SEQ + 1 : (sample + 1) * SEQ + 1])
            assert torch.equal(y[row], torch.where(torch.from_numpy(mask == 1), y0[row], -100))
    counts = [int((batches.global_batch(s)[1][r] != -100).sum()) for s in range(4) for r in range(4)]
    assert 0 in counts and max(counts) >= 20 * max(min(c for c in counts if c), 1) / 2, counts
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(masked).iterdir():
        (broken / f.name).write_bytes(f.read_bytes()[:-1] if f.name == "train-00000.mask" else f.read_bytes())
    with pytest.raises(UsageError, match=r"train-00000.mask is truncated"):
        open_shards(broken)


def test_the_weighted_loss_is_the_global_sum_over_the_global_count(masked):
    """Four micro-batches, one with no valid token: their weighted losses add up to sum/sum, and its gradient is
    that of sum/sum; the mean of means is off by whole percents on this data."""
    from megakit.nn.model import ModelConfig, Transformer, set_loss_tokens
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus

    corpus = open_corpus(masked)
    config = ModelConfig.load("llama-tiny").replace(vocab_size=corpus.vocab_size)
    batches = TokenBatches(corpus.train, BatchPlan(seq_len=SEQ, micro_batch=1, accumulation=4), corpus.train_masks)
    step = next(s for s in range(50) if any((y == -100).all() for _, y in batches.micro_batches(s, 0)))
    micro = batches.micro_batches(step, 0)
    x, y = torch.cat([a for a, _ in micro]), torch.cat([b for _, b in micro])
    whole = Transformer(config, seed=1)
    whole(x, y).backward()  # one batch: its own sum over its own count
    want = {n: p.grad.clone() for n, p in whole.named_parameters()}
    model = Transformer(config, seed=1)
    tokens = int((y != -100).sum())
    set_loss_tokens(model, float(tokens))
    losses = [model(a, b) for a, b in micro]
    for loss in losses:
        loss.backward()
    empty = next(loss for loss, (_, b) in zip(losses, micro) if (b == -100).all())
    assert empty.item() == 0.0  # no valid token: nothing, not NaN
    weighted = sum(loss.item() for loss in losses)
    assert abs(weighted - whole(x, y).item()) <= fp32_bound(weighted, tokens)
    scale = max(g.abs().max().item() for g in want.values())
    for name, p in model.named_parameters():
        assert (p.grad - want[name]).abs().max().item() <= fp32_bound(scale, tokens), name
    set_loss_tokens(model, None)
    means = [model(a, b).item() for a, b in micro if (b != -100).any()]
    assert abs(sum(means) / len(micro) - weighted) > 0.01 * weighted  # what DeepSpeed's averages gave before


DOCUMENTS = dict(reset_attention_mask=True, reset_position_ids=True, eod_mask_loss=True)
MTP_MODEL = "deepseek-v3-tiny"  # one MTP module (num_nextn_predict_layers 1), trained with --mtp
CASES = {
    "dp2-ga2": dict(zero=1, accumulation=2),
    "tp2-ga4": dict(zero=1, accumulation=4, tp=2),
    "pp2-4mb": dict(zero=1, accumulation=4, pp=2),
    "cp2": dict(zero=1, accumulation=2, cp=2),
    "zero3": dict(zero=3, accumulation=2),
    # packed documents on top: the mask, restarted positions and no loss on the end-of-document token
    "cp2-documents": dict(zero=1, accumulation=2, cp=2, **DOCUMENTS),
    "pp2-documents": dict(zero=1, accumulation=4, pp=2, model="gpt-tiny", **DOCUMENTS),
    "tp2-sp-documents": dict(zero=1, accumulation=2, tp=2, sequence_parallel=True, **DOCUMENTS),
    "ep2-moe-documents": dict(zero=1, accumulation=2, ep=2, model="moe-tiny", **DOCUMENTS),
    "a2a2-documents": dict(zero=1, accumulation=2, cp=2, cp_mode="a2a", **DOCUMENTS),  # Ulysses
    # DeepSeek-V3's MTP module on the last stage: each depth's tokens counted apart, the embedding's two copies
    "pp2-mtp-documents": dict(zero=1, accumulation=4, pp=2, model=MTP_MODEL, mtp=True, mtp_weight=0.3, **DOCUMENTS),
    # and the MTP module's MoE block with its experts over EP 2, and under ZeRO 3
    "ep2-mtp-documents": dict(zero=1, accumulation=2, ep=2, model=MTP_MODEL, mtp=True, **DOCUMENTS),
    "zero3-mtp": dict(zero=3, accumulation=2, model=MTP_MODEL, mtp=True),
}
CASES4 = {
    "tp2-cp2-documents": dict(zero=1, accumulation=2, tp=2, cp=2, **DOCUMENTS),
    "tp2-a2a2-documents": dict(zero=2, accumulation=2, tp=2, cp=2, cp_mode="a2a", **DOCUMENTS),
    # EP 4 folded over TP 2 x DP 2 with packed documents; Ulysses under a pipeline
    "tp2-ep4-moe-documents": dict(
        zero=1, accumulation=2, tp=2, ep=4, sequence_parallel=True, model="moe-tiny", **DOCUMENTS
    ),
    "a2a2-pp2-documents": dict(zero=1, accumulation=2, cp=2, cp_mode="a2a", pp=2, **DOCUMENTS),
    "cp2-pp2-documents": dict(zero=1, accumulation=2, cp=2, pp=2, **DOCUMENTS),
    # hybrid CP 4: an all-to-all inside CP ranks {0, 1} and {2, 3}, a ring of 2 across them
    "hybrid2x2-documents": dict(zero=1, accumulation=2, cp=4, cp_mode="hybrid", cp_a2a=2, **DOCUMENTS),
    # MTP's targets cut before the CP split, and its loss weighted over GA 2 x DP 2 x CP 2 like the main loss
    "cp2-dp2-mtp-documents": dict(zero=1, accumulation=2, cp=2, model=MTP_MODEL, mtp=True, **DOCUMENTS),
}


def _cases(specs: dict, data: str) -> list[dict]:
    cases = []
    for spec in specs.values():
        spec = dict(spec)
        config = ds_config(spec.pop("zero"), micro=1, accumulation=spec.pop("accumulation"))
        config["optimizer"]["params"]["eps"] = 1e-4  # no near-ties in Adam's first steps (see test_trainer.sync_cases)
        cases.append(
            dict(
                ds_config=config,
                model=spec.pop("model", "llama-tiny"),
                steps=3,
                seq_len=SEQ,
                data=data,
                eval_every=3,
                eval_batches=2,
                **spec,
            )
        )
    return cases


@pytest.mark.slow
def test_every_layout_trains_sum_over_sum_as_one_process(masked, tmp_path_factory):
    from megakit.train.doctor.reference import reference_run

    for world, specs in ((2, CASES), (4, CASES4)):
        cases = _cases(specs, masked)
        for (name, spec), case, got in zip(specs.items(), cases, sweep(tmp_path_factory, world, cases), strict=True):
            _check_against_one_process(name, spec, case, got, world, reference_run)


def _check_against_one_process(name, spec, case, got, world, reference_run) -> None:
    """Every step's loss, the first gradient norm and the validation loss against one process's sum/sum run."""
    dp = world // (spec.get("tp", 1) * spec.get("pp", 1) * spec.get("cp", 1))
    want = reference_run(
        case["ds_config"],
        model=case["model"],
        steps=case["steps"],
        dp=dp,
        seq_len=SEQ,
        data=case["data"],
        eval_every=3,
        eval_batches=2,
        documents={k: v for k, v in spec.items() if k in DOCUMENTS},
        mtp={k: v for k, v in spec.items() if k.startswith("mtp")},
    )
    for step, (a, b) in enumerate(zip(got["loss"], want["loss"], strict=True)):
        assert abs(a - b) <= fp32_bound(b, 2 * 4 * SEQ), (name, step, a, b)  # the step's tokens, at most
    for step, (a, b) in enumerate(zip(got["mtp"], want["mtp"], strict=True)):  # each depth's own loss, logged
        assert (a is None) == (b is None) and all(
            abs(x - y) <= fp32_bound(y, 2 * 4 * SEQ) for x, y in zip(a or [], b or [], strict=True)
        ), (name, step, a, b)
    a, b = got["grad_norm"][0], want["grad_norm"][0]  # the first step's gradient, before clipping
    assert abs(a - b) <= 1e-4 * b, (name, a, b)
    (ea,), (eb,) = got["evals"], want["evals"]
    assert abs(ea["loss"] - eb["loss"]) <= fp32_bound(eb["loss"], 2 * 2 * SEQ), (name, ea, eb)
    if "reset_attention_mask" in spec:  # and the documents change the run: the comparison can fail
        plain = reference_run(
            case["ds_config"], model=case["model"], steps=case["steps"], dp=dp, seq_len=SEQ, data=case["data"]
        )
        gap = max(abs(a - b) for a, b in zip(plain["loss"], want["loss"]))
        assert gap > fp32_bound(max(want["loss"]), 2 * 4 * SEQ), (name, gap)  # past the tolerance above
