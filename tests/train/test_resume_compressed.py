"""Exact resume of runs whose DP ranks each keep their own state: local SGD, Top-K and int8 (error feedback).

Under local SGD, sign and Top-K every DP rank steps Adam on its own gradients, so each holds its own moments;
int8 keeps each rank's error-feedback residuals (the worker's and the second phase's). A checkpoint saves
them per DP rank, and a resume at the same layout must reproduce the uninterrupted losses bit for bit.

One 4-process launch (shared with test_resume.py: ``resume_jobs`` in conftest.py) runs, per method, the
uninterrupted run (saving a series at step 2) and the run resumed from it, then the Top-K checkpoint at another
layout (its per-rank state dropped, with one warning line).
Without processes: the per-rank files' round trip and checksums; on two gloo ranks: ZeRO 0's int8/fp16
reducer rebuilt from its state.
"""

import json

import pytest
import torch
from multiproc import run_ranks
from resume_cases import COMPRESSED_STEPS as STEPS
from resume_cases import METHODS, SAVED

from megakit.errors import UsageError
from megakit.interop.checkpoint import load_rank_state, save_checkpoint
from megakit.nn.model import ModelConfig, Transformer
from megakit.train.resilience.resume import choose_checkpoint


@pytest.fixture(scope="module")
def runs(resume_jobs):
    job = resume_jobs["test_resume_compressed"]
    return job["tmp"], job["results"], job["stdout"]


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
def test_a_resume_at_the_same_layout_reproduces_the_losses_bitwise(runs, method):
    _, results, _ = runs
    index = 2 * list(METHODS).index(method)
    full, resumed = results[index]["loss"], results[index + 1]["loss"]
    assert len(full) == STEPS and len(resumed) == STEPS - SAVED
    assert resumed == full[SAVED:], (method, resumed, full[SAVED:])  # exact float equality


@pytest.mark.slow
def test_per_rank_state_is_saved_per_dp_rank_and_dropped_at_another_layout_with_one_warning(runs):
    tmp, results, stdout = runs
    for name, wanted in (("local-sgd", "optimizer/exp_avg/"), ("topk", "optimizer/exp_avg_sq/"), ("int8", "residual/")):
        manifest = json.loads((tmp / name / f"step-{SAVED:07d}" / "manifest.json").read_text())
        files = manifest["per_rank"]["files"]
        assert files and all(
            any(t.startswith(wanted) for t in f["tensors"])
            for f in files.values()
            if f["dp"] > 0 or wanted == "residual/"
        ), (name, files)
    warnings = [line for line in stdout.splitlines() if "per-DP-rank state" in line]
    assert len(warnings) == 1 and "DP rank 0's" in warnings[0], warnings
    assert len(results[-1]["loss"]) == STEPS - SAVED  # the resharded run trains on


def test_per_rank_files_round_trip_and_are_checksummed(tmp_path):
    """A rank's own tensors come back bitwise; a flipped byte in its file makes the checkpoint damaged (a series
    then resumes from the one before) and its load one clear error naming the file."""
    config = ModelConfig.load("gpt-tiny")
    model, own = (
        Transformer(config, seed=1),
        {"residual/residual": torch.randn(1000), "residual/sizes": torch.arange(3)},
    )
    for step in (2, 4):
        save_checkpoint(
            tmp_path / f"step-{step:07d}", model, step=step, config=config, rank_state=own, rank_key={"dp": 2}
        )
    newest = tmp_path / "step-0000004"
    assert json.loads((newest / "manifest.json").read_text())["per_rank"]["key"] == {"dp": 2}
    back = load_rank_state(newest)
    assert back.keys() == own.keys() and all(torch.equal(back[k], own[k]) for k in own)
    rank_file = newest / "rank-pp00-tp00-dp00.safetensors"
    data = bytearray(rank_file.read_bytes())
    data[-3] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    said = []
    assert choose_checkpoint(str(tmp_path), say=said.append) == tmp_path / "step-0000002"
    assert "skipping damaged checkpoint" in said[0] and rank_file.name in said[0], said
    with pytest.raises(UsageError, match="rank-pp00-tp00-dp00.safetensors fails its checksum"):
        load_rank_state(newest)


def _reduce_resumed(rank, world, specs, rounds, cut):
    """Per spec, each rank reduces a new gradient every round; from round ``cut`` on, through a reducer rebuilt
    from the first one's ``state()`` (what a checkpoint holds). Returns both runs' outputs per spec and round."""
    import torch

    from megakit.core.compression import parse_compression
    from megakit.nn import comm
    from megakit.nn.compression import GradientReducer

    shapes = [(37, 29), (1000,), (3,)]
    grads = [
        [torch.randn(s, generator=torch.Generator().manual_seed(1000 * r + rank)) for s in shapes]
        for r in range(rounds)
    ]
    outs = {}
    for spec, run in ((spec, run) for spec in specs for run in ("full", "resumed")):
        reducer = GradientReducer(parse_compression(spec), comm.WORLD)
        got = outs.setdefault(spec, {}).setdefault(run, [])
        for r, local in enumerate(grads):
            if run == "resumed" and r == cut:
                saved = {k: t.clone() for k, t in reducer.state().items()}
                reducer = GradientReducer(parse_compression(spec), comm.WORLD)
                reducer.load_state(saved)
            step = [g.clone() for g in local]
            reducer.reduce(step)
            got.append(torch.cat([g.reshape(-1) for g in step]).tolist())
    return outs


def test_a_gradient_reducer_rebuilt_from_its_state_continues_bitwise():
    """ZeRO 0's int8 and fp16 path (the launcher case above compresses ZeRO-1's buckets): the worker's residual
    and the second phase's (int8) carry over exactly, so the rounds after the cut are the uninterrupted ones."""
    for outs in run_ranks(_reduce_resumed, 2, ["int8", "fp16"], 4, 2):
        for spec, runs in outs.items():
            assert runs["resumed"] == runs["full"], spec
