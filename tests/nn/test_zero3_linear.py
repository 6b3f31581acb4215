"""ZeRO-3: megakit's linears must hand autograd the weight itself (``megakit.train.engine.zero3_linear``).

A saved view of the weight keeps DeepSpeed's gathered copy alive until backward. The launcher
test that measures it is ``test_trainer.py::test_verify_memory_zero_0_to_3`` (ZeRO-3 case);
this one checks the mechanism in one process, in about a second once DeepSpeed is imported.
"""

import torch
import torch.nn.functional as F

from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megakit.train.engine.zero3_linear import save_weights_not_views


def _run(layers, x):
    """The layers' output and every tensor autograd saved for backward."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = layers[1](layers[0](x))
    y.square().sum().backward()
    return y, saved


def test_zero3_linears_save_the_parameter_not_a_view_and_compute_the_same():
    torch.manual_seed(0)
    layers = torch.nn.Sequential(ColumnParallelLinear(8, 16), RowParallelLinear(16, 8))
    for p in layers.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(5, 3, 8, requires_grad=True)  # (S, B, H): F.linear saves weight.t() for a 3-D input

    y_plain, saved_plain = _run(layers, x)
    grads_plain = [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]
    weights = [layers[0].weight, layers[1].weight]
    views = [t for t in saved_plain if t._base is not None and any(t._base is w for w in weights)]
    assert len(views) == 2  # the pinning this module exists for: a view of each weight

    layers.zero_grad()
    x.grad = None
    assert save_weights_not_views(layers) == 2
    assert save_weights_not_views(layers) == 0  # a layer already swapped (or --fp8's) is left alone
    y, saved = _run(layers, x)
    assert not [
        t
        for t in saved
        if not isinstance(t, torch.nn.Parameter) and t._base is not None and any(t._base is w for w in weights)
    ]
    assert all(any(t is w for t in saved) for w in weights)  # the parameters themselves
    torch.testing.assert_close(y, y_plain, rtol=1e-6, atol=1e-5)
    for got, want in zip([p.grad for p in layers.parameters()] + [x.grad], grads_plain):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    assert layers[0].matmul is not F.linear
