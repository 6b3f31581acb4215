"""Export a megakit checkpoint (any TP x PP layout) to Hugging Face transformers' layout.

The output directory holds ``config.json``, the tokenizer the run trained with (if any) and
``model.safetensors`` -- or, past ``max_shard_bytes``, transformers' sharded form
(``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``) -- so
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it with no megakit installed.

Streaming: the weights are converted one unit at a time (the embeddings, final norm and
head; then each block), reading each parameter's TP slices straight from the checkpoint's
files, so memory holds at most one output shard, never the whole model. The name and
layout mapping is ``megakit.interop.hf.to_hf_state_dict`` itself, applied to a one-block model per
unit; a first pass over meta tensors sizes the shards without reading any weights. Every
tensor read is checked against the manifest's checksum. The output is written to a temporary
directory and renamed, so a failed export leaves nothing at ``OUT_DIR``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import uuid
from pathlib import Path

import torch

from megakit.core.families import family_of
from megakit.errors import UsageError
from megakit.interop.checkpoint_format import (
    ShardReader,
    manifest_config,
    read_manifest,
)
from megakit.interop.hf import mtp_to_hf, to_hf_state_dict

DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained


def _layer_prefix(config, i: int) -> str:
    """transformers' name prefix of block ``i`` (its family's weight table)."""
    return family_of(config).weights.layer.format(i=i)


def _unit(
    config, manifest: dict, reader: ShardReader, unit: int | str | None, *, meta: bool
) -> dict[str, torch.Tensor]:
    """transformers' tensors of one unit: ``None`` = everything outside the blocks, ``"mtp.k"`` = MTP module k (layer
    ``L + k``, with its copies of the embedding and head), else block ``unit``.

    Runs ``to_hf_state_dict`` on a one-block model whose block 0 is block ``unit``; tensors
    not wanted from this unit are meta (no data), as is everything when ``meta``.
    """
    params = manifest["params"]

    def tensor(name: str, source: str, real: bool) -> torch.Tensor:
        if real and not meta:
            return reader.read(source)
        entry = params[source]
        return torch.empty(entry["shape"], dtype=getattr(torch, entry["dtype"]), device="meta")

    if isinstance(unit, str):
        k = int(unit.removeprefix("mtp."))
        shared = ("embed.weight", "lm_head.weight")
        return mtp_to_hf(config, k, {n: tensor(n, n, True) for n in params if n.startswith(unit + ".") or n in shared})
    state, block = {}, f"layers.{0 if unit is None else unit}."  # blocks may differ (MoE and dense layers)
    for name in params:
        if not name.startswith(("layers.", "mtp.")):
            state[name] = tensor(name, name, unit is None)
        elif name.startswith(block):
            state["layers.0." + name[len(block) :]] = tensor(name, name, unit is not None)
    # names only; a hybrid's (Nemotron-H) blocks are told apart by their keys (``interop.hf_mamba.state_to_hf``)
    one_block = (
        config if config.layer_pattern else config.replace(layers=1, layer_types=config.layer_types[:1], nope_layers=())
    )
    hf = to_hf_state_dict(one_block, state)
    first = _layer_prefix(config, 0)
    if unit is None:
        out = {k: v for k, v in hf.items() if not k.startswith(first)}
        if config.tie_embeddings:
            del out["lm_head.weight"]  # transformers ties it to the input embedding, as save_pretrained does
        return out
    return {_layer_prefix(config, unit) + k[len(first) :]: v for k, v in hf.items() if k.startswith(first)}


def export_hf(checkpoint, out_dir, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES, lora=None) -> dict:
    """Write ``checkpoint`` to ``out_dir`` in transformers' layout; returns a summary dict. ``lora``: a LoRA
    checkpoint trained on ``checkpoint``, whose adapters are merged into the weights (``megakit.interop.peft``)."""
    checkpoint, out = Path(checkpoint), Path(out_dir)
    manifest = read_manifest(checkpoint)
    config = manifest_config(manifest, source=str(checkpoint))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not empty; choose a new output directory or remove it")
    mtp = [f"mtp.{k}" for k in range(config.mtp_layers) if f"mtp.{k}.norm.weight" in manifest["params"]]
    units = [None, *range(config.layers), *mtp]
    with ShardReader(checkpoint, manifest) as reader, contextlib.ExitStack() as stack:
        if lora is not None:  # the adapted weights read as W + scaling B A
            from megakit.interop.peft import MergedReader, merge_source

            _, layers, scaling = merge_source(lora)
            adapters = stack.enter_context(ShardReader(Path(lora), read_manifest(Path(lora))))
            reader = MergedReader(reader, adapters, layers, scaling)
        shards, size = [[]], 0  # units per output file, sized from meta tensors
        for unit in units:
            nbytes = sum(
                t.numel() * t.element_size() for t in _unit(config, manifest, reader, unit, meta=True).values()
            )
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(unit)
            size += nbytes
        tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            summary = _write(config, manifest, reader, shards, tmp)
            summary["tokenizer"] = _tokenizer(checkpoint, tmp, config)
            if out.exists():
                out.rmdir()  # empty, checked above
            os.rename(tmp, out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return summary


def _tokenizer(checkpoint: Path, tmp: Path, config) -> bool:
    """The checkpoint's tokenizer (``CHECKPOINT/tokenizer``, saved from the data it trained on) beside the weights,
    with the model's ``generation_config.json``, and its stop ids in config.json, so ``AutoTokenizer``,
    ``generate`` and ``pipeline("text-generation")`` load ``OUT_DIR`` and stop where the model was taught to."""
    from megakit.interop.tokenizer import GENERATION_CONFIG, check_eos_ids, export_tokenizer

    source = checkpoint / "tokenizer"
    if not (source / "tokenizer.json").is_file():
        return False
    ids = export_tokenizer(source, tmp, model_max_length=config.max_seq_len)
    check_eos_ids(
        ids["eos_token_id"],
        config.vocab_size,
        source=str(checkpoint),
        vocabulary="the model's vocabulary",
        fix="prepare the data with the model's own tokenizer",
    )
    hf_config = json.loads((tmp / "config.json").read_text())
    hf_config.update({key: ids[key] for key in ("bos_token_id", "eos_token_id")})
    (tmp / "config.json").write_text(json.dumps(hf_config, indent=2))
    if not (tmp / GENERATION_CONFIG).is_file():
        generation = {key: value for key, value in ids.items() if value is not None}
        (tmp / GENERATION_CONFIG).write_text(json.dumps(generation, indent=2))
    return True


def _write(config, manifest: dict, reader: ShardReader, shards: list[list], tmp: Path) -> dict:
    from safetensors.torch import save_file

    weight_map, params, total = {}, 0, 0
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for fname, units in zip(names, shards):
        tensors = {}
        for unit in units:
            tensors.update({k: v.contiguous() for k, v in _unit(config, manifest, reader, unit, meta=False).items()})
        save_file(tensors, tmp / fname, metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            params += v.numel()
            total += v.numel() * v.element_size()
        del tensors
    dtype = manifest["params"]["embed.weight"]["dtype"]
    (tmp / "config.json").write_text(json.dumps({**config.to_hf(), "dtype": dtype}, indent=2))
    if len(names) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return {
        "files": names,
        "tensors": len(weight_map),
        "params": params,
        "bytes": total,
        "dtype": dtype,
        "step": manifest["step"],
    }
