"""The executor on real gloo processes: loss and every gradient equal the single-process model's.

One spawn of 4 ranks sweeps the layouts (PP = 4, PP = 2 x DP = 2, TP = 2 x PP = 2, DP = 4) and
schedules (1F1B, GPipe, interleaved, zero bubble's ZB-H1); each rank compares its own stage against a
single-process ``Transformer`` built from the same seed, on the same micro-batches.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import B, M, S, _batches, _equivalence_worker
from multiproc import run_ranks

from megakit.core.layout import Layout
from megakit.core.partition import partition_layers
from megakit.core.schedules import add_p2p, build_schedule, interleaved_compute
from megakit.errors import UsageError
from megakit.nn.model import (
    ModelConfig,
    Transformer,
    build_stage_chunks,
    full_state_dict,
)
from megakit.nn.pipeline.executor import PipelineExecutor
from megakit.nn.topology import Topology

# (model, tp, pp, schedule, vpp, layers or None, p2p[, micro-batches]); "+sp": TP with sequence parallelism
CASES = [
    ("gpt-tiny", 1, 4, "1f1b", 1, None, "async"),
    ("gpt-tiny", 1, 4, "1f1b", 1, None, "batched"),  # NCCL's way, run here on gloo
    ("gpt-tiny", 1, 4, "interleaved", 2, 8, "async"),
    ("llama-tiny", 1, 2, "1f1b", 1, None, "async"),
    ("gpt-tiny", 1, 2, "interleaved", 2, None, "async"),
    ("gpt-tiny", 1, 2, "gpipe", 1, None, "async"),
    ("llama-tiny", 2, 2, "1f1b", 1, None, "batched"),
    ("gpt-tiny+sp", 2, 2, "1f1b", 1, None, "async"),
    ("gpt-tiny", 2, 2, "interleaved", 2, None, "batched"),
    ("gpt-tiny", 1, 1, "interleaved", 2, None, "async"),  # DP = 4; both tied copies on one rank
    ("gpt-tiny", 1, 4, "zb-h1", 1, None, "async", 8),  # B and W split, W deferred: 4 stages, 8 micro-batches
    ("llama-tiny+sp", 2, 2, "zb-h1", 1, None, "batched"),  # with TP (SP's collectives in B) and NCCL's P2P
]


@pytest.mark.slow
def test_pipeline_matches_single_process_model():
    results = run_ranks(_equivalence_worker, 4, CASES, timeout_s=170)
    for i, case in enumerate(CASES):
        names = set()
        for rank_results in results:
            r = rank_results[i]
            assert r["loss_err"] < 1e-5, r
            assert r["grad_err"] < 1e-5, r
            assert r["weight_err"] < 1e-5, r
            names |= set(r["names"])
            if r["held"] is not None and case[6] == "batched" and r["sent"]:
                # batched P2P waits for its sends, so every output sent is freed (sent_output); interleaving's fused
                # pairs send one output together with a later receive, so it may still hold that one
                assert r["held"] <= (1 if case[3] == "interleaved" else 0), r
            elif r["held"] is not None and r["sent"]:  # gloo's isends are known done at the output's backward
                assert r["held"] >= 1, r
        config = ModelConfig.load(case[0].removesuffix("+sp"))
        if case[5]:
            config = config.replace(layers=case[5])
        assert names == {n for n, _ in Transformer(config).named_parameters()}, case  # every gradient checked


def test_partition_balances_and_validates():
    config = ModelConfig.load("gpt-tiny")
    assert partition_layers(config, 4) == [range(i, i + 1) for i in range(4)]
    assert partition_layers(config, 2, method=[1, 3]) == [range(0, 1), range(1, 4)]
    # a pinned split may leave the embedding's and the head's chunks without a block, even with more chunks than blocks
    assert partition_layers(config, 2, 2, method=[0, 2, 2, 0]) == [range(0, 0), range(0, 2), range(2, 4), range(4, 4)]
    assert len(partition_layers(config, 3, 2, method=[0, 1, 1, 1, 1, 0])) == 6
    with pytest.raises(UsageError, match="below 1 in the middle"):
        partition_layers(config, 2, 2, method=[2, 0, 2, 0])
    # a huge vocabulary pushes blocks away from the first and last stage
    big_vocab = config.replace(layers=12, vocab_size=64_000)
    counts = [len(r) for r in partition_layers(big_vocab, 4, method="flops")]
    assert sum(counts) == 12 and counts[-1] < counts[1] and counts[0] >= counts[-1]
    counts = [len(r) for r in partition_layers(big_vocab, 4, method="params")]
    assert counts[0] < counts[1] and counts[-1] < counts[2]
    with pytest.raises(UsageError, match="cannot fill"):
        partition_layers(config, 4, vpp=2)
    with pytest.raises(UsageError, match="sums to 3"):
        partition_layers(config, 2, method=[1, 2])
    with pytest.raises(UsageError, match="one per virtual stage"):
        partition_layers(config, 2, method=[1, 1, 2])
    with pytest.raises(UsageError, match="unknown partition"):
        partition_layers(config, 2, method="magic")


def test_more_virtual_stages_than_blocks_give_the_embedding_and_the_loss_stages_of_their_own():
    """Megatron's layouts ("E|t|...|t|L"): up to two virtual stages more than blocks, the balanced split leaves the
    first only the embedding and the last only the final norm, head and loss (one of them with one stage more, the
    costlier alone); beyond that, one line. ``N*K`` writes K stages of N blocks in --stage-layers."""
    from megakit.core.partition import parse_stage_layers

    config = ModelConfig.load("gpt-tiny")  # 4 blocks; the embedding (token + positions) outweighs the tied head
    assert [len(r) for r in partition_layers(config, 2, 3)] == [0, 1, 1, 1, 1, 0]
    assert [len(r) for r in partition_layers(config, 5)] == [0, 1, 1, 1, 1]
    assert [len(r) for r in partition_layers(config, 5, method="flops")] == [1, 1, 1, 1, 0]  # the lookup is free
    qwen = ModelConfig.load("qwen3-235b-a22b")  # 94 blocks on PP 32 x VPP 3
    assert [len(r) for r in partition_layers(qwen, 32, 3)] == [0] + [1] * 94 + [0]
    with pytest.raises(
        UsageError,
        match=r"^4 layers cannot fill --pp 7 x --vpp 1 = 7 virtual stages, even with an "
        r"embedding-only first and a loss-only last one; .* at most 6 virtual",
    ):
        partition_layers(config, 7)
    assert parse_stage_layers("0,1*94,0") == (0,) + (1,) * 94 + (0,)
    assert parse_stage_layers("3,2*2,3") == (3, 2, 2, 3) and parse_stage_layers(None) is None
    for bad in ("1*0", "2;2", "1*x", "*3", "1*-2", "2*"):
        with pytest.raises(UsageError, match="is not a list of layer counts; .* N\\*K for K stages of N"):
            parse_stage_layers(bad)
    with pytest.raises(UsageError, match="sums to 96 layers but the model has 94"):
        partition_layers(qwen, 32, 3, method=parse_stage_layers("1*96"))
    with pytest.raises(UsageError, match="below 1 in the middle"):
        partition_layers(qwen, 32, 3, method=parse_stage_layers("1,0,1*93,1"))


def _deepspeed_worker(rank, world_size):
    """PP = 2 x DP = 2 with one DeepSpeed engine (ZeRO-1) per stage, driven through the pluggable hooks."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the running process group
    config = ModelConfig.load("gpt-tiny")  # tied embeddings: first and last stage sync them
    topo = Topology(Layout.for_world(world_size, pp=2))
    all_ids, all_labels, ids, labels = _batches(config, topo.dp_rank, topo.dp, seed=5)
    ref = Transformer(config, seed=3)
    torch.stack([ref(x, y) for x, y in zip(all_ids, all_labels)]).mean().backward()
    lr = 0.1
    assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0) > 1.0  # clipping is part of the check
    with torch.no_grad():
        for p in ref.parameters():
            p -= lr * p.grad

    chunks = build_stage_chunks(config, topo, seed=3)
    stage = torch.nn.ModuleList(chunks)
    ds_config = {
        "train_micro_batch_size_per_gpu": B,
        "gradient_accumulation_steps": M,
        "zero_optimization": {"stage": 1},
        "managed_gradient_accumulation": False,
        "zero_allow_untested_optimizer": True,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(
        model=stage, optimizer=torch.optim.SGD(stage.parameters(), lr=lr), config=ds_config, mpu=topo
    )

    def backward(scalar, is_loss):  # DeepSpeed scales the loss by 1 / gradient_accumulation_steps
        engine.backward(scalar, scale_wrt_gas=is_loss)

    executor = PipelineExecutor(
        chunks,
        topo,
        schedule=build_schedule("1f1b", 2, M),
        backward=backward,
        activation_shape=(S, B, config.hidden),
        reduce_grads=lambda: None,
        optimizer_step=engine.step,
    )
    with pytest.raises(UsageError, match="micro-batch"):
        executor.step(ids[:1] if topo.is_first_stage else None, labels[:1] if topo.is_last_stage else None)
    with pytest.raises(UsageError, match="stages"):
        PipelineExecutor(chunks, topo, schedule=build_schedule("1f1b", 4, M))
    unfused = add_p2p(interleaved_compute(2, M, 2))  # deadlocks where a send waits for its receive
    with pytest.raises(UsageError, match="not deadlock-free with batched"):
        PipelineExecutor(chunks * 2, topo, schedule=unfused, p2p="batched", activation_shape=(S, B, config.hidden))
    loss = executor.step(ids if topo.is_first_stage else None, labels if topo.is_last_stage else None)
    ref_params = dict(ref.named_parameters())
    err = max((w - ref_params[n]).abs().max().item() for n, w in full_state_dict(stage[0], topo).items())
    return loss, err


@pytest.mark.slow
def test_pipeline_drives_one_deepspeed_engine_per_stage():
    results = run_ranks(_deepspeed_worker, 4, timeout_s=170)
    losses = {round(loss, 6) for loss, _ in results}
    assert len(losses) == 1, results  # every rank reports the step's mean loss
    assert max(err for _, err in results) < 1e-5, results


def _bf16_fp32_accumulation_worker(rank, world_size, sum_tied: bool):
    """PP = 2 in bf16 with fp32 gradient accumulation (DeepSpeed's bf16 optimizer), through the trainer's hooks."""
    import deepspeed

    from megakit.train.engine.dp_sync import gradient_of
    from megakit.train.engine.ds_config import load_ds_config

    deepspeed.init_distributed(dist_backend="gloo")
    config = ModelConfig.load("gpt-tiny")  # tied embeddings: the head's copy on the last stage
    topo = Topology(Layout.for_world(world_size, pp=2))
    _, _, ids, labels = _batches(config, 0, 1, seed=5)
    lr = 0.1
    stage = torch.nn.ModuleList(build_stage_chunks(config, topo, seed=3))
    ds_config = load_ds_config(
        {
            "train_micro_batch_size_per_gpu": B,
            "gradient_accumulation_steps": M,
            "bf16": {"enabled": True},
            "data_types": {"grad_accum_dtype": "fp32"},
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
        dp=1,
        pp=2,
    )
    engine, *_ = deepspeed.initialize(
        model=stage, optimizer=torch.optim.SGD(stage.parameters(), lr=lr), config=ds_config, mpu=topo
    )

    def backward(scalar, is_loss):
        engine.backward(scalar, scale_wrt_gas=is_loss)

    executor = PipelineExecutor(
        list(stage),
        topo,
        schedule=build_schedule("1f1b", 2, M),
        backward=backward,
        activation_shape=(S, B, config.hidden),
        activation_dtype=torch.bfloat16,
        reduce_grads=lambda: None,
        optimizer_step=engine.step,
        gradient=gradient_of(engine) if sum_tied else None,
    )
    executor.step(ids if topo.is_first_stage else None, labels if topo.is_last_stage else None)
    return type(engine.optimizer).__name__, full_state_dict(stage[0], topo)["embed.weight"].float().tolist()


@pytest.mark.slow
def test_bf16_with_fp32_accumulation_sums_the_tied_copies_where_it_steps():
    """DeepSpeed's bf16 optimizer adds each micro-batch's bf16 gradient into fp32 accumulators and steps from
    there, so the tied embedding's two copies must be summed there (``dp_sync.gradient_of``): summed on
    ``.grad`` after the last backward, the sum never reaches the step and each copy steps with its own part."""
    (opt, first), (_, last) = run_ranks(_bf16_fp32_accumulation_worker, 2, True, timeout_s=170)  # each stage's copy
    assert opt == "BF16_Optimizer"
    assert first == last  # the embedding and the head's copy stepped with the same gradient
    (_, first), (_, last) = run_ranks(_bf16_fp32_accumulation_worker, 2, False, timeout_s=170)
    assert first != last  # on .grad the sum is lost: the copies drift apart
