"""gpt-oss's attention sinks on megakit's attention blocks against an independent fp64 reference.

The reference is transformers' eager formulation: a sink column of logit ``sink_h`` appended to every row's
scores, the softmax taken, the column dropped. megakit instead multiplies the merged output by
``sigmoid(lse - sink)`` and folds the LSE's gradient into the kernels' ``D`` term (``attention.blocks._sink_backward``);
the layouts' equivalence (``test_context_parallel``) cannot see a mistake there (every layout runs the same code), so
the output, ``dq``, ``dk``, ``dv`` and ``d sinks`` are held to the reference here, for the fused blocks (exact in fp64)
and the explicit ones (fp32 inside: fp32 rounding), with GQA, a window and packed documents. The sinks are drawn
near the rows' log-sum-exp: at zero their effect ``sigmoid(lse)`` is close to 1 and a wrong gradient hides in rounding.
Without CP, sinks run on the rank's own block (``block_attention``), bit for bit as a ring of one.
"""

from __future__ import annotations

import pytest
import torch

from megakit.nn.attention.blocks import block_attention
from megakit.nn.attention.masks import same_document
from megakit.nn.attention.ring import ring_attention

B, N, KV, S, D = 2, 4, 2, 16, 8


def _reference(q, k, v, sinks, window, documents):
    k, v = (t.repeat_interleave(N // KV, 1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) * D**-0.5
    i = torch.arange(S)
    gap = i[:, None] - i[None, :]
    allowed = (gap >= 0) & (gap < window) if window else gap >= 0
    if documents is not None:
        allowed = allowed & same_document(documents, documents)
    scores = scores.masked_fill(~allowed, float("-inf"))
    scores = torch.cat([scores, sinks[None, :, None, None].expand(B, N, S, 1)], dim=-1)
    return scores.softmax(-1)[..., :-1] @ v


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("window,documents", [(0, False), (5, False), (0, True)])
def test_sinks_match_the_eager_reference_forward_and_backward(fused, window, documents):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, N, S, D, generator=gen, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(B, KV, S, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in "kv")
    sinks = (2.0 + torch.randn(N, generator=gen, dtype=torch.float64)).requires_grad_()
    docs = (torch.rand(B, S, generator=gen) < 0.2).long().cumsum(-1) if documents else None
    grad = torch.randn(B, N, S, D, generator=gen, dtype=torch.float64)
    results = []
    for run in (
        lambda: _reference(q, k, v, sinks, window, docs),
        lambda: block_attention(q, k, v, fused=fused, window=window, documents=docs, sinks=sinks),
        lambda: ring_attention(q, k, v, None, fused=fused, window=window, documents=docs, sinks=sinks),
    ):
        for t in (q, k, v, sinks):
            t.grad = None
        out = run()
        out.backward(grad)
        results.append([out.detach()] + [t.grad.clone() for t in (q, k, v, sinks)])
    with torch.no_grad():  # the sinks act: the share each row keeps, sigmoid(lse - sink), spans most of (0, 1)
        scores = q @ k.repeat_interleave(N // KV, 1).transpose(-1, -2) * D**-0.5
        lse = scores.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf")).logsumexp(-1)
        kept = torch.sigmoid(lse - sinks[None, :, None])
        assert kept.min() < 0.2 and kept.max() > 0.8, (kept.min(), kept.max())
    tol = 1e-12 if fused else 1e-5  # the explicit blocks compute in fp32
    for name, got, want in zip(("out", "dq", "dk", "dv", "dsinks"), results[1], results[0]):
        assert (got - want).abs().max().item() <= tol * max(1.0, want.abs().max().item()), name
    for name, own, ring in zip(("out", "dq", "dk", "dv", "dsinks"), results[1], results[2]):
        assert torch.equal(own, ring), name  # no CP: the own block alone is a ring of one, bit for bit
