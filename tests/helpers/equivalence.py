"""Multi-process equivalence workers against a single-process reference, shared by the context-parallel,
pipeline and family tests (run through ``multiproc.run_ranks``, so they live in an importable module)."""

import torch

from megakit.core.layout import Layout
from megakit.core.schedules import build_schedule
from megakit.core.simulator import simulate
from megakit.nn.model import (
    ModelConfig,
    Transformer,
    build_stage_chunks,
    full_state_dict,
)
from megakit.nn.pipeline.executor import PipelineExecutor, activation_shape
from megakit.nn.topology import Topology

B, S, M = 2, 8, 4  # micro-batch size, sequence length, micro-batches per step
RTOL, FLOOR = 1e-5, 1e-9  # context parallelism against one process: fp32 summation order only


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = (got - want).abs().max().item()
    bound = RTOL * want.abs().max().item() + FLOOR
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


def _equivalence(
    topo,
    preset: str,
    *,
    sequence_parallel: bool = False,
    dropout: float = 0.0,
    recompute: str = "none",
    cp_mode: str = "ring",
    seq: int = 16,
    documents: bool = False,
    **changes,
) -> str:
    import torch.distributed as dist

    from megakit.nn import comm as C
    from megakit.nn.attention.core import use_cp_mode
    from megakit.nn.model import ModelConfig, Transformer, full_state_dict
    from megakit.nn.sequence import gather_sequence

    config = ModelConfig.load(preset).replace(vocab_size=250, dropout=dropout, **changes)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 250, (2, seq), generator=gen)
    labels = torch.randint(0, 250, (2, seq), generator=gen)
    labels[0, :3] = -100  # ignored tokens (all in CP rank 0's first chunk) are left out of the mean
    labels[1, 9] = -100
    ref = Transformer(config, seed=3)
    model = Transformer(config, topo, seed=3, sequence_parallel=sequence_parallel, recompute=recompute)
    if config.attention_sinks:  # drawn near the rows' log-sum-exp (about ln 16), so sigmoid(lse - sink) spans 0.1-0.9
        with torch.no_grad():
            for i, block in ref.layers.items():
                sinks = 2.8 + torch.randn(config.heads, generator=torch.Generator().manual_seed(int(i)))
                block.attn.sinks.copy_(sinks)
                model.layers[i].attn.sinks.copy_(sinks.chunk(topo.tp)[topo.tp_rank])
    use_cp_mode(model, cp_mode, topo)
    case = (
        f"{preset} cp={topo.cp} ({cp_mode}) tp={topo.tp} sp={sequence_parallel} dropout={dropout} "
        f"recompute={recompute} {changes}"
    )
    rows = {"sample_ids": [11, 12]}
    if documents:  # packed documents of random lengths, crossing the zig-zag chunks
        rows["documents"] = (torch.rand(2, seq, generator=gen) < 0.1).long().cumsum(-1)
        case += " documents"

    want_logits, got = ref(ids, **rows), model(ids, **rows)  # (B, S, V) vs (B, S/cp, V/tp)
    got = gather_sequence(got, topo.cp_group, dim=1)
    if topo.tp > 1:
        parts = [torch.empty_like(got) for _ in range(topo.tp)]
        dist.all_gather(parts, got.contiguous(), group=topo.tp_group)
        got = torch.cat(parts, dim=-1)
    _close(got[..., :250], want_logits[..., :250], f"{case} logits")

    want_loss, loss = ref(ids, labels, **rows), model(ids, labels, **rows)
    _close(loss.detach(), want_loss.detach(), f"{case} loss")  # the whole sequence's mean, on every CP rank
    want_loss.backward()
    loss.backward()
    grads, ref_grads = full_state_dict(model, topo, grads=True), full_state_dict(ref, grads=True)
    assert grads.keys() == ref_grads.keys()
    for name, want in ref_grads.items():
        mean = C.all_reduce(grads[name].clone(), topo.cp_group) / topo.cp
        _close(mean, want, f"{case} grad of {name}")
    return case


def _batches(config, dp_rank: int, dp: int, seed: int = 1, m: int = M):
    """``dp * m`` micro-batches (token ids, labels) shared by every rank; replica d takes its m."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (dp * m, B, S + 1), generator=g)
    mine = ids[dp_rank * m : (dp_rank + 1) * m]
    return [x[:, :-1] for x in ids], [x[:, 1:] for x in ids], [x[:, :-1] for x in mine], [x[:, 1:] for x in mine]


def _ds_style_backward(m: int, outputs: list, held: list):
    """What a trainer does through DeepSpeed engines, without DeepSpeed: the pluggable path. It notes how
    many sent outputs (``outputs``: what the chunks returned) still hold their values at each backward."""

    def backward(scalar, is_loss):  # the loss, or a sent output's handle (its gradient: the one received)
        held.append(sum(out.untyped_storage().nbytes() > 0 for out in outputs if out.dim()))
        (scalar / m if is_loss else scalar).backward()

    return backward


def _equivalence_worker(rank, world_size, cases):
    torch.manual_seed(0)
    results = []
    for model, tp, pp, schedule_name, vpp, layers, p2p, *m in cases:
        m = m[0] if m else M
        sp = model.endswith("+sp")
        config = ModelConfig.load(model.removesuffix("+sp"))
        if layers:
            config = config.replace(layers=layers)
        layout = Layout.for_world(world_size, tp=tp, pp=pp)
        topo = Topology(layout)
        all_ids, all_labels, ids, labels = _batches(config, topo.dp_rank, topo.dp, m=m)

        ref = Transformer(config, seed=3)
        ref_losses = [ref(x, y) for x, y in zip(all_ids, all_labels)]
        ref_loss = torch.stack(ref_losses).mean()
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in ref.named_parameters()}

        chunks = build_stage_chunks(config, topo, vpp=vpp, seed=3, sequence_parallel=sp)
        schedule = build_schedule(schedule_name, pp, m, vpp)
        lr = 0.1
        params = [p for c in chunks for p in c.parameters()]
        opt = torch.optim.SGD(params, lr=lr)
        shape = (
            None
            if schedule_name == "gpipe"
            else activation_shape(  # None: a shape header per message
                config, micro_batch_size=B, seq_len=S, tp=tp, sequence_parallel=sp
            )
        )
        outputs, held = [], []  # the last virtual stage returns the loss, a 0-dim tensor
        for c in chunks:
            c.register_forward_hook(lambda _module, _args, out: outputs.append(out))
        executor = PipelineExecutor(
            chunks,
            topo,
            schedule=schedule,
            activation_shape=shape,
            p2p=p2p,
            backward=_ds_style_backward(m, outputs, held) if tp == 2 and not schedule.split_backward else None,
            optimizer_step=opt.step,
        )
        loss = executor.step(ids, labels)
        # the executor ran the very list the simulator proved: same activations held at the peak
        assert executor.last_times.peak_in_flight == simulate(schedule).peak_in_flight[topo.pp_rank]
        grads = {n: g for c in chunks for n, g in full_state_dict(c, topo, grads=True).items()}
        assert grads, "stage holds no parameters"
        grad_err = max((grads[n] - ref_grads[n]).abs().max().item() for n in grads)
        # after the optimizer step, every weight (both copies of a tied embedding too) equals the reference's
        with torch.no_grad():
            for p in ref.parameters():
                p -= lr * p.grad
        ref_params = dict(ref.named_parameters())
        weight_err = max(
            max((w - ref_params[n]).abs().max().item() for n, w in full_state_dict(c, topo).items()) for c in chunks
        )
        results.append(
            dict(
                case=(model, tp, pp, schedule_name, vpp, p2p),
                loss_err=abs(loss - ref_loss.item()),
                grad_err=grad_err,
                weight_err=weight_err,
                names=sorted(grads),
                held=max(held, default=None),
                sent=sum(out.dim() > 0 for out in outputs),
            )
        )
    return results
