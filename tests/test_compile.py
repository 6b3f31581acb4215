"""--compile: each block through torch.compile gives the eager model's loss and gradients, as one graph.

A counting backend records every graph Dynamo hands over (and runs it eagerly, so the numbers are the
eager ones through Dynamo's and AOTAutograd's capture); a graph break would split a block into more
graphs and shows in Dynamo's ``graph_break`` counter. The TP case runs on 2 real gloo ranks. AOTAutograd
may decompose an op (a softmax, a norm) into others that sum in another order, so the loss and the
gradients are compared within fp32 rounding of their magnitude over the 64 tokens (``tolerance``).
"""

import pytest
import torch
from multiproc import run_ranks
from tolerance import fp32_bound, grad_scale

from megakit.core.model_config import ModelConfig
from megakit.nn.model import Transformer


def _graphs_and_breaks(config: ModelConfig, topo=None, *, sequence_parallel: bool = False, recompute: str = "none"):
    """Loss and gradient differences of a compiled model from its eager twin (2 forward/backward passes), each as a
    share of its fp32 bound, and the graph and break counts."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = (Transformer(config, topo, seed=0, sequence_parallel=sequence_parallel, recompute=recompute)
                       for _ in range(2))
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for block in compiled.layers.values():
        block.compile(backend=count, dynamic=False)
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    worst = 0.0
    for step in range(2):  # the second pass reuses the graphs: nothing recompiles
        losses = [m(ids, ids.roll(-1, 1), sample_ids=[2 * step, 2 * step + 1]) for m in (eager, compiled)]
        for loss in losses:
            loss.backward()
        worst = max(worst, abs(losses[0].item() - losses[1].item()) / fp32_bound(losses[0].item(), ids.numel()))
    bound = fp32_bound(grad_scale({n: p.grad for n, p in eager.named_parameters()}), ids.numel())
    grads = max((a.grad - b.grad).abs().max().item() for a, b in zip(eager.parameters(), compiled.parameters())) / bound
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    return worst, grads, len(graphs), breaks


def test_a_llama_block_is_one_graph_reused_by_every_layer():
    """TP 1, dropout 0: the 4 blocks share one graph (regional compilation), with no graph break."""
    loss, grads, graphs, breaks = _graphs_and_breaks(ModelConfig.load("llama-tiny"))
    assert (graphs, breaks) == (1, 0)
    assert loss <= 1 and grads <= 1


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_wraps_or_sits_inside_the_compiled_block(recompute):
    """full: torch.utils.checkpoint around the compiled block (its recompute re-enters the compiled code);
    selective: the checkpoint of the attention core traced inside the block's graph. Still no break."""
    loss, grads, graphs, breaks = _graphs_and_breaks(ModelConfig.load("llama-tiny"), recompute=recompute)
    assert breaks == 0 and graphs == 1
    assert loss <= 1 and grads <= 1


def test_dropout_draws_stay_eager_and_the_losses_stay_equal():
    """Layout-free dropout's generators cannot enter a graph: each draw is a break (torch.compiler.disable on the
    draw), and the masks are still the eager ones."""
    loss, grads, graphs, breaks = _graphs_and_breaks(ModelConfig.load("gpt-tiny").replace(dropout=0.1))
    assert breaks > 0 and graphs > 1
    assert loss <= 1 and grads <= 1


def _tp2(rank, world_size):
    from megakit.core.layout import Layout
    from megakit.nn.topology import Topology

    topo = Topology(Layout(tp=world_size))
    return _graphs_and_breaks(ModelConfig.load("llama-tiny"), topo, sequence_parallel=True)


@pytest.mark.slow
def test_tp2_sp_collectives_are_traced_into_the_block_graph():
    """TP 2 with SP: the f/g all-gather and reduce-scatter (autograd functions over megakit.nn.comm) are traced,
    not broken around: still one graph per rank, with the eager model's loss and gradients."""
    for loss, grads, graphs, breaks in run_ranks(_tp2, 2):
        assert (graphs, breaks) == (1, 0)
        assert loss <= 1 and grads <= 1
