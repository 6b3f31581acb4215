"""The planner and context parallelism: memory and cost of a CP plan, the long-context search, the --cp pin."""

import json

import pytest

from megakit.commands import cli
from megakit.core.planner.compute import attention_time, cp_kernel_seq
from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan

LONG = 131072


def _llama8b() -> ModelSpec:
    return ModelSpec.from_config("llama-3-8b").with_overrides(seq_len=LONG)


def test_cp_divides_activations_and_shards_zero_over_dp_x_cp():
    model = _llama8b()
    one = estimate_memory(model, tp=2, dp=1, zero_stage=1, recompute="full", sequence_parallel=True)
    four = estimate_memory(model, tp=2, dp=1, cp=4, zero_stage=1, recompute="full", sequence_parallel=True)
    assert four.items["activations"] == pytest.approx(one.items["activations"] / 4)
    assert four.items["logits"] == pytest.approx(one.items["logits"] / 4)
    assert four.items["optimizer"] == pytest.approx(one.items["optimizer"] / 4)  # ZeRO-1 over DP x CP = 4
    assert four.items["params"] == one.items["params"]  # every CP rank holds the weights


def test_ring_traffic_hides_behind_attention_inside_a_node_and_not_across_slow_nodes():
    model = _llama8b()
    plan = Plan(tp=1, cp=8, dp=1, zero_stage=1, micro_batch=1, accumulation=16, recompute="full")
    inside = estimate_cost(model, Cluster(gpu=gpu_preset("a100-80gb"), num_gpus=8, gpus_per_node=8), plan)
    assert (
        inside.cp_comm_s < 1e-6 * inside.step_time_s
    )  # K/V blocks arrive before the previous block's attention is done
    short = model.with_overrides(seq_len=8192)
    slow = Cluster(gpu=gpu_preset("a100-80gb"), num_gpus=8, gpus_per_node=1).with_overrides(inter_gbps=1.0)
    assert estimate_cost(short, slow, plan, seq_len=8192).cp_comm_s > 0.01  # a short sequence over a slow network


def _plan(capsys, *argv):
    code = cli.main(["plan", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_llama3_8b_at_128k_tokens_on_8_gpus_picks_context_parallelism(capsys):
    code, out, err = _plan(capsys, "--model", "llama-3-8b", "--seq-len", str(LONG), "--gpus", "8", "--json")
    assert code == 0, err
    report = json.loads(out)
    p = report["plan"]
    assert p["cp"] > 1 and p["tp"] * p["cp"] <= 8  # CP (and TP) inside the node
    assert p["tp"] * p["cp"] * p["pp"] * p["dp"] == 8
    assert p["peak_memory_gib"] <= 0.8 * p["gpu_memory_gib"]
    assert f"--cp {p['cp']}" in report["assumptions"]["launch"]
    assert p["cp_mode"] in ("ring", "a2a", "hybrid") and p["cp_mode_note"].startswith(p["cp_mode"])  # and why
    assert "x the tokens/s of" in p["cp_mode_note"]  # Llama-3-8B's 32 heads allow each: priced against the others


def test_ulysses_prices_its_all_to_alls_and_is_launched_as_planned(capsys):
    """--cp-mode a2a: four all-to-alls of q, k, v and the output a block, forward and backward (and in the recompute),
    not overlapped: on NVLink cheaper than the ring at a short sequence whose ring is not hidden; pinned, the launch
    command carries it; heads that CP does not divide are refused in one line."""
    model = _llama8b().with_overrides(seq_len=8192)
    cluster = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=8, gpus_per_node=8)
    ring = Plan(tp=1, cp=8, dp=1, zero_stage=1, micro_batch=1, accumulation=16, recompute="none")
    a2a = estimate_cost(model, cluster, Plan(**{**ring.__dict__, "cp_mode": "a2a"}), seq_len=8192)
    assert a2a.cp_comm_s > 0 and a2a.tokens_per_s != estimate_cost(model, cluster, ring, seq_len=8192).tokens_per_s
    code, out, err = _plan(
        capsys,
        "--model",
        "llama-3-8b",
        "--seq-len",
        str(LONG),
        "--gpus",
        "8",
        "--cp",
        "8",
        "--cp-mode",
        "a2a",
        "--json",
    )
    assert code == 0, err
    report = json.loads(out)
    assert report["plan"]["cp_mode"] == "a2a" and "--cp 8 --cp-mode a2a" in report["assumptions"]["launch"]
    code, _, err = _plan(
        capsys,
        "--model",
        "llama-3-8b",
        "--seq-len",
        str(LONG),
        "--gpus",
        "64",
        "--cp",
        "8",
        "--tp",
        "8",
        "--cp-mode",
        "a2a",
    )
    assert (
        code == 2
        and err.count("\n") == 1
        and "--cp-mode a2a splits each TP rank's 4 attention heads over --cp 8" in err
    ), err


def test_the_mode_follows_the_node_a2a_inside_hybrid_across_ring_where_heads_forbid(capsys):
    """Llama-3-8B at 32k tokens, CP pinned: a2a inside one node of H100s; across 4 nodes hybrid (a2a over the
    node's 8 GPUs, a ring of 4 across the nodes), which the launch command carries; at TP 8 each rank keeps 4 heads,
    which CP 8 cannot split: the ring, saying why. The ring's chunk pairs are short (32k / (2 x 32) = 512 tokens),
    so its attention alone runs slower than Ulysses' over the whole sequence (the per-block kernel time)."""

    def planned(*argv):
        code, out, err = _plan(
            capsys, "--model", "llama-3-8b", "--seq-len", "32768", "--gpu", "h100-80gb", *argv, "--json"
        )
        assert code == 0, err
        return json.loads(out)

    inside, across = planned("--gpus", "8", "--cp", "8"), planned("--gpus", "32", "--cp", "32")
    assert (inside["plan"]["cp_mode"], inside["plan"]["cp_a2a"]) == ("a2a", 8)
    assert (across["plan"]["cp_mode"], across["plan"]["cp_a2a"]) == ("hybrid", 8)
    assert "--cp 32 --cp-mode hybrid --cp-a2a 8" in across["assumptions"]["launch"]
    assert "CP=32(ring)" in across["plan"]["cp_mode_note"] and "CP=32(a2a)" in across["plan"]["cp_mode_note"]
    heads = planned("--gpus", "64", "--cp", "8", "--tp", "8")["plan"]
    assert heads["cp_mode"] == "ring" and "a2a would split each TP rank's 4 heads over CP 8" in heads["cp_mode_note"]
    model = _llama8b().with_overrides(seq_len=32768)
    cluster = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=32, gpus_per_node=8)
    ring = Plan(tp=1, cp=32, dp=1, zero_stage=1, micro_batch=1, accumulation=16, recompute="none")
    a2a = Plan(**{**ring.__dict__, "cp_mode": "a2a"})
    hybrid = Plan(**{**ring.__dict__, "cp_mode": "hybrid", "cp_a2a": 8})
    attention = {
        p.cp_mode: attention_time(
            model,
            cluster.gpu,
            tp=1,
            seq_len=32768,
            micro_batch=1,
            flash=True,
            peak=1e15,
            nbytes=2,
            kernel_seq=cp_kernel_seq(p, 32768),
        )[0]
        for p in (ring, a2a, hybrid)
    }
    assert [cp_kernel_seq(p, 32768) for p in (ring, a2a, hybrid)] == [512, 32768, 4096]  # hybrid: a ring of 4
    assert attention["ring"] > 1.9 * attention["a2a"] and attention["a2a"] < attention["hybrid"] < attention["ring"]
    speed = {p.cp_mode: estimate_cost(model, cluster, p, seq_len=32768).tokens_per_s for p in (ring, a2a, hybrid)}
    assert speed["hybrid"] > max(speed["ring"], speed["a2a"])


def test_hybrid_pins_are_checked_in_one_line(capsys):
    for argv, needle in (
        (["--cp", "8", "--cp-mode", "hybrid", "--cp-a2a", "3"], "--cp-a2a 3 must be above 1, below --cp 8"),
        (["--cp", "8", "--cp-a2a", "2"], "--cp-a2a 2 sets the all-to-all degree of --cp-mode hybrid"),
        (["--cp", "2", "--cp-mode", "hybrid"], "it must be above 1, below --cp 2"),
    ):
        code, _, err = _plan(capsys, "--model", "llama-3-8b", "--seq-len", "32768", "--gpus", "8", *argv)
        assert code == 2 and err.count("\n") == 1 and needle in err, (argv, err)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--cp", "3"], "--cp 3 does not divide the sequence"),
        (["--cp", "16"], "--cp 16 (x --tp 1 x --pp 1) does not divide the 8 GPUs"),
    ],
)
def test_a_pinned_cp_that_does_not_divide_is_refused_in_one_line(argv, needle, capsys):
    code, _, err = _plan(capsys, "--params", "8B", "--seq-len", str(LONG), "--gpus", "8", *argv)
    assert code == 2
    assert err.startswith("megakit plan: error: ") and err.count("\n") == 1 and needle in err, err


def test_pinned_cp_is_planned_and_judged(capsys):
    code, out, err = _plan(capsys, "--params", "8B", "--seq-len", "32768", "--gpus", "8", "--cp", "2", "--json")
    assert code == 0, err
    p = json.loads(out)["plan"]
    assert p["cp"] == 2 and p["tp"] * p["cp"] * p["pp"] * p["dp"] == 8


def test_a_window_within_a_chunk_prices_the_neighbours_k_v_not_the_ring():
    """gpt-oss-120b at 32k tokens, CP 8 (TP 1) over a network slow enough that the attention hides nothing. Each rank
    holds 4096 tokens: its K/V block is 2 x 4096 x 8 KV heads x 64 x 2 bytes (bf16) = 8 MiB, its gradients 16 MiB
    (fp32). A full block (the ring): forward 7 blocks, backward 7 more and 8 of gradients, 56 + 184 = 240 MiB. A
    sliding block (window 128 within a chunk of 32k / 16 = 2048 tokens): one chunk of K/V from each neighbour (one
    block) forward, again backward with their gradients, 8 + 24 = 32 MiB. Half the blocks slide: 136 MiB a block
    on average, at 0.01 GB/s x 0.63 (the network's efficiency). At 1024 tokens the chunks (64) are shorter than the
    window: every block keeps the full ring, 30 blocks of 256 KiB."""
    from megakit.core.planner.cost import _ring_exposed

    model = ModelSpec.from_config("gpt-oss-120b").with_overrides(seq_len=32768)
    slow = Cluster(gpu=gpu_preset("h100-80gb"), num_gpus=8, gpus_per_node=1).with_overrides(inter_gbps=0.01)
    plan = Plan(tp=1, cp=8, micro_batch=1, accumulation=1)
    rate, mib = 0.01e9 * 0.63, 2**20

    def exposed(seq_len):
        return _ring_exposed(model, slow, plan, tokens=seq_len // 8, nbytes=2, peak=1e15, seq_len=seq_len)

    assert exposed(32768) == pytest.approx(136 * mib / rate, rel=1e-3)  # 240 MiB with the ring on every block
    assert exposed(1024) == pytest.approx(30 * 256 * 1024 / rate, rel=1e-3)


def test_the_ring_prices_mla_values_at_their_own_width():
    """DeepSeek-V3 at CP 2 (TP 1): a rank's K/V block of 4096 tokens is 128 heads x (192 + 128) x 2 bytes a token,
    as the ring sends it (``megakit.nn.attention.transport.pack``), not 2 x 192 (values padded to the key width, 20 %
    more); Llama's equal widths give 2 x 8 KV heads x 128 as before."""
    from megakit.core.planner.cost import _ring_block_bytes

    plan = Plan(tp=1, cp=2, micro_batch=1, accumulation=1)
    dsv3 = ModelSpec.from_config("deepseek-v3").with_overrides(seq_len=8192)
    assert _ring_block_bytes(dsv3, plan, tokens=4096, nbytes=2) == 4096 * 128 * (192 + 128) * 2
    assert _ring_block_bytes(_llama8b(), plan, tokens=4096, nbytes=2) == 4096 * 2 * 8 * 128 * 2
