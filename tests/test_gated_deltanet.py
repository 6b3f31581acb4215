"""Gated DeltaNet (Qwen3-Next, Qwen3.5): megakit's mixer against transformers' own module, and its parallel layouts.

transformers' ``Qwen3NextGatedDeltaNet`` (its torch path: no flash-linear-attention or causal-conv1d here) with
its weights copied into megakit's, the decays, biases and conv taps moved away from their initial values, over
sequences longer than the chunk (fp32, within 1e-5). Packed documents restart the conv and the state: the same as
transformers run on each document alone. One spawn of four gloo ranks then checks TP (with and without SP), CP by the
all-to-all of heads, and both, with documents, against one process: outputs, input gradients, weight gradients.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks

from megakit.core.linear_attention_config import LinearAttentionConfig
from megakit.errors import UsageError

TOL = 1e-5
HIDDEN = 32
LINEAR = LinearAttentionConfig(key_heads=4, value_heads=8, key_head_dim=8, value_head_dim=4, chunk=16)


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item()
    bound = TOL * max(want.abs().max().item(), 1.0)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _hf_module(seed: int = 0):
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = Qwen3NextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        linear_conv_kernel_dim=4,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(seed)
    hf = Qwen3NextGatedDeltaNet(config, layer_idx=0).float()
    with torch.no_grad():  # away from their initial values (ones, zero-mean conv, A in (0.01, 16))
        hf.dt_bias.copy_(torch.randn_like(hf.dt_bias))
        hf.A_log.copy_(torch.randn_like(hf.A_log) * 0.5)
        hf.conv1d.weight.copy_(torch.randn_like(hf.conv1d.weight) * 0.5)
        hf.norm.weight.copy_(1 + 0.3 * torch.randn_like(hf.norm.weight))
    return hf, config


def _megakit_from_hf(hf, config, chunk: int = 64):
    """megakit's mixer with ``hf``'s weights, through the import's own split of the fused projections (and back)."""
    from megakit.interop.hf_linear import linear_from_hf, linear_to_hf
    from megakit.nn.linear_attention.gated_deltanet import GatedDeltaNet

    linear = LinearAttentionConfig.from_hf(config.to_dict(), 1)
    linear = LinearAttentionConfig(**{**linear.__dict__, "chunk": chunk})
    ours = GatedDeltaNet(
        linear, HIDDEN, eps=config.rms_norm_eps, group=None, sequence_parallel=False, dtype=torch.float32, device=None
    )
    theirs = {f"linear_attn.{k}": v for k, v in hf.state_dict().items()}
    state = linear_from_hf(linear, "qwen3_next", "", "", theirs)
    ours.load_state_dict({k.removeprefix("attn."): v for k, v in state.items()})
    back = linear_to_hf(linear, "qwen3_next", "", "", state)
    assert back.keys() == theirs.keys() and all(torch.equal(back[k], theirs[k]) for k in back)
    return ours


def test_gated_deltanet_matches_transformers():
    """Forward and input gradient over 150 tokens (chunks of 64 and a padded last one), two sequences."""
    hf, config = _hf_module()
    ours = _megakit_from_hf(hf, config)
    x = torch.randn(2, 150, HIDDEN, requires_grad=True)
    want = hf(x)
    want.square().sum().backward()
    xs = x.detach().transpose(0, 1).clone().requires_grad_()
    got = ours(xs)  # sequence-first
    got.square().sum().backward()
    _close(got.transpose(0, 1), want, "output")
    _close(xs.grad.transpose(0, 1), x.grad, "input gradient")
    _close(ours.A_log.grad, hf.A_log.grad, "A_log gradient")
    _close(ours.conv_v.grad, hf.conv1d.weight.grad.squeeze(1)[-ours.conv_v.shape[0] :], "conv gradient")


def test_documents_restart_the_conv_and_the_state():
    """A packed row of three documents (one crossing a chunk boundary, one of a single token) equals transformers run on
    each alone; a chunk of 16 puts boundaries inside and at the edges of chunks."""
    hf, config = _hf_module(seed=1)
    ours = _megakit_from_hf(hf, config, chunk=16)
    lengths = [37, 1, 16, 26]
    x = torch.randn(1, sum(lengths), HIDDEN)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]
    with torch.no_grad():
        want = torch.cat([hf(part) for part in x.split(lengths, dim=1)], dim=1)
        got = ours(x.transpose(0, 1), documents=documents).transpose(0, 1)
        plain = ours(x.transpose(0, 1)).transpose(0, 1)
    _close(got, want, "packed documents")
    assert (plain - want).abs().max() > 1e-3  # without the documents the state leaks across them


def test_bad_head_counts_and_layer_types_are_one_line():
    with pytest.raises(UsageError, match="key heads 4 are not divisible by TP x CP = 2 x 4"):
        LINEAR.check_parallel(tp=2, cp=4)
    with pytest.raises(UsageError, match="layer type 'mamba' is not one megakit builds"):
        LinearAttentionConfig(
            key_heads=2, value_heads=4, key_head_dim=8, value_head_dim=8, layer_types=("linear_attention", "mamba")
        )


def _layouts(rank, world_size):
    """Each layout's output, input gradient and weight gradients against one process, on 4 ranks."""
    import torch.distributed as dist

    from megakit.nn.linear_attention.gated_deltanet import GatedDeltaNet
    from megakit.nn.sequence import positions

    def full_weights(seed):
        gen = torch.Generator().manual_seed(seed)
        ref = GatedDeltaNet(
            LINEAR, HIDDEN, eps=1e-6, group=None, sequence_parallel=False, dtype=torch.float32, device=None
        )
        with torch.no_grad():
            for p in ref.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 1.0))
        return ref

    seq, b = 48, 2
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(seq, b, HIDDEN, generator=gen)
    documents = torch.tensor([[0] * 20 + [1] * 28, [0] * 5 + [1] * 30 + [2] * 13])
    ref = full_weights(3)
    xr = x.clone().requires_grad_()
    want = ref(xr, documents)
    want.square().sum().backward()
    ranks = list(range(4))
    done = []
    for tp, cp, sp in ((2, 2, True), (2, 2, False), (1, 4, False), (4, 1, True)):
        groups = [dist.new_group(g) for g in ([[0, 1], [2, 3]] if tp == 2 else [ranks])]  # TP: consecutive ranks
        cps = [dist.new_group(g) for g in ([[0, 2], [1, 3]] if cp == 2 else [ranks])]
        tp_group = None if tp == 1 else groups[rank // 2 if tp == 2 else 0]
        cp_group = None if cp == 1 else cps[rank % 2 if cp == 2 else 0]
        tp_rank, cp_rank = rank % tp, (rank // tp) % cp
        model = GatedDeltaNet(
            LINEAR,
            HIDDEN,
            eps=1e-6,
            group=tp_group,
            sequence_parallel=sp,
            dtype=torch.float32,
            device=None,
            cp_group=cp_group,
        )
        with torch.no_grad():
            for p, full in zip(model.parameters(), ref.parameters()):
                p.copy_(full if p.tp_dim is None else full.chunk(tp, dim=p.tp_dim)[tp_rank])
        mine = positions(seq, cp, cp_rank)
        xs = x[mine]
        if sp:
            xs = xs.chunk(tp, dim=0)[tp_rank]
        xs = xs.clone().requires_grad_()
        out = model(xs, documents)
        out.square().sum().backward()
        want_rows = want.detach()[mine]
        want_grad = xr.grad[mine]
        if sp:
            want_rows, want_grad = want_rows.chunk(tp, dim=0)[tp_rank], want_grad.chunk(tp, dim=0)[tp_rank]
        _close(out, want_rows, f"tp {tp} cp {cp} sp {sp} output")
        _close(xs.grad, want_grad, f"tp {tp} cp {cp} sp {sp} input gradient")
        for (name, p), full in zip(model.named_parameters(), ref.parameters()):
            grad = p.grad.clone()
            if cp_group is not None:
                dist.all_reduce(grad, group=cp_group)  # each CP rank holds its tokens' share (or its heads')
            expect = full.grad if p.tp_dim is None else full.grad.chunk(tp, dim=p.tp_dim)[tp_rank]
            _close(grad, expect, f"tp {tp} cp {cp} sp {sp} {name} gradient")
        done.append((tp, cp, sp))
    return done


def test_tensor_and_context_parallel_layouts_match_one_process():
    results = run_ranks(_layouts, 4, timeout_s=200)
    assert results[0] == [(2, 2, True), (2, 2, False), (1, 4, False), (4, 1, True)]


def test_qwen3_5_layout_matches_transformers():
    """Qwen3.5's mixer (q, k, v in one projection, z, b and a apart) through the same import, over 70 tokens."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from megakit.interop.hf_linear import linear_from_hf
    from megakit.nn.linear_attention.gated_deltanet import GatedDeltaNet

    config = Qwen3_5TextConfig(
        hidden_size=HIDDEN,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=6,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
    )
    torch.manual_seed(2)
    hf = Qwen3_5GatedDeltaNet(config, layer_idx=0).float()
    with torch.no_grad():
        hf.dt_bias.copy_(torch.randn_like(hf.dt_bias))
        hf.conv1d.weight.copy_(torch.randn_like(hf.conv1d.weight) * 0.5)
    linear = LinearAttentionConfig.from_hf(config.to_dict(), 1)
    ours = GatedDeltaNet(
        linear, HIDDEN, eps=config.rms_norm_eps, group=None, sequence_parallel=False, dtype=torch.float32, device=None
    )
    state = linear_from_hf(linear, "qwen3_5_text", "", "", {f"linear_attn.{k}": v for k, v in hf.state_dict().items()})
    ours.load_state_dict({k.removeprefix("attn."): v for k, v in state.items()})
    x = torch.randn(2, 70, HIDDEN)
    with torch.no_grad():
        _close(ours(x.transpose(0, 1)).transpose(0, 1), hf(x), "Qwen3.5 output")
