"""The fused column-parallel linears (``megakit.nn.tensor_parallel.overlapped_linear``) on 2 gloo ranks.

Against the composed path (``enter_tp_region`` then each ``ColumnParallelLinear``): the same
outputs and gradients within 1e-6 (in fp64, whose rounding is near 1e-15 on any machine), with and without SP;
under SP the saved activation is the ``(S/t, B, H)`` shard, never the gathered input; and zero bubble's B/W split
gives the same gradients with each collective run once (B: the reduce-scatter, W: the re-gather).
"""

from __future__ import annotations

from tests.multiproc import run_ranks

S, B, H = 8, 2, 6


def _chunk(group, sp: bool, fused: bool, bias: bool):
    import torch
    from torch import nn

    from megakit.nn.tensor_parallel.collectives import enter_tp_region
    from megakit.nn.tensor_parallel.layers import ColumnParallelLinear
    from megakit.nn.tensor_parallel.overlapped_linear import column_parallel

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            kw = dict(group=group, sequence_parallel=sp, enter_region=False, bias=bias)
            self.a, self.b, self.c = (ColumnParallelLinear(H, 4, **kw) for _ in "abc")
            torch.manual_seed(1)
            for p in self.parameters():
                nn.init.normal_(p)

        def forward(self, x):
            layers = (self.a, self.b, self.c)
            if fused:
                a, b, c = column_parallel(x, layers, group, sp)
            else:
                full = enter_tp_region(x, group, sp)
                a, b, c = (layer(full) for layer in layers)
            return a * b + c.tanh()  # (S, B, 4/tp)

    return Chunk()


def _worker(rank, world, _):
    import torch
    import torch.distributed as dist
    from torch.autograd.graph import saved_tensors_hooks

    from megakit.nn import comm as C
    from megakit.nn.pipeline import split_backward

    torch.manual_seed(0)
    group = dist.new_group([0, 1])
    full_x = torch.randn(S, B, H, dtype=torch.float64)
    for sp in (True, False):
        for bias in (True, False):
            x0 = full_x.chunk(world)[rank] if sp else full_x  # (S', B, H)
            ref, fused = _chunk(group, sp, False, bias).double(), _chunk(group, sp, True, bias).double()
            split = _chunk(group, sp, True, bias).double()
            fused.load_state_dict(ref.state_dict())
            split.load_state_dict(ref.state_dict())
            saved = {}
            for name, model in (("ref", ref), ("fused", fused)):
                x = x0.clone().requires_grad_()
                shapes = []
                with saved_tensors_hooks(lambda t: shapes.append(t.numel()) or t, lambda t: t):
                    out = model(x)
                out.pow(2).sum().backward()
                saved[name] = (out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}, shapes)
            (o1, g1, w1, s1), (o2, g2, w2, s2) = saved["ref"], saved["fused"]
            case = f"sp={sp} bias={bias}"
            assert torch.allclose(o1, o2, atol=1e-6, rtol=0), case
            assert torch.allclose(g1, g2, atol=1e-6, rtol=0), case
            for n in w1:
                assert torch.allclose(w1[n], w2[n], atol=1e-6, rtol=0), (case, n)
            if sp:  # the composed path keeps the gathered input; the fused one only the shard
                assert S * B * H in s1 and S * B * H not in s2 and S // world * B * H in s2, (case, s1, s2)

            # zero bubble: B then W, each collective once
            x = x0.clone().requires_grad_()
            out = split(x)
            meter = C.Meter()
            with C.metered(meter):
                gx, deferred = split_backward.backward_input(split, x, out.pow(2).sum(), None)
                b_calls = meter.take()[1]
                assert all(p.grad is None for p in split.parameters()), case
                split_backward.backward_weight(split, deferred)
                w_calls = meter.take()[1]
            assert (b_calls, w_calls) == ((1, 1) if sp else (1, 0)), (case, b_calls, w_calls)
            assert torch.allclose(gx, g1, atol=1e-6, rtol=0), case
            for n, p in split.named_parameters():
                assert torch.allclose(p.grad, w1[n], atol=1e-6, rtol=0), (case, n)
    return True


def test_fused_column_parallel_matches_composed_and_saves_the_shard():
    assert run_ranks(_worker, 2, None) == [True, True]
