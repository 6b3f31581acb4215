"""A LoRA run's checkpoints: which base the frozen weights come from, and what ``--load`` resumes.

A fine-tune starts from a base checkpoint (``--lora-base BASE``, or ``--load BASE`` when BASE holds no adapters: a
model ``megakit convert --from-hf`` imported, or a full run's) at step 0, or from the seed's weights without one. Its
checkpoints hold the adapters and their optimizer state only (``megakit.interop.checkpoint_split.named_tensors``)
and name the base in their metadata (``extra["lora"]``), so ``--load`` resumes one at any layout with the same
``--lora-*`` flags, reading the base from there.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from megakit.core.lora import LoraSpec
from megakit.errors import UsageError
from megakit.interop.checkpoint_format import MANIFEST, read_manifest


def saved_lora(checkpoint: Path) -> dict | None:
    """What a checkpoint's metadata says of its adapters (None: it holds none)."""
    return read_manifest(checkpoint)["extra"].get("lora")


def base_for_load(spec: LoraSpec | None, load: str | None, base: str | None) -> tuple[str | None, str | None]:
    """``(load, base)``: with LoRA, a ``--load`` directory that holds no adapters is the fine-tune's base (it starts
    at step 0), not a run to resume."""
    if spec is None or not load or not (Path(load) / MANIFEST).is_file() or saved_lora(Path(load)) is not None:
        return load, base
    if base:
        raise UsageError(
            f"--load {load} holds no LoRA adapters (a base) and --lora-base {base} names a base too; give one of them"
        )
    return None, load


def check_resume(spec: LoraSpec | None, checkpoint: Path | None, base: str | None) -> Path | None:
    """The base checkpoint of a run that resumes ``checkpoint`` (or starts from ``base``); a resume whose
    ``--lora-*`` flags differ from the checkpoint's adapters is a ``UsageError``."""
    saved = saved_lora(checkpoint) if checkpoint is not None else None
    if checkpoint is not None and (spec is None) != (saved is None):
        if spec is None:
            raise UsageError(
                f"checkpoint {checkpoint} holds LoRA adapters (rank {saved['spec']['rank']}); resume it with the "
                "--lora-* flags it was trained with"
            )
        raise UsageError(f"checkpoint {checkpoint} holds no LoRA adapters; start a fine-tune from it with --lora-base")
    if saved is not None:
        if _same(LoraSpec(**saved["spec"])) != _same(spec):
            raise UsageError(
                f"checkpoint {checkpoint} was trained with LoRA {_describe(LoraSpec(**saved['spec']))}, this run asks "
                f"for {_describe(spec)}; resume with the same --lora-* flags"
            )
        recorded = saved["base"]
        if base is not None and (recorded is None or Path(base).resolve() != Path(recorded).resolve()):
            raise UsageError(
                f"checkpoint {checkpoint}'s adapters were trained on the base {recorded or 'of the seed weights'}, "
                f"not --lora-base {base}; resume without --lora-base (the checkpoint names its base)"
            )
        base = base or recorded
    if base is not None:
        read_manifest(Path(base))  # a missing or damaged base: one line now, before any process starts
    return None if base is None else Path(base)


def check_layout(spec: LoraSpec | None, model, *, ep: int, zero_stage: int) -> None:
    """Before any process starts: the targets name layers of ``model`` (a ``ModelConfig``), and the layout is one
    LoRA runs (not frozen routed experts split over EP under ZeRO 3: DeepSpeed would partition each EP rank's own
    experts over the whole DP group, as if they were one tensor)."""
    if spec is None:
        return
    from megakit.nn.lora import check_supported, linear_names

    check_supported(spec)
    spec.resolve(linear_names(model))
    if ep > 1 and zero_stage == 3:
        raise UsageError(
            f"LoRA with --ep {ep} under ZeRO 3 is not supported (the frozen experts are split over EP); "
            "use ZeRO 0-2 with --ep, or --ep 1"
        )


def banner(spec: LoraSpec, base: Path | None) -> str:
    """The run's line on its adapters and their base."""
    on = f"the frozen base {base}" if base is not None else "the seed's weights, frozen (no --lora-base)"
    return f"megakit: LoRA {_describe(spec)} (scaling {spec.scaling:g}) on {on}"


def _same(spec: LoraSpec) -> LoraSpec:
    """``spec`` with its targets in one order: ``q_proj,v_proj`` and ``v_proj,q_proj`` train the same adapters."""
    return replace(spec, targets=tuple(sorted(spec.targets)))


def _describe(spec: LoraSpec) -> str:
    return f"rank {spec.rank}, alpha {spec.alpha:g}, targets {','.join(spec.targets)}" + (
        ", rslora" if spec.rslora else ""
    )
