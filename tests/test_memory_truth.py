"""``--verify-memory`` on every family and layout: the planner's model states and activations within 10 % of what
each rank of the trainer holds (issue 45, item 1).

Families: dense (llama-tiny), MoE (moe-tiny: softmax router, a gated shared expert), MLA with a sigmoid router and
a shared expert (deepseek-v3-tiny), gpt-oss (router and expert biases, clamped SwiGLU, attention sinks) and Gemma 3
(QK-norm, sandwich norms, sliding windows). Layouts: one process, EP 2 (the MoE families), TP 2 with SP, PP 2 and
CP 2 as a ring and as Ulysses' all-to-all; ZeRO 1, seq 32. Two jobs: one process, then every two-process case in one
launcher run (``tests/launch_sweep.py``); one optimizer step each (two micro-batches: PP 2's 1F1B has both in
flight), enough for every state (Adam's moments appear at the first step) and every activation.
"""

import json
import os
import subprocess

import pytest
from multiproc import THREADS, free_port
from test_trainer import ROOT, ds_config, sweep

FAMILIES = ("llama-tiny", "moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny", "gemma3-tiny")
MOE = ("moe-tiny", "deepseek-v3-tiny", "gpt-oss-tiny")
LAYOUTS = {
    "EP 2": dict(ep=2),
    "TP 2 + SP": dict(tp=2, sequence_parallel=True),
    "PP 2": dict(pp=2),
    "CP 2 ring": dict(cp=2),
    "CP 2 a2a": dict(cp=2, cp_mode="a2a"),
}
TOLERANCE = 0.10


def _case(model: str, **layout) -> dict:
    return dict(ds_config=ds_config(1), model=model, steps=1, seq_len=32, verify_memory=True, **layout)


def _one_process(tmp_path, cases: list[dict]) -> list[dict]:
    """The one-process cases in one plain ``python`` run of the sweep (no launcher: a world of one)."""
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    env = {
        "OMP_NUM_THREADS": THREADS,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
    }
    out = subprocess.run(
        ["python", "tests/launch_sweep.py", str(tmp_path / "cases.json"), str(tmp_path / "results.json")],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    *results, last = json.loads((tmp_path / "results.json").read_text())
    assert last == {"replaced": []}, last
    return results


@pytest.mark.slow
def test_memory_truth_every_family_and_layout(tmp_path, tmp_path_factory):
    single = [("one process", model, _case(model)) for model in FAMILIES]
    pairs = [
        (name, model, _case(model, **layout))
        for name, layout in LAYOUTS.items()
        for model in FAMILIES
        if name != "EP 2" or model in MOE
    ]
    results = _one_process(tmp_path, [c for _, _, c in single]) + sweep(tmp_path_factory, 2, [c for _, _, c in pairs])
    ratios, off = {}, []
    for (layout, model, _), result in zip(single + pairs, results, strict=True):
        rows = result["memory"]
        assert len(rows) == (1 if layout == "one process" else 2), (layout, model, rows)
        for row in rows:
            m, p = row["measured"], row["predicted"]
            ratio = (m["model_states"] / p["model_states"], m["activations"] / p["activations"])
            ratios[layout, model, row["rank"]] = ratio
            if any(abs(r - 1) > TOLERANCE for r in ratio):
                off.append((layout, model, row["rank"], f"states {ratio[0]:.3f}", f"activations {ratio[1]:.3f}"))
    assert not off, off
    assert len(ratios) == 5 + 2 * (3 + 5 * 4)  # every rank of every case was compared


def test_plan_shows_each_moe_memory_line_and_zero_bubble_w_inputs_at_the_expert_width(capsys):
    """``megakit plan`` (table and ``--json``) shows the lines inside an item, which add up to it; zero bubble's
    deferred W inputs of an MoE block are its routed experts' fc1 and fc2 outputs for top-k copies, not a dense
    MLP's."""
    from megakit.commands import cli
    from megakit.core.planner.memory import _matmul_output_bytes
    from megakit.core.planner.model_spec import ModelSpec

    argv = ["plan", "--model", "deepseek-v3-tiny", "--gpus", "4", "--ep", "2", "--cp", "2", "--seq-len", "4096"]
    assert cli.main([*argv, "--json"]) == 0
    p = json.loads(capsys.readouterr().out)["plan"]
    lines = p["memory_breakdown"]
    assert set(lines["moe_routing"]) == {
        "router logits and scores",
        "top-k indices and probabilities",
        "aux-loss terms",
        "permutation and dispatch",
        "routed experts",
    }
    assert sum(lines["moe_routing"].values()) == pytest.approx(p["memory"]["moe_routing"])
    assert set(lines["activations"]) == {
        "shared experts (MoE blocks)",
        "MLA latents",
        "attention output kept twice (CP, sinks)",
    }
    assert 0 < lines["comm_buffers"]["MoE all-to-all send and receive buffers"] <= p["memory"]["comm_buffers"]
    assert p["memory"]["expert_grads"] > 0 and "expert_states" not in p["memory"]
    assert cli.main(argv) == 0
    table = capsys.readouterr().out
    for line in (
        "MoE routing",
        "of which router logits and scores",
        "of which permutation and dispatch",
        "of which MLA latents",
        "of which MoE all-to-all send and receive buffers",
    ):
        assert line in table, line

    spec = ModelSpec.from_config("moe-tiny")  # H 32, 8 experts of F 16, top-2, shared FFN 32
    kw = dict(tp=1, precision="fp32", seq_len=32, micro_batch=2)
    dense, moe = _matmul_output_bytes(spec, **kw), _matmul_output_bytes(spec, moe=True, imbalance=1.5, **kw)
    attention = 8 * 4 + 2 * 4 * 4 + 32  # q, k, v (4 KV heads of 4), o_proj
    assert dense == 4 * 64 * (attention + 2 * 64 + 32)  # the dense FFN's gate, up and down
    assert moe == 4 * 64 * (attention + 8 + (2 * 32 + 32) + 2 * 1.5 * (2 * 16 + 32))  # router, shared, top-k copies


def test_lines_follow_their_item_on_a_loss_only_stage_and_under_recompute_modules():
    """The lines inside an item are what the item holds: on a loss-only last stage (whose peak is another moment
    than the blocks' own) and under Megatron's recompute modules, which free some of them and not others."""
    from megakit.core.planner.memory import estimate_memory
    from megakit.core.planner.model_spec import ModelSpec

    spec = ModelSpec.from_config("moe-tiny").with_overrides(seq_len=32)
    loss_only = estimate_memory(spec, pp=2, vpp=3, stage=1, precision="fp32", micro_batch=2)
    routing = loss_only.breakdown["moe_routing"]
    assert sum(routing.values()) == pytest.approx(loss_only.items["moe_routing"])

    spec = ModelSpec.from_config("deepseek-v3-tiny").with_overrides(seq_len=32)
    kw = dict(precision="bf16", micro_batch=2, megatron=True, recompute="selective")
    plain = estimate_memory(spec, **kw)
    shared = estimate_memory(spec, recompute_modules=("shared_experts",), **kw)
    act = estimate_memory(spec, recompute_modules=("moe_act",), **kw)
    assert shared.items["activations"] < plain.items["activations"]
    assert "shared experts (MoE blocks)" not in shared.breakdown["activations"]  # recomputed: none kept
    assert plain.breakdown["activations"]["shared experts (MoE blocks)"] > 0
    router = "router logits and scores"
    assert act.breakdown["moe_routing"][router] == pytest.approx(plain.breakdown["moe_routing"][router])
    assert sum(act.breakdown["moe_routing"].values()) == pytest.approx(act.items["moe_routing"])
    for flash in (True, False):  # the attention core is what plain selective recompute and "core_attn" both free
        default, core = (
            estimate_memory(spec, flash_attention=flash, recompute_modules=modules, **kw)
            for modules in ((), ("core_attn",))
        )
        assert core.items == pytest.approx(default.items)
