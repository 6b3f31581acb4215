"""``megakit plan --runtime megatron-core`` against Megatron-Core's own H100 BF16 runs: the Megatron-LM README's
weak-scaling table (Megatron-Core r0.8.0, GPT 1.7B-462B, TP + SP, PP up to 16, distributed optimizer, seq 4096,
``--tp-comm-overlap --overlap-grad-reduce --overlap-param-gather``; tests/data/megatron-core-runs.json). Each row
goes through the CLI in-process with its layout pinned as published; the unstated parts are pinned as micro-batch 1,
selective recompute, no interleaving.

Measured with one set of constants (``pytest -s`` prints the table): TP <= 4 rows +1.8 %, -2.1 %, -11.1 %; TP 8:
32B -26.0 %, 70B -17.4 %, 119B -14.9 %, 177B -15.2 %, 314B -19.5 %, 462B -17.4 % (with ``--runtime megatron``,
which prices no TP/DP overlap beyond Megatron-LM 2022's: -18.2 % to -34.6 %). What is left, from the planner's
breakdown: (1) the DP exchange, 2-20 % of the step: 48 replicas on 48 nodes and 4-64 micro-batches per step, so
the reduce-scatter has only the last backward to hide behind and the gather the first forward; (2) the bubble,
10-17 % for PP > 1, since the README does not say whether the pipeline was interleaved: at one layer per virtual
stage (what Megatron-Core r0.8 allows for the prime 23- and 7-layer stages) the PP rows come to -5.7 % to -15 %
(``test_interleaved_sensitivity``). The bound below is the measured worst plus a margin, not a target; the
TP <= 4, PP 1 rows are held to 15 %."""

import json
from pathlib import Path

import pytest

import megakit.interop.hf as hf
from megakit.commands.cli import main

ROWS = json.loads((Path(__file__).parent / "data" / "megatron-core-runs.json").read_text())["rows"]
TOLERANCE = 0.15  # where DP traffic and the bubble are small (TP <= 4, PP 1)
BOUND = 0.30  # every row; measured worst -26.0 % (32B, TP 8)


@pytest.fixture
def plan_json(monkeypatch, capsys):
    monkeypatch.setattr(hf, "exact_param_count", lambda raw: None)  # names the model only; the cost never reads it

    def run(*argv) -> dict:
        assert main(["plan", *map(str, argv), "--json"]) == 0, capsys.readouterr().err
        return json.loads(capsys.readouterr().out)["plan"]
    return run


def _argv(row, tmp_path, **override) -> list:
    """The row's GPT shape as a config.json and its layout pinned as tests/data says (``row["planner"]``)."""
    config = tmp_path / f"{row['id']}.json"
    config.write_text(json.dumps({
        "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": row["vocab"],
        "n_positions": row["seq_len"], "n_embd": row["hidden"], "n_layer": row["layers"], "n_head": row["heads"],
        "n_inner": row["ffn"], "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "tie_word_embeddings": True}))
    q = {**row["planner"], **override}
    return ["--model", config, "--gpu", q["gpu"], "--gpus", q["gpus"], "--tp", q["tp"], "--pp", q["pp"], "--cp", q["cp"],
            "--vpp", q["vpp"], "--zero", q["zero"], "--micro-batch", q["micro_batch"], "--global-batch", q["global_batch"],
            "--seq-len", q["seq_len"], "--recompute", q["recompute"], "--runtime", q["runtime"]]


def _error(got, row) -> float:
    return got["tokens_per_s"] / got["num_gpus"] / row["tokens_per_s_per_gpu"] - 1


def test_megatron_core_h100_rows_through_the_cli(plan_json, tmp_path):
    """Each published run fits its GPU as pinned (it trained), and tokens/s/GPU lands within the bound."""
    lines, errors = [f"{'row':26s} {'tp':>2s} {'pp':>2s} {'predicted':>9s} {'measured':>9s} {'error':>7s} comm bubble"], {}
    for row in ROWS:
        got = plan_json(*_argv(row, tmp_path))
        assert (got["tp"], got["pp"], got["dp"], got["vpp"]) == (row["tp"], row["pp"], row["dp"], 1)
        assert got["peak_memory_gib"] <= got["gpu_memory_gib"], f"{row['id']} called out of memory"
        errors[row["id"]] = _error(got, row)
        lines.append(f"{row['id']:26s} {row['tp']:2d} {row['pp']:2d} {got['tokens_per_s'] / got['num_gpus']:9.1f} "
                     f"{row['tokens_per_s_per_gpu']:9.1f} {errors[row['id']]:+7.1%} {got['comm_fraction']:4.2f} "
                     f"{got['bubble_fraction']:6.2f}")
    print("\n".join(lines))
    assert max(map(abs, errors.values())) <= BOUND, errors
    small = {r["id"]: errors[r["id"]] for r in ROWS if r["tp"] <= 4 and r["pp"] == 1}
    assert small and max(map(abs, small.values())) <= TOLERANCE, small


def test_interleaved_sensitivity(plan_json, tmp_path):
    """The VP the README leaves unstated: one layer per virtual stage (what Megatron-Core r0.8 allows for the
    prime 23- and 7-layer stages) shrinks the bubble and the error, to within 16 % on every PP row."""
    for row in (r for r in ROWS if r["pp"] > 1):
        plain = _error(plan_json(*_argv(row, tmp_path)), row)
        interleaved = _error(plan_json(*_argv(row, tmp_path, vpp=row["layers"] // row["pp"])), row)
        assert plain < interleaved and abs(interleaved) < 0.16, (row["id"], plain, interleaved)
