"""The planner's LoRA prices (``megakit.core.planner.lora_cost``), item by item, without processes: the frozen base's
states, the adapters' full states, the activations they keep, the FLOPs left without the base's weight gradients,
and ``megakit plan --lora-*`` (Llama-3-70B on one 8 x H100 node plans; bad input is one line, exit 2)."""

import dataclasses
import json

import pytest

from megakit.commands import cli
from megakit.core.lora import LoraSpec
from megakit.core.planner import lora_cost
from megakit.core.planner.cost import _step_flops, estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan

R = 8


@pytest.fixture(scope="module")
def tiny():
    return ModelSpec.from_config("llama-tiny")  # hidden 32, 8 heads (4 KV) of 4, FFN 96, 4 layers


def _adapters_per_block(tp: int) -> int:
    """llama-tiny's adapters on one TP rank, by hand: r (k + n) of q, k, v, o, gate, up, down."""
    h, q, kv, f = 32, 32 // tp, 16 // tp, 96 // tp
    return R * ((h + q) + 2 * (h + kv) + (q + h) + 2 * (h + f) + (f + h))


def test_the_frozen_base_keeps_its_weights_only_and_the_adapters_every_state(tiny):
    lora = LoraSpec(rank=R)
    full = estimate_memory(tiny, precision="bf16")
    est = estimate_memory(tiny, precision="bf16", lora=lora)
    psi_a = 4 * _adapters_per_block(1)
    assert est.items["params"] == full.items["params"]  # the base in bf16, all of it
    assert est.items["grads"] == est.items["master_params"] == est.items["optimizer"] == 0
    assert (est.items["lora_params"], est.items["lora_grads"]) == (2 * psi_a, 2 * psi_a)
    assert (est.items["lora_master_params"], est.items["lora_optimizer"]) == (4 * psi_a, 8 * psi_a)
    assert est.items["fp32_step_grads"] == 4 * psi_a  # the step's fp32 copy: the adapters' only
    zero2 = estimate_memory(tiny, precision="bf16", lora=lora, tp=2, dp=2, zero_stage=2)
    psi_tp = 4 * _adapters_per_block(2)
    assert zero2.items["lora_grads"] == 2 * psi_tp / 2 and zero2.items["lora_optimizer"] == 8 * psi_tp / 2
    assert zero2.model_states < full.model_states / 3


def test_the_adapters_keep_their_rank_r_intermediates_and_under_sp_their_gathered_inputs(tiny):
    s, b = 64, 2
    shape = dict(micro_batch=b, seq_len=s, accumulation=1, precision="bf16")
    plain = estimate_memory(tiny, lora=LoraSpec(rank=R, targets=("q_proj", "down_proj")), **shape)
    assert plain.items["lora_activations"] == 4 * 2 * (2 * s * b * R)  # 4 blocks x 2 adapters x (S, B, r) in bf16
    sp = estimate_memory(tiny, lora=LoraSpec(rank=R, targets=("q_proj",)), tp=2, sequence_parallel=True, **shape)
    assert sp.items["lora_activations"] == 4 * 2 * s * b * (R + 32 / 2)  # + q_proj's all-gathered input, less its shard
    dropped = estimate_memory(tiny, lora=LoraSpec(rank=R, targets=("q_proj",), dropout=0.1), **shape)
    assert dropped.items["lora_activations"] == 4 * s * b * (2 * R + 32 * 3)  # + the dropped input and its mask
    assert estimate_memory(tiny, recompute="full", lora=LoraSpec(rank=R), **shape).items["lora_activations"] == 0


def test_lora_runs_about_two_thirds_of_a_full_fine_tunes_flops():
    model = ModelSpec.from_config("llama-3-8b")
    plan = Plan(tp=2, dp=4, micro_batch=1, accumulation=8)
    tuned = dataclasses.replace(plan, lora=LoraSpec(rank=16))
    full_model, full_hw = _step_flops(model, plan, seq_len=model.seq_len, tokens=1000)
    lora_model, lora_hw = _step_flops(model, tuned, seq_len=model.seq_len, tokens=1000)
    assert 0.6 < lora_model / full_model < 0.75 and lora_hw < full_hw
    cluster = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=8)
    full, lora = estimate_cost(model, cluster, plan), estimate_cost(model, cluster, tuned)
    # the time saves less: attention's backward stays, and the adapters' thin GEMMs are memory-bound (unfused)
    assert 0.6 < lora.step_time_s / full.step_time_s < 0.95
    assert lora_cost.model_params(model, tuned.lora) == 16 * 32 * sum(
        k + n for k, n in ((4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336))
    ) + 16 * 32 * (14336 + 4096)


def test_llama_3_70b_lora_plans_on_one_8_x_h100_node_and_says_why(capsys):
    argv = ["plan", "--model", "llama-3-70b", "--gpus", "8", "--gpu", "h100-80gb", "--tp", "8", "--pp", "1"]
    code = cli.main([*argv, "--lora-rank", "16", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    p = json.loads(out)["plan"]
    assert p["lora"]["lets_it_fit"] and "LoRA is what lets it fit" in p["lora"]["why"]
    assert p["memory"]["grads"] == p["memory"]["optimizer"] == 0 and p["memory"]["lora_optimizer"] > 0
    assert "--lora-rank 16" in json.loads(out)["assumptions"]["launch"]
    assert p["save_interval"]["write_s"] < 10  # adapter-only checkpoints: 0.2B parameters' states, not 70B's
    assert cli.main([*argv, "--json"]) == 0  # a full fine-tune fits that node only by offloading Adam to the host
    assert json.loads(capsys.readouterr().out)["plan"]["offload"] != "none"


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--lora-rank", "0"], "LoRA rank must be a positive integer"),
        (["--lora-rank", "8", "--lora-targets", "q_proj,wq"], "the linear layers are named q_proj"),
        (["--lora-targets", "q_proj"], "give --lora-rank R too"),
        (["--lora-rank", "8", "--runtime", "megatron"], "LoRA is priced for megakit's trainer"),
    ],
)
def test_bad_lora_input_is_one_line_and_exit_2(capsys, flags, says):
    code = cli.main(["plan", "--model", "llama-tiny", "--gpus", "2", *flags])
    err = capsys.readouterr().err
    assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--model", "nemotron-h-tiny", "--lora-rank", "4"], "linear-attention or Mamba-2 mixers"),
        (["--model", "qwen3.5-tiny", "--lora-rank", "4"], "linear-attention or Mamba-2 mixers"),
        (["--model", "llama-tiny", "--lora-rank", "4", "--optimizer", "muon"], "--optimizer muon does not train LoRA"),
    ],
)
def test_lora_plans_it_cannot_price_are_one_line(flags, says, capsys):
    """Hybrid models' mixers (their adapters are not in ``lora_cost``'s block) and Muon with LoRA (which the
    trainer refuses) are refused in one line, exit 2, rather than priced wrong."""
    assert cli.main(["plan", "--gpus", "8", "--gpu", "h100-80gb", *flags]) == 2
    assert says in capsys.readouterr().err
