"""Selective recompute (Korthikanti et al. 2022: the attention core only) gives the loss and gradients of
no recompute and of full recompute, at TP = 2 with sequence parallelism on real gloo processes, with and
without dropout (keyed masks: the recompute redraws the same ones), and keeps what the planner says."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from activations import block_saved_bytes
from multiproc import run_ranks

from megakit.core.planner.memory import estimate_memory
from megakit.core.planner.model_spec import ModelSpec
from megakit.errors import UsageError
from megakit.nn.model import ModelConfig, Transformer
from megakit.nn.pipeline import sent_output

TOL = 1e-6


def _run(config, topo, recompute: str, ids, labels, *, layers=None):
    """Loss and full gradients of one layout, as a whole model or as two chained pipeline stages."""
    from megakit.nn.model import full_state_dict

    kw = dict(seed=5, sequence_parallel=True, recompute=recompute)
    if layers is None:
        model = Transformer(config, topo, **kw).train()
        loss = model(ids, labels, sample_ids=[3, 4])
        stages = [model]
    else:  # the stages a PP = 2 split would run, chained in one process
        first = Transformer(config, topo, layers=range(0, layers), post=False, **kw).train()
        last = Transformer(config, topo, layers=range(layers, config.layers), pre=False, **kw).train()
        loss = last(first(ids, sample_ids=[3, 4]), labels, sample_ids=[3, 4])
        stages = [first, last]
    loss.backward()
    grads = {}
    for stage in stages:
        for name, g in full_state_dict(stage, topo, grads=True).items():
            grads[name] = grads.get(name, 0) + g
    return loss.detach(), grads


def _worker(rank: int, world_size: int) -> list[str]:
    from megakit.nn.topology import Topology

    topo = Topology.from_world(tp=world_size)
    checked = []
    for preset, dropout in (("llama-tiny", 0.0), ("gpt-tiny", 0.1), ("llama-tiny", 0.1)):
        config = ModelConfig.load(preset).replace(dropout=dropout)
        gen = torch.Generator().manual_seed(11)
        ids = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        labels = torch.randint(0, config.vocab_size, (2, 16), generator=gen)
        for layers in (None, 2):
            want_loss, want = _run(config, topo, "none", ids, labels, layers=layers)
            for recompute in ("selective", "full"):
                loss, grads = _run(config, topo, recompute, ids, labels, layers=layers)
                case = f"{preset} dropout={dropout} stages={'1' if layers is None else '2'} {recompute}"
                assert abs(loss - want_loss).item() <= TOL * abs(want_loss).item(), case
                assert grads.keys() == want.keys(), case
                for name in want:
                    err = (grads[name] - want[name]).abs().max().item()
                    assert err <= TOL * max(want[name].abs().max().item(), 1.0), f"{case} grad of {name}: {err:.3g}"
                checked.append(case)
    for recompute in ("none", "selective", "full"):  # activations under PP, stage by stage
        measured, predicted = _one_f_one_b_peaks(topo, recompute)
        for stage in (0, 1):
            ratio = measured[stage] / predicted[stage]
            assert 0.9 <= ratio <= 1.1, f"{recompute} stage {stage}: measured / predicted {ratio:.3f}"
            checked.append(f"{recompute} pp stage {stage} {ratio:.3f}")
    return checked


def test_selective_equals_none_and_full_at_tp2_with_sp():
    results = run_ranks(_worker, 2)
    assert len(results[0]) == 18, results[0]
    print("\n".join(results[0][12:]))


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_selective_keeps_what_the_planner_predicts(name):
    """With dropout the attention core is written out (scores, softmax, mask): selective drops exactly
    those s x s tensors from what a block keeps, as ``estimate_memory(recompute='selective')`` says."""
    config = dataclasses.replace(ModelConfig.load(name), dropout=0.1)
    spec = dataclasses.replace(ModelSpec.from_config(name), dropout=0.1)
    s, b = 64, 2
    kept = block_saved_bytes(config, torch.randn(s, b, config.hidden, requires_grad=True))
    est = estimate_memory(
        spec,
        precision="fp32",
        micro_batch=b,
        seq_len=s,
        recompute="selective",
        flash_attention=False,
        dropout_mask_bytes=1,
    )
    assert kept["selective"] < 0.8 * kept["none"]
    assert est.activation_per_layer == pytest.approx(kept["selective"], rel=0.05)


def test_bad_recompute_is_named():
    with pytest.raises(UsageError, match="recompute 'some' is not one of none, selective, full"):
        Transformer(ModelConfig.load("gpt-tiny"), recompute="some")


class _Peak:
    """Live bytes of the tensors autograd saves (each storage once, parameters excluded), and their peak:
    what the trainer's ``--verify-memory`` census counts as activations on CPU."""

    def __init__(self, params):
        import weakref

        self.weakref, self.skip = weakref, {p.untyped_storage().data_ptr() for p in params}
        self.live, self.bytes, self.peak = {}, 0, 0

    def pack(self, t):
        ptr = t.untyped_storage().data_ptr()
        if ptr in self.skip or not ptr:
            return t
        entry = self.live.setdefault(ptr, [t.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.bytes += entry[0]
            self.peak = max(self.peak, self.bytes)
        entry[1] += 1
        holder = _Holder(t)
        self.weakref.finalize(holder, self.release, ptr)
        return holder

    def release(self, ptr):
        entry = self.live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            self.bytes -= entry[0]
            del self.live[ptr]


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor):
        self.tensor = tensor


def _one_f_one_b_peaks(topo, recompute: str, m: int = 4):
    """Two pipeline stages of gpt-tiny run 1F1B in one process (TP over the ranks, SP on), each stage's
    saved bytes tracked as the trainer's census does; its backward is the trainer's (the sent output's
    handle, ``megakit.nn.pipeline.sent_output``). Returns (peak of stage 0, peak of stage 1) and the planner's
    predictions."""
    from megakit.core.planner.memory import estimate_memory

    config, spec = ModelConfig.load("gpt-tiny"), ModelSpec.from_config("gpt-tiny")
    s, b = 32, 2
    kw = dict(seed=1, sequence_parallel=True, recompute=recompute)
    stages = [
        Transformer(config, topo, layers=range(0, 2), post=False, **kw).train(),
        Transformer(config, topo, layers=range(2, 4), pre=False, **kw).train(),
    ]
    peaks = [_Peak(stage.parameters()) for stage in stages]
    gen = torch.Generator().manual_seed(2)
    ids = [torch.randint(0, config.vocab_size, (b, s), generator=gen) for _ in range(m)]
    outs, grads = {}, {}

    def run(stage, action, mb):
        with torch.autograd.graph.saved_tensors_hooks(peaks[stage].pack, lambda h: getattr(h, "tensor", h)):
            if action == "F" and stage == 0:
                out = stages[0](ids[mb], sample_ids=[2 * mb, 2 * mb + 1])
                outs[0, mb] = (out, sent_output.handle(out))
            elif action == "F":
                x = outs[0, mb][0].detach().clone().requires_grad_()  # what stage 1 receives
                sent_output.release(outs[0, mb][0])  # sent: stage 0 frees its output
                outs[1, mb] = (x, stages[1](x, ids[mb], sample_ids=[2 * mb, 2 * mb + 1]))
            elif stage == 1:
                x, loss = outs.pop((1, mb))
                (loss / m).backward()
                grads[mb] = x.grad
            else:
                sent_output.with_gradient(outs.pop((0, mb))[1], grads.pop(mb)).backward()

    order = [
        (0, "F", 0),
        (0, "F", 1),
        (1, "F", 0),
        (1, "B", 0),
        (0, "B", 0),
        (0, "F", 2),
        (1, "F", 1),
        (1, "B", 1),
        (0, "B", 1),
        (0, "F", 3),
        (1, "F", 2),
        (1, "B", 2),
        (0, "B", 2),
        (1, "F", 3),
        (1, "B", 3),
        (0, "B", 3),
    ]  # 1F1B for pp = 2, m = 4, as the two stages interleave it
    for stage, action, mb in order:
        run(stage, action, mb)
    predicted = []
    for stage in (0, 1):
        est = estimate_memory(
            spec,
            tp=topo.tp,
            pp=2,
            stage=stage,
            precision="fp32",
            micro_batch=b,
            seq_len=s,
            accumulation=m,
            recompute=recompute,
            sequence_parallel=True,
            flash_attention=True,
        )
        logits_shard = s * b * 4 * spec.padded_vocab(topo.tp) // topo.tp if stage == 1 else 0  # transient
        predicted.append(est.items["activations"] + est.items["logits"] - logits_shard)
    return [p.peak for p in peaks], predicted


def test_planner_launches_selective_recompute(capsys):
    from megakit.commands import cli

    code = cli.main(
        [
            "plan",
            "--params",
            "13B",
            "--gpus",
            "64",
            "--tp",
            "8",
            "--pp",
            "2",
            "--recompute",
            "selective",
            "--attention",
            "standard",
            "--json",
        ]
    )
    import json

    report = json.loads(capsys.readouterr().out)
    assert code == 0 and "--recompute selective" in report["assumptions"]["launch"]
    assert report["assumptions"]["launch_note"] == ""
