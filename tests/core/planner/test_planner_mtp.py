"""The planner's MTP (``megakit plan --mtp``): DeepSeek-V3's prediction module charged to the last stage, pinned
against a hand derivation; and MLA's GEMMs at their own projection shapes."""

import json
import subprocess
import sys

import pytest

from megakit.core.planner.compute import _linears
from megakit.core.planner.memory import BACKWARD_ONLY, GIB, STEP_ONLY, _matmul_output_bytes, estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.stages import stage_moe_layers, virtual_stage_ranges
from megakit.errors import UsageError

H, V, N_HEADS, F_SHARED, EXPERTS, F_EXPERT = 7168, 129280, 128, 2048, 256, 2048  # models/deepseek-v3.json
Q_LORA, KV_LORA, D_NOPE, D_ROPE, D_V = 1536, 512, 128, 64, 128


def _spec(mtp: bool, split=None) -> ModelSpec:
    return ModelSpec.from_config("deepseek-v3").with_overrides(seq_len=4096, mtp=mtp, stage_layers=split)


def _module_params(tp: int) -> tuple[int, int]:
    """(dense parameters on one TP rank, routed-expert parameters) of DeepSeek-V3's one MTP module, by hand."""
    n = N_HEADS // tp
    mla = (
        H * Q_LORA
        + Q_LORA * n * (D_NOPE + D_ROPE)
        + H * (KV_LORA + D_ROPE)
        + KV_LORA * n * (D_NOPE + D_V)
        + n * D_V * H
    )  # q_a, q_b, kv_a_proj_with_mqa, kv_b, o_proj
    shared = 3 * H * F_SHARED  # replicated over TP (megakit.nn.moe.layer.SharedExpert)
    eh_proj = 2 * H * H // tp
    replicated = 2 * H + Q_LORA + KV_LORA + EXPERTS * H + 3 * H  # block norms, latent norms, router, enorm/hnorm/norm
    return mla + shared + eh_proj + replicated, EXPERTS * 3 * H * F_EXPERT


def _derived_extra(
    *, tp: int, dp: int, ep: int, pp: int, seq: int, in_flight: int, block_kept: float, block_routing: float
) -> dict:
    """The last stage's extra bytes with MTP (ZeRO 1, bf16, SP on, no recompute, one loss chunk), item by item."""
    dense, experts = _module_params(tp)
    dense += (V // tp) * H if pp > 1 else 0  # the embedding copy (V divides by 8: no padding)
    edp = tp * dp // ep
    hidden, rows = 2 * seq * H / tp, seq / tp  # one (S/tp, B, H) bf16 tensor under SP
    inputs = hidden + 2 * (hidden + 4 * rows) + 2 * hidden  # Emb, enorm/hnorm outputs + fp32 rstd, eh_proj's input
    logits = seq * ((2 * 2 * H + 4) / tp + 2 * H + 4 * (V // tp) + 10)  # norm, head input, fp32 softmax, targets
    return {
        "params": 2 * dense,
        "grads": 2 * dense,
        "master_params": 4 * dense / dp,
        "optimizer": 8 * dense / dp,
        "expert_params": 2 * experts / ep,
        "expert_grads": 2 * experts / ep,
        "expert_master_params": 4 * experts / ep / edp,
        "expert_optimizer": 8 * experts / ep / edp,
        "activations": in_flight * (block_kept + inputs),
        "moe_routing": in_flight * block_routing,
        "logits": logits,
    }


def _phase(est) -> float:
    """The larger of the step phase (fp32 step copies) and the backward phase (what activations hold)."""
    return max(sum(est.items.get(k, 0.0) for k in STEP_ONLY), sum(est.items.get(k, 0.0) for k in BACKWARD_ONLY))


PINNED_EXTRA_GIB = 4.51  # was 4.86: the experts' fp32 step copies now in the step phase (not the peak)


def test_mtp_last_stage_pp16_hand_derived():
    """PP 16 (the split as --mtp balances it, pinned both ways so only the module differs): the extra parameters,
    states and activations of the last stage are the module's, the embedding copy's, and one depth's logits."""
    split = tuple(len(r) for r in virtual_stage_ranges(_spec(True), 16))
    layout = dict(
        tp=8,
        pp=16,
        dp=8,
        ep=64,
        zero_stage=1,
        micro_batch=1,
        accumulation=16,
        seq_len=4096,
        sequence_parallel=True,
        stage="last",
    )
    with_mtp, without = (estimate_memory(_spec(m, split), **layout) for m in (True, False))
    n_moe = split[-1]  # every block of the last stage is an MoE one
    routing_per_block = without.items["moe_routing"] / n_moe
    derived = _derived_extra(
        tp=8,
        dp=8,
        ep=64,
        pp=16,
        seq=4096,
        in_flight=1,
        block_kept=without.activation_per_layer,
        block_routing=routing_per_block,
    )
    for item, extra in derived.items():
        assert with_mtp.items[item] - without.items[item] == pytest.approx(extra, rel=1e-9), item
    dense, _ = _module_params(8)
    dense += (V // 8) * H
    comm = 2 * dense / 8  # ZeRO 1's all-gather buffer: psi / DP, below the bucket
    assert with_mtp.items["comm_buffers"] - without.items["comm_buffers"] == pytest.approx(comm)
    _, experts = _module_params(8)
    step = 4 * dense / 8 + 4 * experts / 64  # the fp32 step copies (dense over DP, experts' over EDP 1)
    assert with_mtp.items["fp32_step_grads"] - without.items["fp32_step_grads"] == pytest.approx(step)
    # the peak holds the states, the buffers and the larger phase: the step's fp32 copies or what backward holds
    states = sum(v for k, v in derived.items() if k not in BACKWARD_ONLY)
    assert with_mtp.total - without.total == pytest.approx(states + comm + _phase(with_mtp) - _phase(without), rel=1e-9)
    assert (with_mtp.total - without.total) / GIB == pytest.approx(PINNED_EXTRA_GIB, abs=0.01)  # its routed experts


def test_mtp_refused_without_prediction_modules():
    with pytest.raises(UsageError, match="MTP asked of a model without prediction modules"):
        ModelSpec.from_config("llama-tiny").with_overrides(mtp=True)
    assert ModelSpec.from_config("llama-tiny").with_overrides(mtp=False).mtp == 0


def test_mtp_split_gives_the_last_stage_fewer_blocks():
    from megakit.core.planner.stages import stage_layer_counts

    plain, mtp = stage_layer_counts(_spec(False), 16), stage_layer_counts(_spec(True), 16)
    assert sum(mtp) == 61 and mtp[-1] < plain[-1]


def _plan(*flags) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from megakit.commands.cli import main; sys.exit(main())",
            "plan",
            "--model",
            "models/deepseek-v3.json",
            "--gpus",
            "1024",
            "--gpu",
            "h100-80gb",
            "--seq-len",
            "4096",
            "--json",
            *flags,
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_plan_mtp_cli_fits_with_ep_and_charges_the_derived_amount():
    report = _plan("--mtp")
    p = report["plan"]
    assert p["mtp"] == 1 and p["ep"] > 1 and p["fits"] == "yes"
    assert p["peak_memory_gib"] < 0.8 * 80
    assert "--mtp" in report["assumptions"]["launch"].split()
    # the same layout without --mtp, its last stage, against the derived extra (no embedding copy at PP 1)
    layout = dict(
        tp=p["tp"],
        pp=p["pp"],
        dp=p["dp"],
        ep=p["ep"],
        zero_stage=p["zero_stage"],
        micro_batch=p["micro_batch"],
        accumulation=p["grad_accum"],
        seq_len=4096,
        stage="last",
        sequence_parallel=p["sequence_parallel"],
        recompute=p["recompute"],
        loss_chunks=0,
        overhead_bytes=GIB,
    )
    assert p["zero_stage"] == 1 and p["recompute"] == "none" and p["sequence_parallel"]  # the derivation's case
    split = tuple(p["stage_layers"])
    with_mtp, without = (estimate_memory(_spec(m, split), **layout) for m in (True, False))
    assert with_mtp.items["activations"] / GIB == pytest.approx(p["memory"]["activations"])
    moe_blocks = stage_moe_layers(_spec(False, split), p["pp"])[-1]  # 58 of 61 at PP 1
    derived = _derived_extra(
        tp=p["tp"],
        dp=p["dp"],
        ep=p["ep"],
        pp=p["pp"],
        seq=4096,
        in_flight=1,
        block_kept=without.activation_per_layer,
        block_routing=without.items["moe_routing"] / moe_blocks,
    )
    # auto loss chunks: one here (4096 x 16160 fp32 logits are below 256 MiB), so the derivation's unchunked head
    extra = with_mtp.total - without.total
    comm = with_mtp.items["comm_buffers"] - without.items["comm_buffers"]
    states = sum(v for k, v in derived.items() if k not in BACKWARD_ONLY)
    assert extra == pytest.approx(states + comm + _phase(with_mtp) - _phase(without), rel=1e-9)
    plain = _plan()["plan"]
    assert "mtp" in plain and plain["mtp"] == 0


def test_mla_linears_at_their_own_shapes():
    """DeepSeek-V3 at TP 8: MLA's five projections, 36.6M multiply-adds per token on a rank without SP (the down
    projections replicated), not q, k, v, o at the 192-wide query: 88.1M."""
    spec = _spec(False)
    n = N_HEADS // 8
    hand = [
        (1.0, H, Q_LORA),
        (1.0, Q_LORA, n * (D_NOPE + D_ROPE)),
        (1.0, H, KV_LORA + D_ROPE),
        (1.0, KV_LORA, n * (D_NOPE + D_V)),
        (1.0, n * D_V, H),
    ]
    assert _linears(spec, 8, moe=True)[:5] == hand
    assert sum(r * k * m for r, k, m in hand) == 36_634_624
    sp = _linears(spec, 8, moe=True, sequence_parallel=True)
    assert [r for r, _, _ in sp[:5]] == [1 / 8, 1.0, 1 / 8, 1.0, 1.0]
    assert _linears(spec, 8, moe=True)[5:] == [(1.0, H, 256), (1.0, H, 256), (1.0, 256, H)]  # shared expert
    # zero bubble's gradients at the matmul outputs: the projections' widths, the latents over S/tp under SP
    width = Q_LORA / 8 + n * 192 + (KV_LORA + D_ROPE) / 8 + n * 256 + H + 2 * 18432 // 8 + H
    assert _matmul_output_bytes(
        spec, tp=8, precision="bf16", seq_len=4096, micro_batch=1, sequence_parallel=True
    ) == pytest.approx(2 * 4096 * width)
