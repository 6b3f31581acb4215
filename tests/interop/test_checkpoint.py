"""Checkpoints on real gloo processes: save at one TP x PP layout, load at another, export to transformers.

One 4-process spawn sweeps every multi-process case (process start-up dominates); the
single-process halves run in the test process. Weights are compared exactly (a checkpoint
copies bits), losses to fp32 rounding. Vocab 253 needs padding at TP = 2 and TP = 4, so
resharding must trim and re-pad it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from multiproc import run_ranks
from paths import ROOT

from megakit.errors import UsageError
from megakit.interop.checkpoint import load_checkpoint, save_checkpoint
from megakit.nn.model import ModelConfig, Transformer, full_state_dict

CASES = [("gpt-tiny", 253), ("llama-tiny", 253)]  # tied (gpt2) and untied (llama) embeddings
SAVE_SEED, LOAD_SEED = 7, 99  # loads go into differently-initialised models


def _config(preset: str, vocab: int) -> ModelConfig:
    return ModelConfig.load(preset).replace(vocab_size=vocab)


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, vocab, (2, 16), generator=gen), torch.randint(0, vocab, (2, 16), generator=gen)


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _pipeline_loss(stage, topo, ids, labels) -> float | None:
    """Two-stage forward by hand: stage 0 sends its hidden state ``(S, B, H)`` to stage 1."""
    import torch.distributed as dist

    with torch.no_grad():
        if topo.is_first_stage:
            dist.send(stage(ids).contiguous(), topo.next_rank)
            return None
        h = torch.empty(ids.shape[1], ids.shape[0], stage.config.hidden)
        dist.recv(h, topo.prev_rank)
        return stage(h, labels).item()


def _numpy(state: dict) -> dict:
    """Plain arrays cross the result queue (tensors would go through shared memory the child frees)."""
    return {k: v.numpy() for k, v in state.items()}


def _errors(fn) -> str | None:
    try:
        fn()
    except (UsageError, RuntimeError, OSError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _worker(rank, world_size, root):
    import torch.distributed as dist

    import megakit.interop.checkpoint as ckpt
    from megakit.core.layout import Layout
    from megakit.nn.model import build_stage_chunks
    from megakit.nn.topology import Topology

    root = Path(root)
    topo22, topo4, topo2x2 = (Topology(Layout(tp=2, pp=2)), Topology(Layout(tp=4)), Topology(Layout(tp=2, dp=2)))
    out = {}
    for preset, vocab in CASES:
        config, d = _config(preset, vocab), root / preset
        ids, labels = _batch(vocab)
        (stage,) = build_stage_chunks(config, topo22, seed=SAVE_SEED)
        save_checkpoint(d / "tp2pp2", stage, topo22, step=3, config=config, extra={"preset": preset})
        # TP = 2 x PP = 2 -> TP = 4
        m4 = Transformer(config, topo4, seed=LOAD_SEED).eval()
        loaded = load_checkpoint(d / "tp2pp2", m4, topo4)
        pad = m4.embed.weight[vocab - rank * m4.embed.weight.shape[0] :] if rank == 3 else None
        with torch.no_grad():
            loss4 = m4(ids, labels).item()
        # TP = 1 (saved by the test process) -> TP = 2 x PP = 2
        (s22,) = build_stage_chunks(config, topo22, seed=LOAD_SEED)
        s22.eval()
        load_checkpoint(d / "tp1", s22, topo22)
        # PP = 2 with two interleaved chunks per rank -> loaded at TP = 1 below
        chunks = build_stage_chunks(config, topo22, vpp=2, seed=SAVE_SEED)  # as a list, or as one engine holds them
        chunks = chunks if preset == "llama-tiny" else torch.nn.ModuleList(chunks)
        save_checkpoint(d / "vpp2", chunks, topo22, step=6, config=config)
        # TP = 2 x DP = 2: DP replica 1 holds the same weights and writes nothing
        save_checkpoint(d / "tp2dp2", Transformer(config, topo2x2, seed=SAVE_SEED), topo2x2, step=4, config=config)
        out[preset] = {
            "loaded": tuple(loaded),
            "w4": _numpy(full_state_dict(m4, topo4)),
            "loss4": loss4,
            "pad_zero": None if pad is None else bool((pad == 0).all()) and pad.shape[0] == 3,
            "w22": _numpy(full_state_dict(s22, topo22)),
            "loss22": _pipeline_loss(s22, topo22, ids, labels),
        }

    # Failures: raised on every rank, nothing half-written, the old checkpoint intact.
    config, d = _config(*CASES[0]), root / CASES[0][0]
    (stage,) = build_stage_chunks(config, topo22, seed=LOAD_SEED)
    publish, write_shard = ckpt._publish, ckpt.write_shard
    if rank == 0:

        def crash(tmp, target):
            raise RuntimeError("injected crash after every shard was written, before the rename")

        ckpt._publish = crash
    out["crash_before_rename"] = _errors(lambda: save_checkpoint(d / "tp2pp2", stage, topo22, step=9, config=config))
    if rank == 3:

        def disk_full(*args, **kwargs):
            raise OSError("injected: no space left on device")

        ckpt.write_shard = disk_full
    out["write_fails_on_rank_3"] = _errors(lambda: save_checkpoint(d / "tp2pp2", stage, topo22, step=10, config=config))
    ckpt._publish, ckpt.write_shard = publish, write_shard
    out["after_failures"] = tuple(load_checkpoint(d / "tp2pp2", stage, topo22))
    out["leftovers"] = sorted(p.name for p in d.iterdir() if ".tmp-" in p.name or ".old-" in p.name)
    if rank == 0:
        shutil.copytree(d / "tp2pp2", d / "corrupt")
        _flip_byte(d / "corrupt" / "model-pp01-tp01.safetensors")
    dist.barrier()
    out["corrupt"] = _errors(lambda: load_checkpoint(d / "corrupt", stage, topo22))

    # ZeRO-3 partitions each TP shard over DP: save gathers it (every DP rank takes part).
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the running process group
    config = _config(*CASES[1])
    model = Transformer(config, topo2x2, seed=SAVE_SEED)
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=ds_config, mpu=topo2x2
    )
    out["zero3_partitioned"] = model.embed.weight.numel() == 0
    save_checkpoint(root / "zero3", model, topo2x2, step=5, config=config)
    out["zero3_load"] = _errors(lambda: load_checkpoint(root / "zero3", model, topo2x2))
    return out


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    for preset, vocab in CASES:
        config = _config(preset, vocab)
        save_checkpoint(root / preset / "tp1", Transformer(config, seed=SAVE_SEED), step=1, config=config)
    return root, run_ranks(_worker, 4, str(root))


@pytest.mark.parametrize("preset,vocab", CASES)
def test_tp2pp2_loads_at_tp1_and_tp4(spawned, preset, vocab):
    root, results = spawned
    config, ids, labels = _config(preset, vocab), *_batch(vocab)
    ref = Transformer(config, seed=SAVE_SEED).eval()
    want = full_state_dict(ref)
    one = Transformer(config, seed=LOAD_SEED).eval()
    assert load_checkpoint(root / preset / "tp2pp2", one) == (3, {"preset": preset})
    assert all(r[preset]["loaded"] == (3, {"preset": preset}) for r in results)
    got1 = full_state_dict(one)
    got4 = {k: torch.from_numpy(v) for k, v in results[0][preset]["w4"].items()}
    assert got1.keys() == got4.keys() == want.keys()
    for name in want:
        assert torch.equal(got1[name], want[name]) and torch.equal(got4[name], want[name]), name
    assert results[3][preset]["pad_zero"]  # TP=4 pads vocab 253 to 256 with zero rows
    with torch.no_grad():
        want_loss = ref(ids, labels).item()
        assert one(ids, labels).item() == want_loss
    assert all(r[preset]["loss4"] == pytest.approx(want_loss, rel=1e-6) for r in results)
    manifest = json.loads((root / preset / "tp2pp2" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == [f"model-pp0{p}-tp0{t}.safetensors" for p in (0, 1) for t in (0, 1)]
    embed = manifest["params"]["embed.weight"]
    assert embed["shape"] == [vocab, config.hidden]  # padding trimmed; the tied copy on stage 1 is not written
    assert [(s["file"], s["start"], s["stop"]) for s in embed["slices"]] == [
        ("model-pp00-tp00.safetensors", 0, 127),
        ("model-pp00-tp01.safetensors", 127, 253),
    ]


@pytest.mark.parametrize("preset,vocab", CASES)
def test_tp1_loads_at_tp2pp2(spawned, preset, vocab):
    root, results = spawned
    config, ids, labels = _config(preset, vocab), *_batch(vocab)
    ref = Transformer(config, seed=SAVE_SEED).eval()
    want = full_state_dict(ref)
    seen = {}
    for r in results:  # each stage holds a subset of the names; the tied embedding is on both stages
        for name, tensor in r[preset]["w22"].items():
            assert torch.equal(torch.from_numpy(tensor), want[name]), name
            seen[name] = True
    assert seen.keys() == want.keys()
    with torch.no_grad():
        assert results[3][preset]["loss22"] == pytest.approx(ref(ids, labels).item(), rel=1e-6)
    vpp = Transformer(config, seed=LOAD_SEED)
    assert load_checkpoint(root / preset / "vpp2", vpp).step == 6
    assert all(torch.equal(t, want[n]) for n, t in full_state_dict(vpp).items())
    manifest = json.loads((root / preset / "tp2dp2" / "manifest.json").read_text())
    assert sorted(manifest["files"]) == ["model-pp00-tp00.safetensors", "model-pp00-tp01.safetensors"]
    assert manifest["layout"] == {"tp": 2, "pp": 1, "dp": 2} and manifest["step"] == 4


def test_failure_on_any_rank_raises_everywhere_and_keeps_the_old_checkpoint(spawned):
    _, results = spawned
    for rank, r in enumerate(results):
        assert "injected crash" in r["crash_before_rename"], (rank, r["crash_before_rename"])
        assert "no space left" in r["write_fails_on_rank_3"], (rank, r["write_fails_on_rank_3"])
        assert r["after_failures"] == (3, {"preset": "gpt-tiny"})  # the step-3 checkpoint survived
        assert r["leftovers"] == []  # no temporary or moved-aside directories
    assert "(on rank 0)" in results[1]["crash_before_rename"]
    assert "(on rank 3)" in results[0]["write_fails_on_rank_3"]


def test_corrupt_byte_names_the_file(spawned, tmp_path):
    root, results = spawned
    for rank, r in enumerate(results):  # only rank 3 reads the file; every rank reports it
        assert (
            r["corrupt"].startswith("UsageError") and "model-pp01-tp01.safetensors fails its checksum" in r["corrupt"]
        ), (rank, r)
    config = _config(*CASES[1])
    model = Transformer(config, seed=SAVE_SEED)
    save_checkpoint(tmp_path / "c", model, step=2, config=config)
    _flip_byte(tmp_path / "c" / "model-pp00-tp00.safetensors")
    with pytest.raises(UsageError, match="model-pp00-tp00.safetensors fails its checksum"):
        load_checkpoint(tmp_path / "c", model)


def test_bad_checkpoints_are_clear_usage_errors(tmp_path):
    config = _config(*CASES[1])
    model = Transformer(config, seed=SAVE_SEED)
    with pytest.raises(UsageError, match="does not exist"):
        load_checkpoint(tmp_path / "nowhere", model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="holds no manifest.json"):
        load_checkpoint(tmp_path / "empty", model)
    save_checkpoint(tmp_path / "ok", model, step=0, config=config)
    with pytest.raises(UsageError, match="different model.*layers 4 vs 2"):
        load_checkpoint(tmp_path / "ok", Transformer(config.replace(layers=2)))
    assert load_checkpoint(tmp_path / "ok", Transformer(config.replace(dropout=0.1))).step == 0  # training setting
    (tmp_path / "ok" / "manifest.json").write_text('{"format": "megakit-checkpoint", "ver')
    with pytest.raises(UsageError, match="manifest.json is corrupt"):
        load_checkpoint(tmp_path / "ok", model)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(UsageError, match="not a megakit checkpoint; refusing to replace it"):
        save_checkpoint(tmp_path / "mine", model, step=0, config=config)
    with pytest.raises(UsageError, match="differs from the model's.*layers 2 vs 4"):
        save_checkpoint(tmp_path / "x", model, step=0, config=config.replace(layers=2))
    with pytest.raises(UsageError, match="JSON-serialisable"):
        save_checkpoint(tmp_path / "x", model, step=0, config=config, extra={"bad": object()})
    assert sorted(os.listdir(tmp_path)) == ["empty", "mine", "ok"]
    # a save killed mid-way: a moved-aside copy is pointed out; a save removes only its own moved-aside copy (another
    # save's temporary, maybe one in progress, is not its to judge): what killed saves left goes under a run's lock
    # (save_dir.remove_leftovers), the moved-aside copy only once the checkpoint is in place again
    from megakit.train.resilience.save_dir import remove_leftovers

    shutil.copytree(tmp_path / "empty", tmp_path / "ok.tmp-dead")
    shutil.move(tmp_path / "ok", tmp_path / "ok.old-dead")
    with pytest.raises(UsageError, match="left .*ok.old-dead; rename that back to ok"):
        load_checkpoint(tmp_path / "ok", model)
    save_checkpoint(tmp_path / "ok", model, step=1, config=config)
    save_checkpoint(tmp_path / "ok", model, step=2, config=config)
    assert sorted(os.listdir(tmp_path)) == ["empty", "mine", "ok", "ok.old-dead", "ok.tmp-dead"]
    said = []
    remove_leftovers(tmp_path / "ok", say=said.append)
    assert sorted(os.listdir(tmp_path)) == ["empty", "mine", "ok"]
    assert said == [f"megakit: removed what saves killed mid-way left in {tmp_path / 'ok'}: ok.tmp-dead, ok.old-dead"]


def test_dtype_is_kept_and_converted_on_load(tmp_path):
    config = _config(*CASES[0])
    half = Transformer(config, seed=SAVE_SEED, dtype=torch.bfloat16)
    save_checkpoint(tmp_path / "bf16", half, step=1, config=config)
    manifest = json.loads((tmp_path / "bf16" / "manifest.json").read_text())
    assert {p["dtype"] for p in manifest["params"].values()} == {"bfloat16"}
    full = Transformer(config, seed=LOAD_SEED)
    load_checkpoint(tmp_path / "bf16", full)
    want = full_state_dict(half)
    assert all(torch.equal(t, want[n].float()) for n, t in full_state_dict(full).items())


@pytest.mark.parametrize("preset,vocab", CASES)
def test_hf_export_matches_transformers(spawned, tmp_path, capsys, preset, vocab):
    """Exported from the TP=2 x PP=2 checkpoint; transformers loads it and gives megakit's logits."""
    import transformers

    from megakit.commands.cli import main

    root, _ = spawned
    out = tmp_path / "hf"
    assert main(["convert", str(root / preset / "tp2pp2"), "--to-hf", str(out)]) == 0
    assert "model.safetensors + config.json" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    ref = Transformer(_config(preset, vocab), seed=SAVE_SEED).eval()
    ids, _ = _batch(vocab)
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, ref(ids), rtol=1e-5, atol=1e-5)
    # sharded form: one file per unit at a tiny shard size, still loadable
    from megakit.interop.hf_export import export_hf

    summary = export_hf(root / preset / "tp2pp2", tmp_path / "sharded", max_shard_bytes=1)
    assert len(summary["files"]) == 1 + ref.config.layers
    sharded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "sharded", attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(sharded(ids).logits, ref(ids), rtol=1e-5, atol=1e-5)
    assert main(["convert", str(root / preset / "tp2pp2"), "--to-hf", str(out)]) == 2  # not over a full directory
    assert "already exists and is not empty" in capsys.readouterr().err


def test_zero3_partitioned_model_saves_whole_shards(spawned):
    root, results = spawned
    assert all(r["zero3_partitioned"] for r in results)  # so saving must have gathered
    assert all("before deepspeed.initialize" in r["zero3_load"] for r in results)
    config = _config(*CASES[1])
    model = Transformer(config, seed=LOAD_SEED)
    assert load_checkpoint(root / "zero3", model).step == 5
    got, want = full_state_dict(model), full_state_dict(Transformer(config, seed=SAVE_SEED))
    assert all(torch.equal(got[n], want[n]) for n in want)


V1 = ROOT / "tests" / "data" / "checkpoint-v1"  # written by megakit's save_checkpoint at format 1


def test_a_version_1_checkpoint_still_loads(tmp_path):
    """A checkpoint of format version 1 (weights only, one sha256 per file; tests/data/checkpoint-v1, written by
    the code before format 2) loads with its stored tensors, and a changed byte is still caught."""
    from safetensors import safe_open

    from megakit.interop.checkpoint_format import manifest_config, read_manifest

    manifest = read_manifest(V1)
    assert manifest["version"] == 1 and all("sha256" in f for f in manifest["files"].values())
    config = manifest_config(manifest)
    model = Transformer(config, seed=LOAD_SEED)
    assert load_checkpoint(V1, model).step == 3
    with safe_open(V1 / "model-pp00-tp00.safetensors", framework="pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    params = dict(model.named_parameters())
    assert set(stored) == set(params) and len(stored) > 10
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor), name
    assert not torch.equal(params["embed.weight"], Transformer(config, seed=LOAD_SEED).embed.weight)  # it loaded
    damaged = tmp_path / "v1"
    shutil.copytree(V1, damaged)
    _flip_byte(damaged / "model-pp00-tp00.safetensors")
    with pytest.raises(UsageError, match="fails its checksum.*sha256"):
        load_checkpoint(damaged, model)
