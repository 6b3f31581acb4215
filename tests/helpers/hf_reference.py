"""What the tests that hold megakit to transformers' own models share: a seeded eager transformers model, the same
weights in megakit, gpt-oss's weights drawn so that each of its pieces acts, and a checkpoint directory written,
converted with ``megakit convert --from-hf`` and run."""

from __future__ import annotations

import torch

from megakit.core.model_config import ModelConfig
from megakit.interop.hf import from_hf_state_dict
from megakit.nn.model import Transformer, load_full_state_dict


def eager(model_class, config, seed: int = 0):
    """``model_class(config)`` seeded, in eval mode, on transformers' eager attention (the written-out reference)."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return model_class(config).eval()


def megakit_copy(config: ModelConfig, hf) -> Transformer:
    """megakit's one-process model of ``config`` holding ``hf``'s weights, in eval mode."""
    model = Transformer(config).eval()
    load_full_state_dict(model, from_hf_state_dict(config, hf.state_dict()))
    return model


@torch.no_grad()
def draw_gpt_oss(model):
    """A gpt-oss whose pieces act: sinks near the rows' log-sum-exp (at zero, ``sigmoid(lse - sink)`` is about 1 and a
    wrong sink hides in rounding), non-zero router, attention and expert biases, expert weights large enough that the
    SwiGLU's clamp at 7 acts."""
    for name, p in model.named_parameters():
        if name.endswith("sinks"):
            p.normal_(3.0, 1.5)
        elif name.endswith("bias"):
            p.normal_(0.0, 0.5)
        elif "experts" in name:
            p.normal_(0.0, 1.0)
    return model


@torch.no_grad()
def draw_deepseek(model):
    """A DeepSeek-V3 whose norms and expert bias act: norm weights ``N(1, 0.2)`` (at one a norm's weight hides in
    rounding) and the routing bias ``N(0, 0.1)`` (at zero it changes no choice)."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.normal_(1.0, 0.2)
    for module in model.modules():
        if hasattr(module, "e_score_correction_bias"):
            module.e_score_correction_bias.normal_(0.0, 0.1)
    return model


@torch.no_grad()
def converted_logits(directory, hf_config, tensors: dict, config: ModelConfig, ids: torch.Tensor) -> torch.Tensor:
    """Write ``tensors`` with ``hf_config`` as a transformers checkpoint in ``directory``, convert it with ``megakit
    convert --from-hf`` and return the imported bf16 model's fp32 logits of ``ids``."""
    from safetensors.torch import save_file

    from megakit.commands.cli import main
    from megakit.interop.checkpoint import load_checkpoint

    directory.mkdir()
    hf_config.save_pretrained(directory)
    save_file(tensors, str(directory / "model.safetensors"))
    assert main(["convert", str(directory), str(directory) + "-ck", "--from-hf"]) == 0
    model = Transformer(config, dtype=torch.bfloat16).eval()
    load_checkpoint(str(directory) + "-ck", model)
    return model(ids).float()
