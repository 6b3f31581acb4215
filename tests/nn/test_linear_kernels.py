"""The linear-attention mixers' kernel dispatch (``megakit.nn.linear_attention.kernels``) on the CPU: the torch forms
run on CPU tensors and where flash-linear-attention, causal-conv1d or mamba-ssm are absent; the argument mappings
onto those kernels' APIs (layouts, GVA, gates, ``cu_seqlens`` and ``seq_idx`` from megakit's document numbers) give
what megakit's torch forms give, run through transformers' reference implementations of the same APIs (the torch
paths its qwen3_next and nemotron_h modelling falls back to), documents split as the kernels' varlen contracts say.
The kernels themselves need a GPU: ``scripts/bench_gpu.py`` compares them there."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from megakit.errors import UsageError
from megakit.nn.linear_attention import kernels
from megakit.nn.linear_attention.conv import causal_conv1d
from megakit.nn.linear_attention.delta_rule import chunk_gated_delta_rule
from megakit.nn.linear_attention.mamba2 import ssd_scan
from megakit.nn.model import ModelConfig, Transformer

TOL = 2e-5
DOCUMENTS = torch.tensor([[3] * 9 + [4] * 30 + [5] * 11, [0] * 50])  # (B, S): a row of three documents, one of one


def _runs(row: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of equal values along ``row``."""
    cuts = [0, *((row[1:] != row[:-1]).nonzero().flatten() + 1).tolist(), row.numel()]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _close(got, want, what):
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL * max(want.abs().max().item(), 1.0), f"{what}: {err:.3g}"


def test_the_torch_forms_run_on_the_cpu_and_without_the_packages():
    x = torch.zeros(2)
    for package, (module, _) in kernels.PACKAGES.items():
        assert kernels.kernel(package, "auto", x) is None and kernels.kernel(package, "torch", x) is None
        if importlib.util.find_spec(module.split(".")[0]) is None:  # absent here: the import says so, no error
            assert kernels.imported(package) is None
    model = Transformer(ModelConfig.load("nemotron-h-tiny"))
    kernels.use_linear_kernels(model, "torch")
    assert {m.linear_kernels for m in model.modules() if hasattr(m, "linear_kernels")} == {"torch"}
    for bad in (lambda: kernels.use_linear_kernels(model, "fla"), lambda: _train_config("fla")):
        with pytest.raises(UsageError, match="--linear-attention-kernels fla is not one of auto, torch"):
            bad()
    assert _train_config().linear_attention_kernels == "auto"


def _train_config(kernels: str = "auto"):
    from megakit.train.run import TrainConfig

    return TrainConfig(ds_config="zero1.json", model="nemotron-h-tiny", data="d", linear_attention_kernels=kernels)


def test_causal_conv1d_takes_what_its_checks_accept():
    assert kernels.conv_kernel_fits(1024, 4) and kernels.conv_kernel_fits(16, 2)
    assert not kernels.conv_kernel_fits(1024, 5) and not kernels.conv_kernel_fits(12, 4)


def test_cu_seqlens_and_seq_idx_from_document_numbers():
    assert kernels.cu_seqlens(DOCUMENTS).tolist() == [0, 9, 39, 50, 100]
    index = kernels.seq_idx(DOCUMENTS)
    assert index.dtype == torch.int32 and index.is_contiguous()
    assert index[0].unique().tolist() == [0, 1, 2] and index[1].unique().tolist() == [0]


def _varlen(fn):
    """fla's contract for ``cu_seqlens``: one row, each ``[cu[i], cu[i+1])`` its own sequence from a zero state."""

    def run(q, k, v, g, beta, *, cu_seqlens=None, **kw):
        if cu_seqlens is None:
            return fn(q, k, v, g, beta, **kw)
        cuts = cu_seqlens.tolist()
        outs = [fn(*(t[:, a:b] for t in (q, k, v, g, beta)), **kw)[0] for a, b in zip(cuts[:-1], cuts[1:])]
        return torch.cat(outs, dim=1), None

    return run


@pytest.mark.parametrize("documents", [None, DOCUMENTS])
def test_the_fla_mapping_gives_the_torch_delta_rule(documents):
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(0)
    s, b, nk, nv, dk, dv = 50, 2, 2, 4, 8, 6  # two value heads per key head (GVA)
    q, k = (torch.randn(s, b, nk, dk, generator=gen) for _ in "qk")
    v = torch.randn(s, b, nv, dv, generator=gen)
    g = -F.softplus(torch.randn(s, b, nv, generator=gen))
    beta = torch.rand(s, b, nv, generator=gen)
    want = chunk_gated_delta_rule(q, k, v, g, beta, chunk=16, documents=documents)
    got = kernels.fla_gated_delta_rule(_varlen(torch_chunk_gated_delta_rule), q, k, v, g, beta, documents=documents)
    _close(got, want, "delta rule")


def _per_document(fn, *, tokens: int, split: tuple[int, ...]):
    """causal-conv1d's and mamba-ssm's contract for ``seq_idx`` ``(B, S)``: no tap or state crosses a change of it.
    Runs ``fn`` on each run of one row's tokens (dimension ``tokens`` of the arguments at positions ``split``)."""

    def run(*args, seq_idx=None, **kw):
        if seq_idx is None:
            return fn(*args, **kw)
        rows = []
        for r, row in enumerate(seq_idx):
            pieces = []
            for a, e in _runs(row):
                cut = [t[r : r + 1].narrow(tokens, a, e - a) if i in split else t for i, t in enumerate(args)]
                pieces.append(fn(*cut, **kw))
            rows.append(torch.cat(pieces, dim=tokens))
        return torch.cat(rows, dim=0)

    return run


@pytest.mark.parametrize("documents", [None, DOCUMENTS])
def test_the_causal_conv1d_mapping_gives_the_torch_conv(documents):
    from transformers.models.nemotron_h.modeling_nemotron_h import causal_conv1d_fn

    gen = torch.Generator().manual_seed(1)
    x, weight, bias = torch.randn(50, 2, 12, generator=gen), torch.randn(12, 4, generator=gen), torch.randn(12)
    want = F.silu(causal_conv1d(x, weight, bias, documents=documents))
    fn = _per_document(causal_conv1d_fn, tokens=2, split=(0,))
    _close(kernels.conv_kernel_silu(fn, x, weight, bias, documents=documents), want, "conv")


@pytest.mark.parametrize("documents", [None, DOCUMENTS])
def test_the_mamba_ssm_mapping_gives_the_torch_scan(documents):
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    gen = torch.Generator().manual_seed(2)
    b, s, h, p, g, n = 2, 50, 4, 3, 2, 5
    x, dt = torch.randn(b, s, h, p, generator=gen), torch.randn(b, s, h, generator=gen)
    B, C = (torch.randn(b, s, g, n, generator=gen) for _ in "BC")
    A, D, dt_bias = -torch.rand(h, generator=gen) - 0.1, torch.randn(h, generator=gen), torch.randn(h, generator=gen)
    limit = (0.05, 2.0)
    after = F.softplus(dt + dt_bias).clamp(*limit)
    want = ssd_scan(x, after, A, B, C, D, chunk=8, documents=documents)
    fn = _per_document(mamba2_chunk_scan, tokens=1, split=(0, 1, 3, 4))
    got = kernels.mamba_chunk_scan(fn, x, dt, A, B, C, D, dt_bias=dt_bias, dt_limit=limit, chunk=8, documents=documents)
    _close(got, want, "scan")
