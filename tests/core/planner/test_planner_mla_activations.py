"""The planner's activations for Multi-head Latent Attention (DeepSeek-V3), pinned against a hand derivation.

What ``megakit.nn.attention.latent`` keeps for backward, per token and layer, in bf16 (2 bytes; fp32 stats 4),
with h = 7168, q_lora_rank d_c' = 1536, kv_lora_rank d_c = 512, rope d_r = 64, nope d_n = 128, v d_v = 128,
n = 128 heads, so a query/key head is d_qk = 192 wide (``models/deepseek-v3.json``):

* the block's RMSNorm: its input h, the normalised input h and the fp32 rstd; its output h, the input both
  down-projections (``q_a_proj``, ``kv_a_proj_with_mqa``) keep;
* each latent's RMSNorm: its input (d_c', and for the KV latent d_c + d_r: a view of ``kv_a_proj_with_mqa``'s
  output, RoPE columns included), the normalised latent, the rstd; its up-projection keeps the normed latent;
* the heads: q and k at n·d_qk, v at n·d_v, the fp32 log-sum-exp (n), the output (``o_proj``'s input) at n·d_v.

Under TP the heads split; the latent path is replicated and only SP splits it, except the up-projections' inputs,
which ``ColumnParallelLinear`` all-gathers itself and keeps whole. The test in ``test_planner_activations`` measures
the same tensors on megakit's model (CPU, autograd's saved tensors).
"""

import dataclasses

import pytest

from megakit.core.planner.memory import activation_tensors, estimate_memory
from megakit.core.planner.model_spec import ModelSpec

DSV3 = ModelSpec.from_config("deepseek-v3")


def shaped(**changes) -> ModelSpec:
    """DeepSeek-V3 with ``changes`` to its ModelConfig."""
    return ModelSpec(config=DSV3.config.replace(**changes), name="deepseek-v3", seq_len=DSV3.seq_len)


PLAIN = shaped(mla=None)  # multi-head attention of DeepSeek-V3's 128 heads of 192


def attention_bytes(model, **kw) -> float:
    """Bytes per token the block keeps from its first norm to ``o_proj``'s input (no dropout in DeepSeek-V3)."""
    tensors = activation_tensors(model, **kw)
    end = next(i for i, x in enumerate(tensors) if x.name == "norm2 input")
    return sum(x.bytes(seq_len=1, micro_batch=1) for x in tensors[:end])


def test_deepseek_v3_mla_activations_by_hand_tp1():
    norm1 = 2 * 7168 + 2 * 7168 + 4  # input, normalised, rstd                     = 28676
    down_input = 2 * 7168  # the norm's output, read by q_a_proj and kv_a_proj_with_mqa = 14336
    q_latent = 2 * 1536 + 2 * 1536 + 4 + 2 * 1536  # norm input, normalised, rstd, q_b_proj's input = 9220
    kv_latent = 2 * (512 + 64) + 2 * 512 + 4 + 2 * 512  # norm input (RoPE columns too), normalised, rstd, kv_b's = 3204
    heads = 2 * 128 * 192 * 2 + 2 * 128 * 128 + 4 * 128 + 2 * 128 * 128  # q, k; v; lse; output = 164352
    assert norm1 + down_input + q_latent + kv_latent + heads == 219788
    assert attention_bytes(DSV3) == 219788  # 214.6 KiB


def test_deepseek_v3_mla_activations_by_hand_tp8_with_sp():
    norm1 = (2 * 7168 + 2 * 7168 + 4) / 8  # = 3584.5
    down_input = 2 * 7168 / 8  # = 1792
    q_latent = (2 * 1536 + 2 * 1536 + 4) / 8 + 2 * 1536  # q_b_proj keeps the gathered latent: = 3840.5
    kv_latent = (2 * (512 + 64) + 2 * 512 + 4) / 8 + 2 * 512  # kv_b_proj's too: = 1296.5
    heads = (2 * 128 * 192 * 2 + 2 * 128 * 128 + 4 * 128 + 2 * 128 * 128) / 8  # 16 heads a rank: = 20544
    assert norm1 + down_input + q_latent + kv_latent + heads == 31057.5
    assert attention_bytes(DSV3, tp=8, sequence_parallel=True) == 31057.5  # 30.3 KiB
    # Without SP the replicated latent path is whole on every rank: 9220 + 3204 of it
    assert attention_bytes(DSV3, tp=8) == 28676 + 14336 + 9220 + 3204 + 164352 / 8


def test_mla_is_not_counted_as_plain_attention():
    """The same shape as multi-head attention of d_qk = 192 wide q, k, v and output heads (what the planner counted
    before MLA had its own terms): no latents, and v and the output 192 wide."""
    plain = PLAIN
    assert attention_bytes(plain) == 28676 + 14336 + 4 * 2 * 128 * 192 + 4 * 128  # = 240132
    assert attention_bytes(DSV3) == 219788 != attention_bytes(plain)
    assert (
        attention_bytes(DSV3, tp=8, sequence_parallel=True)
        == 31057.5
        != attention_bytes(plain, tp=8, sequence_parallel=True)
    )  # 30016.5


def test_ring_context_parallelism_keeps_mla_values_at_their_own_width():
    """The ring carries V at d_v (``megakit.nn.attention.transport.pack``; the fused kernel's zero columns are local to
    each call): it keeps v and its (B, n, S, d_v) output, and ``o_proj`` a contiguous (B, S, n, d_v) copy. Before,
    v and the output were padded to d_qk: 285324 bytes a token. Ulysses' all-to-all runs SDPA, whose output the
    all-to-all back copies into ``o_proj``'s input: kept twice as well (measured by
    ``tests/train/test_memory_truth.py``: deepseek-v3-tiny at CP 2 a2a, 1.086 of the prediction without it, 1.042
    with it)."""
    ring_bytes = 219788 + 2 * 128 * 128  # the ring's output, apart from o_proj's copy
    assert ring_bytes == 252556
    assert attention_bytes(DSV3, ring=True) == ring_bytes
    assert attention_bytes(PLAIN, ring=True) == 240132  # same widths: nothing changes
    layout = dict(tp=8, cp=2, micro_batch=1, seq_len=8192, sequence_parallel=True, layers=1)
    ring, a2a = (estimate_memory(DSV3, cp_ring=r, **layout).activation_per_layer for r in (True, False))
    assert ring == a2a
    plain = estimate_memory(DSV3, **layout | dict(cp=1, seq_len=4096)).activation_per_layer
    assert ring - plain == 4096 * (ring_bytes - 219788) / 8  # this rank's 4096 tokens, 16 heads


def test_without_a_query_latent_q_proj_keeps_the_gathered_input_under_sp():
    """``q_lora_rank`` null: ``q_proj`` reads the block's normed input; under SP it all-gathers it itself and keeps
    the whole sequence's (h, not h/t); without SP it is the tensor the down-projection already keeps."""
    plain_q = shaped(mla=dataclasses.replace(DSV3.config.mla, q_lora_rank=0))
    assert attention_bytes(plain_q) == 219788 - 9220
    assert attention_bytes(plain_q, tp=8, sequence_parallel=True) == 31057.5 - 3840.5 + 2 * 7168


@pytest.mark.parametrize("recompute, kept", [("selective", 219788 - 512 + 59396), ("full", 2 * 7168)])
def test_recompute_keeps_mla_latents_with_the_heads_or_only_the_block_input(recompute, kept):
    """Selective recompute re-runs the attention core only: it keeps everything above but the log-sum-exp (512),
    and the MoE block's own: its norm 28676, the MLP input 14336 and the shared expert's gate, up, act(gate) and
    down input, 4 x 2 x 2048 (59396 in all); full keeps the block input, 2h."""
    est = estimate_memory(DSV3, micro_batch=1, seq_len=1, recompute=recompute, layers=1)
    assert est.activation_per_layer == kept
