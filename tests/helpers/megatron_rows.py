"""Narayanan et al. 2021's published runs (``tests/data/megatron-2021.json``) as planner cases, shared by the
planner's cost, calibration and kernel tests."""

import json

from paths import DATA

from megakit.core.planner.cost import estimate_cost
from megakit.core.planner.hardware import Cluster, gpu_preset
from megakit.core.planner.model_spec import ModelSpec
from megakit.core.planner.plan import Plan

ROWS = json.loads((DATA / "megatron-2021.json").read_text())["rows"]


A100 = gpu_preset("a100-80gb")


def _vpp(layers_per_stage: int) -> int:
    """The paper used the interleaved schedule without saying v: two chunks where the stage's layers
    split in two, else three, else none (a documented assumption of this test)."""
    return 2 if layers_per_stage % 2 == 0 else 3 if layers_per_stage % 3 == 0 else 1


def row_case(row):
    model = ModelSpec(
        name=row["id"],
        family="gpt2",
        layers=row["layers"],
        hidden=row["hidden"],
        heads=row["heads"],
        kv_heads=row["heads"],
        ffn=row["ffn"],
        vocab_size=row["vocab"],
        seq_len=row["seq_len"],
        max_seq_len=row["seq_len"],
        tie_embeddings=True,
        dropout=0.1,
    )
    n = row["num_gpus"]
    tp, pp = row["tp"], row["pp"]
    if tp is None:  # Table 2 PTD-P 175B rows give only t*p = 96; the GPT-3 estimate: docs/planning.md's 8 x 16
        tp = 8
        pp = n // (8 * row["dp"]) if row["dp"] else 16
    dp = n // (tp * pp)
    mb = row["micro_batch"] or 1
    # Megatron-LM's fused kernels (bias-GeLU, bias-dropout-add, masked softmax); its Table 2 ZeRO-3 is
    # DeepSpeed's of 2021, without today's prefetch and overlap.
    plan = Plan(
        tp=tp,
        pp=pp,
        dp=dp,
        vpp=_vpp(model.layers // pp) if pp > 1 else 1,
        zero_stage=3 if "ZeRO-3" in (row["zero_or_fsdp"] or "") else 0,
        micro_batch=mb,
        accumulation=row["global_batch_seqs"] // (mb * dp),
        recompute="full",
        precision="fp16",
        flash_attention=False,
        fused_kernels=True,
        zero3="deepspeed-2021",
    )
    assert plan.world == n and plan.global_batch == row["global_batch_seqs"]
    return model, plan, estimate_cost(model, Cluster(gpu=A100, num_gpus=n), plan)
