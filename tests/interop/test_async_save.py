"""``--async-save``: the step waits for the host copy only; a kill -9 during the background write leaves the previous
checkpoint in place, and the series loader takes it.

A child process saves a real model in a ``--keep`` series through ``AsyncWriter``: the first save's write is held
until the model has been changed (so it must have written its host copy, not the live weights); the second's
write stops half-way (shards written, no manifest, no rename) and the child, whose main thread went on, is killed
with SIGKILL there.
"""

import os
import signal
import subprocess
import sys
import time

import torch
from paths import ROOT

CHILD = r"""
import sys, threading, time
from pathlib import Path
import torch
from megakit.interop import checkpoint_split
from megakit.interop.checkpoint import stage_checkpoint
from megakit.interop.checkpoint_async import AsyncWriter
from megakit.nn.model import ModelConfig, Transformer
from megakit.train.resilience.resume import publish_in_series

torch.set_num_threads(1)
root = Path(sys.argv[1])
config = ModelConfig.load("gpt-tiny")
model = Transformer(config, seed=0)
changed = threading.Event()
real_write = checkpoint_split.write_tensors

def write_tensors(path, tensors):  # the injected slow write
    if "step-0000001" in str(path):
        changed.wait()  # not before the trainer has changed the weights
    out = real_write(path, tensors)
    if "step-0000002" in str(path):
        (root / "writing").touch()
        time.sleep(600)  # killed here, half-way through the checkpoint
    return out

checkpoint_split.write_tensors = write_tensors
writer = AsyncWriter(None)

def save(step):
    target = root / f"step-{step:07d}"
    staged = stage_checkpoint(target, model, step=step, config=config, copy=writer.buffers.copy)
    writer.submit(staged, then=lambda: publish_in_series(root, target, keep=2))

save(1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(1.0)  # the next step, while the write runs
changed.set()
writer.wait()
save(2)
(root / "went-on").touch()  # the step was not held by the write
time.sleep(600)
"""


def test_a_kill_during_the_background_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    from megakit.interop.checkpoint import load_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.resilience.resume import choose_checkpoint

    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not ((tmp_path / "writing").exists() and (tmp_path / "went-on").exists()):
            assert child.poll() is None, child.stdout.read()
            assert time.monotonic() < deadline, "the child never reached the second write"
            time.sleep(0.2)
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()
    half = [p for p in tmp_path.iterdir() if p.name.startswith("step-0000002")]
    assert len(half) == 1 and ".tmp-" in half[0].name and not (half[0] / "manifest.json").exists(), half
    assert any(half[0].glob("*.safetensors"))  # killed mid-checkpoint: shards written, nothing published
    assert (tmp_path / "latest").read_text().strip() == "step-0000001"
    said = []
    chosen = choose_checkpoint(str(tmp_path), say=said.append)
    assert chosen == tmp_path / "step-0000001", said
    config = ModelConfig.load("gpt-tiny")
    loaded, original = Transformer(config, seed=5), Transformer(config, seed=0)
    load_checkpoint(chosen, loaded)
    for (name, got), want in zip(loaded.named_parameters(), original.parameters()):  # the host copy, not the
        assert torch.equal(got, want), name  # weights changed after it
