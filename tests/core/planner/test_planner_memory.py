"""The planner's memory model against its sources: the ZeRO formulas, DeepSpeed's own
estimators, Korthikanti et al. 2022 activations and the 1F1B in-flight counts."""

import re

import pytest

from megakit.core.planner.memory import (
    activation_tensors,
    estimate_memory,
    in_flight_micro_batches,
    peak_memory,
    stage_params,
)
from megakit.core.planner.model_spec import known_shape
from megakit.errors import UsageError

GPT3 = known_shape("gpt3-175b")
S, H, A = 2048, 12288, 96


def per_layer(model, **kw):
    return sum(t.bytes(seq_len=S, micro_batch=1) for t in activation_tensors(model, **kw)) / (S * H)


def test_korthikanti_table2_coefficients():
    # Standard attention, 16-bit, dropout on: sbh(34 + 5as/h); the LayerNorm fp32 stats add < 0.01 %.
    assert per_layer(GPT3, flash_attention=False, dropout=True) == pytest.approx(34 + 5 * A * S / H, rel=1e-4)
    for t in (2, 4, 8):  # TP without SP: sbh(10 + 24/t + 5as/(ht)); with SP everything is divided by t
        assert per_layer(GPT3, tp=t, flash_attention=False, dropout=True) == pytest.approx(
            10 + 24 / t + 5 * A * S / (H * t), rel=1e-3
        )
        assert per_layer(GPT3, tp=t, sequence_parallel=True, flash_attention=False, dropout=True) == pytest.approx(
            (34 + 5 * A * S / H) / t, rel=1e-4
        )
    # Flash attention never stores the s x s scores: 34 + (fp32 log-sum-exp: 4 bytes x heads per token).
    assert per_layer(GPT3, flash_attention=True, dropout=True) == pytest.approx(34 + 4 * A / H, rel=1e-3)


def test_recompute_variants_keep_what_the_paper_says():
    kw = dict(
        tp=8,
        pp=1,
        dp=1,
        micro_batch=1,
        seq_len=S,
        flash_attention=False,
        dropout=True,
        sequence_parallel=True,
        stage="first",
    )
    full = estimate_memory(GPT3, recompute="full", **kw)
    selective = estimate_memory(GPT3, recompute="selective", **kw)
    none = estimate_memory(GPT3, recompute="none", **kw)
    assert full.activation_per_layer == pytest.approx(2 * S * H / 8)  # 2sbh/t: the block input only
    assert selective.activation_per_layer == pytest.approx(34 * S * H / 8, rel=1e-3)
    assert none.activation_per_layer == pytest.approx((34 + 5 * A * S / H) * S * H / 8, rel=1e-3)
    # Recomputing rebuilds one block's activations for one micro-batch during its backward.
    assert full.items["recompute_working_set"] == pytest.approx(none.activation_per_layer)


def test_in_flight_micro_batches_of_1f1b_and_interleaving():
    assert [in_flight_micro_batches(pp=4, stage=i, accumulation=8) for i in range(4)] == [4, 3, 2, 1]
    assert in_flight_micro_batches(pp=4, stage=0, accumulation=2) == 2  # fewer micro-batches than stages
    for p, v in ((4, 2), (8, 3), (16, 4)):  # Korthikanti: stage 0 holds p(1 + (p-1)/(pv)) micro-batches
        assert in_flight_micro_batches(pp=p, stage=0, accumulation=64, vpp=v) == pytest.approx(
            p * (1 + (p - 1) / (p * v))
        )


@pytest.mark.parametrize(
    "precision,zero,expected",
    [
        ("bf16", 0, lambda P, N: 2 * P + 2 * P + 4 * P + 8 * P + 4 * P),
        ("bf16", 1, lambda P, N: 4 * P + 16 * P / N),
        ("bf16", 2, lambda P, N: 2 * P + 18 * P / N),
        ("fp32", 0, lambda P, N: 16 * P),
        ("fp32", 1, lambda P, N: 8 * P + 16 * P / N),
        ("fp32", 2, lambda P, N: 4 * P + 20 * P / N),
        ("fp32", 3, lambda P, N: 24 * P / N),
    ],
)
def test_model_states_follow_the_zero_table(precision, zero, expected):
    model = known_shape("gpt3-1.3b")
    est = estimate_memory(model, dp=8, zero_stage=zero, precision=precision)
    assert est.model_states == pytest.approx(expected(est.params_local, 8))
    assert est.params_local == model.params


def _printed_gpu_gib(capsys, options_wanted):
    """The 'per GPU' column of the table DeepSpeed's *_all_cold estimator prints, for one options row."""
    for line in capsys.readouterr().out.splitlines():
        match = re.match(r"\s*[\d.]+GB \|\s*([\d.]+)GB \| (.*)$", line)
        if match and all(option in match.group(2) for option in options_wanted):
            return float(match.group(1))
    raise AssertionError(f"no row with {options_wanted}")


def test_model_states_agree_with_deepspeed_estimators(capsys):
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    gib = 2**30
    for name in ("gpt3-1.3b", "gpt3-13b", "llama-2-70b"):
        model = known_shape(name)
        psi = model.params
        for nodes, per_node in ((1, 8), (4, 8), (16, 8)):
            n = nodes * per_node
            # ZeRO-2. DeepSpeed: 2Ψ fp16 params + 18Ψ/N (2 grads + 4 fp32 grads + 4 master + 8 Adam): our items.
            capsys.readouterr()
            stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold(
                psi, num_gpus_per_node=per_node, num_nodes=nodes
            )
            ours = estimate_memory(model, dp=n, zero_stage=2)
            assert ours.model_states / gib == pytest.approx(
                _printed_gpu_gib(capsys, ["offload_optimizer=none"]), abs=0.006
            )
            # CPU offload: DeepSpeed keeps only the 16-bit params (2Ψ); we also count the 16-bit gradient
            # partition (2Ψ/N) that lives on the GPU until it is copied to the host.
            off = estimate_memory(model, dp=n, zero_stage=2, offload="optimizer")
            stage_1_and_2.estimate_zero2_model_states_mem_needs_all_cold(
                psi, num_gpus_per_node=per_node, num_nodes=nodes
            )
            assert (off.model_states - off.items["grads"]) / gib == pytest.approx(
                _printed_gpu_gib(capsys, ["offload_optimizer=", "cpu"]), abs=0.006
            )

            # ZeRO-3. DeepSpeed: 4·largest layer + 18Ψ/N. Ours: 16Ψ/N partitioned states plus the fp32
            # gradient of one optimizer sub-group at step (≤ 4Ψ/N, DeepSpeed says a flat 2Ψ/N), and the
            # gathered layers as a separate buffer (2 layers + prefetch; DeepSpeed: 2 bytes x 2 of the largest).
            stage3.estimate_zero3_model_states_mem_needs_all_cold(
                psi, model.largest_layer_params(), num_gpus_per_node=per_node, num_nodes=nodes
            )
            ds3 = _printed_gpu_gib(capsys, ["offload_param=none", "offload_optimizer=none", "zero_init=1"]) * gib
            _, _, largest = stage3.estimate_zero3_model_states_mem_needs(
                psi, model.largest_layer_params(), num_gpus_per_node=per_node, num_nodes=nodes, cpu_offload=False
            )
            ours3 = estimate_memory(model, dp=n, zero_stage=3)
            partitioned = ours3.model_states - ours3.items["fp32_step_grads"]
            assert partitioned == pytest.approx(16 * psi / n, rel=1e-9)
            assert partitioned + 2 * psi / n + largest == pytest.approx(ds3, abs=0.006 * gib)
            assert ours3.model_states + ours3.items["zero3_gather"] == pytest.approx(ds3, rel=0.35)


def test_embedding_on_first_stage_head_on_last_and_peak_picks_the_worst():
    model = known_shape("gpt3-175b")
    first = stage_params(model, tp=8, pp=16, stage=0)
    middle = stage_params(model, tp=8, pp=16, stage=5)
    last = stage_params(model, tp=8, pp=16, stage=15)
    assert first - middle == model.embedding_params(8)
    assert last - middle == model.head_params(8, separate=True)  # tied, but a copy lives on the last stage
    one_stage = stage_params(model, tp=1, pp=1, stage=0)
    assert one_stage == model.params  # tied head counted once
    layout = dict(
        tp=8, pp=16, dp=8, zero_stage=1, micro_batch=1, accumulation=64, recompute="selective", sequence_parallel=True
    )
    peak = peak_memory(model, **layout)
    assert peak.total == max(estimate_memory(model, stage=s, **layout).total for s in range(16))


def test_bad_layouts_are_usage_errors():
    with pytest.raises(UsageError):
        estimate_memory(GPT3, precision="fp8")
    with pytest.raises(UsageError):
        estimate_memory(GPT3, zero_stage=2, offload="params")
    with pytest.raises(UsageError):
        estimate_memory(GPT3, pp=4, stage=4)


@pytest.mark.parametrize("pp,m,vpp", [(4, 8, 1), (4, 2, 1), (4, 8, 2), (8, 16, 3), (16, 64, 4), (2, 4, 2)])
def test_in_flight_counts_agree_with_the_pipeline_simulator(pp, m, vpp):
    from megakit.core.schedules import build_schedule
    from megakit.core.simulator import simulate

    report = simulate(build_schedule("interleaved" if vpp > 1 else "1f1b", pp, m, vpp))
    simulated = [chunks / vpp for chunks in report.peak_in_flight]  # chunk activations, in stage units
    assert simulated == [in_flight_micro_batches(pp=pp, stage=i, accumulation=m, vpp=vpp) for i in range(pp)]


def test_stages_follow_the_trainers_split_and_peak_covers_middle_stages():
    from megakit.core.model_config import ModelConfig
    from megakit.core.partition import partition_layers
    from megakit.core.planner.memory import stage_layer_counts
    from megakit.core.planner.model_spec import ModelSpec

    llama = ModelSpec.from_config("llama-3-8b")
    config = ModelConfig.load("llama-3-8b")
    assert stage_layer_counts(llama, 4) == (7, 9, 9, 7)  # not the even 8, 8, 8, 8
    assert list(stage_layer_counts(llama, 4)) == [len(r) for r in partition_layers(config, 4)]
    chunks = partition_layers(config, 2, 2)
    assert stage_layer_counts(llama, 2, 2) == (len(chunks[0]) + len(chunks[2]), len(chunks[1]) + len(chunks[3]))
    assert estimate_memory(llama, pp=4, stage=1).layers == 9
    # one micro-batch in flight everywhere: the 14-block middle stages outweigh the 13 blocks + embedding
    layout = dict(tp=8, pp=7, dp=1, zero_stage=0, micro_batch=1, accumulation=1, recompute="full")
    assert stage_layer_counts(GPT3, 7) == (13, 14, 14, 14, 14, 14, 13)
    peak = peak_memory(GPT3, **layout)
    assert peak.stage not in (0, 6)
    for model, kwargs in (
        (GPT3, layout),
        (GPT3, {**layout, "accumulation": 64, "recompute": "none"}),
        (llama, dict(pp=4, dp=2, zero_stage=1, accumulation=2)),
        (llama, dict(pp=2, vpp=2, accumulation=8, recompute="selective")),
    ):
        pp = kwargs["pp"]
        assert peak_memory(model, **kwargs).total == max(
            estimate_memory(model, stage=s, **kwargs).total for s in range(pp)
        )
