"""SmolLM3 (``SmolLM3ForCausalLM``) against transformers' own, in fp32, and its NoPE blocks under CP, TP and PP.

A tiny config whose pieces are made to matter: 4 blocks with block 1 NoPE among RoPE blocks, at 64 tokens (far
enough apart that a rotation moves every score), GQA, a tied head, and q/k/v/o and MLP biases drawn at random
(transformers starts them at 0: no test), and attention weights large enough that attention is sharp and moves the
residual stream (at transformers' 0.02 a rotation hides in rounding). The control turns RoPE back on in the NoPE block
and must move the logits far past the tolerance, so ``no_rope_layers`` is shown to be read. With
``use_sliding_window`` the NoPE blocks slide (transformers' default ``layer_types``).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from equivalence import _equivalence, _equivalence_worker
from multiproc import run_many

transformers = pytest.importorskip("transformers")

from hf_reference import eager, megakit_copy  # noqa: E402
from tolerance import assert_fp32_close  # noqa: E402

from megakit.core.model_config import PRESETS, ModelConfig  # noqa: E402
from megakit.errors import UsageError  # noqa: E402
from megakit.interop.hf import exact_param_count, to_hf_state_dict  # noqa: E402
from megakit.nn.attention.masks import position_ids  # noqa: E402
from megakit.nn.model import full_state_dict  # noqa: E402

TOL = 1e-5
FIELDS = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    no_rope_layers=[1, 0, 1, 1],
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    attention_bias=True,
    mlp_bias=True,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def _hf_model(**changes):
    model = eager(transformers.SmolLM3ForCausalLM, transformers.SmolLM3Config(**{**FIELDS, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):  # sharp attention (at 0.02 near uniform)
                p.normal_(0.0, 0.2)
            elif name.endswith(("v_proj.weight", "o_proj.weight")):  # a branch that moves the residual stream
                p.normal_(0.0, 0.1)
    return model


@pytest.mark.parametrize("window", [None, 8])
@torch.no_grad()
def test_smollm3_logits_match_transformers_and_the_nope_block_is_read(window):
    hf = _hf_model(**({"use_sliding_window": True, "sliding_window": window} if window else {}))
    config = ModelConfig.from_hf(hf.config.to_dict(), source="smollm3")
    assert config.nope_layers == (1,) and [config.block_uses_rope(i) for i in range(4)] == [True, False, True, True]
    assert [config.attention_window(i) for i in range(4)] == [0, window or 0, 0, 0]  # only the NoPE block slides
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    diff = (megakit_copy(config, hf)(ids) - want).abs().max().item()
    gap = (megakit_copy(config.replace(nope_layers=()), hf)(ids) - want).abs().max().item()  # RoPE on every block
    print(f"smollm3 window {window}: max |logit diff| {diff:.2e}; RoPE everywhere: {gap:.2e}")
    assert diff < TOL
    assert gap > 1e-2, gap  # 4e-2 measured: the rotation in the one NoPE block alone


@torch.no_grad()
def test_packed_documents_restart_positions_in_rope_and_nope_blocks():
    """Packed rows with ``position_ids`` restarting per document equal transformers' packed batch; the NoPE block
    sees no positions at all, so only the document mask keeps it apart."""
    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="smollm3")
    docs = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 13 + [1] * 19])
    ids = torch.randint(0, 128, docs.shape, generator=torch.Generator().manual_seed(3))
    got = megakit_copy(config, hf)(ids, documents=docs, position_ids=position_ids(docs))
    want = torch.cat([hf(ids[b : b + 1, docs[b] == d]).logits for b in range(2) for d in docs[b].unique()], dim=1)
    assert_fp32_close(got.reshape(1, -1, 128), want, terms=64, what="smollm3 per document")


def test_smollm3_config_and_weights_round_trip_and_transformers_reads_them():
    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="smollm3")
    assert ModelConfig.from_hf(config.to_hf()) == config
    written, original = config.to_hf(), hf.config.to_dict()
    for field, value in written.items():  # field for field what transformers wrote (its own bookkeeping aside)
        if field != "architectures":
            assert original[field] == value, (field, original[field], value)
    assert written["no_rope_layers"] == [1, 0, 1, 1] and written["layer_types"] == ["full_attention"] * 4
    again = eager(
        transformers.SmolLM3ForCausalLM,
        transformers.SmolLM3Config(**{k: v for k, v in written.items() if k != "model_type"}),
    )  # pad_token_id None: megakit trains every row
    missing, unexpected = again.load_state_dict(
        to_hf_state_dict(config, full_state_dict(megakit_copy(config, hf))), strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied to the embedding
    again.tie_weights()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (again(ids).logits - hf(ids).logits).abs().max().item() < TOL
    sliding = ModelConfig.from_hf(_hf_model(use_sliding_window=True, sliding_window=8).config.to_dict())
    assert sliding.to_hf()["layer_types"] == ["full_attention", "sliding_attention"] + ["full_attention"] * 2
    assert ModelConfig.from_hf(sliding.to_hf()) == sliding


def test_a_trained_checkpoint_exports_and_transformers_loads_it(tmp_path):
    """``megakit convert``'s export converts one block at a time through a one-block config, which must not keep
    the NoPE block numbers of the whole model (it refused every SmolLM3 checkpoint before)."""
    from megakit.interop.checkpoint import save_checkpoint
    from megakit.interop.hf_export import export_hf

    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="smollm3")
    save_checkpoint(tmp_path / "ck", megakit_copy(config, hf), None, step=0, config=config)
    export_hf(tmp_path / "ck", tmp_path / "hf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (loaded(ids).logits - hf(ids).logits).abs().max().item() < TOL


@pytest.mark.parametrize("layers, interval", [(4, 4), (7, 3), (36, 4)])
def test_no_rope_layer_interval_is_transformers_default_rule(layers, interval):
    fields = {k: v for k, v in FIELDS.items() if k != "no_rope_layers"}
    fields |= dict(num_hidden_layers=layers, no_rope_layer_interval=interval)
    flags = transformers.SmolLM3Config(**fields).no_rope_layers
    config = ModelConfig.from_hf({"model_type": "smollm3", **fields})
    assert [int(config.block_uses_rope(i)) for i in range(layers)] == flags


def test_parameter_counts_are_transformers_own():
    hf = _hf_model()
    config = ModelConfig.from_hf(hf.config.to_dict(), source="smollm3")
    assert config.num_params() == sum(p.numel() for p in hf.parameters())
    for name in ("smollm3-tiny", "smollm3-3b"):
        raw = json.loads((PRESETS / f"{name}.json").read_text())
        assert ModelConfig.load(name).num_params() == exact_param_count(raw), name
    big = ModelConfig.load("smollm3-3b")
    assert big.num_params() == 3_075_098_624 and big.nope_layers == tuple(range(3, 36, 4))
    assert big.rope_theta == 5e6 and big.tie_embeddings and not big.sliding_window


@pytest.mark.parametrize(
    "change, message",
    [
        (
            dict(layer_types=["chunked_attention", "full_attention", "full_attention", "full_attention"]),
            "'chunked_attention', which megakit does not implement",
        ),
        (dict(no_rope_layers=[1, 0, 1]), "give a 1 (RoPE) or 0 (none) per block"),
        (dict(no_rope_layers=[1, 2, 1, 1]), "give a 1 (RoPE) or 0 (none) per block"),
        (dict(layer_types=["sliding_attention"] * 4, sliding_window=8), "but use_sliding_window false"),
        (dict(hidden_act="gelu"), "uses activation 'gelu'"),
        (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}), "per layer type"),
    ],
)
def test_what_megakit_does_not_implement_is_refused_in_one_line(change, message):
    with pytest.raises(UsageError, match=re.escape(message)) as error:
        ModelConfig.from_hf({"model_type": "smollm3", **FIELDS, **change})
    assert "\n" not in str(error.value)


def test_nope_layers_outside_smollm3_are_refused():
    with pytest.raises(UsageError, match="cannot be written as a transformers llama config"):
        ModelConfig.load("llama-tiny").replace(nope_layers=(1,)).to_hf()
    with pytest.raises(UsageError, match="needs the llama family"):
        ModelConfig.load("gpt-tiny").replace(nope_layers=(1,))
    with pytest.raises(UsageError, match="outside blocks 0..3"):
        ModelConfig.load("smollm3-tiny").replace(nope_layers=(4,))


def _cp_tp_cases(rank, world_size):
    """smollm3-tiny (block 3 NoPE) on 4 ranks against one process: the ring at CP 2 (RoPE at the rank's global
    positions, none in block 3), TP 2 with SP, CP 2 x TP 2 with SP, and Ulysses at CP 4 and under TP 2."""
    from megakit.core.layout import Layout
    from megakit.nn.topology import Topology

    cp2dp2, tp2dp2 = Topology(Layout(cp=2, dp=2)), Topology(Layout(tp=2, dp=2))
    cp2tp2, cp4 = Topology(Layout(tp=2, cp=2)), Topology(Layout(cp=4))
    return [
        _equivalence(cp2dp2, "smollm3-tiny", seq=64),
        _equivalence(tp2dp2, "smollm3-tiny", sequence_parallel=True),
        _equivalence(cp2tp2, "smollm3-tiny", sequence_parallel=True),
        _equivalence(cp4, "smollm3-tiny", cp_mode="a2a"),
        _equivalence(cp2tp2, "smollm3-tiny", cp_mode="a2a", sequence_parallel=True),
    ]


PP_CASES = [
    ("smollm3-tiny", 1, 2, "1f1b", 1, None, "async"),  # blocks 0-1 | 2-3: the NoPE block on stage 2
    ("smollm3-tiny+sp", 2, 2, "1f1b", 1, None, "batched"),
]


def test_smollm3_under_cp_tp_and_pp_matches_one_process():
    cp_tp, pp = run_many([(_cp_tp_cases, ()), (_equivalence_worker, (PP_CASES,))], 4, timeout_s=400)
    assert len(cp_tp[0]) == 5  # each case asserted logits, loss and every gradient on every rank
    for rank_results in pp:
        for r in rank_results:
            assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5 and r["weight_err"] < 1e-5, r
