"""Tensor parallelism on real gloo processes: TP = 2 and 4 against the TP = 1 model (fp32).

Each world size is one spawn that sweeps every case (at 4, the DeepSpeed step too), because starting
processes costs far more than the tiny models. Tolerance: |a - b| <= 1e-5 * max|b| per tensor, plus an
absolute floor of 1e-9 for gradients that are zero in exact arithmetic (the key bias:
softmax ignores a shift shared by all keys, so its gradient is pure rounding noise).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from multiproc import run_many, run_ranks

RTOL, FLOOR = 1e-5, 1e-9
CASES = [("gpt-tiny", 254), ("llama-tiny", 250)]  # vocabs that need padding at TP = 4


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item()
    bound = RTOL * want.abs().max().item() + FLOOR
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _equivalence(
    topo, preset: str, vocab: int, sequence_parallel: bool, recompute: bool = False, dropout: float = 0.0
) -> None:
    """In training mode: with dropout the TP model must drop the very units the TP = 1 model drops."""
    from megakit.nn.model import ModelConfig, Transformer, full_state_dict

    config = ModelConfig.load(preset).replace(vocab_size=vocab, dropout=dropout)
    gen = torch.Generator().manual_seed(42)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    labels = torch.randint(0, vocab, (2, 16), generator=gen)
    labels[0, :3] = -100  # ignored tokens are left out of the mean
    ref = Transformer(config, seed=9)
    model = Transformer(config, topo, seed=9, sequence_parallel=sequence_parallel, recompute=recompute)
    case = f"{preset} tp={topo.tp} sp={sequence_parallel} recompute={recompute} dropout={dropout}"

    rows = dict(sample_ids=[7, 8])  # the same masks in every call below
    want_logits, got_logits = ref(ids, **rows), model(ids, **rows)  # (B, S, V) vs this rank's (B, S, V/tp)
    assert got_logits.shape == (2, 16, config.padded_vocab(topo.tp) // topo.tp)
    gathered = torch.cat(_gather(got_logits, topo), dim=-1)
    assert torch.isinf(gathered[..., vocab:]).all()  # padded columns are -inf
    _close(gathered[..., :vocab], want_logits[..., :vocab], f"{case} logits")

    want_loss, loss = ref(ids, labels, **rows), model(ids, labels, **rows)
    torch.testing.assert_close(want_loss, F.cross_entropy(want_logits.transpose(1, 2), labels))
    _close(loss.detach(), want_loss.detach(), f"{case} loss")
    want_loss.backward()
    loss.backward()
    grads, ref_grads = full_state_dict(model, topo, grads=True), full_state_dict(ref, grads=True)
    assert grads.keys() == ref_grads.keys()
    for name in ref_grads:
        _close(grads[name], ref_grads[name], f"{case} grad of {name}")
    # The same seed gives the same full weights at every TP degree.
    weights, ref_weights = full_state_dict(model, topo), full_state_dict(ref)
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights), case


def _gather(x: torch.Tensor, topo) -> list[torch.Tensor]:
    import torch.distributed as dist

    out = [torch.empty_like(x) for _ in range(topo.tp)]
    dist.all_gather(out, x.contiguous(), group=topo.tp_group)
    return out


def _cross_entropy(topo) -> None:
    """The vocab-parallel loss against F.cross_entropy on gathered logits, values and grads."""
    from megakit.nn.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    gen = torch.Generator().manual_seed(3)
    vocab = 30 * topo.tp - 1  # one padded column on the last rank
    full = (torch.randn(5, 7, 30 * topo.tp, generator=gen) * 4).requires_grad_()
    target = torch.randint(0, vocab, (5, 7), generator=gen)
    target[1, 2] = -100
    target[0, 0] = vocab - 1  # a target on the last rank
    mine = full.detach().chunk(topo.tp, dim=-1)[topo.tp_rank].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(mine, target, topo.tp_group, vocab_size=vocab)
    want = F.cross_entropy(full[..., :vocab].transpose(1, 2), target)
    _close(loss.detach(), want.detach(), "cross-entropy")
    loss.backward()
    want.backward()
    _close(mine.grad, full.grad.chunk(topo.tp, dim=-1)[topo.tp_rank], "cross-entropy grad")
    per_token = vocab_parallel_cross_entropy(mine.detach(), target, topo.tp_group, vocab_size=vocab, reduction="none")
    _close(
        per_token,
        F.cross_entropy(full.detach()[..., :vocab].transpose(1, 2), target, reduction="none"),
        "cross-entropy per token",
    )


def _layers(topo) -> None:
    """Column-parallel with a gathered output, fed into row-parallel through scatter_to_tp,
    against plain nn.Linear layers with the same full weights: outputs and all gradients."""
    from megakit.nn.tensor_parallel.collectives import scatter_to_tp
    from megakit.nn.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megakit.nn.weights import init_shard_

    col = ColumnParallelLinear(6, 4 * topo.tp, group=topo.tp_group, gather_output=True)
    row = RowParallelLinear(4 * topo.tp, 5, group=topo.tp_group)
    ref_col, ref_row = torch.nn.Linear(6, 4 * topo.tp), torch.nn.Linear(4 * topo.tp, 5)
    for name, (ours, ref) in {"col": (col, ref_col), "row": (row, ref_row)}.items():
        for part in ("weight", "bias"):
            p = getattr(ours, part)
            init_shard_(p, name=f"{name}.{part}", seed=0, tp_rank=topo.tp_rank, rule=("normal", 1.0))
            with torch.no_grad():
                dim = p.tp_dim
                full = torch.cat(_gather(p.detach(), topo), dim=dim) if dim is not None else p.detach()
                getattr(ref, part).copy_(full)
    x = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(8))
    x_ours, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    mid = col(x_ours)  # (3, 2, 4 tp): full features on every rank
    _close(mid.detach(), ref_col(x_ref).detach(), "column-parallel gathered output")
    y, want = row(scatter_to_tp(mid, topo.tp_group)), ref_row(ref_col(x_ref))
    _close(y.detach(), want.detach(), "row-parallel output")
    (y * y).sum().backward()
    (want * want).sum().backward()
    _close(x_ours.grad, x_ref.grad, "input grad")
    for ours, ref in ((col, ref_col), (row, ref_row)):
        _close(
            ours.bias.grad if ours.bias.tp_dim is None else torch.cat(_gather(ours.bias.grad, topo)),
            ref.bias.grad,
            "bias grad",
        )
        _close(torch.cat(_gather(ours.weight.grad, topo), dim=ours.weight.tp_dim), ref.weight.grad, "weight grad")


def _stages(topo, preset: str, sequence_parallel: bool) -> None:
    """A TP-sharded pipeline stage holds a subset of the full model's names, identically initialised,
    and chaining stages reproduces the whole model (the hidden state passes through unchanged)."""
    from megakit.nn.model import ModelConfig, Transformer, full_state_dict

    config = ModelConfig.load(preset)
    kw = dict(seed=4, sequence_parallel=sequence_parallel)
    whole = Transformer(config, topo, **kw)
    first = Transformer(config, topo, layers=range(0, 2), post=False, **kw)
    last = Transformer(config, topo, layers=range(2, 4), pre=False, **kw)
    params = dict(whole.named_parameters())
    for stage in (first, last):
        for name, p in stage.named_parameters():
            assert name in params and torch.equal(p, params[name]), name
    ids = torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(5))
    hidden = first(ids)
    assert hidden.shape == (8 // topo.tp if sequence_parallel else 8, 2, config.hidden)
    torch.testing.assert_close(last(hidden, ids), whole(ids, ids), rtol=0, atol=0)
    assert full_state_dict(first, topo).keys() <= full_state_dict(whole, topo).keys()


def _dropout_is_layout_free(topo) -> None:
    """In training mode with dropout: the replicated residual stream is bit-identical on every TP rank,
    with SP each rank holds its rows of the TP = 1 model's stream, and torch's default generator is
    never drawn from (so no rank's masks depend on how it was seeded)."""
    from megakit.nn.model import ModelConfig, Transformer

    config = ModelConfig.load("llama-tiny").replace(dropout=0.2)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    torch.manual_seed(1000 + topo.tp_rank)  # deliberately different on every rank: it must not matter
    default_stream = torch.get_rng_state()
    stage = Transformer(config, topo, post=False, seed=2).train()
    hidden = stage(ids, sample_ids=[40, 41])
    assert all(torch.equal(h, hidden) for h in _gather(hidden, topo))
    assert not torch.equal(hidden, stage.eval()(ids))  # dropout did act in training mode
    single = Transformer(config, post=False, seed=2).train()(ids, sample_ids=[40, 41])
    split = Transformer(config, topo, post=False, seed=2, sequence_parallel=True).train()(ids, sample_ids=[40, 41])
    rows = 8 // topo.tp
    _close(split, single[topo.tp_rank * rows : (topo.tp_rank + 1) * rows], "SP residual stream under dropout")
    _close(hidden, single, "TP residual stream under dropout")
    swapped = Transformer(config, topo, post=False, seed=2).train()(ids.flip(0), sample_ids=[41, 40])
    _close(swapped.flip(1), hidden, "a sample's masks follow it to another batch row")
    assert torch.equal(torch.get_rng_state(), default_stream)


def _bad_tp(topo) -> None:
    from megakit.errors import UsageError
    from megakit.nn.model import ModelConfig, Transformer

    config = ModelConfig.load("gpt-tiny").replace(heads=2, kv_heads=2, hidden=34, ffn=130)
    if topo.tp == 4:
        with pytest.raises(
            UsageError, match="TP 4 does not divide attention heads 2, KV heads 2, hidden size 34, FFN size 130"
        ):
            Transformer(config, topo)
    model = Transformer(ModelConfig.load("gpt-tiny"), topo, sequence_parallel=True)
    with pytest.raises(UsageError, match=f"sequence length 9 is not divisible by TP {topo.tp}"):
        model(torch.zeros(1, 9, dtype=torch.long))


def _worker(rank: int, world_size: int) -> str:
    from megakit.nn.topology import Topology

    topo = Topology.from_world(tp=world_size)
    for preset, vocab in CASES:
        for sequence_parallel in (False, True):
            _equivalence(topo, preset, vocab, sequence_parallel)
    _equivalence(topo, "llama-tiny", 250, sequence_parallel=True, recompute=True)
    for preset, vocab in CASES:  # dropout: the same masks at every layout
        _equivalence(topo, preset, vocab, sequence_parallel=preset == "gpt-tiny", dropout=0.1)
    _equivalence(topo, "gpt-tiny", 254, sequence_parallel=True, recompute=True, dropout=0.1)
    _cross_entropy(topo)
    _layers(topo)
    _stages(topo, "gpt-tiny", sequence_parallel=True)
    _stages(topo, "llama-tiny", sequence_parallel=False)
    _dropout_is_layout_free(topo)
    _bad_tp(topo)
    return "ok"


@pytest.fixture(scope="module")
def four_ranks() -> dict:
    """The TP = 4 sweep and the DeepSpeed step below in one 4-process job (one start for both)."""
    tp, deepspeed = run_many([(_worker, ()), (_deepspeed_worker, ())], 4, timeout_s=440)
    return {"tp": tp, "deepspeed": deepspeed}


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_tensor_parallel_matches_single_process(tp, request):
    got = request.getfixturevalue("four_ranks")["tp"] if tp == 4 else run_ranks(_worker, tp)
    assert got == ["ok"] * tp


def _deepspeed_worker(rank: int, world_size: int) -> list[float]:
    """TP = 2 x DP = 2 under a DeepSpeed engine (ZeRO-1, clipping active): one step equals plain
    SGD on the single-process model. Checks the parameters' TP marks and the mpu's grad norm."""
    import deepspeed

    from megakit.nn.model import ModelConfig, Transformer, full_state_dict
    from megakit.nn.topology import Topology

    deepspeed.init_distributed(dist_backend="gloo")  # adopts the running process group
    topo = Topology.from_world(tp=2)
    config = ModelConfig.load("llama-tiny").replace(vocab_size=250)
    ids = torch.randint(0, 250, (topo.dp, 2, 16), generator=torch.Generator().manual_seed(0))
    ref = Transformer(config, seed=3)
    torch.stack([ref(ids[d], ids[d]) for d in range(topo.dp)]).mean().backward()
    assert torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5) > 0.5  # clipping is part of the check
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    errors = []
    for sequence_parallel in (False, True):
        model = Transformer(config, topo, seed=3, sequence_parallel=sequence_parallel)
        ds_config = {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 1},
            "zero_allow_untested_optimizer": True,
            "gradient_clipping": 0.5,
            "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=ds_config, mpu=topo
        )
        engine.backward(engine(ids[topo.dp_rank], ids[topo.dp_rank]))
        engine.step()
        state, want = full_state_dict(model, topo), dict(ref.named_parameters())
        errors.append(max((state[n] - want[n]).abs().max().item() for n in want))
    return errors


@pytest.mark.slow
def test_deepspeed_zero1_step_with_tp_matches_single_process(four_ranks):
    errors = four_ranks["deepspeed"]
    assert max(max(e) for e in errors) < 1e-6, errors
