"""Mixture-of-Experts on real gloo processes (fp64): dispatch round trips, EP/TP/SP/CP equal to one process.

Two spawns (2 and 4 ranks) each sweep their cases, because starting processes costs far more than
the tiny models. The reference is the single-process model run on every data-parallel replica's
micro-batch, with the loss (and the attached balancing losses, ``set_aux_loss_scale``) averaged
over the replicas; the distributed gradients are reduced as a trainer must (``megakit.nn.moe.layer``):
dense ones averaged over DP x CP, expert ones summed over EDP and divided by DP x CP.
"""

from __future__ import annotations

import pytest
import torch
from multiproc import run_ranks

from megakit.core.layout import Layout
from megakit.core.moe_config import MoEConfig
from megakit.errors import UsageError

RTOL = 1e-10
FP32_RTOL = 1e-6  # with TP or CP: the vocab-parallel cross-entropy and ring attention compute in fp32


def _close(got, want, what, rtol=RTOL, floor=1.0):
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err, bound = (got - want).abs().max().item(), rtol * max(want.abs().max().item(), floor)
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _config(**moe):
    from megakit.core.model_config import ModelConfig

    fields = (
        dict(
            experts=8,
            top_k=2,
            ffn=16,
            shared_ffn=24,
            shared_gate=True,
            dense_layers=(0,),
            aux_loss_coeff=0.1,
            seq_aux_loss_coeff=0.05,
            z_loss_coeff=0.01,
        )
        | moe
    )
    return ModelConfig.load("llama-tiny").replace(layers=3, qk_norm=True, moe=MoEConfig(**fields))


# -- T1: dispatch -> identity experts -> combine ---------------------------------------------------
def _round_trip(ep_group, rank: int, n: int, experts: torch.Tensor) -> None:
    from megakit.nn.moe.dispatch import make_dispatcher

    x = torch.randn(n, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    d = make_dispatcher(8, ep_group)
    keep = torch.ones_like(experts, dtype=torch.bool)
    if n:
        keep[0, 1] = False  # one dropped slot comes back as zeros
    rows, counts, plan = d.dispatch(x, experts, keep)
    assert len(counts) == 8 // (1 if ep_group is None else torch.distributed.get_world_size(ep_group))
    assert counts.device == x.device  # on the device: the grouped GEMM's offsets, no host sync
    assert rows.shape[0] == (n * 2 if ep_group is None else int(counts.sum()))  # EP 1: static, dropped rows last
    slots = d.combine(rows * 1.0, plan)  # identity experts
    want = x.detach().unsqueeze(1).expand(n, 2, 8) * keep.unsqueeze(-1)
    assert torch.equal(slots.detach(), want)
    slots.sum().backward()
    assert torch.equal(x.grad, keep.sum(1, keepdim=True).double().expand(n, 8))


def _dispatch_cases(rank: int, world: int) -> None:
    from megakit.nn.topology import Topology

    topo = Topology(Layout(dp=world, ep=world))
    gen = torch.Generator().manual_seed(7)
    routed = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(10)])  # (10, 2) distinct experts
    _round_trip(topo.ep_group, rank, 10, routed)
    _round_trip(topo.ep_group, rank, 6, torch.tensor([[0, 1]] * 6))  # every rank but 0 receives nothing
    _round_trip(topo.ep_group, rank, 0 if rank == 1 else 5, routed[: 0 if rank == 1 else 5])  # rank 1 sends nothing
    _round_trip(None, rank, 10, routed)


# -- T2: the model at EP x TP x CP against one process -------------------------------------------------
def _batch(replica: int):
    gen = torch.Generator().manual_seed(100 + replica)
    return torch.randint(0, 256, (2, 16), generator=gen), torch.randint(0, 256, (2, 16), generator=gen)


def _reference(config, replicas: int, main: float = 1.0):
    from megakit.nn.model import Transformer, full_state_dict
    from megakit.nn.moe.layer import set_aux_loss_scale, update_expert_bias

    ref = Transformer(config, seed=5, dtype=torch.float64)
    set_aux_loss_scale(ref, 1.0 / replicas)
    losses = []
    for d in range(replicas):
        loss = ref(*_batch(d))
        (loss * main / replicas).backward()
        losses.append(loss.detach())
    weights, grads = full_state_dict(ref), full_state_dict(ref, grads=True)
    counts = update_expert_bias(ref)  # the step's tokens per expert, every replica's
    return losses, weights, grads, counts, full_state_dict(ref)


def _equivalence(topo, config, *, sp: bool = False, repeat: bool = False, aux_only: bool = False) -> None:
    """``aux_only``: T4, the loss's own gradient multiplied by 0, so only the balancing losses' remains."""
    from megakit.nn import comm as C
    from megakit.nn.model import Transformer, full_state_dict

    case = f"tp={topo.tp} cp={topo.cp} dp={topo.dp} ep={topo.ep} sp={sp} aux_only={aux_only}"
    rtol, floor, main = (
        FP32_RTOL if topo.cp * topo.tp > 1 else RTOL,
        1e-12 if aux_only else 1.0,
        0.0 if aux_only else 1.0,
    )
    from megakit.nn.moe.layer import update_expert_bias

    want_losses, want_weights, want_grads, want_counts, want_updated = _reference(config, topo.dp, main)
    model = Transformer(config, topo, seed=5, dtype=torch.float64, sequence_parallel=sp)
    weights = full_state_dict(model, topo)
    assert weights.keys() == want_weights.keys()
    assert all(torch.equal(weights[n], want_weights[n]) for n in weights), f"{case}: initial weights differ"
    results = []
    for _ in range(2 if repeat else 1):
        model.zero_grad()
        loss = model(*_batch(topo.dp_rank))
        (loss * main).backward()
        _close(loss.detach(), want_losses[topo.dp_rank], f"{case} loss", rtol)
        for p in model.parameters():
            expert = getattr(p, "ep_dim", None) is not None
            group = topo.edp_group if expert else topo.get_data_parallel_group()
            C.all_reduce(p.grad, group).div_(topo.dp * topo.cp)
        grads = full_state_dict(model, topo, grads=True)
        for name, want in want_grads.items():
            _close(grads[name], want, f"{case} grad of {name}", rtol, floor)
        if aux_only:
            assert grads["layers.1.mlp.gate.weight"].abs().max() > 1e-4, case  # the losses do reach the router
        results.append((loss.detach(), grads))
    if repeat:  # T10: the same step twice is bit-identical (no atomics, no duplicate-index scatters)
        (l1, g1), (l2, g2) = results
        assert torch.equal(l1, l2) and all(torch.equal(g1[n], g2[n]) for n in g1)
    moe = model.layers["1"].mlp
    assert moe.stats["tokens_per_expert"].sum() == 2 * 16 * 2 // (topo.cp * topo.tp)  # this rank's tokens x k
    assert (moe.stats["a2a_bytes"] > 0) == (topo.ep > 1)
    counts = update_expert_bias(model, topo)  # T5: summed over DP x CP and TP, once per step
    assert torch.equal(counts, want_counts * (2 if repeat else 1)), case
    if not repeat:
        updated = full_state_dict(model, topo)
        assert all(torch.equal(updated[n], want_updated[n]) for n in want_updated if "bias" in n), case


def _two_ranks(rank: int, world: int) -> None:
    from megakit.nn.topology import Topology

    _dispatch_cases(rank, world)
    _equivalence(Topology(Layout(dp=2, ep=2)), _config(), repeat=True)
    _equivalence(Topology(Layout(dp=2, ep=1)), _config())
    sigmoid = _config(
        score="sigmoid",
        groups=4,
        group_top_k=2,
        expert_bias=True,
        route_scale=2.5,
        shared_gate=False,
        aux_loss_coeff=0.0,
    )
    _equivalence(Topology(Layout(dp=2, ep=2)), sigmoid)
    _equivalence(Topology(Layout(cp=2, ep=2)), _config())  # EP over the CP ranks of one sequence
    _equivalence(Topology(Layout(cp=2, ep=2)), _config(), aux_only=True)
    _equivalence(Topology(Layout(tp=2, ep=2)), _config())  # folded: EP over the TP pair, DP 1
    _equivalence(Topology(Layout(tp=2, ep=2)), _config(), sp=True)
    relu2 = dict(activation="relu2", shared_gate=False)  # Nemotron-3: non-gated experts and shared expert
    _equivalence(Topology(Layout(tp=2, ep=2)), _config(**relu2, expert_bias=True), sp=True)


def _four_ranks(rank: int, world: int) -> None:
    from megakit.nn.model import Transformer
    from megakit.nn.moe.layer import MoE
    from megakit.nn.topology import Topology

    _dispatch_cases(rank, world)
    topo = Topology(Layout(dp=4, ep=4))
    with pytest.raises(UsageError, match="--ep 4 does not divide the 6 experts"):
        MoE(MoEConfig(experts=6, top_k=2, ffn=4), 8, ep_group=topo.ep_group)
    with pytest.raises(UsageError, match="the model has no experts"):
        Transformer(_config().replace(moe=None), topo)
    _equivalence(topo, _config())
    _equivalence(Topology(Layout(tp=2, dp=2, ep=2)), _config(), sp=True)
    _equivalence(Topology(Layout(tp=2, dp=2, ep=2)), _config(), aux_only=True)
    _equivalence(Topology(Layout(tp=2, dp=2, ep=2)), _config(expert_bias=True))
    _equivalence(Topology(Layout(cp=2, dp=2, ep=4)), _config(expert_bias=True))
    _equivalence(Topology(Layout(tp=2, dp=2, ep=4)), _config(), sp=True)  # folded over TP x DP
    _equivalence(Topology(Layout(tp=2, dp=2, ep=4)), _config(expert_bias=True))  # ... without SP
    _equivalence(Topology(Layout(tp=2, cp=2, ep=4)), _config(), aux_only=True)  # folded over TP x CP


def test_moe_two_ranks():
    run_ranks(_two_ranks, 2)


def test_moe_four_ranks():
    run_ranks(_four_ranks, 4)


# -- single process ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "gpt_oss, compiled, gated", [(False, False, True), (True, False, True), (True, True, True), (False, True, False)]
)
def test_loop_and_grouped_gemm_agree(gpt_oss, compiled, gated):
    """The grouped path (and, compiled through AOTAutograd, its custom op's shape function and gradient) equals the
    loop, with gpt-oss's expert biases and clamped SwiGLU too, and Nemotron-3's non-gated squared ReLU."""
    from megakit.nn.moe.layer import Experts

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    grads = []
    for grouped in (False, True):
        torch.manual_seed(0)
        experts = Experts(
            4,
            16,
            8,
            dtype=torch.float32,
            device=None,
            grouped=grouped,
            biases=gpt_oss,
            limit=7.0 if gpt_oss else 0.0,
            alpha=1.702 if gpt_oss else 1.0,
            gated=gated,
        )
        assert hasattr(experts, "gate_up_proj") == gated and experts.down_proj.shape == (4, 16, 8)
        for p in experts.parameters():
            torch.nn.init.normal_(p)
        x = torch.randn(11, 16, requires_grad=True)
        counts = torch.tensor([3, 0, 6, 1])  # an expert with no rows; the last row dropped: no expert computes it
        run = torch.compile(experts, backend="aot_eager", fullgraph=True) if compiled and grouped else experts
        y = run(x, counts)
        y.backward(torch.randn(11, 16, generator=torch.Generator().manual_seed(1)))
        assert not y[10:].any() and not x.grad[10:].any()  # the kernel leaves that row unwritten: masked to zeros
        grads.append([y.detach(), x.grad, *(p.grad for p in experts.parameters())])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_an_ep1_moe_layer_never_waits_for_the_device():
    """Item 2 of issue 54: at EP 1 the routing, the capacity drops, the sort, the grouped experts, the combine, the
    losses and the statistics convert no tensor to a Python number, forward or backward (a probe on every
    conversion)."""
    from megakit.nn.moe.layer import MoE

    config = MoEConfig(
        experts=8,
        top_k=2,
        ffn=16,
        shared_ffn=16,
        capacity_factor=0.75,
        aux_loss_coeff=0.1,
        z_loss_coeff=0.01,
        expert_bias=True,
        score="sigmoid",
    )
    torch.manual_seed(0)
    moe = MoE(config, 16)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.5)
    x = torch.randn(16, 2, 16, requires_grad=True)
    calls = []
    names = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
    saved = {name: getattr(torch.Tensor, name) for name in names}

    def probe(name):
        def converted(self, *args, **kwargs):
            calls.append(name)
            return saved[name](self, *args, **kwargs)

        return converted

    try:
        for name in names:
            setattr(torch.Tensor, name, probe(name))
        moe(x).sum().backward()
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
    assert calls == [] and moe.stats["dropped"] > 0 and x.grad.abs().sum() > 0


def test_sequence_losses_do_not_depend_on_the_micro_batch_size():
    """T4: z and per-sequence aux gradients for one batch of 2 sequences: 1 micro-batch of 2 == 2 of 1."""
    from megakit.nn.moe.layer import MoE, set_aux_loss_scale

    config = MoEConfig(experts=8, top_k=2, ffn=8, seq_aux_loss_coeff=0.3, z_loss_coeff=0.2)
    x = torch.randn(12, 2, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    grads = []
    for micro in (2, 1):
        torch.manual_seed(0)
        moe = MoE(config, 16, dtype=torch.float64)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.5)
        set_aux_loss_scale(moe, micro / 2)  # the trainer's 1 / accumulation steps
        for part in x.split(micro, dim=1):
            (moe(part) * 0).sum().backward()  # only the balancing losses' gradient
        grads.append(moe.gate.weight.grad.clone())
    assert grads[0].abs().max() > 1e-3
    _close(grads[1], grads[0], "router gradient, micro-batch 1 vs 2")


def test_capacity_drops_the_lowest_weights_per_expert():
    from megakit.nn.moe.router import capacity_keep

    experts = torch.tensor([[0, 1], [0, 1], [0, 2], [3, 0]])
    weights = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    keep = capacity_keep(experts, weights, 4, capacity_factor=1.0)  # capacity ceil(4 * 2 / 4) = 2
    assert keep.tolist() == [[True, True], [True, True], [False, True], [True, False]]
    assert capacity_keep(experts, weights, 4, capacity_factor=4.0).all()


def test_capacity_factor_large_enough_is_dropless():
    from megakit.nn.moe.layer import MoE

    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1))
    outs = []
    for cf in (None, 4.0, 0.5):
        torch.manual_seed(0)
        moe = MoE(MoEConfig(experts=4, top_k=2, ffn=8, capacity_factor=cf), 16)
        for p in moe.parameters():
            torch.nn.init.normal_(p)
        outs.append((moe(x), moe.stats["dropped"].item()))
    assert torch.equal(outs[0][0], outs[1][0]) and outs[1][1] == 0.0
    assert outs[2][1] > 0 and not torch.equal(outs[0][0], outs[2][0])


def test_expert_bias_update_counts_each_token_once():
    from megakit.nn.model import Transformer
    from megakit.nn.moe.layer import moe_layers, update_expert_bias

    config = _config(score="sigmoid", expert_bias=True, bias_update_rate=0.01)
    ids, labels = _batch(0)
    counts, sums = [], []
    for recompute in (False, True):  # full recompute re-runs the forward in backward: not counted again
        model = Transformer(config, seed=5, recompute=recompute)
        model(ids, labels).backward()
        model(ids, labels).backward()  # two micro-batches in one step
        counts.append(torch.stack([m.step_tokens.clone() for m in moe_layers(model)]))
        sums.append(torch.stack([torch.cat([m.step_sums, m.step_forwards.view(1)]) for m in moe_layers(model)]))
        total = update_expert_bias(model)
    assert torch.equal(counts[0], counts[1]) and (counts[0].sum(1) == 2 * 2 * 16 * 2).all()
    assert torch.equal(sums[0], sums[1]) and (sums[0][:, -1] == 2).all()  # the statistics' sums: 2 forwards each
    bias = moe_layers(model)[0].gate.e_score_correction_bias
    load = total[0].double()
    assert torch.equal(bias, (0.01 * torch.sign(load.mean() - load)).float())
    assert (moe_layers(model)[0].step_tokens == 0).all()


def test_layout_and_bad_input():
    assert Layout(dp=4, ep=2).groups("ep") == [[0, 1], [2, 3]]
    assert Layout(dp=4, ep=2).groups("edp") == [[0, 2], [1, 3]]
    assert Layout(tp=2, cp=2, dp=2, ep=2).groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the TP pairs
    assert Layout(tp=2, cp=2, dp=2, ep=2).groups("edp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    folded = Layout(tp=2, pp=2, dp=2, ep=4)  # EP over TP x DP: one group a stage, each expert on one rank
    assert folded.groups("ep") == [[0, 1, 2, 3], [4, 5, 6, 7]] and folded.groups("edp") == [[r] for r in range(8)]
    assert [folded.ep_coords(r)["ep"] for r in range(8)] == [0, 1, 2, 3] * 2
    with pytest.raises(UsageError, match=r"--ep 3 does not divide TP x CP x DP = 1 x 1 x 4 = 4, .* use one of 1, 2, 4"):
        Layout(dp=4, ep=3)
    with pytest.raises(UsageError, match="top-k 9 exceeds"):
        MoEConfig(experts=8, top_k=9, ffn=4)
    with pytest.raises(UsageError, match="capacity factor must be > 0"):
        MoEConfig(experts=8, top_k=2, ffn=4, capacity_factor=0.0)
    for name in ("aux_loss_coeff", "z_loss_coeff", "seq_aux_loss_coeff"):  # NaN passed `< 0`: every step skipped
        for bad in (float("nan"), float("inf"), -0.1):
            with pytest.raises(UsageError, match=f"MoE field {name} must be a finite number >= 0"):
                MoEConfig(experts=8, top_k=2, ffn=4, **{name: bad})


def test_force_balance_spreads_a_skewed_router_evenly_in_training_only():
    """--moe-force-balance (Megatron's --moe-router-force-load-balancing): a router that sends every token to
    experts 0 and 1 is ignored in training, whose load is then near even (random logits, drawn from the default
    generator: the same seed, the same routing); evaluation routes by the router."""
    from megakit.nn.moe.layer import MoE

    gen = torch.Generator().manual_seed(2)
    common = torch.randn(16, generator=gen)
    x = common + 0.1 * torch.randn(64, 4, 16, generator=gen)  # every token near one direction
    loads = {}
    for force in (False, True):
        moe = MoE(MoEConfig(experts=8, top_k=2, ffn=8, force_balance=force), 16)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.02)
        with torch.no_grad():
            moe.gate.weight.zero_()
            moe.gate.weight[:2] = 10 * common  # experts 0 and 1 win every token
        torch.manual_seed(0)
        moe.train()(x)
        loads[force] = moe.stats["tokens_per_expert"].float()
        moe.eval()(x)
        assert moe.stats["tokens_per_expert"][:2].sum() == 64 * 4 * 2  # the router's own choice
    assert loads[False][2:].sum() == 0
    balanced = loads[True]
    assert balanced.max() / balanced.mean() < 1.3 and balanced.sum() == 64 * 4 * 2, balanced
    torch.manual_seed(0)
    again = MoE(MoEConfig(experts=8, top_k=2, ffn=8, force_balance=True), 16)
    again.load_state_dict(moe.state_dict())
    torch.manual_seed(0)
    again.train()(x)
    assert torch.equal(again.stats["tokens_per_expert"].float(), balanced)
