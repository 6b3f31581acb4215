"""Attach LoRA adapters (``megakit.core.lora.LoraSpec``) to a model or pipeline stage and freeze its base.

The targets resolve against the leaf names of the *whole* model's linear layers (a pipeline stage may hold some of
them only), so every stage adapts the same kinds of layers. The adapters are parameters of the linear layer they
adapt (``layers.3.attn.q_proj.lora_A``, ``...lora_B``: peft's ``lora_A.weight`` and ``lora_B.weight``) and split as
its weight is (``megakit.nn.tensor_parallel.lora``). They start as peft's: ``A`` kaiming-uniform
(``U(-1/sqrt(in), 1/sqrt(in))``, what ``kaiming_uniform_(a=sqrt(5))`` draws) and ``B`` zero, drawn like every other
weight from ``(seed, name, index)`` (``megakit.nn.weights``), so they are the same at every layout.
"""

from __future__ import annotations

import torch
from torch import nn

from megakit.core.lora import LoraSpec
from megakit.errors import UsageError
from megakit.nn import comm as C
from megakit.nn.block import Block
from megakit.nn.moe.layer import SharedExpert
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, mark
from megakit.nn.weights import init_shard_

NOT_ADAPTED = ("lm_head", "eh_proj")  # the output head (peft's all-linear leaves it too) and MTP's projection


def adaptable(model: nn.Module) -> dict[str, nn.Module]:
    """The linear layers of ``model`` an adapter can go on, by full name: column- and row-parallel linears but the
    output head, and the shared experts' projections."""
    out = {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, ColumnParallelLinear | RowParallelLinear) and leaf not in NOT_ADAPTED:
            out[name] = module
        elif isinstance(module, SharedExpert):
            out.update({f"{name}.{n}": getattr(module, n) for n in ("gate_proj", "up_proj", "down_proj")})
    return out


def linear_names(config) -> tuple[str, ...]:
    """The leaf names (``q_proj``, ``down_proj``, ...) of the whole model's adaptable layers, in model order."""
    meta = torch.device("meta")  # shapes only: nothing allocated or drawn
    blocks = nn.ModuleList(
        Block(config, index=i, group=None, sequence_parallel=False, dtype=torch.float32, device=meta)
        for i in range(config.layers)
    )
    return tuple(dict.fromkeys(name.rsplit(".", 1)[-1] for name in adaptable(blocks)))


def check_supported(spec: LoraSpec) -> None:
    """What megakit's adapters do not do yet, as one line each: DoRA, and dropout (its masks would have to be keyed
    like ``megakit.nn.dropout``'s to be the same at every layout)."""
    if spec.dora:
        raise UsageError("DoRA is not supported yet; train plain LoRA (leave use_dora off)")
    if spec.dropout:
        raise UsageError(f"LoRA dropout {spec.dropout:g} is not supported yet; give --lora-dropout 0")


def add_lora(model: nn.Module, spec: LoraSpec, *, config, seed: int, tp_group=None) -> list[str]:
    """Freeze every parameter of ``model`` and give each target layer an adapter (drawn from ``seed``); the names
    of the adapted layers. ``config``: the model's ``ModelConfig`` (to resolve targets against the whole model)."""
    check_supported(spec)
    targets = set(spec.resolve(linear_names(config)))
    tp, tp_rank = C.size(tp_group), C.rank(tp_group)
    for param in model.parameters():
        param.requires_grad_(False)
    adapted = []
    for name, layer in adaptable(model).items():
        if name.rsplit(".", 1)[-1] not in targets:
            continue
        weight = layer.weight
        out_local, in_local = weight.shape
        kind = (
            "column"
            if isinstance(layer, ColumnParallelLinear)
            else "row"
            if isinstance(layer, RowParallelLinear)
            else ""
        )
        kw = dict(dtype=weight.dtype, device=weight.device)
        layer.lora_A = mark(nn.Parameter(torch.empty(spec.rank, in_local, **kw)), 1 if kind == "row" else None)
        layer.lora_B = mark(nn.Parameter(torch.empty(out_local, spec.rank, **kw)), 0 if kind == "column" else None)
        layer.lora_scaling = spec.scaling
        in_global = in_local * (tp if kind == "row" else 1)
        init_shard_(layer.lora_A, name=f"{name}.lora_A", seed=seed, tp_rank=tp_rank, rule=("uniform", in_global**-0.5))
        init_shard_(layer.lora_B, name=f"{name}.lora_B", seed=seed, tp_rank=tp_rank, rule=("zeros",))
        adapted.append(name)
    model.lora_spec = spec  # its checkpoints hold the adapters (megakit.interop.checkpoint_split.adapted)
    return adapted


def is_adapter(name: str) -> bool:
    """Whether the parameter called ``name`` is a LoRA adapter's."""
    return name.endswith((".lora_A", ".lora_B"))
