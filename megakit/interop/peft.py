"""LoRA adapters between megakit's checkpoints and peft's format, both ways, and merged into the base.

peft's adapter directory is ``adapter_config.json`` (``megakit.core.lora.LoraSpec.to_peft``) and
``adapter_model.safetensors``, whose keys are ``base_model.model.<transformers module>.lora_A.weight`` ``(r, in)``
and ``...lora_B.weight`` ``(out, r)``: megakit's ``<layer>.lora_A`` and ``<layer>.lora_B`` gathered over TP. The
transformers module of each megakit layer is found by ``to_hf_state_dict`` itself: the layer's weight passes through
it unchanged (same tensor) under that module's name, so the export names modules exactly as the base's export does.
A layer whose weight transformers fuses or transposes (GPT-2's ``c_attn`` and ``Conv1D``) has no peft name and is
refused. ``megakit convert --to-hf`` of a LoRA checkpoint writes the adapter (``export_adapter``), or with
``--merged`` the whole model with ``W + scaling B A`` (``merged_reader`` under ``export_hf``);
``megakit convert PEFT_DIR OUT --from-peft BASE`` imports one to train on (``import_adapter``).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import asdict
from pathlib import Path

import torch

from megakit.core.lora import LoraSpec
from megakit.errors import UsageError
from megakit.interop.checkpoint_format import STATE_PREFIX as STATE
from megakit.interop.checkpoint_format import ShardReader, manifest_config, read_manifest
from megakit.interop.hf import to_hf_state_dict

PREFIX = "base_model.model."  # peft's wrapper around the transformers model
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def lora_extra(spec: LoraSpec, base) -> dict:
    """A LoRA checkpoint's metadata (``extra["lora"]``): its spec and the base checkpoint it trains on."""
    return {"spec": asdict(spec), "base": None if base is None else str(Path(base).resolve())}


def saved_spec(manifest: dict, checkpoint) -> tuple[LoraSpec, str | None]:
    """The spec and base of a LoRA checkpoint's manifest; one without adapters is a ``UsageError``."""
    saved = manifest["extra"].get("lora")
    if saved is None:
        raise UsageError(
            f"checkpoint {checkpoint} holds no LoRA adapters; export it without --adapter (the whole model), "
            "or export a checkpoint trained with --lora-rank"
        )
    return LoraSpec(**saved["spec"]), saved["base"]


def hf_modules(config) -> dict[str, str]:
    """megakit layer name (``layers.0.attn.q_proj``) -> transformers module name (``model.layers.0.self_attn.q_proj``)
    for every layer an adapter can go on and transformers keeps as its own matrix."""
    from megakit.nn.lora import adaptable
    from megakit.nn.model import Transformer

    meta = Transformer(config, device=torch.device("meta"))
    state = dict(meta.named_parameters())
    state.update(dict(meta.named_buffers()))
    ids = {id(t): name for name, t in to_hf_state_dict(config, state).items()}
    out = {}
    for name in adaptable(meta):
        hf = ids.get(id(state[f"{name}.weight"]))
        if hf is not None and hf.endswith(".weight"):
            out[name] = hf.removesuffix(".weight")
    return out


def _adapted_layers(manifest: dict) -> list[str]:
    return sorted(
        {n.removesuffix(".lora_A") for n in manifest["params"] if n.endswith(".lora_A") and not n.startswith(STATE)}
    )


def _names(config, layers: list[str]) -> dict[str, str]:
    modules = hf_modules(config)
    missing = [name for name in layers if name not in modules]
    if missing:
        raise UsageError(
            f"the adapters on {', '.join(missing[:3])} have no peft name: transformers fuses or transposes that "
            f"{config.family} layer; export the merged model with --merged instead"
        )
    return {name: modules[name] for name in layers}


def _publish(out: Path, write) -> None:
    """Write into a temporary sibling of ``out`` with ``write(tmp)``, then rename: nothing half-written at ``out``."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not empty; choose a new output directory or remove it")
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        write(tmp)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def export_adapter(checkpoint, out_dir) -> dict:
    """Write the adapters of LoRA ``checkpoint`` as a peft adapter directory; a summary."""
    from safetensors.torch import save_file

    checkpoint, out = Path(checkpoint), Path(out_dir)
    manifest = read_manifest(checkpoint)
    spec, base = saved_spec(manifest, checkpoint)
    config = manifest_config(manifest, source=str(checkpoint))
    names = _names(config, _adapted_layers(manifest))
    tensors = {}
    with ShardReader(checkpoint, manifest) as reader:
        for ours, theirs in names.items():
            for part in ("lora_A", "lora_B"):
                tensors[f"{PREFIX}{theirs}.{part}.weight"] = reader.read(f"{ours}.{part}").contiguous()
    targets = sorted({theirs.rsplit(".", 1)[-1] for theirs in names.values()})

    def write(tmp: Path) -> None:
        save_file(tensors, tmp / WEIGHTS, metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(spec.to_peft(targets=targets, base_model=base or ""), indent=2))

    _publish(out, write)
    return {"adapters": len(names), "params": sum(t.numel() for t in tensors.values()), "step": manifest["step"]}


class MergedReader:
    """A base checkpoint's ``ShardReader`` whose adapted weights read as ``W + scaling B A`` (the full matrices)."""

    def __init__(self, base: ShardReader, adapters: ShardReader, layers: list[str], scaling: float) -> None:
        self.base, self.adapters, self.layers, self.scaling = base, adapters, set(layers), scaling

    def read(self, name: str, start: int | None = None, stop: int | None = None) -> torch.Tensor:
        """The tensor ``name`` of the base, merged with its adapter if it has one."""
        layer = name.removesuffix(".weight")
        if layer not in self.layers:
            return self.base.read(name, start, stop)
        assert start is None and stop is None, "the export reads whole tensors"
        w = self.base.read(name)
        a, b = self.adapters.read(f"{layer}.lora_A"), self.adapters.read(f"{layer}.lora_B")
        return (w.double() + self.scaling * (b.double() @ a.double())).to(w.dtype)


def merge_source(checkpoint) -> tuple[Path, list[str], float]:
    """``(base checkpoint, adapted layers, scaling)`` of a LoRA checkpoint to export merged."""
    manifest = read_manifest(checkpoint)
    spec, base = saved_spec(manifest, checkpoint)
    if base is None:
        raise UsageError(
            f"checkpoint {checkpoint} trained its adapters on the seed's weights, not a saved base; export the "
            "adapter alone, or train from a base (--lora-base) to export the merged model"
        )
    return Path(base), _adapted_layers(manifest), spec.scaling


def import_adapter(peft_dir, out_dir, *, base) -> dict:
    """Write the peft adapter in ``peft_dir`` as a megakit LoRA checkpoint (step 0) on the base checkpoint ``base``,
    so that ``train.py --load OUT`` continues training it at any layout; a summary."""
    from safetensors.torch import load_file

    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.lora import add_lora
    from megakit.nn.model import Transformer
    from megakit.nn.tensor_parallel.layers import mark

    peft_dir, out, base = Path(peft_dir), Path(out_dir), Path(base)
    if not (peft_dir / CONFIG).is_file() or not (peft_dir / WEIGHTS).is_file():
        raise UsageError(f"{peft_dir} is not a peft adapter: it needs {CONFIG} and {WEIGHTS}")
    spec = LoraSpec.from_peft(json.loads((peft_dir / CONFIG).read_text()))
    manifest = read_manifest(base)
    config = manifest_config(manifest, source=str(base))
    theirs = load_file(peft_dir / WEIGHTS)
    modules = {hf: ours for ours, hf in hf_modules(config).items()}
    layers = {}
    for key in theirs:
        module = key.removeprefix(PREFIX).rsplit(".", 2)[0]
        if module not in modules or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise UsageError(f"the peft adapter's tensor {key!r} names no adaptable layer of the base {base}")
        layers[modules[module]] = module
    net = Transformer(config, device=torch.device("meta"))  # shapes only: the adapters are filled below
    targets = sorted({m.rsplit(".", 1)[-1] for m in layers.values()})
    spec = LoraSpec(**{**asdict(spec), "targets": tuple(targets)})
    add_lora(net, spec, config=config, seed=0)
    owners = dict(net.named_modules())
    missing = [name for name in owners if getattr(owners[name], "lora_scaling", None) and name not in layers]
    if missing:
        raise UsageError(f"the peft adapter lacks {missing[0]}'s matrices (its targets cover that layer)")
    for ours, module in layers.items():
        layer = owners[ours]
        for part in ("lora_A", "lora_B"):
            tensor = theirs[f"{PREFIX}{module}.{part}.weight"]
            want = tuple(getattr(layer, part).shape)
            if tuple(tensor.shape) != want:
                raise UsageError(
                    f"the peft adapter's {module}.{part} is {tuple(tensor.shape)} but the base {base} needs {want} "
                    "(rank x in, out x rank); it was trained on another model"
                )
            old = getattr(layer, part)
            setattr(layer, part, mark(torch.nn.Parameter(tensor.to(old.dtype)), old.tp_dim))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not empty; choose a new output directory or remove it")
    save_checkpoint(out, net, step=0, config=config, extra={"lora": lora_extra(spec, base)})
    return {"adapters": len(layers), "spec": spec}
