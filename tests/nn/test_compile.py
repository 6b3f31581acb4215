"""--compile: each block through torch.compile gives the eager model's loss and gradients, as one graph.

A counting backend records every graph Dynamo hands over (and runs it eagerly, so the numbers are the
eager ones through Dynamo's and AOTAutograd's capture); a graph break would split a block into more
graphs and shows in Dynamo's ``graph_break`` counter. The TP case runs on 2 real gloo ranks. AOTAutograd
may decompose an op (a softmax, a norm) into others that sum in another order, so the loss and the
gradients are compared within fp32 rounding of their magnitude over the 64 tokens (``tolerance``).
"""

import dataclasses

import pytest
import torch
from multiproc import run_ranks
from tolerance import fp32_bound, grad_scale

from megakit.core.model_config import ModelConfig
from megakit.nn.compile import compile_blocks
from megakit.nn.model import Transformer


def _graphs_and_breaks(
    config: ModelConfig,
    topo=None,
    *,
    sequence_parallel: bool = False,
    recompute: str = "none",
    part: str | None = None,
    twin=None,
):
    """Loss and gradient differences of a compiled model from its eager twin (2 forward/backward passes), each as a
    share of its fp32 bound, and the graph and break counts. ``part``: compile that submodule of each block (``mlp``)
    instead of the block; ``twin(eager, compiled)``: a further check on the two models after the passes."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    eager, compiled = (
        Transformer(config, topo, seed=0, sequence_parallel=sequence_parallel, recompute=recompute) for _ in range(2)
    )
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    if part is None:
        compile_blocks(compiled, backend=count)
    for block in compiled.layers.values() if part else ():
        getattr(block, part).compile(backend=count, dynamic=False)
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
    if twin is not None:
        twin(eager, compiled)
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


def _counted_once(eager, compiled):
    """The experts' token counts of the step: the same compiled as eager, and not counted again by recompute."""
    from megakit.nn.moe.layer import moe_layers

    for a, b in zip(moe_layers(eager), moe_layers(compiled)):
        assert torch.equal(a.step_tokens, b.step_tokens) and a.step_tokens.sum() == 2 * 64 * a.config.top_k


@pytest.mark.parametrize(
    "name, recompute, graphs", [("moe-tiny", "full", 1), ("deepseek-v3-tiny", "none", 2), ("gpt-oss-tiny", "none", 2)]
)
def test_a_moe_block_is_one_graph(name, recompute, graphs):
    """Router, sort by expert, grouped experts (torch._grouped_mm over device offsets), shared expert and balancing
    losses in one graph, no break: no bincount, no tolist, no branch on a tensor. moe-tiny's 4 MoE blocks share
    one (with full recompute, whose token counting is a flag set eagerly); DeepSeek-V3's dense first block is the
    other graph, and gpt-oss's sliding-window blocks the other of its two. Loss, gradients and the experts' token
    counts as eager."""
    loss, grads, n, breaks = _graphs_and_breaks(ModelConfig.load(name), recompute=recompute, twin=_counted_once)
    assert (n, breaks) == (graphs, 0)
    assert loss <= 1 and grads <= 1


def test_a_moe_layer_with_capacity_drops_is_one_graph():
    """Capacity drops (a sentinel group no expert computes, masked to zeros): the MoE layer is one graph."""
    config = ModelConfig.load("moe-tiny")
    config = config.replace(moe=dataclasses.replace(config.moe, capacity_factor=0.5))
    loss, grads, n, breaks = _graphs_and_breaks(config, part="mlp", twin=_counted_once)
    assert (n, breaks) == (1, 0)
    assert loss <= 1 and grads <= 1


def _ep2(rank, world_size):
    from megakit.core.layout import Layout
    from megakit.nn.topology import Topology

    return _graphs_and_breaks(ModelConfig.load("moe-tiny"), Topology(Layout(dp=world_size, ep=world_size)))


def test_ep2_all_to_alls_stay_eager_with_one_break_each():
    """EP 2: the dispatch (split sizes to the host, all-to-all) and the combine run eager between three graphs that
    every block reuses (the experts' graph takes any number of received rows), as eager in loss and gradients."""
    for loss, grads, graphs, breaks in run_ranks(_ep2, 2):
        assert (graphs, breaks) == (3, 2)
        assert loss <= 1 and grads <= 1


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_qk_clip_records_and_clips_as_eager_in_one_graph(recompute):
    """--qk-clip under --compile: each attention's largest logits, recorded in the compiled block, equal eager's over
    3 steps of Muon, and so do the weights its clip scaled (half the heads above tau each step); still one graph, no
    break. With selective recompute the maxima are kept outside the checkpointed core, which Dynamo cannot trace a
    module's mutation inside (it broke the block in 4 graphs before)."""
    import torch._dynamo
    from torch._dynamo.backends.registry import lookup_backend

    from megakit.train.engine.muon import MuonWithAdamW, QKClip, muon_groups

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    config = ModelConfig.load("llama-tiny")
    eager, compiled = (Transformer(config, seed=0, recompute=recompute) for _ in range(2))
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    compile_blocks(compiled, backend=count)
    clips = [QKClip(m, tau=1.0) for m in (eager, compiled)]
    optimizers = [
        MuonWithAdamW(muon_groups(m, weight_decay=0.1), lr=1e-2, qk_clip=c) for m, c in zip((eager, compiled), clips)
    ]
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for m in (eager, compiled):
            m(ids, ids.roll(-1, 1)).backward()
        maxima = [torch.stack([m.max_logits for m in clip.attention]) for clip in clips]
        assert torch.equal(*maxima)
        tau = float(maxima[0].median())
        assert (maxima[0] > tau).any()
        for clip, optimizer in zip(clips, optimizers):
            clip.tau = tau
            optimizer.step()
            optimizer.zero_grad()
        for a, b in zip(eager.parameters(), compiled.parameters()):
            assert torch.equal(a, b)
    assert (len(graphs), sum(torch._dynamo.utils.counters["graph_break"].values())) == (1, 0)
