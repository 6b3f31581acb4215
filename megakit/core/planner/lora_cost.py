"""What LoRA (``megakit.core.lora.LoraSpec``) changes in a plan: the adapters' shapes on one TP rank, their
parameters, the activations they keep and their FLOPs.

megakit's adapters sit on the TP linears (``megakit.nn.tensor_parallel.lora``): on a column-parallel layer ``A``
``(r, in)`` whole and ``B`` ``(out/tp, r)``; on a row-parallel one ``A`` ``(r, in/tp)`` and ``B`` ``(out, r)``
whole; on MoE's shared experts (replicated over TP in megakit) both whole. So each adapter on a ``k x n`` GEMM of
the rank (``k``, ``n`` as the rank runs it) has ``r (k + n)`` parameters and costs ``2 r (k + n)`` FLOPs a token
forward, twice that backward (input and weight gradients). The output head, the embedding, the norms and the routed
experts get none (``megakit.nn.lora.NOT_ADAPTED``; routed experts are refused).

What an adapter keeps for backward, per micro-batch: its rank-``r`` intermediate ``A x`` (``B``'s input, p bytes an
element) and, with dropout, its dropped input and the mask; under SP the column-parallel layers' adapters keep their
all-gathered input, once for q, k and v and once for gate and up (the frozen base keeps nothing: its weight needs no
gradient; megakit's full fine-tune keeps the shard and gathers it again, counted in ``activations``). Without
dropout or SP the input ``A`` keeps is the tensor a full fine-tune's weight gradient keeps, so the block's other
saved tensors are counted as before (``activations``), less the norms' normalised copies that only their frozen
weights' gradients would want (``memory._Stage.saved``).
Pure Python: no torch.
"""

from __future__ import annotations

from megakit.core.lora import LoraSpec
from megakit.core.planner.activations import PRECISIONS
from megakit.core.planner.model_spec import ModelSpec

SHARED_INPUT = {
    "q_proj": "attention",
    "k_proj": "attention",
    "v_proj": "attention",
    "gate_proj": "mlp",
    "up_proj": "mlp",
}


def block_linears(model: ModelSpec, tp: int, *, moe: bool = False, sequence_parallel: bool = False) -> list:
    """``(name, kind, rows, k, n)`` of the adaptable linears of one dense or MoE block on one TP rank, in execution
    order: ``kind`` column, row or replicated; ``rows`` the share of the rank's tokens the GEMM runs over."""
    h = model.hidden
    mla = model.config.mla
    if mla:  # the up-projections and o_proj are TP linears; the down-projections (plain linears) get no adapter
        proj = mla.projections(h, model.heads, tp, sequence_parallel=sequence_parallel)
        attention = [
            (name, "row" if name == "o_proj" else "column", rows, k, n)
            for name, rows, k, n in proj
            if name in ("q_proj", "q_b_proj", "kv_b_proj", "o_proj")
        ]
    else:
        q, kv = model.heads // tp * model.head_dim, model.kv_heads_per_rank(tp) * model.head_dim
        attention = [
            ("q_proj", "column", 1.0, h, q),
            ("k_proj", "column", 1.0, h, kv),
            ("v_proj", "column", 1.0, h, kv),
            ("o_proj", "row", 1.0, q, h),
        ]
    if moe:  # the shared experts, whole on every TP rank (megakit.nn.moe.layer.SharedExpert)
        f = model.moe.shared_ffn if model.moe is not None else 0
        kinds, f_in, f_out = ("replicated",) * 3, f, f
    else:
        f = model.ffn // tp
        kinds, f_in, f_out = ("column", "column", "row"), f, f
    if f == 0:
        return attention
    mlp = [
        ("gate_proj", kinds[0], 1.0, h, f_out),
        ("up_proj", kinds[1], 1.0, h, f_out),
        ("down_proj", kinds[2], 1.0, f_in, h),
    ]
    return attention + (mlp if model.gated_mlp else mlp[1:])


def adapted(model: ModelSpec, spec: LoraSpec, tp: int, *, moe: bool = False, sequence_parallel: bool = False) -> list:
    """``block_linears`` that ``spec``'s targets name (a target no block has is a ``UsageError`` listing those it
    has, as the trainer's)."""
    names = [x[0] for x in block_linears(model, 1)]
    if model.moe is not None:
        names += [x[0] for x in block_linears(model, 1, moe=True)]
    targets = set(spec.resolve(names))
    return [x for x in block_linears(model, tp, moe=moe, sequence_parallel=sequence_parallel) if x[0] in targets]


def block_params(model: ModelSpec, spec: LoraSpec, tp: int, *, moe: bool = False) -> float:
    """The adapters' parameters of one block on one TP rank: ``r (k + n)`` each (``+ n`` with DoRA's magnitudes)."""
    return sum(spec.params(k, n) for _, _, _, k, n in adapted(model, spec, tp, moe=moe))


def block_activations(
    model: ModelSpec,
    spec: LoraSpec,
    *,
    tp: int,
    moe: bool,
    tokens: float,
    precision: str,
    sequence_parallel: bool,
) -> float:
    """Bytes one block's adapters keep for backward, one micro-batch of ``tokens`` (this rank's, before the SP
    split): the rank-``r`` intermediates, the dropped inputs and masks, and under SP the column layers' gathered
    inputs."""
    p = PRECISIONS[precision]
    total, gathered = 0.0, set()
    for name, kind, rows, k, _ in adapted(model, spec, tp, moe=moe, sequence_parallel=sequence_parallel):
        m = rows * tokens
        total += p * m * spec.rank
        if spec.dropout:
            total += m * k * (p + 1)  # the dropped copy of the input and its mask (bool)
        elif sequence_parallel and tp > 1 and kind == "column" and SHARED_INPUT.get(name, name) not in gathered:
            gathered.add(SHARED_INPUT.get(name, name))  # q, k and v (gate and up) adapt one gathered input
            total += p * m * k * (1 - 1 / tp)  # the gathered input, where a full fine-tune keeps its shard
    return total


def block_flops(model: ModelSpec, spec: LoraSpec, *, tp: int, moe: bool, tokens: float) -> float:
    """Forward FLOPs of one block's adapters on one TP rank over ``tokens``: ``2 m r (k + n)`` each."""
    return sum(2 * rows * tokens * spec.rank * (k + n) for _, _, rows, k, n in adapted(model, spec, tp, moe=moe))


def model_params(model: ModelSpec, spec: LoraSpec) -> float:
    """The whole model's adapter parameters (TP 1), what ``megakit convert --to-hf`` exports."""
    c = model.config
    return c.moe_layers * block_params(model, spec, 1, moe=True) + (c.layers - c.moe_layers) * block_params(
        model, spec, 1
    )
