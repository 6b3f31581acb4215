"""DeepSeek-V3 (``DeepseekV3ForCausalLM``): Multi-head Latent Attention on the DeepSeek MoE block, in fp32.

A tiny config (hidden 64, 4 heads, ``q_lora_rank`` 24, ``kv_lora_rank`` 16, nope 16, rope 8, v 16, one dense
layer, 4 experts top-2 in 2 groups with a shared expert, YaRN factor 40) against transformers' eager model: with
``q_lora_rank`` none, ``rope_interleave`` true and false, and an mscale pair (0.707, 1.0) that makes the cos/sin
factor differ from 1; the positions from 16 on are checked apart, since a wrong softmax scale still matches at
position 0 (onnxruntime's mobius #548). At TP 2, without and with SP, the gradients of the replicated part --
``q_a_proj``, both latent norms, and ``kv_a_proj_with_mqa``'s latent rows and its RoPE rows apart (the RoPE rows
are the ones Megatron-LM#1699 left partial) -- equal one process's and are identical on both ranks.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_reference import converted_logits, draw_deepseek, eager, megakit_copy  # noqa: E402
from multiproc import run_ranks  # noqa: E402

from megakit.core.model_config import ModelConfig  # noqa: E402
from megakit.interop.hf import from_hf_state_dict  # noqa: E402
from megakit.nn.model import Transformer, load_full_state_dict  # noqa: E402

TOL = 1e-5


def hf_deepseek(**changes):
    """The tiny DeepSeek-V3 of ``models/deepseek-v3-tiny.json`` (vocab 128), its norms and expert bias drawn."""
    fields = ModelConfig.load("deepseek-v3-tiny").to_hf() | {"vocab_size": 128} | changes
    config = transformers.DeepseekV3Config(**{k: v for k, v in fields.items() if k != "model_type"})
    return draw_deepseek(eager(transformers.DeepseekV3ForCausalLM, config))


@pytest.mark.parametrize("changes", [{}, {"q_lora_rank": None}, {"rope_interleave": False}])
@torch.no_grad()
def test_mla_logits_match_transformers_at_every_position(changes):
    hf = hf_deepseek(**changes)
    config = ModelConfig.from_hf(hf.config.to_dict(), source="deepseek-v3")
    assert ModelConfig.from_hf(config.to_hf()) == config
    assert config.attention_scale(0) == pytest.approx(hf.model.layers[0].self_attn.scaling, rel=1e-12)
    assert config.attention_scale(0) != config.head_dim**-0.5  # mscale(40, 1.0)^2 / sqrt(24)
    ids = torch.randint(0, 128, (2, 64), generator=torch.Generator().manual_seed(1))
    want = hf(ids).logits
    got = megakit_copy(config, hf)(ids)
    diff, late = (got - want).abs().max().item(), (got - want)[:, 16:].abs().max().item()
    print(f"deepseek-v3 {changes}: max |logit diff| {diff:.2e}, from position 16 {late:.2e}")
    assert diff < TOL and late < TOL
    state = from_hf_state_dict(config, hf.state_dict())
    mla = config.mla
    flipped = config.replace(mla=type(mla)(**{**mla.__dict__, "rope_interleave": not mla.rope_interleave}))
    for what, other in (
        ("the other RoPE pair layout", flipped),
        (
            "no softmax mscale",
            config.replace(
                rope_scaling=type(config.rope_scaling)(
                    "yarn", tuple(p for p in config.rope_scaling.params if p[0] != "mscale_all_dim")
                )
            ),
        ),
    ):
        model = Transformer(other).eval()
        load_full_state_dict(model, state)
        gap = (model(ids) - want)[:, 16:].abs().max().item()
        assert gap > 20 * max(diff, 1e-7), (what, gap)


def _replicated_grads(rank, world, sequence_parallel):
    import torch.distributed as dist

    from megakit.core.layout import Layout
    from megakit.nn.model import full_state_dict
    from megakit.nn.topology import Topology

    config = ModelConfig.load("deepseek-v3-tiny").replace(vocab_size=128)
    topo = Topology(Layout(tp=2))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    labels = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    ref, model = Transformer(config, seed=4), Transformer(config, topo, seed=4, sequence_parallel=sequence_parallel)
    ref(ids, labels).backward()
    model(ids, labels).backward()
    want = full_state_dict(ref, grads=True)
    rows = config.mla.kv_lora_rank
    out = []
    every = slice(None)
    for i in ("0", "1"):
        for label, name, part in (
            ("q_a_proj", "q_a_proj.weight", every),
            ("q_a_layernorm", "q_a_layernorm.weight", every),
            ("kv_a_layernorm", "kv_a_layernorm.weight", every),
            ("kv_a_proj_with_mqa latent rows", "kv_a_proj_with_mqa.weight", slice(0, rows)),
            ("kv_a_proj_with_mqa RoPE rows", "kv_a_proj_with_mqa.weight", slice(rows, None)),
        ):
            grad = model.get_parameter(f"layers.{i}.attn.{name}").grad[part].contiguous()
            full = want[f"layers.{i}.attn.{name}"][part]
            both = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(both, grad, group=topo.tp_group)
            out.append(
                (
                    f"layer {i} {label}",
                    (grad - full).abs().max().item(),
                    full.abs().max().item(),
                    torch.equal(both[0], both[1]),
                )
            )
    return out


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_the_replicated_part_gets_one_process_gradients_on_every_tp_rank(sequence_parallel):
    results = run_ranks(_replicated_grads, 2, sequence_parallel, timeout_s=300)
    for name, err, scale, same in results[0]:
        assert same, f"{name}: the TP ranks hold different gradients"
        assert err <= 1e-5 * scale + 1e-9, f"{name}: {err:.2e} off (scale {scale:.2e})"


def test_the_planner_counts_deepseek_v3_and_plans_it_on_1024_h100s_with_ep(capsys):
    """249.8 GFLOP per token at 4096 tokens (260.0 with its one MTP module): Megatron's formula with MLA's widths
    (``docs`` of ``model-notes`` section 1.5); 187.1M attention parameters a layer; kimi_k2 reads as DeepSeek-V3."""
    import json

    from megakit.commands import cli

    config = ModelConfig.load("deepseek-v3")
    assert round(config.causal_flops_per_token(4096) / 1e9, 1) == 249.8
    assert round(config.causal_flops_per_token(4096, mtp=True) / 1e9, 1) == 260.0
    assert round(config.mla.attention_params(7168, 128)[0] / 1e6, 1) == 187.1  # the matrices (the norms: 2048)
    assert round(config.num_params() / 1e9) == 671
    kimi = ModelConfig.from_hf({**config.to_hf(), "model_type": "kimi_k2"})
    assert kimi.mla == config.mla and kimi.moe == config.moe
    assert (
        cli.main(
            [
                "plan",
                "--model",
                "models/deepseek-v3.json",
                "--gpus",
                "1024",
                "--gpu",
                "h100-80gb",
                "--seq-len",
                "4096",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert plan["ep"] > 1 and plan["peak_memory_gib"] < 0.8 * 80, plan
    assert (
        round(plan["gflops_per_token"]["causal"], 1) == 249.8
        and round(plan["gflops_per_token"]["with_mtp"], 1) == 260.0
    )


def test_an_fp8_block_checkpoint_imports_to_the_logits_of_its_bf16_copy(tmp_path):
    """DeepSeek's released layout: each linear weight in FP8 (E4M3) with an fp32 ``weight_scale_inv`` per 128 x 128
    block, the expert bias in fp32, the rest bf16. The test quantises a tiny model itself (hidden 64 < 128: one block
    a matrix, the edges cut) and writes the bf16 copy from its own blockwise product; both directories convert with
    ``megakit convert --from-hf`` to the same logits, far from the unquantised model's."""
    hf = hf_deepseek(hidden_size=192, vocab_size=128)  # 192: two blocks along the hidden size, the second cut
    state = {
        k: v.to(torch.float32 if k.endswith("e_score_correction_bias") else torch.bfloat16).contiguous()
        for k, v in hf.state_dict().items()
    }
    packed, plain = dict(state), dict(state)
    for key in [k for k, v in state.items() if k.endswith("proj.weight") and v.dim() == 2 and "norm" not in k]:
        w = state[key].float()
        rows, cols = w.shape
        scale = torch.empty(-(-rows // 128), -(-cols // 128))
        for i in range(scale.shape[0]):
            for j in range(scale.shape[1]):
                block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
                scale[i, j] = block.abs().max().clamp(min=1e-12) / 448.0  # E4M3's largest value
        expanded = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        fp8 = (w / expanded).to(torch.float8_e4m3fn)
        packed[key], packed[key + "_scale_inv"] = fp8, scale
        plain[key] = (fp8.float() * expanded).to(torch.bfloat16)
    logits = {}
    config = ModelConfig.from_hf(hf.config.to_dict())
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(5))
    for name, tensors in (("fp8", packed), ("bf16", plain)):
        logits[name] = converted_logits(tmp_path / name, hf.config, tensors, config, ids)
    assert torch.equal(logits["fp8"], logits["bf16"])
    with torch.no_grad():
        unquantised = hf.to(torch.bfloat16)(ids).logits.float()
    assert (unquantised - logits["bf16"]).abs().max() > 1e-2
