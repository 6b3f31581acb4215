"""LoRA (``megakit.nn.lora``, ``train.py --lora-*``, ``megakit convert`` to and from peft) at every layout.

One launcher job of 4 processes (``tests/helpers/launch_sweep.py``) trains ``llama-tiny``'s adapters on a base
checkpoint (unlike the seed's weights; ``--load BASE``) at TP 2 x PP 2 x VPP 2 with SP under ZeRO 1, saving at step 2,
and resumes them at DP 4 under ZeRO 3; and ``moe-tiny``'s attention and shared-expert adapters at EP 2 x CP 2 (ring)
under ZeRO 0 (ZeRO 2 and CP's all-to-all ran alike by hand; left out for time). B starts at zero, so step 1 moves only
B, and the later steps' losses and A's gradients show that the adapters agree: every loss and grad norm follows the
single process (``reference_run(lora=...)``) within 1e-5. Against peft 0.21 on transformers: the exported adapter's
logits and one step's adapter gradients equal megakit's. Bad input: one line, exit 2, nothing written.
"""

import importlib.util
import json
import re
import shutil

import pytest
import torch
from jobs import ds_config, sweep
from paths import ROOT

from megakit.commands import cli
from megakit.core.lora import LoraSpec
from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError
from megakit.interop.checkpoint import load_checkpoint, save_checkpoint
from megakit.interop.checkpoint_format import STATE_PREFIX, read_manifest, state_keys
from megakit.interop.peft import hf_modules
from megakit.nn.lora import add_lora
from megakit.nn.model import Transformer

MODEL, STEPS, TOL = "llama-tiny", 3, 1e-5
LORA = dict(rank=4, alpha=8.0)
MOE_LORA = dict(rank=2, alpha=4.0, targets=["q_proj", "v_proj", "gate_proj", "down_proj"])


def _case(stage: int, *, micro: int, accumulation: int, **extra) -> dict:
    """Global batch 4 whatever the DP: micro x accumulation x DP."""
    case = dict(ds_config=ds_config(stage, micro=micro, accumulation=accumulation), model=MODEL, steps=STEPS)
    return case | dict(seq_len=32, lora=LORA) | extra


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base checkpoint whose weights are not the seed's: a run that did not load it would not follow."""
    config = ModelConfig.load(MODEL)
    net = Transformer(config, seed=7)
    path = tmp_path_factory.mktemp("base") / "base"
    save_checkpoint(path, net, step=0, config=config)
    return path


@pytest.fixture(scope="module")
def job(tmp_path_factory, base):
    saved = tmp_path_factory.mktemp("lora") / "adapters"
    cases = [  # --load BASE (no adapters): a fine-tune from it, at step 0
        _case(1, micro=2, accumulation=2, tp=2, pp=2, vpp=2, sequence_parallel=True, load=str(base), save=str(saved))
        | {"steps": 2},
        _case(3, micro=1, accumulation=1, load=str(saved)),  # on the base the checkpoint names
        _case(0, micro=1, accumulation=2, ep=2, cp=2, cp_mode="ring")
        | {"model": "moe-tiny", "lora": MOE_LORA, "steps": 2},
    ]
    return cases, sweep(tmp_path_factory, 4, cases, timeout=900), saved


def _follows(result: dict, ref: dict, start: int = 0) -> None:
    got, want = result["loss"], ref["loss"][start : start + len(result["loss"])]
    assert len(got) == len(want) and all(abs(a - b) < TOL for a, b in zip(got, want)), (got, want)
    for a, b in zip(result["grad_norm"], ref["grad_norm"][start:]):
        assert abs(a - b) < 2e-5 * b, (a, b)


@pytest.mark.slow
def test_every_layout_trains_the_adapters_as_one_process(job, base):
    from megakit.train.doctor.reference import reference_run

    cases, results, _ = job
    # the base's weights are not the seed's, so a run that did not load it would not follow
    lora = LORA | {"base": str(base)}
    ref = reference_run(ds_config(1, micro=2, accumulation=2), model=MODEL, steps=STEPS, seq_len=32, lora=lora)
    tp_pp, resumed, moe = results
    _follows(tp_pp, ref)
    _follows(resumed, ref, start=2)  # from the TP x PP checkpoint, at DP 4 under ZeRO 3
    moe_ref = reference_run(ds_config(0, micro=2, accumulation=2), model="moe-tiny", steps=STEPS, seq_len=32,
                            lora=MOE_LORA)  # fmt: skip
    _follows(moe, moe_ref)


@pytest.mark.slow
def test_a_lora_checkpoint_holds_the_adapters_and_their_optimizer_state_only(job, base):
    _, _, saved = job
    manifest = read_manifest(saved)
    names = {n for n in manifest["params"] if not n.startswith(STATE_PREFIX)}
    assert all(n.endswith((".lora_A", ".lora_B")) for n in manifest["params"]), sorted(names)[:4]
    assert len(names) == 2 * 7 * 4  # every linear layer of the 4 blocks (all-linear), not the head
    assert {"fp32", "exp_avg", "exp_avg_sq"} <= set(state_keys(manifest))
    assert manifest["extra"]["lora"] == {"spec": LoraSpec(**LORA).__dict__ | {"targets": ["all-linear"]},
                                         "base": str(base.resolve())}  # fmt: skip


def _megakit_model(saved, base):
    config = ModelConfig.load(MODEL)
    net = Transformer(config, seed=0)
    add_lora(net, LoraSpec(**LORA), config=config, seed=0)
    load_checkpoint(base, net, base=True)
    load_checkpoint(saved, net)
    return net


@pytest.mark.slow
def test_the_exported_adapter_loads_into_peft_with_megakits_logits_and_gradients(job, base, tmp_path):
    """fp32 throughout and logits of magnitude ~1 (a tiny model, std 0.02 weights): the two differ only in the
    order of float sums, ~1e-7; 1e-5 leaves room for that and catches any wrong matrix, scale or name."""
    import peft
    from transformers import AutoModelForCausalLM

    _, _, saved = job
    assert cli.main(["convert", str(base), str(tmp_path / "hf-base"), "--to-hf"]) == 0
    assert cli.main(["convert", str(saved), str(tmp_path / "adapter"), "--to-hf"]) == 0
    assert cli.main(["convert", str(saved), str(tmp_path / "merged"), "--to-hf", "--merged"]) == 0
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and len(config["target_modules"]) == 7
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf-base", dtype=torch.float32)
    theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter", is_trainable=True)
    ours = _megakit_model(saved, base)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    ours_logits = ours(ids)  # (B, S, V)
    theirs_logits = theirs(input_ids=ids).logits
    assert (ours_logits - theirs_logits).abs().max() < TOL
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    assert (merged(input_ids=ids).logits - theirs_logits).abs().max() < TOL
    # one step's gradients of the same loss on the same batch
    ours(ids, labels).backward()
    torch.nn.functional.cross_entropy(theirs_logits.flatten(0, 1), labels.flatten()).backward()
    theirs_params = dict(theirs.named_parameters())
    compared = 0
    for layer, module in hf_modules(ours.config).items():
        for part in ("lora_A", "lora_B"):
            g = getattr(dict(ours.named_modules())[layer], part).grad
            want = theirs_params[f"base_model.model.{module}.{part}.default.weight"].grad
            assert (g - want).abs().max() < TOL * max(1.0, want.abs().max()), (layer, part)
            compared += 1
    assert compared == 2 * 7 * 4
    # and back: the peft adapter imported on the base is the checkpoint's adapters
    assert cli.main(["convert", str(tmp_path / "adapter"), str(tmp_path / "imported"), "--from-peft", str(base)]) == 0
    again = _megakit_model(tmp_path / "imported", base)
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), name


def test_bad_lora_input_is_one_line_exit_2_and_writes_nothing(base, tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("train_script", ROOT / "scripts" / "train.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    for flags, words in (
        (["--lora-rank", "0"], "LoRA rank must be a positive integer, got 0"),
        (["--lora-rank", "4", "--lora-targets", "q_proj,c_attn"], "LoRA target c_attn matches no module of"),
        (["--lora-rank", "4", "--lora-dropout", "0.1"], "LoRA dropout 0.1 is not supported yet"),
        (["--lora-base", str(base)], "--lora-base applies to LoRA; give --lora-rank R too"),
    ):
        save = tmp_path / "never"
        assert script.main(["--model", MODEL, "--steps", "1", "--save", str(save), "--check", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
        assert not save.exists()
    with pytest.raises(UsageError, match="the linear layers are named q_proj, k_proj, v_proj, o_proj, gate_proj"):
        from megakit.train.run import TrainConfig, resolve

        resolve(TrainConfig(ds_config=ds_config(1, micro=2, accumulation=2), model=MODEL, lora={"rank": 2,
                "targets": ["qkv"]}), 1)  # fmt: skip
    # an adapter export of a checkpoint without adapters
    assert cli.main(["convert", str(base), str(tmp_path / "out"), "--to-hf", "--adapter"]) == 2
    assert "holds no LoRA adapters" in capsys.readouterr().err and not (tmp_path / "out").exists()
    # an imported adapter whose base shape differs
    config = ModelConfig.load(MODEL)
    net = Transformer(config, seed=0)
    add_lora(net, LoraSpec(rank=2, alpha=4.0, targets=("q_proj",)), config=config, seed=0)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    from safetensors.torch import save_file

    tensors = {f"base_model.model.{m}.{p}.weight": torch.zeros(2, 48) if p == "lora_A" else torch.zeros(32, 2)
               for m in hf_modules(config).values() if m.endswith("q_proj") for p in ("lora_A", "lora_B")}  # fmt: skip
    save_file(tensors, wrong / "adapter_model.safetensors")
    (wrong / "adapter_config.json").write_text(json.dumps(LoraSpec(rank=2, alpha=4.0).to_peft(targets=["q_proj"])))
    assert cli.main(["convert", str(wrong), str(tmp_path / "imp"), "--from-peft", str(base)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(r"q_proj.lora_A is \(2, 48\) but the base .* needs \(2, 32\)", err[0]), err
    assert not (tmp_path / "imp").exists()
    shutil.rmtree(wrong)


def test_a_frozen_router_keeps_the_bases_expert_bias():
    """DeepSeek-V3's expert bias is a buffer the base owns: under LoRA it must not move (an adapter checkpoint does
    not keep it, so a moved bias would make a resume, and the exported adapter, route unlike the run)."""
    from megakit.nn.moe.layer import moe_layers, update_expert_bias

    config = ModelConfig.load("deepseek-v3-tiny")

    def moved(lora: bool) -> bool:
        net = Transformer(config, seed=0)
        if lora:
            add_lora(net, LoraSpec(rank=2, targets=("o_proj",)), config=config, seed=0)
        layers = moe_layers(net)
        for m in layers:  # an uneven load: the bias would move towards the idle experts
            m.step_tokens.copy_(torch.arange(m.step_tokens.numel(), dtype=m.step_tokens.dtype))
        before = [m.gate.e_score_correction_bias.clone() for m in layers]
        update_expert_bias(net)
        return any(not torch.equal(b, m.gate.e_score_correction_bias) for b, m in zip(before, layers))

    assert moved(lora=False)  # the control: a full fine-tune moves it
    assert not moved(lora=True)


@pytest.mark.slow
def test_a_resume_keeps_the_base_its_adapters_were_trained_on(job, tmp_path):
    """A LoRA checkpoint names its frozen base; resuming it with another ``--lora-base`` is one line, not adapters
    silently continued on other weights."""
    from megakit.train.engine.lora import check_resume

    _, _, saved = job
    config = ModelConfig.load(MODEL)
    other = tmp_path / "other"
    save_checkpoint(other, Transformer(config, seed=3), step=0, config=config)
    with pytest.raises(UsageError, match="were trained on the base"):
        check_resume(LoraSpec(**LORA), saved, str(other))
    assert check_resume(LoraSpec(**LORA), saved, None) is not None  # the base the checkpoint names
