"""``--fp8 tensorwise|rowwise``: the large TP linears' GEMMs in float8, through torchao's float8 training.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for ``Float8Linear``. megakit's
``ColumnParallelLinear`` and ``RowParallelLinear`` are not ``nn.Linear``; each calls
``self.matmul(x, weight, bias)`` on its own shard, so here that call becomes the very autograd
function ``Float8Linear.forward`` runs (``matmul_with_hp_or_float8_args``), with the config torchao
builds for the recipe. Parameters, their names and the TP collectives around the GEMM stay as they
are, so checkpoints hold the plain weights and TP composes as it does in high precision: each rank
scales its own shard (with ``tensorwise``, by the amax of its shard, not of the whole weight). The
LM head, the embedding and the MoE experts stay in high precision.

Which linears: torchao's shape filter for the recipe (``_auto_filter_for_recipe``, H100 benchmarks:
small GEMMs get slower in float8), applied to the shard's shape. Float8 GEMMs need compute
capability 8.9 (Ada, Hopper, Blackwell); elsewhere ``check_fp8`` refuses ``--fp8`` before any
process group. ``MEGAKIT_FP8_EMULATE=1`` (tests only) runs torchao's emulation on any device and
converts every linear whose shard dims divide by 16, so the plumbing is tested on CPU.
"""

from __future__ import annotations

import dataclasses
import os

import torch
from torch import nn

from megakit.errors import UsageError
from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

RECIPES = ("none", "tensorwise", "rowwise")
EMULATE_ENV = "MEGAKIT_FP8_EMULATE"


def emulating() -> bool:
    """Whether FP8 GEMMs are emulated on the CPU (tests set the environment variable)."""
    return os.environ.get(EMULATE_ENV, "") not in ("", "0")


def check_fp8(recipe: str) -> None:
    """Refuse ``--fp8 recipe`` (one line) where it cannot run: no torchao, or no GPU with float8 GEMMs."""
    if recipe not in RECIPES:
        raise UsageError(f"--fp8 {recipe} is not one of {', '.join(RECIPES)}")
    if recipe == "none":
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UsageError(f"--fp8 {recipe} needs torchao (pip install torchao==0.18.0), or drop --fp8") from None
    if emulating():
        return
    if not torch.cuda.is_available():
        raise UsageError(
            f"--fp8 {recipe} needs an NVIDIA GPU with float8 GEMMs (compute capability 8.9+: Ada, "
            "Hopper, Blackwell) and this machine has none; drop --fp8 (or --fp8 none)"
        )
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        raise UsageError(
            f"--fp8 {recipe}: {torch.cuda.get_device_name()} has compute capability {major}.{minor}, "
            "float8 GEMMs need 8.9+ (Ada, Hopper, Blackwell); drop --fp8 (or --fp8 none)"
        )


class Float8Matmul:
    """``F.linear(x, weight, bias)`` with torchao's float8 GEMMs for forward and both backward GEMMs."""

    def __init__(self, in_features: int, out_features: int, config) -> None:
        from torchao.float8.float8_linear import Float8Linear

        meta = Float8Linear(in_features, out_features, bias=False, config=config, device="meta")
        self.config, self.mm_config = meta.config, meta.linear_mm_config

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ weight.T + bias`` with torchao's float8 GEMM under this recipe."""
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        if bias is not None:
            return y + bias.to(y.dtype)
        # torchao returns a view made inside its autograd function, which autograd forbids modifying in
        # place, and the row-parallel layer's all-reduce is in place: a copy (one activation) instead
        return y.clone() if y._is_view() else y


def convert_to_fp8(model: nn.Module, recipe: str) -> list[str]:
    """Give the TP linears of ``model`` that pass the recipe's shape filter a float8 matmul; returns their names."""
    if recipe == "none":
        return []
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear_utils import _auto_filter_for_recipe

    emulate = emulating()
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    keep = _auto_filter_for_recipe(recipe, filter_fqns=[])
    converted = []
    for name, module in model.named_modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or name.endswith("lm_head"):
            continue
        out_features, in_features = module.weight.shape  # this rank's shard
        probe = nn.Linear(in_features, out_features, bias=False, device="meta")
        if not (in_features % 16 == 0 and out_features % 16 == 0 if emulate else keep(probe, name)):
            continue
        module.matmul = Float8Matmul(in_features, out_features, config)
        converted.append(name)
    return converted
