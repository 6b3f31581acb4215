"""Multi-Token Prediction (DeepSeek-V3's ``num_nextn_predict_layers``): megakit's modules against transformers'.

The tiny DeepSeek-V3 of ``test_deepseek_v3`` (MLA, one dense block, the MoE) with one or two prediction modules:

- depth 1's logits equal transformers' ``MtpModel`` layer (``forward_layer`` then ``_project_to_logits``) on the
  same weights, at every position but the last (the last one's next token lies past the window);
- the loss ``L_main + lambda / D x sum(L_k)``, with loss-masked labels so that every depth counts its own tokens,
  equals an fp64 reference built from transformers' main model and ``MtpModel`` chain for D = 1 and 2
  (transformers' own ``MtpModel.forward(labels=...)`` cannot serve: it adds to ``None``);
- the checkpoint layout: ``model.layers.{L + k}.*`` with the shared embedding and head copied, written and read
  back bit for bit, and transformers' main model still loads the file;
- on four gloo processes: PP 2, PP 4, interleaved PP 2 x VPP 2, zero bubble (ZB-H1) and PP 2 x TP 2 with SP (and
  with full recompute and the loss over token chunks) give one process's loss and every gradient (the first
  stage's embedding gradient holds the MTP modules' share, summed from the last stage);
  CP 2 and CP 4 give CP 1's, with a sequence whose targets leave one CP rank no valid MTP token (no NaN).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import draw_deepseek, eager  # noqa: E402
from multiproc import run_ranks  # noqa: E402
from tolerance import assert_fp32_close, grad_scale  # noqa: E402

from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.interop.hf import from_hf_state_dict, to_hf_state_dict  # noqa: E402
from megakit.nn.model import Transformer, full_state_dict, load_full_state_dict  # noqa: E402
from megakit.nn.mtp import depth_labels, depth_token_counts, shifted  # noqa: E402

V = 128  # the tests' vocabulary


def test_each_depth_targets_token_i_plus_k_plus_1_inside_its_document():
    labels = torch.tensor([[1, 2, 3, -100, 5, 6, 7, 8]])
    documents = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2]])
    for k in range(4):
        want = [
            labels[0, i + k].item() if i + k < 8 and documents[0, i + k] == documents[0, i] else -100 for i in range(8)
        ]
        assert depth_labels(labels, k, documents)[0].tolist() == want, k
    assert depth_labels(labels, 2)[0].tolist() == [3, -100, 5, 6, 7, 8, -100, -100]  # no documents: only the tail
    assert depth_token_counts(labels, 2, documents).tolist() == [7, 4, 2]
    assert shifted(torch.arange(5)[None], 2, 0).tolist() == [[2, 3, 4, 0, 0]]


def hf_models(depths: int, dtype=torch.float32):
    """transformers' tiny DeepSeek-V3 and its ``MtpModel`` of ``depths`` layers, norms and expert biases drawn."""
    from transformers.modeling_layers import MtpModel

    fields = ModelConfig.load("deepseek-v3-tiny").to_hf() | {"vocab_size": V, "num_nextn_predict_layers": depths}
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in fields.items() if k != "model_type"}, experts_implementation="eager"
    )  # its grouped GEMM takes no fp64
    main = eager(transformers.DeepseekV3ForCausalLM, config).to(dtype)
    torch.manual_seed(1)
    mtp = MtpModel(main, depths).to(dtype).eval()
    with torch.no_grad():
        for name, p in mtp.named_parameters():  # post_init leaves some of MtpModel's own tensors as torch.empty
            if name.startswith("layers.") and "norm" not in name:
                p.normal_(0.0, config.initializer_range)
    return draw_deepseek(main), draw_deepseek(mtp)


def checkpoint_tensors(main, mtp) -> dict[str, torch.Tensor]:
    """The two models' weights as DeepSeek's checkpoints hold them: module k is decoder layer ``L + k``."""
    layers = main.config.num_hidden_layers
    out = dict(main.state_dict())
    for name, t in mtp.state_dict().items():
        if not name.startswith("layers."):
            continue  # the shared embedding and head: written below as DeepSeek's copies
        k, rest = name.split(".", 2)[1:]
        rest = rest.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm.")
        out[f"model.layers.{layers + int(k)}.{rest}"] = t
    for k in range(mtp.num_mtp_layers):
        out[f"model.layers.{layers + k}.embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
        out[f"model.layers.{layers + k}.shared_head.head.weight"] = main.lm_head.weight.detach().clone()
    return out


def megakit_model(main, mtp, *, dtype=torch.float32, mtp_weight: float = 0.1) -> Transformer:
    config = ModelConfig.from_hf(main.config.to_dict(), source="deepseek-v3")
    model = Transformer(config, mtp=True, mtp_weight=mtp_weight, dtype=dtype)
    load_full_state_dict(model, from_hf_state_dict(config, checkpoint_tensors(main, mtp)))
    return model


def hf_chain(main, mtp, ids):
    """transformers' main logits and each depth's, the chain fed the main model's normed last hidden state."""
    s = ids.shape[1]
    positions = torch.arange(s)[None]
    h = main.model(ids).last_hidden_state  # (B, S, H), after the final norm
    out = [main.lm_head(h)]
    for k in range(mtp.num_mtp_layers):
        h = mtp.forward_layer(k, h, positions, None, input_ids=shifted(ids, k + 1, 0))
        out.append(mtp._project_to_logits(h))
    return out


@torch.no_grad()
def test_depth_one_logits_equal_transformers_mtp_layer():
    main, mtp = hf_models(1)
    model = megakit_model(main, mtp).eval()
    ids = torch.randint(0, V, (2, 48), generator=torch.Generator().manual_seed(2))
    want = hf_chain(main, mtp, ids)[1][:, :-1]  # the last position's input is past the window
    normed = {}
    model.norm.register_forward_hook(lambda _m, _i, out: normed.setdefault("g", out))
    assert_fp32_close(model(ids), main(ids).logits, terms=64, what="main logits")
    embedded = model._token_embeddings(shifted(ids, 1, 0), None)
    got = model._logits(model.mtp[0](normed["g"], embedded, model._rope("rope", None, None), None, None))[:, :-1]
    err = assert_fp32_close(got, want, terms=64, what="depth-1 logits")
    print(f"depth-1 logits: {err:.2f} of the fp32 bound")
    # a module fed the un-normed hidden state (torchtitan's choice) is another function: the test can tell them apart
    hidden = {}
    model.layers["1"].register_forward_hook(lambda _m, _i, out: hidden.setdefault("h", out))
    model(ids)
    other = model._logits(model.mtp[0](hidden["h"], embedded, model._rope("rope", None, None), None, None))[:, :-1]
    assert (other - want).abs().max() > 1e-3


@pytest.mark.parametrize("depths", [1, 2])
def test_the_loss_equals_an_fp64_reference(depths):
    main, mtp = hf_models(depths, torch.float64)
    weight = 0.3
    model = megakit_model(main, mtp, dtype=torch.float64, mtp_weight=weight).train()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (2, 32), generator=gen)
    labels = shifted(ids, 1, -100)
    labels[0, 5:12] = -100  # a loss mask: each depth loses other positions, so their counts differ
    labels[1, 20] = -100
    with torch.no_grad():
        logits = hf_chain(main, mtp, ids)
    losses = []
    for k, scores in enumerate(logits):  # target of position i at depth k: labels[i + k], if inside the window
        target = torch.full_like(labels, -100)
        target[:, : 32 - k] = labels[:, k:]
        losses.append(torch.nn.functional.cross_entropy(scores.flatten(0, 1), target.flatten(), ignore_index=-100))
    want = losses[0] + weight / depths * torch.stack(losses[1:]).sum()
    got = model(ids, labels)  # its cross-entropy and RoPE tables are fp32's: the bound is fp32's, over 64 tokens
    assert_fp32_close(got.item(), want.item(), terms=64, what=f"D = {depths} loss")
    for k, (mine, theirs) in enumerate(zip(model.mtp_losses, losses[1:]), start=1):
        assert_fp32_close(mine.item(), theirs.item(), terms=64, what=f"depth {k}")
    model.eval()
    assert_fp32_close(model(ids, labels).item(), losses[0].item(), terms=64, what="evaluation: L_main alone")


def test_the_checkpoint_layout_round_trips_bit_for_bit_and_transformers_still_loads_it(tmp_path):
    from safetensors.torch import load_file

    from megakit.interop.checkpoint import save_checkpoint
    from megakit.interop.hf_export import export_hf

    main, mtp = hf_models(2)
    model = megakit_model(main, mtp)
    state = full_state_dict(model)
    assert from_hf_state_dict(model.config, to_hf_state_dict(model.config, state)).keys() == state.keys()
    save_checkpoint(tmp_path / "ck", model, None, step=0, config=model.config)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    written = load_file(str(tmp_path / "hf" / "model.safetensors"))  # DeepSeek's layout: experts one by one
    back = from_hf_state_dict(model.config, written)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    for k in (2, 3):  # the modules as decoder layers L + k, with the shared tensors copied beside them
        for part in (
            "enorm",
            "hnorm",
            "eh_proj",
            "shared_head.norm",
            "shared_head.head",
            "embed_tokens",
            "self_attn.kv_a_proj_with_mqa",
            "mlp.experts.3.down_proj",
            "mlp.shared_experts.up_proj",
        ):
            assert f"model.layers.{k}.{part}.weight" in written, part
    assert torch.equal(written["model.layers.3.eh_proj.weight"], mtp.layers[1].eh_proj.weight)
    assert torch.equal(written["model.layers.3.shared_head.norm.weight"], mtp.layers[1].post_norm.weight)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert all(torch.equal(p, main.state_dict()[n]) for n, p in loaded.state_dict().items())
    wrong = dict(written) | {"model.layers.2.embed_tokens.weight": torch.zeros(V, 64)}
    with pytest.raises(Exception, match="differs from the main model's"):
        from_hf_state_dict(model.config, wrong)


def _layouts(rank, world, cases):
    """Each case's loss and full gradients on this rank against one process's on the same micro-batches."""
    from megakit.core.layout import Layout
    from megakit.core.schedules import build_schedule
    from megakit.nn import comm as C
    from megakit.nn.model import build_stage_chunks
    from megakit.nn.pipeline.executor import PipelineExecutor, activation_shape
    from megakit.nn.sequence import positions
    from megakit.nn.topology import Topology

    torch.manual_seed(0)
    out = []
    for case in cases:
        layers, depths, seq = case.get("layers", 2), case.get("depths", 1), case.get("seq", 16)
        config = ModelConfig.load("deepseek-v3-tiny").replace(vocab_size=V, layers=layers, mtp_layers=depths)
        tp, pp, cp, vpp, m = (case.get(x, 1) for x in ("tp", "pp", "cp", "vpp", "m"))
        topo = Topology(Layout.for_world(world, tp=tp, pp=pp, cp=cp))
        gen = torch.Generator().manual_seed(5)
        ids = torch.randint(0, V, (topo.dp * m, 2, seq), generator=gen)
        labels = torch.stack([shifted(x, 1, -100) for x in ids])
        documents = (torch.arange(seq) >= seq // 2).long().expand(2, seq)  # two documents a row
        if case.get("empty_rank"):  # one target, at the second document's first token: CP rank 0 holds no valid
            labels[:] = -100  # token at all, and no depth-1 target is left anywhere (i + 1 crosses a document)
            labels[..., seq // 2] = 7
            assert not (labels[0, :, positions(seq, cp, 0)] != -100).any()
        ref = Transformer(config, seed=3, mtp=True, mtp_weight=0.3)
        ref_losses = [ref(x, y, documents=documents) for x, y in zip(ids, labels)]
        torch.stack(ref_losses).mean().backward()
        want = full_state_dict(ref, grads=True)
        mine = range(topo.dp_rank * m, (topo.dp_rank + 1) * m)
        sp = case.get("sp", False)
        chunks = build_stage_chunks(
            config,
            topo,
            vpp=vpp,
            seed=3,
            sequence_parallel=sp,
            mtp=True,
            mtp_weight=0.3,
            recompute=case.get("recompute", "none"),
            loss_chunks=case.get("loss_chunks", 1),
        )
        if pp == 1:
            model = chunks[0]
            losses = [model(ids[i], labels[i], documents=documents) for i in mine]
            loss = torch.stack(losses).mean()
            loss.backward()
            loss = C.all_reduce(loss.detach().clone(), topo.dp_group) / topo.dp
        else:
            schedule = build_schedule(case.get("schedule", "interleaved" if vpp > 1 else "1f1b"), pp, m, vpp)
            executor = PipelineExecutor(
                chunks,
                topo,
                schedule=schedule,
                activation_shape=activation_shape(
                    config, micro_batch_size=2, seq_len=seq // cp, tp=tp, sequence_parallel=sp
                ),
                optimizer_step=lambda: None,
            )
            extras = [{"documents": documents, "input_ids": ids[i]} for i in mine]
            loss = executor.step(
                [ids[i] for i in mine] if topo.is_first_stage else None,
                [labels[i] for i in mine] if topo.is_last_stage else None,
                extras=extras,
            )
        grads = {n: g for c in chunks for n, g in full_state_dict(c, topo, grads=True).items()}
        errors = {}
        for name, g in grads.items():
            if pp == 1:  # no executor: average over DP and CP as DeepSpeed would
                g = C.all_reduce(g.clone(), topo.get_data_parallel_group()) / (topo.dp * topo.cp)
            errors[name] = (float((g - want[name]).abs().max()), bool(torch.isfinite(g).all()))
        out.append(
            dict(
                loss=float(loss),
                want=float(torch.stack(ref_losses).mean()),
                errors=errors,
                scale=grad_scale(want),
                names=sorted(want),
                mtp=[float(x) for x in ref.mtp_losses],
            )
        )
    return out


CASES = [
    dict(pp=2, m=4),
    dict(pp=4, layers=4, m=4, depths=2),
    dict(pp=2, vpp=2, layers=4, m=4),
    dict(pp=2, tp=2, sp=True, m=2),
    dict(cp=2, m=2),
    dict(cp=4, depths=2, seq=32),
    dict(cp=2, m=1, empty_rank=True),
    dict(cp=2, tp=2, sp=True, m=1),
    # zero bubble's split backward (the embedding's and enorm's weight gradients in W); full recompute of the
    # modules with the head and loss over token chunks
    dict(pp=2, schedule="zb-h1", m=4),
    dict(pp=2, tp=2, m=2, recompute="full", loss_chunks=2, depths=2),
]


@pytest.mark.slow
def test_every_layout_gives_one_process_loss_and_gradients():
    results = run_ranks(_layouts, 4, CASES, timeout_s=300)
    for i, case in enumerate(CASES):
        seen = set()
        for rank in results:
            r = rank[i]
            assert abs(r["loss"] - r["want"]) <= 1e-5 * r["want"], (case, r["loss"], r["want"])
            for name, (err, finite) in r["errors"].items():
                assert finite and err <= 1e-5 * r["scale"], (case, name, err, r["scale"])
            seen |= set(r["errors"])
        assert seen == set(results[0][i]["names"]), (case, set(results[0][i]["names"]) - seen)  # every gradient
        if case.get("empty_rank"):
            assert results[0][i]["mtp"] == [0.0]  # no valid target anywhere at depth 1: 0, not NaN
