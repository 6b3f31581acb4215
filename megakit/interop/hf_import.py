"""A Hugging Face transformers checkpoint (safetensors) as a megakit checkpoint, to train from at any layout.

``megakit convert HF_DIR OUT --from-hf``: ``config.json`` is read by ``ModelConfig.load`` (GPT-2,
Llama, Mistral, Qwen2, Qwen3 and Gemma 3 families, and the MoE models Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss and
DeepSeek-V3, gpt-oss's MXFP4 experts and DeepSeek's FP8 blocks dequantized to bf16), the weights from
``model.safetensors`` or the shards its
``model.safetensors.index.json`` lists (never a pickled ``pytorch_model.bin``: loading one runs
code), translated by ``megakit.interop.hf.from_hf_state_dict`` and written as a step-0 megakit
checkpoint in their own dtype, so ``--to-hf`` gives back the same bytes. The model is built on
the meta device and given uninitialised CPU storage, so nothing is drawn that is overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError
from megakit.interop.checkpoint import save_checkpoint
from megakit.interop.hf import from_hf_state_dict
from megakit.interop.quantized import dequantize
from megakit.nn.model import Transformer, load_full_state_dict


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a transformers checkpoint directory saved with safetensors."""
    from safetensors.torch import load_file

    index = directory / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (directory / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif list(directory.glob("*.bin")):
        raise UsageError(
            f"{directory} holds pickled PyTorch weights (*.bin), which megakit does not load (loading "
            "runs code); save the model with safe_serialization=True and convert again"
        )
    else:
        raise UsageError(
            f"{directory} holds no model.safetensors (nor an index of shards); give a transformers "
            "checkpoint directory saved with save_pretrained"
        )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        if not (directory / name).is_file():
            raise UsageError(f"{directory} lacks {name}, which its shard index lists; the download is incomplete")
        tensors.update(load_file(directory / name))
    return dequantize(tensors)  # gpt-oss's MXFP4 experts and DeepSeek's FP8 blocks, as released, to bf16


def _materialised(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (built on the meta device) with uninitialised CPU parameters that keep their attributes
    (the TP marks checkpoints read; ``to_empty`` would make new parameters without them), and zeroed buffers
    (DeepSeek's expert bias, which the weights then fill)."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            new = torch.nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
            new.__dict__.update(param.__dict__)
            setattr(module, name, new)
        for name, buffer in list(module.named_buffers(recurse=False)):  # DeepSeek's expert bias
            if buffer.is_meta:
                module._buffers[name] = torch.zeros_like(buffer, device="cpu")
    return model


def import_hf(hf_dir, out_dir) -> dict:
    """Write the transformers checkpoint in ``hf_dir`` as a megakit checkpoint in ``out_dir``; a summary."""
    hf_dir, out = Path(hf_dir), Path(out_dir)
    if not (hf_dir / "config.json").is_file():
        raise UsageError(f"{hf_dir} has no config.json; give a transformers checkpoint directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out} already exists and is not empty; choose a new output directory or remove it")
    config = ModelConfig.load(hf_dir)
    full = from_hf_state_dict(config, read_hf_weights(hf_dir))
    dtypes = {t.dtype for k, t in full.items() if not k.endswith("e_score_correction_bias")}  # fp32 everywhere
    if len(dtypes) != 1:
        raise UsageError(f"{hf_dir} mixes dtypes {sorted(map(str, dtypes))}; save it in one dtype and convert again")
    dtype = dtypes.pop()
    mtp = any(name.startswith("mtp.") for name in full)  # DeepSeek's prediction modules, kept for --mtp
    model = _materialised(Transformer(config, dtype=dtype, device="meta", mtp=mtp))
    load_full_state_dict(model, full)
    save_checkpoint(out, model, None, step=0, config=config, extra={"imported_from": str(hf_dir)})
    return {
        "params": sum(t.numel() for t in full.values()),
        "dtype": str(dtype).removeprefix("torch."),
        "family": config.family,
        "model_type": config.to_hf()["model_type"],
    }
