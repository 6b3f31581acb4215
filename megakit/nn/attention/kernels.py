"""Which fused attention kernel runs: ``--attention-kernel auto|flash|cudnn|efficient|math``.

PyTorch's ``scaled_dot_product_attention`` picks a backend by itself; a run can pin one with
``torch.nn.attention.sdpa_kernel`` around each step (forward and backward dispatch under it,
and a compiled block is traced under it). GQA is the catch: megakit calls SDPA with
``enable_gqa=True`` (K/V heads broadcast, not copied), which FlashAttention-2 takes natively,
while the sources disagree on whether cuDNN's and the memory-efficient kernel accept it
(transformers PR #45776, pytorch PR #181528 vs issue #139586). So with those two, K/V are
expanded to one head per query head first (``repeat_interleave``: more memory, one fused kernel).

``auto``: on CPU, torch's own choice (the path megakit always took). On a CUDA GPU of compute
capability 9.0 or newer (Hopper, Blackwell), cuDNN first, then flash, with K/V expanded: the
PyTorch 2.5 notes measured cuDNN's kernel up to 75 % faster than FA2 on H100, and the 2.11
wheels prefer it there themselves. Older GPUs: torch's choice. ``scripts/bench_gpu.py``
measures flash against cuDNN (variant D) so that this default can be checked on the GPU. Packed documents
(``--reset-attention-mask``) take none of these, whose fused kernels have no mask: on a GPU of compute
capability 8.0 or newer ``auto`` runs them through FlexAttention (``megakit.nn.attention.masks``), which skips the
blocks of other documents; elsewhere SDPA with a boolean mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megakit.errors import UsageError

KERNELS = ("auto", "flash", "cudnn", "efficient", "math")
_BACKEND = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
_EXPANDS_KV = ("cudnn", "efficient")
_CUDA_ONLY = ("flash", "cudnn", "efficient")


@dataclass(frozen=True)
class KernelChoice:
    """What ``--attention-kernel`` means on this device: the backends in priority order (empty: torch's
    own choice) and whether K/V heads are expanded before the call."""

    name: str
    backends: tuple = ()
    expand_kv: bool = False
    flex_documents: bool = False  # packed documents through FlexAttention (attention.masks), not a masked SDPA

    def context(self):
        """The context a step runs in: ``sdpa_kernel`` with these backends, or nothing."""
        if not self.backends:
            return contextlib.nullcontext()
        return sdpa_kernel(list(self.backends), set_priority=len(self.backends) > 1)


def choose_kernel(name: str, *, cuda: bool, capability: tuple[int, int] | None = None) -> KernelChoice:
    """``--attention-kernel name`` on this device; UsageError for an unknown name or a CUDA kernel on CPU."""
    if name == "torch":  # torch's own choice everywhere, K/V broadcast (what megakit ran before; bench_gpu's baseline)
        return KernelChoice("torch")
    if name not in KERNELS:
        raise UsageError(f"--attention-kernel {name} is not one of {', '.join(KERNELS)}")
    if name in _CUDA_ONLY and not cuda:
        raise UsageError(f"--attention-kernel {name} needs a CUDA GPU; on CPU use auto (torch's choice) or math")
    if name == "auto":
        flex = cuda and capability is not None and capability >= (8, 0)  # FlexAttention's Triton kernels: Ampere on
        if cuda and capability is not None and capability >= (9, 0):
            return KernelChoice(
                "auto",
                (
                    SDPBackend.CUDNN_ATTENTION,
                    SDPBackend.FLASH_ATTENTION,
                    SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH,
                ),
                expand_kv=True,
                flex_documents=flex,
            )
        return KernelChoice("auto", flex_documents=flex)
    return KernelChoice(name, (_BACKEND[name],), expand_kv=name in _EXPANDS_KV)


def device_kernel(name: str) -> KernelChoice:
    """``choose_kernel`` for this process's device."""
    cuda = torch.cuda.is_available()
    return choose_kernel(name, cuda=cuda, capability=torch.cuda.get_device_capability() if cuda else None)


def use_kernel(model: torch.nn.Module, choice: KernelChoice) -> None:
    """Tell every attention layer of ``model`` whether to expand K/V heads for ``choice``."""
    from megakit.nn.attention.core import Attention

    for module in model.modules():
        if isinstance(module, Attention):
            module.expand_kv, module.flex_documents = choice.expand_kv, choice.flex_documents


# kernel names as the profiler shows them, per backend (CUDA kernels and the aten ops that launch them)
KERNEL_PATTERNS = {
    "cudnn": ("cudnn", "sm90_flash", "cudnn_attention"),
    "flash": ("flash_fwd", "flash_bwd", "flash_attention"),
    "efficient": ("fmha", "efficient_attention", "mem_eff"),
    "math": ("_scaled_dot_product_attention_math", "attention_math"),
}


def attention_kernels_in(names) -> list[str]:
    """The attention kernel/op names among ``names`` (a profiler's event names), sorted, once each."""
    words = tuple(w for ws in KERNEL_PATTERNS.values() for w in ws) + ("scaled_dot_product", "sdpa")
    return sorted({n for n in names if any(w in n.lower() for w in words)})
