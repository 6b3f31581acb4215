"""Which kernels the linear-attention mixers run: ``--linear-attention-kernels auto|torch``.

``torch``: megakit's own chunked forms on any device (``delta_rule``, ``conv``, ``mamba2.ssd_scan``). ``auto`` (the
default): on CUDA tensors, where the optional extra is installed (``pip install 'megakit[kernels]'``),
flash-linear-attention's ``chunk_gated_delta_rule``, causal-conv1d's ``causal_conv1d_fn`` and mamba-ssm's
``mamba_chunk_scan_combined``, each called as transformers' ``qwen3_next`` and ``nemotron_h`` modelling calls it;
each falls back to the torch form by itself where its package does not import or the tensors are on the CPU
(Triton and CUDA kernels). Packed documents: fla takes them as the ``cu_seqlens`` of one flattened row of ``B x S``
tokens, causal-conv1d and mamba-ssm as a ``seq_idx`` per token (``cu_seqlens`` and ``seq_idx`` build both from
megakit's document numbers); causal-conv1d takes 2 to 4 taps over channels in multiples of 8, other convs run the
torch form.

No GPU has run the kernels here yet: they are unchecked until one does. ``scripts/bench_gpu.py``'s linear-attention
rows run each mixer forward and backward both ways on the same inputs, documents included, and print the largest
difference and the times; ``--linear-attention-kernels torch`` pins the torch forms.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from megakit.errors import UsageError
from megakit.nn.linear_attention.conv import causal_conv1d
from megakit.nn.linear_attention.delta_rule import chunk_gated_delta_rule

KERNELS = ("auto", "torch")
PACKAGES = {  # the distribution (the extra's name for it) -> (module, function)
    "flash-linear-attention": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
    "causal-conv1d": ("causal_conv1d", "causal_conv1d_fn"),
    "mamba-ssm": ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"),
}


def check_kernels(name: str) -> str:
    """``name`` if it is one of ``KERNELS``; else UsageError in one line."""
    if name not in KERNELS:
        raise UsageError(f"--linear-attention-kernels {name} is not one of {', '.join(KERNELS)}")
    return name


@functools.cache
def imported(package: str) -> Callable | None:
    """``package``'s kernel function (``PACKAGES``), or None where it does not import (absent, or no CUDA build)."""
    module, name = PACKAGES[package]
    try:
        return getattr(__import__(module, fromlist=[name]), name)
    except (ImportError, OSError, RuntimeError):  # not installed; a CUDA library or Triton missing underneath
        return None


def kernel(package: str, choice: str, tensor: torch.Tensor) -> Callable | None:
    """The kernel ``choice`` runs on ``tensor``'s device: ``package``'s function under ``auto`` on CUDA where it
    imports; None (the torch form) otherwise."""
    if choice == "torch" or not tensor.is_cuda:
        return None
    return imported(package)


def use_linear_kernels(model: torch.nn.Module, choice: str) -> None:
    """Run every linear-attention mixer of ``model`` (Gated DeltaNet, Mamba-2) with ``choice`` (``KERNELS``)."""
    from megakit.nn.linear_attention.gated_deltanet import GatedDeltaNet  # noqa: PLC0415 (they import this module)
    from megakit.nn.linear_attention.mamba2 import Mamba2  # noqa: PLC0415

    check_kernels(choice)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet | Mamba2):
            module.linear_kernels = choice


def cu_seqlens(documents: torch.Tensor) -> torch.Tensor:
    """``(N + 1,)`` int64: where each of the ``N`` documents of ``documents`` ``(B, S)`` starts in its rows flattened
    to one row of ``B x S`` tokens, then ``B x S`` (flash-attention's and fla's varlen layout). A row's first token
    always starts a document. Reads the boundaries back to the host (``nonzero``), as fla's varlen path does."""
    b, s = documents.shape
    starts = torch.ones_like(documents, dtype=torch.bool)
    starts[:, 1:] = documents[:, 1:] != documents[:, :-1]
    where = starts.flatten().nonzero().flatten()
    return torch.cat([where, where.new_tensor([b * s])])


def seq_idx(documents: torch.Tensor) -> torch.Tensor:
    """``(B, S)`` int32, contiguous: each token's document counted from its row's first (causal-conv1d's and
    mamba-ssm's ``seq_idx``: a tap or a state crosses no change of it)."""
    return (documents - documents[:, :1]).to(torch.int32).contiguous()


def fla_gated_delta_rule(fn: Callable, q, k, v, g, beta, *, documents: torch.Tensor | None) -> torch.Tensor:
    """megakit's ``chunk_gated_delta_rule`` through fla's: the same ``(S, B, ...)`` tensors in (q and k not yet
    l2-normed: ``use_qk_l2norm_in_kernel``; ``g`` the log-decay; ``beta`` after its sigmoid; each key head serves
    ``n_v / n_k`` consecutive value heads: repeated to them here), ``(S, B, n_v, d_v)`` out in ``v``'s dtype.
    Documents: one flattened row with ``cu_seqlens``. fla chunks by its own 64 tokens, not the config's ``chunk``:
    the result is the same but for rounding."""
    s, b = v.shape[:2]
    if k.shape[2] != v.shape[2]:  # each key head's value heads, as transformers' qwen3_next and the torch form do:
        repeat = v.shape[2] // k.shape[2]  # fla versions without grouped value heads take them so too
        q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
    q, k, v, g, beta = (t.transpose(0, 1) for t in (q, k, v, g, beta))  # (B, S, n, ...)
    cu = None
    if documents is not None:
        q, k, v, g, beta = (t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta))
        cu = cu_seqlens(documents)
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    o, _ = fn(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)  # scale: d_k^-1/2
    return o.reshape(b, s, *o.shape[2:]).transpose(0, 1).to(v.dtype)


def gated_delta_rule(
    q, k, v, g, beta, *, chunk: int, documents: torch.Tensor | None, choice: str = "auto"
) -> torch.Tensor:
    """``delta_rule.chunk_gated_delta_rule``, or fla's where ``choice`` runs it (``kernel``)."""
    fn = kernel("flash-linear-attention", choice, v)
    if fn is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk=chunk, documents=documents)
    return fla_gated_delta_rule(fn, q, k, v, g, beta, documents=documents)


def conv_silu(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    documents: torch.Tensor | None,
    choice: str = "auto",
) -> torch.Tensor:
    """``silu(causal_conv1d(x))`` of ``x`` ``(S, B, C)`` by ``weight`` ``(C, K)``, or causal-conv1d's fused conv and
    SiLU (channels last, which its ``seq_idx`` needs) where ``choice`` runs it and it fits (``conv_kernel_fits``)."""
    fn = kernel("causal-conv1d", choice, x)
    if fn is None or not conv_kernel_fits(*weight.shape):
        return F.silu(causal_conv1d(x, weight, bias, documents=documents))
    return conv_kernel_silu(fn, x, weight, bias, documents=documents)


def conv_kernel_fits(channels: int, taps: int) -> bool:
    """Whether causal-conv1d takes a conv of ``channels`` and ``taps``: 2 to 4 taps, and (channels last, which its
    ``seq_idx`` needs) channels, hence the strides, a multiple of 8 (its ``causal_conv1d_fwd`` checks)."""
    return 2 <= taps <= 4 and channels % 8 == 0


def conv_kernel_silu(fn: Callable, x, weight, bias, *, documents: torch.Tensor | None) -> torch.Tensor:
    """``conv_silu`` through causal-conv1d's ``causal_conv1d_fn`` ``fn``: ``(S, B, C)`` in and out."""
    channels_last = x.transpose(0, 1).contiguous().transpose(1, 2)  # (B, C, S), the channels contiguous
    index = None if documents is None else seq_idx(documents)
    y = fn(channels_last, weight.contiguous(), bias, seq_idx=index, activation="silu")  # (B, C, S)
    return y.permute(2, 0, 1)


def mamba_chunk_scan(
    fn: Callable, x, dt, A, B, C, D, *, dt_bias, dt_limit: tuple, chunk: int, documents: torch.Tensor | None
) -> torch.Tensor:
    """``mamba2.ssd_scan`` through mamba-ssm's ``mamba_chunk_scan_combined`` ``fn``: ``x`` ``(b, s, h, p)``, ``dt``
    ``(b, s, h)`` before its bias, softplus and clamp (done in the kernel, as transformers' nemotron_h passes them),
    ``A`` ``(h,)`` fp32, ``B``/``C`` ``(b, s, g, n)``, ``D`` ``(h,)``; ``(b, s, h, p)`` out."""
    index = None if documents is None else seq_idx(documents)
    x, dt, B, C = (t.contiguous() for t in (x, dt, B, C))
    return fn(x, dt, A, B, C, chunk, D=D, z=None, dt_bias=dt_bias, dt_softplus=True, dt_limit=dt_limit, seq_idx=index)
