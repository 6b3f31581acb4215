"""A transformers checkpoint imported, trained one step by megakit at TP2 x PP2, exported: the same model as
transformers' own one-step training of the same weights on the same batch. The model carries Llama 3.1's
RoPE (theta 500000, llama3 scaling by 8 past 16 positions), so sequences of 32 test the scaled positions."""

import json
import os
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from multiproc import THREADS, free_port  # noqa: E402
from paths import ROOT  # noqa: E402

from megakit.commands.cli import main  # noqa: E402
from megakit.train.data.batches import BatchPlan, TokenBatches, load_tokens  # noqa: E402

OPTIMIZER = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_model(directory):
    """llama-tiny with Llama 3.1's RoPE, saved by the installed transformers (5: ``rope_parameters``)."""
    config = json.loads((ROOT / "models" / "llama-tiny.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("model_type", "architectures", "rope_theta")}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, rope_parameters=dict(ROPE)))
    model.save_pretrained(directory, safe_serialization=True)


def _as_transformers_4(source, directory):
    """The same checkpoint with transformers 4's config.json: top-level ``rope_theta`` and ``rope_scaling``."""
    shutil.copytree(source, directory)
    data = json.loads((directory / "config.json").read_text())
    data["rope_scaling"] = data.pop("rope_parameters")
    data["rope_theta"] = data["rope_scaling"].pop("rope_theta")
    (directory / "config.json").write_text(json.dumps(data))


def test_import_then_export_gives_back_the_same_bytes(tmp_path):
    from safetensors.torch import load_file

    _hf_model(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 0
    assert main(["convert", str(tmp_path / "ck"), "--to-hf", str(tmp_path / "back")]) == 0
    before, after = load_file(tmp_path / "hf" / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "back2"), "--to-hf"]) == 0  # the --from-hf shape
    again = load_file(tmp_path / "back2" / "model.safetensors")
    assert again.keys() == after.keys() and all(torch.equal(again[k], after[k]) for k in again)
    assert main(["convert", str(tmp_path / "ck"), str(tmp_path / "x"), "--to-hf", str(tmp_path / "y")]) == 2  # two OUTs
    assert main(["convert", str(tmp_path / "ck"), "--to-hf"]) == 2  # no OUT_DIR
    assert main(["convert", str(tmp_path / "hf"), "--from-hf"]) == 2  # no OUT_DIR: one line, exit 2
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 2  # never over a checkpoint


@pytest.mark.slow
def test_one_step_at_tp2_pp2_equals_transformers_own_step(tmp_path):
    _hf_model(tmp_path / "hf")
    assert main(["convert", str(tmp_path / "hf"), str(tmp_path / "ck"), "--from-hf"]) == 0
    _as_transformers_4(tmp_path / "hf", tmp_path / "hf4")  # trained from: its config must be the checkpoint's
    ds = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {**OPTIMIZER, "torch_adam": True}},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10**9,
    }
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    out = subprocess.run(
        [
            "deepspeed",
            "--num_gpus",
            "4",
            "--master_port",
            str(free_port()),
            "scripts/train.py",
            "--ds_config",
            str(tmp_path / "ds.json"),
            "--model",
            str(tmp_path / "hf4"),
            "--load",
            str(tmp_path / "ck"),
            "--steps",
            "1",
            "--tp",
            "2",
            "--pp",
            "2",
            "--seq-len",
            "32",
            "--save",
            str(tmp_path / "trained"),
            "--no-progress",
        ],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS=THREADS),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert main(["convert", str(tmp_path / "trained"), "--to-hf", str(tmp_path / "exported")]) == 0

    inputs, labels = TokenBatches(load_tokens(None), BatchPlan(seq_len=32, micro_batch=2, accumulation=2)).global_batch(
        0
    )
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float()
    decayed = set(transformers.Trainer.get_decay_parameter_names(None, reference))  # transformers' own rule
    groups = [
        {"params": [p for n, p in reference.named_parameters() if n in decayed]},
        {"params": [p for n, p in reference.named_parameters() if n not in decayed], "weight_decay": 0.0},
    ]
    assert groups[1]["params"]  # the norms and biases
    optimizer = torch.optim.AdamW(
        groups,
        lr=OPTIMIZER["lr"],
        betas=tuple(OPTIMIZER["betas"]),
        eps=OPTIMIZER["eps"],
        weight_decay=OPTIMIZER["weight_decay"],
    )
    logits = reference(inputs).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()).backward()
    torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    optimizer.step()
    trained = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").float()
    with torch.no_grad():
        want, got = reference.eval()(inputs).logits, trained.eval()(inputs).logits
        moved = (want - transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")(inputs).logits).abs().max()
    assert moved > 1e-3  # the step did change the model
    assert trained.config.rope_parameters == reference.config.rope_parameters
    beyond = (got - want)[:, ROPE["original_max_position_embeddings"] :].abs().max()
    print(f"TP2 x PP2 step, llama3 RoPE: max |logit diff| {(got - want).abs().max():.2e}, beyond 16 {beyond:.2e}")
    assert (got - want).abs().max() < 1e-5 and beyond < 1e-5, (got - want).abs().max()
