"""Packed documents: attention inside each document, positions restarted, in every attention path.

Packed attention equals the concatenation of each document's own causal attention (outputs and q/k/v
gradients), with GQA, a sliding window and 1-token documents: SDPA with the mask, the dropout path's explicit
softmax, and the ring (its fused chunk pairs and its explicit blocks) at CP 2 and CP 4 over gloo with documents
crossing the zig-zag chunks (lengths not multiples of 2 x CP); the ring without the document term differs. A
packed Llama and a packed GPT-2 with restarted positions give the logits transformers gives each document alone, and for Llama also transformers'
own packed batch (``position_ids`` restarting, no attention mask). fp32, bounds from ``tolerance``.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks
from tolerance import assert_fp32_close

from megakit.nn.attention.masks import position_ids

# two rows of 32 tokens: 1-token documents, and lengths that are not multiples of 2 x CP, so they cross the chunks
LENGTHS = ([5, 1, 9, 1, 7, 9], [3, 13, 1, 15])


def _documents() -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in LENGTHS])


def _per_document(q, k, v, documents, window: int = 0) -> torch.Tensor:
    """Each document of each row through plain causal SDPA on its own, concatenated."""
    import torch.nn.functional as F

    from megakit.nn.attention.masks import causal_mask

    out = torch.empty_like(q)
    for b in range(q.shape[0]):
        for d in documents[b].unique():
            idx = (documents[b] == d).nonzero().squeeze(1)
            qd, kd, vd = (t[b : b + 1, :, idx] for t in (q, k, v))
            mask = causal_mask(len(idx), window, q.device)
            out[b : b + 1, :, idx] = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=mask, is_causal=mask is None, enable_gqa=q.shape[1] != k.shape[1]
            )
    return out


def _qkv(seed: int = 0, heads: int = 4, kv_heads: int = 2, s: int = 32, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, s, d, generator=gen, requires_grad=True) for n in (heads, kv_heads, kv_heads)]


def _grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    (out * g).sum().backward()
    return out.detach(), [t.grad.clone() for t in (q, k, v)]


def test_positions_restart_at_each_document():
    docs = torch.tensor([[0, 0, 0, 1, 2, 2], [0, 1, 1, 1, 1, 2]])
    assert position_ids(docs).tolist() == [[0, 1, 2, 0, 0, 1], [0, 0, 1, 2, 3, 0]]


@pytest.mark.parametrize("window", [0, 4])
def test_packed_sdpa_and_the_dropout_path_equal_each_document_alone(window):
    import torch.nn.functional as F

    from megakit.nn.attention.masks import allowed_keys

    q, k, v = _qkv()
    docs = _documents()
    g = torch.randn_like(q)
    want, want_grads = _grads(lambda a, b, c: _per_document(a, b, c, docs, window), q, k, v, g)

    def packed(a, b, c):
        return F.scaled_dot_product_attention(
            a, b, c, attn_mask=allowed_keys(32, window, docs, a.device), enable_gqa=True
        )

    def explicit(a, b, c):  # the dropout path's softmax, at p = 0
        b, c = (t.repeat_interleave(2, dim=1) for t in (b, c))
        scores = a @ b.transpose(-2, -1) * 8**-0.5
        scores = scores.masked_fill(~allowed_keys(32, window, docs, a.device), float("-inf"))
        return scores.softmax(-1) @ c

    for fn in (packed, explicit):
        got, grads = _grads(fn, q, k, v, g)
        assert_fp32_close(got, want, terms=32, what="output")
        for name, a, b in zip("qkv", grads, want_grads):
            assert_fp32_close(a, b, terms=32, what=f"d{name}")


@pytest.mark.parametrize("window", [0, 4])
def test_flex_attention_equals_each_document_alone(window):
    """FlexAttention's block mask (the GPU's kernel for packed documents): the same outputs as each document alone,
    and as the Attention layer's own SDPA path. Forward only: torch has no FlexAttention backward on CPU."""
    from megakit.core.model_config import ModelConfig
    from megakit.nn.attention.core import Attention
    from megakit.nn.attention.masks import document_block_mask, flex_document_attention

    q, k, v = (t.detach() for t in _qkv())
    docs = _documents()
    want = _per_document(q, k, v, docs, window)
    assert_fp32_close(
        flex_document_attention(q, k, v, docs, window=window, scale=8**-0.5), want, terms=32, what="output"
    )
    assert document_block_mask(docs, window) is document_block_mask(docs, window)  # one mask per micro-batch
    assert document_block_mask(docs.clone(), window) is not document_block_mask(docs, window)
    config = ModelConfig.load("llama-tiny")
    layer = Attention(config, group=None, sequence_parallel=False, site="t", dtype=torch.float32, device="cpu").eval()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # built empty: megakit.nn.weights writes a model's weights
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    s, b = docs.shape[1], docs.shape[0]
    x = torch.randn(s, b, config.hidden, generator=torch.Generator().manual_seed(1))
    from megakit.nn.attention.core import rope_tables

    rope = tuple(t[position_ids(docs)] for t in rope_tables(config, "cpu"))
    with torch.no_grad():
        sdpa = layer(x, rope, None, docs)
        layer.flex_documents = True
        flex = layer(x, rope, None, docs)
    assert_fp32_close(flex, sdpa, terms=config.hidden, what="Attention layer")


def _ring_worker(rank: int, world: int, window: int):
    from megakit.nn.attention.ring import ring_attention
    from megakit.nn.sequence import gather_sequence, positions
    from megakit.nn.topology import Topology

    topo = Topology.from_world(cp=world)
    q, k, v = _qkv()
    docs = _documents()
    g = torch.randn(q.shape, generator=torch.Generator().manual_seed(5))
    want, want_grads = _grads(lambda a, b, c: _per_document(a, b, c, docs, window), q, k, v, g)
    held = positions(32, world, rank)
    out = {}
    for name, documents, fused in (
        ("packed", docs, True),
        ("packed, explicit blocks", docs, False),
        ("no document term", None, True),
    ):
        mine = [t.detach()[:, :, held].clone().requires_grad_() for t in (q, k, v)]
        y = ring_attention(*mine, topo.cp_group, window=window, documents=documents, fused=fused)
        (y * g[:, :, held]).sum().backward()
        full = gather_sequence(y.detach(), topo.cp_group, dim=2)
        grads = [gather_sequence(t.grad, topo.cp_group, dim=2) for t in mine]
        out[name] = max(
            float((full - want).abs().max()), *(float((a - b).abs().max()) for a, b in zip(grads, want_grads))
        )
    scale = max(float(want.abs().max()), *(float(t.abs().max()) for t in want_grads))
    return out, scale


@pytest.mark.parametrize("cp", [2, 4])
def test_the_ring_keeps_documents_apart_at_cp2_and_cp4(cp):
    from tolerance import fp32_bound

    for window in (0, 4):
        for errors, scale in run_ranks(_ring_worker, cp, window):
            assert errors["packed"] <= fp32_bound(scale, 32), (cp, window, errors)  # the fused ring's chunk pairs
            assert errors["packed, explicit blocks"] <= fp32_bound(scale, 32), (cp, window, errors)  # the reference
            assert errors["no document term"] > 1e-2 * scale, (cp, window, errors)  # the negative control


def _hf_pair(family: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from megakit.interop.hf import from_hf_state_dict
    from megakit.nn.model import ModelConfig, Transformer, load_full_state_dict

    torch.manual_seed(0)
    if family == "llama":
        hf = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                attn_implementation="sdpa",
            )
        ).eval()
    else:
        hf = GPT2LMHeadModel(
            GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, attn_implementation="eager")
        ).eval()
    config = ModelConfig.from_hf(hf.config.to_dict())
    ours = Transformer(config, seed=1).eval()
    load_full_state_dict(ours, from_hf_state_dict(config, {k: v for k, v in hf.state_dict().items()}))
    return hf, ours


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_packed_model_gives_each_documents_own_logits(family):
    hf, ours = _hf_pair(family)
    docs = _documents()
    ids = torch.randint(0, 96, docs.shape, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = ours(ids, documents=docs, position_ids=position_ids(docs))  # (B, S, V)
        unreset = ours(ids, documents=docs)
        want = torch.empty_like(packed)
        for b in range(ids.shape[0]):
            for d in docs[b].unique():
                idx = (docs[b] == d).nonzero().squeeze(1)
                want[b, idx] = hf(ids[b : b + 1, idx]).logits[0]
        assert_fp32_close(packed, want, terms=32, what=f"{family} per document")
        if family == "llama":  # transformers' own packed batch: positions restarting, no attention mask, no cache
            together = hf(ids, position_ids=position_ids(docs), use_cache=False).logits  # packed: no cache
            assert_fp32_close(packed, together, terms=32, what="llama packed")
            assert_fp32_close(unreset, want, terms=32, what="RoPE: relative positions only")
        else:  # learned positions: without the restart the later documents differ
            assert (unreset - want).abs().max() > 1e-3
