"""The DeepSpeed config a run uses: read, validated, checked against the layout, adjusted for the pipeline.

The file stays DeepSpeed's own format (the presets in ``ds_configs/`` or what
``megakit plan --emit-config`` wrote). It is validated completely before any process
exists, because DeepSpeed would otherwise fail mid-start on every rank with a traceback
(a misspelt ``optimiser`` ends in ``AttributeError: 'NoneType' object has no attribute
...``): unknown keys get a "did you mean", wrong types and missing sections one line each,
and the ZeRO section goes through DeepSpeed's own config model. megakit then fills in what
depends on the layout (``train_batch_size = micro x accumulation x DP``) and refuses, in
one sentence, what cannot work: ZeRO 2 with PP > 1, optimizers this DeepSpeed lacks,
fp16 without a GPU.
"""

from __future__ import annotations

import difflib
import importlib
import json
from pathlib import Path

import torch

from megakit.errors import UsageError

# DeepSpeed's schedules that end at total_num_steps (the others, WarmupLR and OneCycle, have no end)
SCHEDULES_WITH_AN_END = ("WarmupCosineLR", "WarmupDecayLR")
MISSING_OPTIMIZERS = ("onebitadam", "zerooneadam", "onebitlamb")
POSITIVE_INTEGERS = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "steps_per_print",
)
SECTIONS = (
    "optimizer",
    "scheduler",
    "zero_optimization",
    "bf16",
    "fp16",
    "comms_logger",
    "activation_checkpointing",
    "flops_profiler",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "aio",
    "data_types",
)
# where DeepSpeed names its config keys; their union is the set of keys it knows
_KEY_MODULES = (
    "deepspeed.runtime.constants",
    "deepspeed.runtime.zero.constants",
    "deepspeed.comm.constants",
    "deepspeed.profiling.constants",
    "deepspeed.autotuning.constants",
    "deepspeed.elasticity.constants",
    "deepspeed.compression.constants",
    "deepspeed.runtime.data_pipeline.constants",
    "deepspeed.nebula.constants",
    "deepspeed.runtime.swap_tensor.constants",
    "deepspeed.checkpoint.constants",
    "deepspeed.runtime.activation_checkpointing.config",
)
_MORE_KEYS = (
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "compile",
    "hybrid_engine",
    "weight_quantization",
    "torch_autocast",
    "zenflow",
    "tensor_parallel",
    "timers",
    "data_types",
    "pipeline",
)


def known_keys() -> set[str]:
    """Every top-level key DeepSpeed reads (a superset: the constants name nested keys too)."""
    keys = set(_MORE_KEYS + SECTIONS + POSITIVE_INTEGERS)
    for name in _KEY_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        keys |= {v for k, v in vars(module).items() if k.isupper() and isinstance(v, str) and v.islower()}
    return keys


def _did_you_mean(key: str, known) -> str:
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}?" if close else "remove it (DeepSpeed would ignore it)"


def validate_ds_config(config: dict) -> None:
    """UsageError naming the first problem: an unknown key, a wrong type, a missing section, a bad ZeRO field."""
    known = known_keys()
    for key in config:
        if key not in known:
            raise UsageError(f"the ds_config has an unknown key {key!r}; {_did_you_mean(key, known)}")
    for key in POSITIVE_INTEGERS:
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise UsageError(f"ds_config {key} must be a positive integer, got {value!r}")
    clipping = config.get("gradient_clipping", 0.0)
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping < 0:
        raise UsageError(f"ds_config gradient_clipping must be a number >= 0 (0: off), got {clipping!r}")
    for key in SECTIONS:
        if key in config and not isinstance(config[key], dict):
            raise UsageError(f"ds_config {key} must be a JSON object, got {config[key]!r}")
    optimizer = config.get("optimizer", {"type": "none"})
    if not isinstance(optimizer.get("type"), str):
        raise UsageError(f'ds_config optimizer needs a "type" such as "AdamW", got {optimizer.get("type")!r}')
    if not isinstance(optimizer.get("params", {}), dict):
        raise UsageError(f"ds_config optimizer.params must be a JSON object, got {optimizer['params']!r}")
    for key in ("bf16", "fp16"):
        enabled = config.get(key, {}).get("enabled", False)
        if not isinstance(enabled, bool):
            raise UsageError(f"ds_config {key}.enabled must be true or false, got {enabled!r}")
    if "zero_optimization" in config:
        _validate_zero(config["zero_optimization"])


def require_optimizer(config: dict) -> None:
    """The trainer lets DeepSpeed build the optimizer, so the ds_config must say which."""
    if "optimizer" not in config:
        raise UsageError(
            'the ds_config has no "optimizer" section (megakit lets DeepSpeed build the optimizer); add '
            'one, e.g. "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}'
        )


def _validate_zero(section: dict) -> None:
    """Through DeepSpeed's own model of the section (pydantic, unknown fields forbidden)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**section)
    except ValidationError as error:
        first = error.errors()[0]
        where = "zero_optimization." + ".".join(str(part) for part in first["loc"])
        if first["type"] == "extra_forbidden":
            fields = set(DeepSpeedZeroConfig.model_fields)
            fields |= {f.alias for f in DeepSpeedZeroConfig.model_fields.values() if f.alias}
            raise UsageError(
                f"the ds_config has an unknown key {where!r}; {_did_you_mean(str(first['loc'][-1]), fields)}"
            ) from None
        raise UsageError(f"ds_config {where}: {first['msg'].lower()}, got {first.get('input')!r}") from None


def read_ds_config(source: str | dict) -> dict:
    """The ds_config file as a dict (a copy when given a dict); UsageError if missing or not JSON."""
    if isinstance(source, dict):
        return json.loads(json.dumps(source))
    path = Path(source)
    if not path.is_file():
        raise UsageError(
            f"--ds_config {source}: no such file; pass a DeepSpeed JSON config such as ds_configs/zero1.json"
        )
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise UsageError(
            f"--ds_config {source} is not valid JSON ({error.msg} at line {error.lineno}); fix the file"
        ) from None
    if not isinstance(config, dict):
        raise UsageError(f"--ds_config {source} must hold a JSON object; see ds_configs/zero1.json")
    return config


def load_ds_config(source: str | dict, *, dp: int, pp: int) -> dict:
    """The ds_config as DeepSpeed will get it, checked against the layout (UsageError on any mistake)."""
    config = read_ds_config(source)
    validate_ds_config(config)
    micro = config.get("train_micro_batch_size_per_gpu")
    accumulation = config.get("gradient_accumulation_steps", 1)
    total = config.get("train_batch_size")
    if micro is None:
        if total is None or total % (accumulation * dp):
            raise UsageError(
                "the ds_config needs train_micro_batch_size_per_gpu (or a train_batch_size divisible by "
                f"gradient_accumulation_steps x DP = {accumulation} x {dp}); add it"
            )
        micro = total // (accumulation * dp)
    if total is not None and total != micro * accumulation * dp:
        raise UsageError(
            f"train_batch_size {total} != micro-batch {micro} x accumulation {accumulation} x DP {dp}; "
            "drop train_batch_size from the ds_config or make it match this layout"
        )
    config.update(
        train_micro_batch_size_per_gpu=micro,
        gradient_accumulation_steps=accumulation,
        train_batch_size=micro * accumulation * dp,
    )
    stage = int(config.get("zero_optimization", {}).get("stage", 0))
    if pp > 1 and stage == 2:  # its copy-or-add of each backward's partitions follows forwards (as stage 3's did)
        raise UsageError(
            f"ZeRO 2 with --pp {pp}: megakit accumulates a pipeline's gradients under ZeRO 0, 1 and 3 "
            "only; use ZeRO 1 or 3 (ds_configs/zero1.json, zero3.json) with --pp > 1, or --pp 1"
        )
    if (
        pp > 1
        and stage == 3
        and (config["zero_optimization"].get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
    ):
        raise UsageError(
            f"ZeRO 3 with zero_optimization.offload_optimizer and --pp {pp}: megakit counts a "
            "pipeline's gradient norm on the partitions kept on the device; drop offload_optimizer, or "
            "use --pp 1"
        )
    if pp > 1 and stage == 1 and config["zero_optimization"].get("overlap_comm"):
        raise UsageError(
            "DeepSpeed allows zero_optimization.overlap_comm with ZeRO-1 only when it manages gradient "
            f"accumulation, which a pipeline (--pp {pp}) does itself; set overlap_comm to false"
        )
    optimizer = str(config.get("optimizer", {}).get("type", "")).lower()
    if optimizer in MISSING_OPTIMIZERS:
        import deepspeed

        raise UsageError(
            f"this DeepSpeed ({deepspeed.__version__}) no longer ships {config['optimizer']['type']} "
            "(1-bit Adam/LAMB were removed); for 1-bit compressed DP with error feedback use AdamW with "
            "ZeRO 0 (ds_configs/zero0.json) and the trainer's --compress sign"
        )
    if config.get("fp16", {}).get("enabled") and not torch.cuda.is_available():
        raise UsageError(
            "fp16 training needs a GPU (CPU kernels and DeepSpeed's loss scaler are GPU-only here); "
            "use ds_configs/zero1.json (fp32) or bf16 on CPU"
        )
    if pp > 1:
        config["managed_gradient_accumulation"] = False  # each engine.step() is the boundary
    fuse_adam(config, cuda=torch.cuda.is_available())
    return config


def fuse_adam(config: dict, *, cuda: bool) -> None:
    """On a GPU, torch's Adam/AdamW (``torch_adam``) runs fused: one kernel updates every parameter instead of
    a loop of small ones (+1.5-2 MFU points at Llama-3-8B, torchtitan PR #355). A ``fused`` or ``foreach`` the
    ds_config sets wins; CPU runs and an optimizer offloaded to the CPU stay as they are."""
    optimizer = config.get("optimizer", {})
    params = optimizer.get("params", {})
    offloaded = config.get("zero_optimization", {}).get("offload_optimizer")
    if (
        cuda
        and not offloaded
        and str(optimizer.get("type", "")).lower() in ("adam", "adamw")
        and params.get("torch_adam")
        and "fused" not in params
        and params.get("foreach") is None
    ):
        optimizer["params"] = {**params, "fused": True}


def schedule_over_steps(config: dict, *, steps: int, resumed: int | None = None) -> str:
    """Give ``config``'s LR schedule ``total_num_steps = steps`` (``--steps``) where the file leaves it out, so a
    200-step fine-tune decays over its 200 steps; a ``total_num_steps`` the file sets is kept (the file pins it, as
    ``megakit plan --emit-config`` does for a token budget). ``resumed``: the length the loaded checkpoint's run
    scheduled, kept over ``--steps`` so that a resume continues its schedule instead of jumping to another curve.
    Returns the line that says which, for the banner. The single-process reference
    (``megakit.train.doctor.reference``) calls it too, so both run one schedule."""
    scheduler = config.get("scheduler")
    lr = config.get("optimizer", {}).get("params", {}).get("lr")
    peak = f"lr {lr:g}" if isinstance(lr, (int, float)) else "lr from the optimizer"
    if scheduler is None:
        return f"megakit: LR schedule: none in the ds_config ({peak}, constant)"
    kind, params = scheduler.get("type"), scheduler.setdefault("params", {})
    if kind not in SCHEDULES_WITH_AN_END:
        return f"megakit: LR schedule: {kind} ({peak}); it has no end, so --steps does not shape it"
    pinned = "total_num_steps" in params
    if not pinned:
        params["total_num_steps"] = steps if resumed is None else resumed
    total, warmup = params["total_num_steps"], params.get("warmup_num_steps", 1000)  # DeepSpeed's default warm-up
    shape = {"WarmupCosineLR": f"cosine to {params.get('cos_min_ratio', 0.0001):g} x", "WarmupDecayLR": "linear to 0"}
    if pinned:
        whose = (
            f"the ds_config pins total_num_steps {total}, not --steps {steps}"
            if total != steps
            else "the ds_config's total_num_steps"
        )
    elif total != steps:
        whose = (
            f"the loaded checkpoint's schedule, kept: --steps is {steps}; set total_num_steps in the ds_config "
            "to schedule again"
        )
    else:
        whose = "--steps"
    text = f"megakit: LR schedule: {kind}, {peak}, {warmup} warm-up steps, {shape[kind]} at step {total} ({whose})"
    if warmup >= total:
        text += f"; the warm-up is not over by step {total}: lower warmup_num_steps in the ds_config"
    return text


def scheduled_steps(config: dict) -> int | None:
    """The ``total_num_steps`` the run's schedule ends at (None: no schedule with an end), for its checkpoints."""
    return config.get("scheduler", {}).get("params", {}).get("total_num_steps")
