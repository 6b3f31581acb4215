"""Context parallelism on real gloo processes: CP = 2 and 4, and CP 2 x TP 2, against one process (fp32).

One spawn of four ranks sweeps every case (CP 4; CP 2 x TP 2 with and without sequence
parallelism; CP 2 x DP 2, i.e. two CP 2 rings; sliding windows, RoPE scaling, GPT-2's score
scaling). Under CP each rank's gradient is CP times its share of the sequence's (DeepSpeed
averages over DP x CP), so the test averages the gradients over the CP group and compares
them with the single process's. Tolerance as in
``test_tensor_parallel``: ``|a - b| <= 1e-5 * max|b| + 1e-9`` per tensor.
"""

from __future__ import annotations

import pytest
import torch
from equivalence import _equivalence
from multiproc import run_ranks

from megakit.nn.sequence import positions


def test_load_balanced_split_covers_the_sequence_once():
    held = [positions(16, 4, r).tolist() for r in range(4)]
    assert held[0] == [0, 1, 14, 15] and held[3] == [6, 7, 8, 9]
    assert sorted(sum(held, [])) == list(range(16))


def _sweep(rank, world_size, root):
    from megakit.core.layout import Layout
    from megakit.core.rope import RopeScaling
    from megakit.errors import UsageError
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.nn.topology import Topology

    cp4, cp2tp2, cp2dp2 = Topology(Layout(cp=4)), Topology(Layout(tp=2, cp=2)), Topology(Layout(cp=2, dp=2))
    hybrid = Topology(Layout(cp=4, cp_a2a=2))  # a2a inside CP ranks {0, 1} and {2, 3}, rings {0, 2} and {1, 3}
    done = []
    for preset in ("gpt-tiny", "llama-tiny"):  # llama-tiny: 8 heads over 4 KV heads (GQA)
        done.append(_equivalence(cp4, preset))
        done.append(_equivalence(cp2tp2, preset))
        done.append(_equivalence(cp2tp2, preset, sequence_parallel=True))
        done.append(_equivalence(cp2dp2, preset))
    done.append(_equivalence(cp2tp2, "llama-tiny", sequence_parallel=True, dropout=0.1))  # residual + attention
    done.append(_equivalence(cp4, "gpt-tiny", dropout=0.1, recompute="full"))
    # a sliding window shorter than the sequence (masked in the ring; Qwen2's: blocks 1 on), Llama 3.1's RoPE
    # at the rank's global positions, GPT-2's score scaling; with dropout the single process writes attention out
    llama3 = RopeScaling(
        "llama3",
        (("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0), ("original_max_position_embeddings", 4)),
    )
    done.append(
        _equivalence(cp4, "llama-tiny", sliding_window=5, sliding_window_from=1, rope_theta=5e5, rope_scaling=llama3)
    )
    done.append(_equivalence(cp2tp2, "llama-tiny", dropout=0.1, sliding_window=3))
    done.append(
        _equivalence(cp2dp2, "gpt-tiny", dropout=0.1, scale_attn_weights=False, scale_attn_by_inverse_layer_idx=True)
    )
    # Ulysses (--cp-mode a2a): MHA and GQA at CP 4 (llama-tiny's 4 KV heads split; 2 KV heads, fewer than CP 4,
    # replicated per query head), under TP 2 with SP, with dropout, a window and full recompute
    done.append(_equivalence(cp4, "gpt-tiny", cp_mode="a2a"))
    done.append(_equivalence(cp4, "llama-tiny", cp_mode="a2a"))
    done.append(_equivalence(cp4, "llama-tiny", cp_mode="a2a", kv_heads=2, sliding_window=5))
    done.append(_equivalence(cp2tp2, "llama-tiny", cp_mode="a2a", sequence_parallel=True, dropout=0.1))
    done.append(_equivalence(cp2dp2, "gpt-tiny", cp_mode="a2a", dropout=0.1, recompute="full"))
    # hybrid 2 x 2 (USP): MHA; GQA with one KV head (replicated for the a2a) and a window; dropout (the explicit
    # ring's blocks), each rank's mask cut from the draw at its head group and its ring rows
    done.append(_equivalence(hybrid, "gpt-tiny", cp_mode="hybrid"))
    done.append(_equivalence(hybrid, "llama-tiny", cp_mode="hybrid", kv_heads=1, sliding_window=5))
    done.append(_equivalence(hybrid, "llama-tiny", cp_mode="hybrid", dropout=0.1))
    # Gemma 3 (5 sliding : 1 full, window 8 at 16 tokens: zig-zag chunks of 2 and 4, shorter than it; local and
    # global RoPE at the global positions; sandwich and (1 + w) norms) on the ring and on Ulysses under TP
    done.append(_equivalence(cp4, "gemma3-tiny"))
    done.append(_equivalence(cp2tp2, "gemma3-tiny", cp_mode="a2a", sequence_parallel=True))
    # gpt-oss's attention sinks (with a window): the ring at CP 4, CP 2 x TP 2 (sinks split with the heads) with SP,
    # Ulysses (each rank's head group's sinks), hybrid, and dropout (the explicit ring's blocks)
    sinks = dict(attention_sinks=True, sliding_window=5)
    done.append(_equivalence(cp4, "llama-tiny", **sinks))
    done.append(_equivalence(cp2tp2, "llama-tiny", sequence_parallel=True, **sinks))
    done.append(_equivalence(cp4, "llama-tiny", cp_mode="a2a", **sinks))
    done.append(_equivalence(hybrid, "llama-tiny", cp_mode="hybrid", **sinks))
    done.append(_equivalence(cp2dp2, "llama-tiny", dropout=0.1, **sinks))
    done.append(_equivalence(cp2tp2, "gpt-oss-tiny", sequence_parallel=True))  # its window 8 over chunks of 4
    done.append(_equivalence(cp2tp2, "gpt-oss-tiny", seq=64))  # chunks of 16: the window inside and across them
    # DeepSeek-V3's MLA: keys of 24, values of 16 (the ring pads them), the shared RoPE key at global positions
    done.append(_equivalence(cp2dp2, "deepseek-v3-tiny"))
    done.append(_equivalence(cp2tp2, "deepseek-v3-tiny", sequence_parallel=True))
    done.append(_equivalence(cp4, "deepseek-v3-tiny", cp_mode="a2a", dropout=0.1))
    # a checkpoint saved at CP 2 x TP 2: CP ranks hold the same weights, so one of them writes
    config = ModelConfig.load("llama-tiny")
    save_checkpoint(f"{root}/cp2tp2", Transformer(config, cp2tp2, seed=21), cp2tp2, step=1, config=config)
    model = Transformer(ModelConfig.load("gpt-tiny"), cp4)
    try:
        model(torch.zeros((1, 12), dtype=torch.long))
    except UsageError as error:
        done.append(str(error))
    return done


def test_context_parallel_matches_one_process(tmp_path):
    from megakit.interop.checkpoint import load_checkpoint
    from megakit.nn.model import ModelConfig, Transformer, full_state_dict

    results = run_ranks(_sweep, 4, str(tmp_path), timeout_s=400)
    assert len(results[0]) == 34
    assert "not divisible by 2 x CP = 8" in results[0][-1]
    loaded = Transformer(ModelConfig.load("llama-tiny"), seed=0)
    load_checkpoint(tmp_path / "cp2tp2", loaded)
    want = full_state_dict(Transformer(ModelConfig.load("llama-tiny"), seed=21))
    assert all(torch.equal(t, want[name]) for name, t in full_state_dict(loaded).items())


def _window_model_sweep(rank, world_size):
    from megakit.core.layout import Layout
    from megakit.nn.topology import Topology

    cp4, hybrid = Topology(Layout(cp=4)), Topology(Layout(cp=4, cp_a2a=2))
    return [
        _equivalence(cp4, "llama-tiny", seq=64, sliding_window=8),  # the window a whole chunk: c = 64 / 8
        _equivalence(cp4, "llama-tiny", seq=64, sliding_window=3, attention_sinks=True, documents=True),
        _equivalence(cp4, "llama-tiny", seq=64, sliding_window=8, dropout=0.1, documents=True),  # explicit blocks
        _equivalence(cp4, "gpt-oss-tiny", seq=64, documents=True),  # window 8 on alternate blocks, the ring between
        _equivalence(cp4, "gemma3-tiny", seq=64),  # window 8 on 5 blocks of 6
        _equivalence(hybrid, "gpt-oss-tiny", cp_mode="hybrid", seq=64),
    ]  # a ring of 2, chunks of 16


def test_a_window_within_a_chunk_matches_one_process():
    """Models whose windows fit in a chunk at CP 4 over 64 tokens (chunks of 8), each rank's K/V swapped with its
    two zig-zag neighbours only (``attention.transport.Halo``): one process's logits, loss and every gradient, with
    sinks, packed documents, dropout, blocks that keep the full ring beside windowed ones, and hybrid's ring of 2."""
    assert len(run_ranks(_window_model_sweep, 4, timeout_s=400)[0]) == 6


# -- a window within a chunk: K/V from the two zig-zag neighbours, not around the ring ------------------------------
B, N, KV, S, D = 2, 4, 2, 64, 8  # at CP 4: chunks of c = S / (2 x 4) = 8 tokens
WINDOW_CASES = [  # (window, fused, documents, sinks, dropout)
    (8, True, False, False, 0.0),
    (8, False, False, False, 0.0),
    (3, True, True, True, 0.0),
    (3, False, True, True, 0.0),
    (8, False, True, False, 0.2),
    (5, True, False, True, 0.0),
    (9, True, True, False, 0.0),
    (0, True, False, False, 0.0),
    (9, False, False, True, 0.2),
]


def _window_case(rank: int, world: int, window: int, fused: bool, documents: bool, sinks: bool, dropout: float):
    """One ``ring_attention`` at CP ``world`` against the ring of one over the whole sequence (its fused blocks are
    held to an eager reference in ``test_sinks``): ``(largest error / scale over out, dq, dk, dv, d sinks; P2P
    messages sent; bytes sent by peer)`` for this rank. fp64 (the explicit blocks compute in fp32 inside)."""
    from megakit.nn import comm as C
    from megakit.nn.attention.ring import ring_attention
    from megakit.nn.sequence import positions
    from megakit.nn.topology import Topology

    topo = Topology.from_world(cp=world)
    gen = torch.Generator().manual_seed(window)
    q = torch.randn(B, N, S, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(B, KV, S, D, generator=gen, dtype=torch.float64) for _ in "kv")
    sink = 2.0 + torch.randn(N, generator=gen, dtype=torch.float64) if sinks else None
    docs = (torch.rand(B, S, generator=gen) < 0.15).long().cumsum(-1) if documents else None
    keep = torch.rand(B, N, S, S, generator=gen) >= dropout if dropout else None
    grad = torch.randn(B, N, S, D, generator=gen, dtype=torch.float64)
    held = positions(S, world, rank)

    def run(q, k, v, sink, group, keep):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)] + ([sink.clone().requires_grad_()] if sinks else [])
        out = ring_attention(
            *leaves[:3],
            group,
            keep=keep,
            p=dropout,
            window=window,
            documents=docs,
            fused=fused,
            sinks=leaves[3] if sinks else None,
        )
        out.backward(grad.index_select(2, held) if group is not None else grad)
        return [out.detach()] + [t.grad for t in leaves]

    want = run(q, k, v, sink, None, keep)
    want = [t.index_select(2, held) for t in want[:4]] + want[4:]
    meter = C.Meter()
    with C.metered(meter):
        got = run(
            *(t.index_select(2, held) for t in (q, k, v)),
            sink,
            topo.cp_group,
            None if keep is None else keep.index_select(2, held),
        )
    if sinks:  # each rank's share of d sinks: summed over the ring
        got[4] = C.all_reduce(got[4].clone(), topo.cp_group)
    error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
    return error, meter.p2p_messages, dict(meter.p2p_sent)


def _window_sweep(rank: int, world: int):
    return [_window_case(rank, world, *case) for case in WINDOW_CASES]


def test_a_window_within_a_chunk_exchanges_with_the_two_neighbours_only():
    """At CP 4 over 64 tokens (chunks of c = 8): windows of 8 and below give the ring of one's output and
    gradients (fused and explicit blocks, GQA, packed documents, sinks, dropout) while each rank sends only to its
    zig-zag neighbours, rank r's first chunk to r + 1 and its second to r - 1: forward one half block each way
    (K/V), backward one each way again (K/V) and the neighbours' chunks' gradients back. Rank 0 (no chunk before
    chunk 0) and rank 3 (its chunks 3 and 4 adjacent) have one neighbour. Windows of 9 (> c) and none: the full
    ring, CP - 1 = 3 K/V blocks forward, 3 more and 4 gradient blocks backward, all to rank r + 1."""
    results = run_ranks(_window_sweep, 4, timeout_s=300)
    block = 2 * B * KV * (S // 4) * D * 8  # K and V of one rank, fp64
    for i, case in enumerate(WINDOW_CASES):
        window, fused = case[:2]
        grads = block if fused else block // 2  # the explicit blocks' gradients travel in fp32
        for rank, (error, messages, sent) in enumerate(r[i] for r in results):
            assert error <= (1e-12 if fused else 1e-5), (case, rank, error)
            if 0 < window <= S // 8:
                peers = {p: block + grads // 2 for p in (rank - 1, rank + 1) if 0 <= p < 4}  # 2 K/V halves, 1 grads
                assert (messages, sent) == (3 * len(peers), peers), (case, rank, messages, sent)
            else:
                assert (messages, sent) == (10, {(rank + 1) % 4: 6 * block + 4 * grads}), (case, rank, messages, sent)


D_QK, D_V = 12, 8  # MLA-shaped heads: values narrower than keys (DeepSeek-V3: 192 and 128)
MLA_CASES = [(0, True), (0, False), (8, True), (8, False)]  # (window, fused): the full ring, then the neighbours'


def _mla_case(rank: int, world: int, window: int, fused: bool):
    """``ring_attention`` of MLA-shaped heads at CP ``world`` against causal softmax attention over the whole
    sequence in fp64: ``(largest error / scale over out, dq, dk, dv; P2P messages sent; bytes sent by peer)``."""
    from megakit.nn import comm as C
    from megakit.nn.attention.ring import ring_attention
    from megakit.nn.topology import Topology

    topo = Topology.from_world(cp=world)
    gen = torch.Generator().manual_seed(window)
    q, k = (torch.randn(B, N, S, D_QK, generator=gen, dtype=torch.float64) for _ in "qk")
    v, grad = (torch.randn(B, N, S, D_V, generator=gen, dtype=torch.float64) for _ in "vg")
    held = positions(S, world, rank)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    gap = torch.arange(S)[:, None] - torch.arange(S)[None, :]
    allowed = (gap >= 0) & (gap < window) if window else gap >= 0
    scores = (leaves[0] @ leaves[1].transpose(-2, -1) * D_QK**-0.5).masked_fill(~allowed, float("-inf"))
    out = scores.softmax(-1) @ leaves[2]
    out.backward(grad)
    want = [t.index_select(2, held) for t in [out.detach()] + [t.grad for t in leaves]]
    leaves = [t.index_select(2, held).requires_grad_() for t in (q, k, v)]
    meter = C.Meter()
    with C.metered(meter):
        out = ring_attention(*leaves, topo.cp_group, window=window, fused=fused)
        out.backward(grad.index_select(2, held))
    got = [out.detach()] + [t.grad for t in leaves]
    assert got[0].shape[-1] == D_V
    error = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
    return error, meter.p2p_messages, dict(meter.p2p_sent)


def _mla_sweep(rank: int, world: int):
    return [_mla_case(rank, world, *case) for case in MLA_CASES]


def test_the_ring_carries_mla_values_at_their_own_width():
    """MLA's values (d_v) narrower than its keys (d_qk), at CP 4 over 64 tokens: the output (d_v wide) and gradients
    equal whole-sequence attention's, and each step's K/V message is n (d_qk + d_v) x tokens x element bytes, one
    flat buffer (``megakit.nn.attention.transport.pack``), not the 2 n d_qk of V padded with zero columns (which the
    ring sent before: 24 / 20 of it here, 384 / 320 for DeepSeek-V3). The full ring: 3 K/V blocks forward, 3 more
    and 4 gradient blocks backward, all to rank r + 1, one message each; a window within a chunk (8 tokens): half
    blocks to and from the zig-zag neighbours (the counts of ``test_a_window_within_a_chunk_...``)."""
    results = run_ranks(_mla_sweep, 4, timeout_s=300)
    block = B * N * (S // 4) * (D_QK + D_V) * 8  # one step's K/V message: this rank's tokens, fp64
    for i, (window, fused) in enumerate(MLA_CASES):
        grads = block if fused else block // 2  # the explicit blocks' gradients travel in fp32
        for rank, (error, messages, sent) in enumerate(r[i] for r in results):
            assert error <= (1e-12 if fused else 1e-5), (window, fused, rank, error)
            if window:
                peers = {p: block + grads // 2 for p in (rank - 1, rank + 1) if 0 <= p < 4}  # 2 K/V halves, 1 grads
                assert (messages, sent) == (3 * len(peers), peers), (window, fused, rank, messages, sent)
            else:
                assert (messages, sent) == (10, {(rank + 1) % 4: 6 * block + 4 * grads}), (fused, rank, sent)


@pytest.mark.parametrize("cp", [2, 4])
def test_layout_places_cp_groups_next_to_tp(cp):
    from megakit.core.layout import Layout

    layout = Layout(tp=2, cp=cp, dp=2)
    assert layout.groups("cp")[0] == [2 * i for i in range(cp)]  # CP after TP: inside a node of 2 x CP GPUs
    for kind in ("tp", "cp", "dp", "dpcp", "pp", "mp"):
        assert sorted(r for g in layout.groups(kind) for r in g) == list(range(layout.world_size)), kind
    for rank in range(layout.world_size):
        assert layout.rank(**layout.coords(rank)) == rank
