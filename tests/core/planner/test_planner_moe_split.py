"""DeepSeek-V3 at Megatron-Bridge's published layout (TP2 PP8 VPP4 EP64, 1,024 H100, seq 4096, micro-batch 1), planned
as a user types it (issue 45): the default split of a model whose first blocks are dense, and a verdict that names the
flags that make a pinned layout fit.

By parameters a dense block weighs 1/20 of DeepSeek-V3's MoE block, so the old default put its three dense blocks and
an MoE one in the first virtual stage, the one with the most micro-batches in flight (stage 0 peaked at 140 GiB, the
published split at 110). Dense blocks now weigh by their time beside MoE ones (``partition._dense_block_weight``)."""

import json

from megakit.core.model_config import PRESETS, ModelConfig
from megakit.core.partition import parse_stage_layers, partition_layers
from megakit.core.planner.memory import GIB, peak_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import RUNTIMES, Plan
from megakit.core.planner.search import OVERHEAD_BYTES
from megakit.core.planner.stages import virtual_stage_ranges

PUBLISHED = "1,2*30,0"  # 'Et|(tt|)*30mL'
TYPED = [
    "--model",
    "deepseek-v3",
    "--mtp",
    "--gpu",
    "h100-80gb",
    "--gpus",
    "1024",
    "--gpus-per-node",
    "8",
    "--seq-len",
    "4096",
    "--global-batch",
    "16384",
    "--tp",
    "2",
    "--pp",
    "8",
    "--vpp",
    "4",
    "--ep",
    "64",
    "--recompute",
    "selective",
    "--runtime",
    "megatron-core",
]


def _spec(split=None) -> ModelSpec:
    return ModelSpec.from_config("deepseek-v3").with_overrides(seq_len=4096, mtp=True, stage_layers=split)


def test_default_split_weighs_dense_blocks_by_time():
    """No virtual stage holds more than ceil(61 / 32) = 2 blocks (the old first one held the 3 dense blocks and an MoE
    one), and the default peaks no higher than the published split, with the run's own Megatron flags."""
    counts = [len(r) for r in virtual_stage_ranges(_spec(), 8, 4)]
    assert counts[0] == 1 and max(counts) == 2 and sum(counts) == 61, counts
    plan = Plan(
        tp=2,
        pp=8,
        dp=64,
        vpp=4,
        ep=64,
        zero_stage=1,
        micro_batch=1,
        accumulation=256,
        recompute="selective",
        recompute_modules=("mla_up_proj", "mlp"),
        sequence_parallel=True,
        moe_imbalance=1.0,
        reduce_precision="bf16",
        moments="bf16",
        fused_kernels=True,
        **RUNTIMES["megatron-core"],
    )
    default, published = (
        peak_memory(_spec(split), seq_len=4096, overhead_bytes=OVERHEAD_BYTES, **plan.memory_kwargs()).total / GIB
        for split in (None, parse_stage_layers(PUBLISHED))
    )
    assert default <= published < 64, (default, published)


def test_models_with_blocks_of_one_kind_keep_the_parameter_split(tmp_path):
    """Dense models and MoE models without dense blocks: the split is the parameter balance as before (each block
    weighs its parameters); a small MoE model with three dense first blocks is split by the trainer as by the
    planner."""
    from megakit.core.partition import _balanced_counts, layer_costs

    for name in ("llama-3-8b", "qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b"):
        config = ModelConfig.load(name)
        block, embedding, head = layer_costs(config, "params")
        assert len(set(block)) == 1
        assert [len(r) for r in partition_layers(config, 4, 2)] == _balanced_counts(
            [config.block_params(moe=config.moe is not None).total] * config.layers, embedding, head, 8
        )
    raw = json.loads((PRESETS / "deepseek-v3-tiny.json").read_text())
    raw.update(num_hidden_layers=8, first_k_dense_replace=3, n_routed_experts=64, moe_intermediate_size=64)
    (tmp_path / "tiny.json").write_text(json.dumps(raw))
    spec = ModelSpec.from_config(str(tmp_path / "tiny.json")).with_overrides(mtp=True)
    config = ModelConfig.load(tmp_path / "tiny.json")
    trainer = partition_layers(config, 4, 1, "params", mtp=config.mtp_depth(True))  # nn.model.build_stage_chunks
    assert tuple(trainer) == virtual_stage_ranges(spec, 4, 1)
    assert [len(r) for r in trainer] == [3, 2, 2, 1]  # by parameters: [4, 1, 2, 1], the dense blocks and an MoE one
    assert [len(r) for r in partition_layers(config, 4)] == [2, 2, 2, 2]  # no MTP module on the last stage


def test_pinned_layout_names_the_recompute_modules_that_fit(capsys, plan_json):
    """As typed with ZeRO and the micro-batch pinned (a judged layout) the default (core_attn) peaks over 80 GiB: the
    verdict names Megatron's --recompute-modules that fit (not --recompute full, which recomputes every block), and
    the command with them added fits under the line. Unpinned ZeRO and micro-batch: the search's 'no' names it too."""
    from megakit.commands.cli import main

    assert main(["plan", *TYPED, "--zero", "1", "--micro-batch", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "does not fit" in err, err
    fix = err.split("fix: ", 1)[1].split(" (peak")[0]
    assert fix.startswith("--recompute-modules ") and "mla_up_proj" in fix, err
    got = plan_json(*TYPED, "--zero", "1", "--micro-batch", "1", *fix.split())
    assert got["fits"] == "yes" and got["peak_memory_gib"] <= 64, got["peak_memory_gib"]
    assert main(["plan", *TYPED]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"fix: {fix} (peak" in err, err


def test_published_run_fits_without_its_split(plan_json):
    """The run's own flags without --stage-layers: under the 80 % line at the default split (it was above it, 68.6
    GiB, when the first virtual stage held four blocks)."""
    got = plan_json(
        *TYPED,
        "--zero",
        "1",
        "--micro-batch",
        "1",
        "--moe-routing",
        "balanced",
        "--recompute-modules",
        "mla_up_proj,mlp",
        "--main-grads",
        "bf16",
        "--adam-moments",
        "bf16",
        "--loss-chunks",
        "1",
    )
    assert got["fits"] == "yes" and got["peak_memory_gib"] <= 64, got["peak_memory_gib"]
