"""``--optimizer muon`` (megakit.train.engine.muon): one process equals torch.optim.Muon on the same matrices, every
layout equals one process, the momentum resumes at another layout, and what it cannot run is one line.

The layouts run in ONE launcher job of 2 processes (``tests/helpers/launch_sweep.py``): TP 2 (column- and row-parallel
shards sent to their owners), PP 2, DP 2, CP 2 and EP 2 of ``moe-tiny``, against the single process
(``reference_run(muon=...)``); TP 2 saves at step 3 and DP 2 resumes from it with its momenta; QK-clip at TP 2 with
SP (MHA) and at DP 2 (grouped K/V heads, ZeRO 0 and 1) against the single process's weights; ZeRO 2 at EP 2, a ZeRO 2
save resumed at ZeRO 0 x TP 2, CP 2 at ZeRO 1, and bf16 at ZeRO 1 (both of DeepSpeed's optimizers for it). A job of
4 processes runs ZeRO 1 at TP 2 x DP 2, from the start and from the TP 2 save.
"""

import json
import re

import pytest
import torch
from jobs import sweep
from paths import ROOT

from megakit.errors import UsageError
from megakit.train.engine.muon import MuonWithAdamW, check_muon, matrices, muon_groups, uses_muon

LR, WD = 3e-3, 0.1
MUON = {"optimizer": "muon", "muon_lr": LR, "muon_weight_decay": WD}


def _grads(net: torch.nn.Module, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    for p in net.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def test_one_process_equals_torch_muon_and_adamw_on_the_same_matrices():
    from megakit.nn.model import ModelConfig, Transformer

    net = Transformer(ModelConfig.load(ROOT / "models" / "moe-tiny.json"), seed=0)
    ref = Transformer(ModelConfig.load(ROOT / "models" / "moe-tiny.json"), seed=0)
    ours = MuonWithAdamW(muon_groups(net, weight_decay=WD), lr=LR, weight_decay=WD)
    names = dict(ref.named_parameters())
    hidden = [n for n, p in names.items() if uses_muon(n, p)]
    assert "layers.0.mlp.experts.gate_up_proj" in hidden and "layers.0.attn.q_proj.weight" in hidden
    assert not {"embed.weight", "lm_head.weight", "layers.0.mlp.gate.weight", "norm.weight"} & set(hidden)
    # torch.optim.Muon on the unfused matrices: each expert's gate, up and down a parameter of its own
    leaves = {n: [torch.nn.Parameter(m.clone()) for m in matrices(n, names[n].detach())] for n in hidden}
    muon = torch.optim.Muon(
        [q for n in hidden for q in leaves[n]], lr=LR, weight_decay=WD, adjust_lr_fn="match_rms_adamw"
    )
    rest = [p for n, p in names.items() if n not in hidden]
    decayed = [p for n, p in names.items() if n not in hidden and p.ndim >= 2 and not n.endswith("bias")]
    adamw = torch.optim.AdamW(
        [{"params": decayed}, {"params": [p for p in rest if all(p is not d for d in decayed)], "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=WD,
    )
    for step in range(3):
        _grads(net, step)
        _grads(ref, step)
        for n in hidden:
            for leaf, g in zip(leaves[n], matrices(n, names[n].grad)):
                leaf.grad = g.clone()
        ours.step()
        muon.step()
        adamw.step()
    got = dict(net.named_parameters())
    for n in hidden:
        for leaf, m in zip(leaves[n], matrices(n, got[n].detach())):
            assert torch.equal(leaf.detach(), m), n
    for n, p in names.items():
        if n not in hidden:
            assert torch.equal(p.detach(), got[n].detach()), n
    assert set(ours.state[got["layers.0.attn.q_proj.weight"]]) == {"momentum_buffer", "step"}
    assert set(ours.state[got["embed.weight"]]) == {"exp_avg", "exp_avg_sq", "step"}


def test_zero_partitions_cut_each_weight_into_contiguous_pieces():
    """DeepSpeed ZeRO 1-2's flat group (weights at their offsets, alignment padding between and after) cut into
    partitions: each weight's pieces cover it once, in order, and lie where the partitions hold them."""
    from megakit.train.engine.muon_zero import Piece, pieces

    numels = [6, 3, 10, 1]
    offsets = [0, 6, 10, 20]  # 1 element of padding after the 3, 3 after the last (24 = 4 partitions of 6)
    got = pieces(offsets, numels, partition_size=6, ranks=4)
    assert got[0] == [Piece(rank=0, start=0, numel=6, at=0)]  # exactly one partition
    assert got[1] == [Piece(rank=1, start=0, numel=3, at=0)]
    assert got[2] == [  # straddles three partitions
        Piece(rank=1, start=0, numel=2, at=4),
        Piece(rank=2, start=2, numel=6, at=0),
        Piece(rank=3, start=8, numel=2, at=0),
    ]
    assert got[3] == [Piece(rank=3, start=0, numel=1, at=2)]
    flat = torch.arange(24.0)
    for offset, numel, row in zip(offsets, numels, got):
        weight = torch.cat([flat.view(4, 6)[pc.rank, pc.at : pc.at + pc.numel] for pc in row])
        assert torch.equal(weight, torch.arange(offset, offset + numel, dtype=torch.float32))
    assert pieces([0], [12], partition_size=6, ranks=2) == [
        [Piece(rank=0, start=0, numel=6, at=0), Piece(rank=1, start=6, numel=6, at=0)]
    ]


# Weights of a flat ZeRO group (an expert stack among them: orthogonalised per expert) and the exchange's bucket
# limits: one bucket per weight or two, and all in one.
_FLAT = [
    ("layers.0.attn.q_proj.weight", (6, 4)),
    ("layers.0.attn.o_proj.weight", (3, 5)),
    ("layers.0.mlp.experts.down_proj", (2, 4, 3)),
    ("layers.1.mlp.up_proj.weight", (8, 8)),
    ("layers.1.mlp.down_proj.weight", (2, 7)),
]


def _exchange(rank: int, world: int, limit: int) -> tuple[list[float], int]:
    """This DP rank's partition of the orthogonalised group, bucket by bucket (``limit`` elements a bucket)."""
    from megakit.train.engine import muon_zero as Z

    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) for _, shape in _FLAT]
    numels = [w.numel() for w in weights]
    offsets = [sum(numels[:j]) for j in range(len(numels))]
    size = -(-sum(numels) // world) + 1  # padding at the end, as DeepSpeed's alignment leaves
    flat = torch.zeros(size * world)
    flat[: sum(numels)] = torch.cat([w.reshape(-1) for w in weights])
    runs, owner = Z.buckets(numels, world, limit)
    group = Z.FlatGroup(
        names=[n for n, _ in _FLAT],
        shapes=[w.shape for w in weights],
        tp_dims=[None] * len(weights),
        pieces=Z.pieces(offsets, numels, partition_size=size, ranks=world),
        buckets=runs,
        owner=owner,
        group=torch.distributed.group.WORLD,  # (None is one rank in megakit.nn.comm)
    )
    update, out = flat[rank * size : (rank + 1) * size].clone(), torch.zeros(size)
    for run in runs:
        for _, piece, orthogonal in Z.orthogonalise_flat(update, group, None, run):
            out.narrow(0, piece.at, piece.numel).copy_(orthogonal)
    return out.tolist(), len(runs)  # a list: tensors would travel back through shared memory


def test_zero_exchange_bucket_by_bucket_equals_newton_schulz_on_each_whole_weight():
    """2 processes over gloo: ZeRO 1-2's exchange of a flat group, in buckets of a few weights or all at once,
    gives every piece of every weight Newton-Schulz's result on the whole weight (bit for bit: the same product on
    the same matrix), padding 0; the buckets hold consecutive weights and a weight above the limit alone."""
    from multiproc import run_ranks

    from megakit.train.engine.muon import orthogonalise
    from megakit.train.engine.muon_zero import buckets

    assert buckets([4, 4, 9, 1], 2, limit=8) == ([[0, 1], [2], [3]], [0, 1, 0, 0])
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=gen) for _, shape in _FLAT]
    want = torch.cat([orthogonalise(name, w).reshape(-1) for (name, _), w in zip(_FLAT, weights)])
    for limit, runs in ((30, 5), (1 << 26, 1)):
        parts = run_ranks(_exchange, 2, limit)
        got = torch.tensor([x for out, _ in parts for x in out])
        assert [n for _, n in parts] == [runs, runs]
        assert torch.equal(got[: want.numel()], want) and not got[want.numel() :].any(), limit


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])  # K/V heads: one per query head, one per two
def test_qk_clip_brings_each_head_above_tau_back_to_tau(model):
    from megakit.nn.model import ModelConfig, Transformer
    from megakit.train.engine.muon import QKClip

    net = Transformer(ModelConfig.load(ROOT / "models" / f"{model}.json"), seed=0)
    x = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    clip = QKClip(net, tau=1.0)
    net(x, x)
    first = clip.attention[0].max_logits  # the first block's: its input stays as it was after the clip
    tau = float(first.median())
    clip = QKClip(net, tau=tau)
    net(x, x)
    clip.clip()
    assert torch.count_nonzero(torch.stack([m.max_logits for m in clip.attention])) == 0  # the next step's maxima
    net(x, x)
    after, above = clip.attention[0].max_logits, first > tau
    assert above.any() and (~above).any(), first
    assert torch.allclose(after[above], torch.full_like(after[above], tau), rtol=1e-5)  # clipped to tau
    assert torch.equal(after[~above], first[~above])  # the others untouched


def test_what_muon_cannot_run_is_one_line(tmp_path):
    from megakit.train.run import TrainConfig, resolve

    muon = json.loads((ROOT / "ds_configs" / "muon.json").read_text())
    adamw = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())
    zero1 = json.loads((ROOT / "ds_configs" / "muon_zero1.json").read_text())
    offload = {**zero1, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    data = tmp_path / "text.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    cases = [
        (adamw, {}, 'the ds_config has an "optimizer" section (AdamW); remove it'),
        ({**muon, "zero_optimization": {"stage": 3}}, {}, "--optimizer muon with ZeRO 3"),
        ({**muon, "bf16": {"enabled": True}}, {}, "--optimizer muon with bf16 at ZeRO 0"),
        (offload, {}, "--optimizer muon with the optimizer offloaded"),
        (muon, {"muon_lr": 0.0}, "--muon-lr must be above 0"),
        (muon, {"qk_clip": 100.0, "model": "deepseek-v3-tiny"}, "its attention is MLA"),
        (muon, {"qk_clip": 100.0, "model": "gpt-oss-tiny"}, "its attention sinks or dropout"),
        (muon, {"qk_clip": 100.0, "cp": 2}, "--qk-clip with --cp 2"),
        (adamw, {"qk_clip": 100.0, "optimizer": "adamw"}, "--qk-clip 100 is MuonClip's: use it with --optimizer muon"),
    ]
    for ds, flags, message in cases:
        with pytest.raises(UsageError, match=re.escape(message)):
            resolve(TrainConfig(**{"ds_config": ds, "data": str(data), "model": "gpt-tiny", **MUON, **flags}), 2)
    with pytest.raises(UsageError, match="--optimizer muon with fp16 at ZeRO 0"):  # resolve: fp16 needs a GPU
        check_muon({**muon, "fp16": {"enabled": True}}, lr=LR, weight_decay=WD)
    with pytest.raises(UsageError, match="--optimizer lion is not one of adamw, muon"):
        TrainConfig(ds_config=muon, optimizer="lion")
    resolve(TrainConfig(ds_config=muon, data=str(data), model="gpt-tiny", tp=2, **MUON), 2)  # runs
    for stage in (1, 2):  # ZeRO 1-2, fp32 or bf16
        resolve(TrainConfig(ds_config={**zero1, "zero_optimization": {"stage": stage}}, data=str(data), **MUON), 2)


# -- 2 processes: each layout against the single process, and a resume at another layout -----------------------------
def _ds(micro: int = 2, accumulation: int = 2, *, zero: int = 0, bf16: bool = False) -> dict:
    config = json.loads((ROOT / "ds_configs" / ("muon_zero1.json" if zero else "muon.json")).read_text())
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accumulation)
    config["scheduler"]["params"].update(warmup_num_steps=2, total_num_steps=6)
    if zero:
        config["zero_optimization"]["stage"] = zero
        config["bf16"]["enabled"] = bf16
    return config


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    saved = tmp_path_factory.mktemp("muon") / "tp2"
    zero2 = saved.parent / "zero2"
    base = dict(data=None, steps=6, seq_len=32, seed=3, **MUON)  # the standard library's sources, as bytes
    cases = [
        dict(base, model="gpt-tiny", ds_config=_ds(accumulation=4), tp=2, sequence_parallel=True, qk_clip=0.05),  # 0
        dict(base, model="gpt-tiny", ds_config=_ds(accumulation=4), pp=2),  # 1: PP 2
        dict(base, model="gpt-tiny", ds_config=_ds()),  # 2: DP 2
        dict(base, model="gpt-tiny", ds_config=_ds(), cp=2),  # 3: CP 2 x DP 1 ... each CP rank half the sequence
        dict(base, model="moe-tiny", ds_config=_ds(), ep=2),  # 4: EP 2 over DP 2
        dict(base, model="gpt-tiny", ds_config=_ds(accumulation=4), tp=2, save=str(saved), save_every=3, keep=5),  # 5
        dict(base, model="gpt-tiny", ds_config=_ds(), load=str(saved / "step-0000003")),  # 6: resumed at DP 2
        dict(base, model="llama-tiny", ds_config=_ds(), qk_clip=0.05),  # 7: QK-clip of grouped K/V heads, DP 2
        dict(base, model="moe-tiny", ds_config=_ds(zero=2), ep=2),  # 8: ZeRO 2, the experts over EDP
        dict(base, model="gpt-tiny", ds_config=_ds(zero=2), save=str(zero2), save_every=3, keep=5),  # 9
        dict(base, model="gpt-tiny", ds_config=_ds(accumulation=4), tp=2, load=str(zero2 / "step-0000003")),  # 10
        dict(base, model="gpt-tiny", ds_config=_ds(zero=1, bf16=True)),  # 11: bf16 ZeRO 1, fp32 masters
        dict(base, model="llama-tiny", ds_config=_ds(zero=1), qk_clip=0.05),  # 12: 7 at ZeRO 1: the masters clipped
        dict(base, model="gpt-tiny", ds_config={**_ds(zero=1, bf16=True), "data_types": {"grad_accum_dtype": "fp32"}}),
        dict(base, model="gpt-tiny", ds_config=_ds(accumulation=4, zero=1), cp=2),  # 14: partitions over DP x CP
        dict(base, model="gpt-tiny", ds_config=_ds(accumulation=4, zero=1), pp=2, vpp=2),  # 15: PP 2 x VPP 2, ZeRO 1
    ]  # 9: ZeRO 2 saves at step 3, 10: ZeRO 0 x TP 2 resumes from it; 13: 11 accumulating in fp32 (BF16_Optimizer)
    for i in (0, 7, 12):
        cases[i]["save"] = str(saved.parent / f"qk{i}")
    cases[3]["ds_config"] = _ds(accumulation=4)
    return cases, sweep(tmp_path_factory, 2, cases, timeout=600)


def _reference(case: dict, dp: int, qk_clip: float = 0.0, weights: bool = False) -> dict:
    from megakit.train.doctor.reference import reference_run

    return reference_run(
        case["ds_config"],
        model=case["model"],
        steps=case["steps"],
        dp=dp,
        seq_len=case["seq_len"],
        seed=case["seed"],
        data=case["data"],
        muon={"lr": LR, "weight_decay": WD, "qk_clip": qk_clip},
        weights=weights,
    )


@pytest.mark.slow
def test_each_layout_equals_one_process_and_the_momentum_resumes_at_another(layouts):
    cases, results = layouts
    dense = _reference(cases[2], dp=2, weights=True)  # cases 0, 1, 3, 5, 15 run DP 1 with 4 micro-batches: the same
    moe = _reference(cases[4], dp=2)  # global batch
    for i, want in [
        (1, dense),
        (2, dense),
        (3, dense),
        (4, moe),
        (5, dense),
        (8, moe),
        (9, dense),
        (14, dense),
        (15, dense),
    ]:
        got = results[i]["loss"]
        assert len(got) == 6, (i, got)
        # 1e-5: TP 2 follows within 2e-6; orthogonalising each TP shard alone is 8e-5 off
        assert got == pytest.approx(want["loss"], rel=1e-5), (i, got, want["loss"])
    assert results[6]["loss"] == pytest.approx(results[5]["loss"][3:], rel=1e-5)  # with its momenta, not from zero
    assert results[10]["loss"] == pytest.approx(results[9]["loss"][3:], rel=1e-5)  # ZeRO 2's partitioned momenta
    # bf16 (Muon steps the fp32 masters): one bf16 rounding is 2^-9 = 2e-3 relative, the bound; measured 1.2e-4
    # off the fp32 one process, where one step's update moves the loss by 1e-2 to 2e-2
    for i in (11, 13):
        assert results[i]["loss"] == pytest.approx(dense["loss"], rel=2e-3), (i, results[i]["loss"])
    from megakit.train.run import TrainConfig, resolve

    optimizer = json.loads((ROOT / "ds_configs" / "zero0.json").read_text())["optimizer"]
    adamw = {**cases[6], "optimizer": "adamw", "ds_config": {**cases[6]["ds_config"], "optimizer": optimizer}}
    with pytest.raises(UsageError, match="holds --optimizer muon's state .* resume with --optimizer muon"):
        resolve(TrainConfig(**adamw), 2)
    from megakit.interop.checkpoint import load_checkpoint
    from megakit.interop.checkpoint_format import manifest_config, read_manifest
    from megakit.nn.model import Transformer

    grouped = _reference(cases[7], dp=2, qk_clip=0.05, weights=True), _reference(cases[7], dp=2, weights=True)
    for i, dp in ((0, 1), (7, 2), (12, 2)):  # QK-clip: each TP rank its own heads (SP too); the maximum over DP
        clipped, plain = (_reference(cases[i], dp=dp, qk_clip=0.05, weights=True), dense) if i == 0 else grouped
        assert results[i]["loss"] == pytest.approx(clipped["loss"], rel=1e-5), i
        net = Transformer(manifest_config(read_manifest(cases[i]["save"])))
        load_checkpoint(cases[i]["save"], net)
        for name in ("layers.0.attn.q_proj.weight", "layers.3.attn.q_proj.weight"):
            got, want, unclipped = net.state_dict()[name], clipped["weights"][name], plain["weights"][name]
            # Newton-Schulz's bf16 turns the layouts' fp32 rounding into ~4e-5 here; the clip moves W_q by 3e-3 to 2e-2
            assert (got - want).abs().max() < 2e-4, (i, name)
            assert (got - unclipped).abs().max() > 2e-3, (i, name)  # it clipped


@pytest.mark.slow
def test_zero1_at_tp2_x_dp2_equals_one_process_and_resumes_a_zero0_save(layouts, tmp_path_factory):
    """4 processes: ZeRO 1 at TP 2 x DP 2 (each DP owner orthogonalises its weights over TP with its TP peer), from
    the start and from case 5's ZeRO 0 x TP 2 save at step 3 (its momenta into ZeRO 1's partitions)."""
    cases, results = layouts
    saved = cases[5]["save"] + "/step-0000003"
    base = {k: v for k, v in cases[2].items() if k != "ds_config"}
    mine = [dict(base, ds_config=_ds(zero=1), tp=2), dict(base, ds_config=_ds(zero=1), tp=2, load=saved)]
    got = sweep(tmp_path_factory, 4, mine, timeout=600)
    dense = _reference(cases[2], dp=2)
    assert got[0]["loss"] == pytest.approx(dense["loss"], rel=1e-5), (got[0]["loss"], dense["loss"])
    assert got[1]["loss"] == pytest.approx(results[5]["loss"][3:], rel=1e-5), (got[1]["loss"], results[5]["loss"])


def test_the_planner_prices_torch_newton_schulz_and_one_moment():
    from torch.optim._muon import _zeropower_via_newtonschulz
    from torch.utils.flop_counter import FlopCounterMode

    from megakit.core.model_config import ModelConfig
    from megakit.core.planner.muon import muon_cost, newton_schulz_flops, render

    for rows, cols in [(48, 16), (16, 48), (32, 32)]:
        with FlopCounterMode(display=False) as counter:
            _zeropower_via_newtonschulz(torch.randn(rows, cols), (3.4445, -4.775, 2.0315), 5, 1e-7)
        assert counter.get_total_flops() == newton_schulz_flops(rows, cols), (rows, cols)
    config = ModelConfig.load(ROOT / "models" / "llama-3-8b.json")
    one, eight = muon_cost(config), muon_cost(config, tp=8)
    hidden = config.layers * (2 * 4096 * 4096 + 2 * 1024 * 4096 + 3 * 14336 * 4096)
    assert one.params == hidden and one.moment_bytes == 4 * hidden  # one fp32 moment where Adam keeps two
    assert one.gather_bytes == 0 and eight.ns_flops == one.ns_flops / 8  # each matrix on one owner
    assert eight.gather_bytes == pytest.approx(2 * 7 / 64 * 4 * hidden)  # to the owners and back
    moe = muon_cost(ModelConfig.load(ROOT / "models" / "mixtral-8x7b.json"), ep=8)
    assert ("experts' gate, up", 14336, 4096, 32 * 2, newton_schulz_flops(14336, 4096, 1)) in moe.rows  # 1 expert
    text = "\n".join(render(eight, step_flops_per_gpu=1e15))
    assert "Newton-Schulz: 83.24 TFLOP per step, 7.7 % of the step's FLOPs" in text


def test_megakit_plan_optimizer_muon_prints_it_line_by_line(capsys):
    from megakit.commands import cli
    from megakit.core.planner.model_spec import ModelSpec
    from megakit.core.planner.muon import muon_cost

    assert cli.main(["plan", "--params", "8B", "--gpus", "8", "--tp", "8", "--optimizer", "muon", "--json"]) == 0
    muon = json.loads(capsys.readouterr().out)["plan"]["muon"]
    want = muon_cost(ModelSpec.from_params("8B").config, tp=8)
    assert muon["ns_flops"] == want.ns_flops and muon["moment_bytes"] == want.moment_bytes
    assert muon["lines"][0].startswith("Muon (--optimizer muon), per GPU and step")
    assert any(line.strip().startswith("TP exchange of the split matrices") for line in muon["lines"])
    assert any("optimizer's share of the step" in line for line in muon["lines"])
    assert cli.main(["plan", "--params", "8B", "--gpus", "8", "--tp", "8", "--json"]) == 0
    assert "muon" not in json.loads(capsys.readouterr().out)["plan"]  # AdamW: nothing added


def test_the_hybrids_conv_filters_and_routers_stay_on_adamw():
    """Gated DeltaNet's and Mamba-2's depthwise conv taps ``(C, K)`` are 2-D but no matrix: AdamW steps them; the
    mixers' projections stay on Muon."""
    import torch

    from megakit.core.model_config import ModelConfig
    from megakit.nn.model import Transformer

    for model in ("nemotron-h-tiny", "qwen3.5-tiny"):
        net = Transformer(ModelConfig.load(model), seed=0)
        convs = [n for n, p in net.named_parameters() if p.ndim == 2 and ".conv_" in n]
        assert convs and not any(uses_muon(n, p) for n, p in net.named_parameters() if n in convs)
        projections = [n for n, p in net.named_parameters() if uses_muon(n, p) and (".mixer." in n or ".attn." in n)]
        assert projections, model
    assert uses_muon("layers.0.mlp.down_proj.weight", torch.zeros(4, 4))
    nemotron_3 = Transformer(ModelConfig.load("nemotron-3-tiny"), seed=0)  # its 'E' blocks' router is mixer.gate
    routers = [n for n, _ in nemotron_3.named_parameters() if n.endswith(".gate.weight")]
    assert routers and not any(uses_muon(n, p) for n, p in nemotron_3.named_parameters() if n in routers)
    assert uses_muon("layers.1.mixer.experts.up_proj", torch.zeros(2, 4, 4))
