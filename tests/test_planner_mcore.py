"""``megakit plan --runtime megatron`` against Megatron-Core's own H100 BF16 runs: the Megatron-LM README's
weak-scaling table (Megatron-Core r0.8.0, GPT 1.7B-462B, TP + SP, PP up to 16, distributed optimizer, seq 4096;
tests/data/megatron-core-runs.json). Each row goes through the CLI in-process with its layout pinned as
published; the unstated parts are pinned as micro-batch 1, selective recompute, no interleaving.

Measured with one set of constants (``pytest -s`` prints the table): TP <= 2 rows +1.8 % and -4.5 %; the rest
are predicted slow, beyond 15 %: 16B (TP 4) -18.2 %, 32B (TP 8) -34.6 %, 70B -25.5 %, 119B -21.9 %,
177B -21.1 %, 314B -24.0 %, 462B -21.4 %. Why, from the planner's breakdown (share of its step):
(1) data parallelism, 2-22 %: DP 48 spans 48 nodes with only 4-64 micro-batches per step; the planner prices
ZeRO-1 as one all-reduce hidden only behind the last backward, while Megatron's distributed optimizer with
``--overlap-grad-reduce --overlap-param-gather`` reduce-scatters behind the backward and all-gathers behind the
next step's forwards. (2) TP, 4-7 %: ``--tp-comm-overlap`` pipelines every all-gather/reduce-scatter with its
GEMM; the planner hides only the column-parallel backward exchange. (3) The bubble, 10-17 % for PP > 1: the
README does not say whether the pipeline was interleaved; at one layer per virtual stage the PP rows come to
-11 % to -23 % (``test_interleaved_sensitivity``). Without (1) and (2) the 32B row would be about -8 %. The
bound below is the measured worst plus a margin, not a target; the TP <= 2, PP 1 rows, where none of the
three applies, are held to 15 %."""

import json
from pathlib import Path

import pytest

import megakit.interop.hf as hf
from megakit.commands.cli import main

ROWS = json.loads((Path(__file__).parent / "data" / "megatron-core-runs.json").read_text())["rows"]
TOLERANCE = 0.15  # where TP communication and the bubble are small (TP <= 2, PP 1)
BOUND = 0.38  # every row; measured worst -34.6 % (32B, TP 8)


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
    small = {r["id"]: errors[r["id"]] for r in ROWS if r["tp"] <= 2 and r["pp"] == 1}
    assert small and max(map(abs, small.values())) <= TOLERANCE, small


def test_interleaved_sensitivity(plan_json, tmp_path):
    """The VP the README leaves unstated: one layer per virtual stage (what Megatron-Core r0.8 allows for the
    prime 23- and 7-layer stages) shrinks the bubble and the error, but the exposed DP and TP traffic keeps every
    PP row more than 10 % slow."""
    for row in (r for r in ROWS if r["pp"] > 1):
        plain = _error(plan_json(*_argv(row, tmp_path)), row)
        interleaved = _error(plan_json(*_argv(row, tmp_path, vpp=row["layers"] // row["pp"])), row)
        assert plain < interleaved < -0.10, (row["id"], plain, interleaved)
