"""The DeepSpeed config a run uses: read, checked against the layout, adjusted for the pipeline.

The file stays DeepSpeed's own format (the presets in ``ds_configs/`` or what
``megakit plan --emit-config`` wrote); megakit only fills in what depends on the
layout (``train_batch_size = micro x accumulation x DP``) and refuses, in one
sentence, what cannot work: ZeRO 2-3 with PP > 1, optimizers this DeepSpeed lacks,
fp16 without a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megakit.errors import UsageError

MISSING_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")


def read_ds_config(source: str | dict) -> dict:
    """The ds_config file as a dict (a copy when given a dict); UsageError if missing or not JSON."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))
    path = Path(source)
    if not path.is_file():
        raise UsageError(f"--ds_config {source}: no such file; pass a DeepSpeed JSON config such as ds_configs/zero1.json")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(f"--ds_config {source} is not valid JSON ({error.msg} at line {error.lineno}); fix the file") from None
    if not isinstance(config, dict):
        raise UsageError(f"--ds_config {source} must hold a JSON object; see ds_configs/zero1.json")
    return config


def load_ds_config(source: str | dict, *, dp: int, pp: int) -> dict:
    """The ds_config as DeepSpeed will get it, checked against the layout (UsageError on any mistake)."""
    config = read_ds_config(source)
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if micro is None:
        if total is None or total % (accumulation * dp):
            raise UsageError("the ds_config needs train_micro_batch_size_per_gpu (or a train_batch_size divisible by "
                             f"gradient_accumulation_steps x DP = {accumulation} x {dp}); add it")
        micro = total // (accumulation * dp)
    if total is not None and total != micro * accumulation * dp:
        raise UsageError(f"train_batch_size {total} != micro-batch {micro} x accumulation {accumulation} x DP {dp}; "
                         "drop train_batch_size from the ds_config or make it match this layout")
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation,
                  train_batch_size=micro * accumulation * dp)
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if pp > 1 and stage >= 2:
        raise UsageError(f"ZeRO stage {stage} partitions gradients during every micro-batch's backward, which a "
                         f"pipeline (--pp {pp}) cannot accumulate; use ZeRO 0 or 1 with --pp > 1, or --pp 1")
    if pp > 1 and stage == 1 and config["zero_optimization"].get("overlap_comm"):
        raise UsageError("DeepSpeed allows zero_optimization.overlap_comm with ZeRO-1 only when it manages gradient "
                         f"accumulation, which a pipeline (--pp {pp}) does itself; set overlap_comm to false")
    optimizer = str(config.get("optimizer", {}).get("type", "")).lower()
    if optimizer in MISSING_OPTIMIZERS:
        import deepspeed

        raise UsageError(f"this DeepSpeed ({deepspeed.__version__}) no longer ships {config['optimizer']['type']} "
                         "(1-bit Adam/LAMB were removed); use another ds_config or a DeepSpeed release that has it")
    if config.get("fp16", {}).get("enabled") and not torch.cuda.is_available():
        raise UsageError("fp16 training needs a GPU (CPU kernels and DeepSpeed's loss scaler are GPU-only here); "
                         "use ds_configs/zero1.json (fp32) or bf16 on CPU")
    if pp > 1:
        config["managed_gradient_accumulation"] = False  # each engine.step() is the boundary
    return config
