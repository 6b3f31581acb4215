"""What one transformer block keeps for backward, tensor by tensor, and the LM head's share.

Activations per layer and micro-batch follow Korthikanti et al. 2022 (Table 2):
``sbh(34 + 5as/h)`` bytes in 16-bit with dropout, which ``activation_tensors`` lists tensor by
tensor so it also covers GQA, SwiGLU, fp32, no-dropout and fused (flash) attention, where the
``as²`` scores are never stored. TP shards the tensors inside attention and the MLP; sequence
parallelism shards the rest. An MoE block keeps, in place of the MLP's, its shared experts' and
``routing_tensors`` (the router's logits and scores, the top-k indices and probabilities, the aux-loss
terms, the dispatch's permutation and permuted tokens -- ``dispatch_buffers``, the one place that prices
the dispatch -- and the top-k copies of its tokens through the experts), each as megakit's code keeps it
(``tests/train/test_memory_truth.py`` measures every family against it). Multi-head Latent Attention
(DeepSeek-V3) keeps its latents (``latent_tensors``) and heads of its own widths (``value_widths``).
``memory`` multiplies these by the blocks and micro-batches in flight.
"""

from __future__ import annotations

import dataclasses

from megakit.core.planner import mamba
from megakit.core.planner.model_spec import ModelSpec
from megakit.errors import UsageError

PRECISIONS = {"bf16": 2, "fp16": 2, "fp32": 4}
# torchtitan's per-op selective checkpointing keeps the outputs of every other matmul (q, v, gate/fc1, and
# the down projection's, the size of the block input), flash attention's output and log-sum-exp, and the
# block input; everything else is recomputed (torchtitan/models/llama/parallelize_llama.py, _save_list).
PER_OP_KEPT = ("q", "v", "attention log-sum-exp", "attention output (proj input)", "gate output", "gelu input")


@dataclasses.dataclass(frozen=True)
class SavedTensor:
    """One tensor a transformer layer keeps for backward, per micro-batch.

    ``per_token`` elements for each of the s·b tokens, plus ``per_token_seq`` × s
    for the attention-score tensors (``as`` per token). ``shard``: 'tp' (split by
    tensor parallelism), 'sp' (split only with sequence parallelism), 'none'."""

    name: str
    per_token: float
    per_token_seq: float
    bytes_per_element: int
    shard: str

    def bytes(self, *, seq_len: int, micro_batch: int) -> float:
        """Bytes this tensor takes for one micro-batch of ``seq_len`` tokens, before any sharding."""
        return seq_len * micro_batch * (self.per_token + self.per_token_seq * seq_len) * self.bytes_per_element


def activation_tensors(
    model: ModelSpec,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "bf16",
    flash_attention: bool = True,
    dropout: bool | None = None,
    dropout_mask_bytes: int = 1,
    gathered_inputs: bool = False,
    moe: bool = False,
    fused_swiglu: bool = False,
    ring: bool = False,
    cp: bool = False,
) -> list[SavedTensor]:
    """The tensors one transformer block saves for backward, sizes already divided by TP/SP
    (``moe``: an MoE block's, whose MLP is its shared experts, if any; ``routing_tensors`` adds the rest).

    Dropout masks are 1 byte per element (megakit's dropout keeps a bool mask on every
    device). Flash attention saves q, k, v, the output and an fp32 log-sum-exp per head
    and token instead of the s×s scores (PyTorch's CPU kernel too, when dropout is off);
    written-out attention (SDPA's math path, megakit's with dropout) saves K and V
    repeated to every query head under GQA. A gated MLP keeps gate, up, act(gate) and the product (megakit's
    composite SwiGLU); with ``fused_swiglu`` (Megatron's ``bias_swiglu_impl``, megatron/core/fusions/
    fused_bias_swiglu.py) the activation saves only its input, fc1's gate and up, and recomputes the rest.
    ``ring``: the core is ring attention (context parallelism), which changes what MLA keeps (``value_widths``);
    ``cp``: context parallelism in any mode, whose core output ``o_proj`` keeps a copy of (``value_widths``).
    QK-norm (Qwen3, Gemma 3) keeps each head's norm of q and k as the block's norms keep theirs; Gemma 3's sandwich
    norms two more block norms."""
    p = PRECISIONS[precision]
    dropout = model.dropout > 0 if dropout is None else dropout
    h, hd = model.hidden, model.head_dim
    f = model.config.moe.shared_ffn if moe and model.config.moe and not model.config.layer_pattern else model.ffn
    heads = model.heads // tp
    kv = model.kv_heads_per_rank(tp) * hd
    rest = tp if sequence_parallel else 1  # the LayerNorm/dropout region: split only with SP

    def t(name, per_token, bytes_=p, shard="tp", per_seq=0.0):
        return SavedTensor(name, per_token, per_seq, bytes_, shard)

    def norm(which):
        """LayerNorm keeps its input and fp32 mean/rstd; RMSNorm (torch's composite) its input, the
        normalised input (for the weight's gradient) and the fp32 rstd."""
        if model.family == "gpt2":
            return [t(f"{which} input", h / rest, shard="sp"), t(f"{which} stats", 2 / rest, 4, "sp")]
        return [
            t(f"{which} input", h / rest, shard="sp"),
            t(f"{which} normalised", h / rest, shard="sp"),
            t(f"{which} stats", 1 / rest, 4, "sp"),
        ]

    kv = kv if flash_attention else heads * hd
    # With SP, Megatron-LM and megakit (``nn.tensor_parallel.overlapped_linear``) keep the column-parallel layers'
    # input split and all-gather it again in backward (Korthikanti et al.); torchtitan's layers keep the
    # all-gathered (S, B, H) (``gathered_inputs``).
    gathered = h if gathered_inputs else h / rest
    v, kernel_out, proj_in = value_widths(model, tp=tp, kv=kv, ring=ring, cp=cp)
    latents = (
        latent_tensors(
            model, tp=tp, sequence_parallel=sequence_parallel, precision=precision, gathered_inputs=gathered_inputs
        )
        if model.config.mla
        else []
    )
    out = norm("norm1") + [t("qkv input", gathered, shard="sp"), *latents, t("q", heads * hd), t("k", kv), t("v", v)]
    if model.config.qk_norm:  # per head, over the rank's heads: input, normalised, fp32 rstd (RoPE follows: q, k)
        kv_heads = model.kv_heads_per_rank(tp)
        out += [
            t("q norm input", heads * hd),
            t("q norm normalised", heads * hd),
            t("q norm stats", heads, 4),
            t("k norm input", kv_heads * hd),
            t("k norm normalised", kv_heads * hd),
            t("k norm stats", kv_heads, 4),
        ]
    if flash_attention:
        out.append(t("attention log-sum-exp", heads, 4))
    else:
        out.append(t("softmax output", 0, per_seq=heads))
        if dropout:
            out += [
                t("attention dropout mask", 0, dropout_mask_bytes, per_seq=heads),
                t("attention dropout output", 0, per_seq=heads),
            ]
    if kernel_out:
        out.append(t("ring attention output", kernel_out))
    out.append(t("attention output (proj input)", proj_in))
    if model.config.sandwich_norms:  # o_proj's output normed before the residual
        out += norm("attention post-norm")
    if dropout:
        out.append(t("attention residual dropout mask", h / rest, dropout_mask_bytes, "sp"))
    out += norm("norm2") + [t("mlp input", gathered, shard="sp")]
    out += _mlp_tensors(model, f=f, tp=tp, p=p, moe=moe, fused_swiglu=fused_swiglu)
    if model.config.sandwich_norms:
        out += norm("mlp post-norm")
    if dropout:
        out.append(t("mlp residual dropout mask", h / rest, dropout_mask_bytes, "sp"))
    if model.config.linear is not None:
        return _hybrid(out, model, tp=tp, bytes_per_element=p)
    return _mean_block(out, model, tp=tp, sp=sequence_parallel, precision=precision, fused_swiglu=fused_swiglu)


_ATTENTION_CORE = (
    "q",
    "k",
    "v",
    "q norm input",
    "q norm normalised",
    "q norm stats",
    "k norm input",
    "k norm normalised",
    "k norm stats",
    "attention log-sum-exp",
    "softmax output",
    "attention dropout mask",
    "attention dropout output",
    "ring attention output",
    "attention output (proj input)",
)


def _hybrid(out: list[SavedTensor], model: ModelSpec, *, tp: int, bytes_per_element: int) -> list[SavedTensor]:
    """A hybrid model's typical block (Qwen3-Next, Qwen3.5): attention's tensors in the share of blocks that run it,
    and in the others Gated DeltaNet's (``LinearAttentionConfig.activation_elements_per_token``, linear in the
    sequence: no ``s x s`` term), plus the fp32 recurrent state its chunked scan keeps at each chunk's start. Under
    CP the all-to-all gives a rank all tokens of ``1/cp`` of the heads: the same elements per rank."""
    linear = model.config.linear
    assert linear is not None, "a hybrid block of a model without linear attention"
    share = sum(linear.is_linear(i) for i in range(model.layers)) / model.layers
    kept = [
        dataclasses.replace(x, per_token=x.per_token * (1 - share), per_token_seq=x.per_token_seq * (1 - share))
        if x.name in _ATTENTION_CORE
        else x
        for x in out
    ]
    states = share * linear.state_elements() / (tp * linear.chunk)  # one d_k x d_v state per head and chunk
    return kept + [
        SavedTensor("linear attention mixer", share * linear.kept_elements_per_token(tp), 0, bytes_per_element, "tp"),
        SavedTensor("linear attention core", share * linear.core_elements_per_token(tp), 0, bytes_per_element, "tp"),
        SavedTensor("linear attention states", states, 0, 4, "tp"),
    ]


def _mean_block(
    block: list[SavedTensor], model: ModelSpec, *, tp: int, sp: bool, precision: str, fused_swiglu: bool
) -> list[SavedTensor]:
    """``block`` itself, or a hybrid's (Nemotron-H) mean block (``mamba.mean_tensors``), whichever kind the planner
    asks for (an 'E' block adds ``routing_tensors``): with Nemotron-3's 'E' blocks, their norm and MLP input as
    ``block``'s, then the shared expert's tensors at its own width."""
    moe, shared = model.config.moe, []
    if model.config.layer_pattern and moe is not None and moe.shared_ffn:
        start = next(i for i, x in enumerate(block) if x.name == "norm2 input")
        shared = [x for x in block[start:] if x.name.startswith("norm2") or x.name == "mlp input"]
        p = PRECISIONS[precision]
        shared += _mlp_tensors(model, f=moe.shared_ffn, tp=tp, p=p, moe=True, fused_swiglu=fused_swiglu)
    return mamba.mean_tensors(block, model, tp=tp, sequence_parallel=sp, precision=precision, experts=shared)


# What megakit's selective recompute frees of a hybrid's mixers (``nn.linear_attention``: the Gated DeltaNet and
# Mamba-2 cores run under a checkpoint, their inputs kept): the chunked scans' intermediates and the conv's output.
MIXER_CORES = (
    "linear attention core",
    "linear attention states",
    "conv output",
    "scan x, B, C (fp32)",
    "scan decays and scores (fp32)",
    "scan chunk states (fp32)",
)


def _mlp_tensors(model: ModelSpec, *, f: int, tp: int, p: int, moe: bool, fused_swiglu: bool) -> list[SavedTensor]:
    """What the MLP of FFN width ``f`` keeps past its input, TP-sharded (``activation_tensors``): a block's own
    tensors, apart so the MLP's kinds (GELU, SwiGLU, fused SwiGLU, a gated shared expert) read in one place."""

    def t(name, per_token):
        return SavedTensor(name, per_token, 0.0, p, "tp")

    if f == 0:
        out = []
    elif model.gated_mlp and fused_swiglu:
        out = [t("gate and up output", 2 * f / tp), t("down input", f / tp)]
    elif model.gated_mlp:
        out = [t("gate output", f / tp), t("up output", f / tp), t("act(gate)", f / tp), t("down input", f / tp)]
    else:
        out = [t("gelu input", f / tp), t("fc2 input", f / tp)]
    if moe and model.config.moe and f and model.config.moe.shared_gate:  # Qwen2-MoE: the shared output x
        # sigmoid(gate), over the rank's tokens
        out += [t("shared expert gate", 1 / tp), t("shared expert output", model.hidden / tp)]
    return out


SHARED_EXPERT = (
    "gate output",
    "up output",
    "act(gate)",
    "down input",
    "gate and up output",
    "gelu input",
    "fc2 input",
    "shared expert gate",
    "shared expert output",
)  # an MoE block's MLP tensors


def value_widths(
    model: ModelSpec, *, tp: int, kv: float, ring: bool = False, cp: bool = False
) -> tuple[float, float, float]:
    """Per token on one TP rank: (v, the attention kernel's saved output when ``o_proj`` keeps a copy apart, else 0,
    ``o_proj``'s input). ``kv``: the k width as saved (q/k/v heads of one width: v is the same).

    MLA's value heads are ``v_head_dim`` wide, its query and key heads ``qk_head_dim`` (``head_dim``;
    ``megakit.nn.attention.latent``). SDPA keeps v at ``v_head_dim`` and the output once: a fused kernel's, laid out
    (B, S, n, d) so that ``o_proj``'s input is a view of it, or (math path) ``o_proj``'s copy only. The ring carries v
    at its own width too (``megakit.nn.attention.transport.pack``; the fused kernel's zero columns are local to each
    call) and saves v and its (B, n, S, d_v) output, of which ``o_proj`` keeps a (B, S, n, d_v) copy of its own.
    Plain attention keeps its output twice under CP (``cp``): the ring's (B, n, S, d) output, or, under Ulysses, the
    kernel's before the all-to-all back, and ``o_proj``'s (S, B, n d) copy; with attention sinks (gpt-oss) the core
    is a ring of one (``Attention.core``), so likewise without CP."""
    heads, mla = model.heads // tp, model.config.mla
    if mla is None:
        twice = cp or model.config.attention_sinks
        return kv, heads * model.head_dim if twice else 0.0, heads * model.head_dim
    v = heads * mla.v_head_dim
    return v, v if ring or cp else 0.0, v


def latent_tensors(
    model: ModelSpec,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    precision: str = "bf16",
    gathered_inputs: bool = False,
) -> list[SavedTensor]:
    """What MLA keeps between the block's norm and its heads (``megakit.nn.attention.latent``): each latent's RMSNorm
    keeps its input, the normalised input and the fp32 rstd (torch's composite, as ``activation_tensors``' norms), and
    its up-projection keeps the normed latent.

    The down-projections and latent norms are replicated over TP and run on the rank's rows of the block input: all
    ``S`` tokens, or ``S/tp`` with SP (all again with ``gathered_inputs``: torchtitan gathers the block input). The
    up-projections (``ColumnParallelLinear``, which all-gathers its input itself under SP) keep the whole sequence's
    normed latent on every rank, with SP or without. The compressed KV is a view of ``kv_a_proj_with_mqa``'s output,
    so its norm's saved input holds the RoPE key's ``qk_rope_head_dim`` columns too. Without a query latent
    (``q_lora_rank`` 0), ``q_proj`` all-gathers the block input itself under SP and keeps it."""
    m, p = model.config.mla, PRECISIONS[precision]
    assert m is not None, "latent_tensors is for MLA models"
    rows = tp if sequence_parallel and not gathered_inputs else 1  # 1: every rank holds every token

    def latent(which: str, width: int, stored: int) -> list[SavedTensor]:
        return [
            SavedTensor(f"{which} latent (norm input)", stored / rows, 0.0, p, "sp"),
            SavedTensor(f"{which} latent normalised", width / rows, 0.0, p, "sp"),
            SavedTensor(f"{which} latent stats", 1 / rows, 0.0, 4, "sp"),
            SavedTensor(f"{which} latent normed (up-projection input)", width, 0.0, p, "none"),
        ]

    if m.q_lora_rank:
        q = latent("q", m.q_lora_rank, m.q_lora_rank)
    else:
        gathers = rows > 1  # else q_proj's input is the block's normed input, counted already ("qkv input")
        q = [SavedTensor("q_proj input (gathered)", model.hidden, 0.0, p, "none")] if gathers else []
    return q + latent("kv", m.kv_lora_rank, m.kv_lora_rank + m.qk_rope_head_dim)


def routing_tensors(
    model: ModelSpec,
    *,
    tp: int = 1,
    precision: str = "bf16",
    imbalance: float = 1.0,
    megatron: bool = False,
    ep: int = 1,
) -> list[SavedTensor]:
    """What an MoE block keeps for backward beyond attention and the shared experts, per token of the sequence: each
    TP rank routes 1/TP of the tokens (the split sequence parallelism makes). In ``ROUTING_GROUPS``' order:

    - the router (``megakit.nn.moe.layer``, ``router``; fp32 whatever the model's dtype): its input's fp32 copy below
      fp32, the logits (the z-loss's log-sum-exp keeps them) and the scores (the softmax's or sigmoid's output);
    - the top-k: the chosen experts' int64 indices (the gather's), their probabilities before the renormalisation
      and its sum (``normalize_top_k``), and the weights the combine multiplies by, in the model's dtype;
    - the aux-loss terms: the log-sum-exp per token (z-loss) and, with sigmoid scores, their per-token sum;
    - the dispatch (``dispatch_buffers``): the permutation and the permuted tokens;
    - the experts, top-k copies of every token: fc1's gate and up output, the SwiGLU's activation (gpt-oss's clamped
      one keeps three more) and fc2's input, and the expert outputs at home (the combine's input, for the gradient of
      the probabilities).

    The busiest rank holds ``imbalance`` times the balanced share of the expert side (a capacity factor caps it).
    ``megatron``: Megatron-Core's router and permutation as its estimator prices them (fp32 probabilities and an int64
    map, E per token: ModelZoo misc/tools/deepseek_mem_estimate.py); its grouped experts multiply the probabilities
    inside the fused SwiGLU (``weighted_bias_swiglu_impl`` in megatron/core/transformer/moe/experts.py), so its
    unpermute keeps no expert output and its activation only its input."""
    m = model.config.moe
    assert m is not None, "routing_tensors is for MoE models"
    p = PRECISIONS[precision]
    k = m.top_k * imbalance / tp
    top_k = m.top_k / tp  # at home: this rank's own tokens' slots
    if megatron:
        return [
            SavedTensor("router probabilities", m.experts / tp, 0.0, 4, "tp"),
            SavedTensor("permutation map", m.experts / tp, 0.0, 8, "tp"),
            SavedTensor("permuted tokens", k * model.hidden, 0.0, p, "tp"),
            SavedTensor("expert fc1 output", k * (m.matrices - 1) * m.ffn, 0.0, p, "tp"),
            SavedTensor("expert fc2 input", k * m.ffn, 0.0, p, "tp"),
        ]
    router = [
        *([SavedTensor("router input (fp32 copy)", model.hidden / tp, 0.0, 4, "tp")] if p < 4 else []),
        SavedTensor("router logits", m.experts / tp, 0.0, 4, "tp"),
        SavedTensor("router scores", m.experts / tp, 0.0, 4, "tp"),
    ]
    chosen = [
        SavedTensor("top-k indices", top_k, 0.0, 8, "tp"),
        *(
            [
                SavedTensor("top-k probabilities (before renormalising)", top_k, 0.0, 4, "tp"),
                SavedTensor("top-k probability sums", 1 / tp, 0.0, 4, "tp"),
            ]
            if m.normalize_top_k
            else []
        ),
        SavedTensor("top-k weights (combine)", top_k, 0.0, p, "tp"),
    ]
    aux = [
        SavedTensor("z-loss log-sum-exp", 1 / tp, 0.0, 4, "tp"),
        *([SavedTensor("sigmoid score sums", 1 / tp, 0.0, 4, "tp")] if m.score == "sigmoid" else []),
    ]
    saved, _ = dispatch_buffers(model, tp=tp, precision=precision, imbalance=imbalance, ep=ep)
    activation = 4 if m.swiglu_limit else 1  # gpt-oss: the clamped gate, (up + 1), its product, the sigmoid
    experts = [
        SavedTensor("expert fc1 output", k * (m.matrices - 1) * m.ffn, 0.0, p, "tp"),  # gate and up, or up
        SavedTensor("expert activation", k * activation * m.ffn, 0.0, p, "tp"),  # relu2: relu's output
        SavedTensor("expert fc2 input", k * m.ffn, 0.0, p, "tp"),
        SavedTensor("expert outputs", top_k * model.hidden, 0.0, p, "tp"),
    ]
    return router + chosen + aux + saved + experts


ROUTING_GROUPS = {  # how ``megakit plan`` shows ``routing_tensors``, one line each
    "router logits and scores": ("router input (fp32 copy)", "router logits", "router scores", "router probabilities"),
    "top-k indices and probabilities": (
        "top-k indices",
        "top-k probabilities (before renormalising)",
        "top-k probability sums",
        "top-k weights (combine)",
        "permutation map",
    ),
    "aux-loss terms": ("z-loss log-sum-exp", "sigmoid score sums"),
    "permutation and dispatch": ("dispatch order", "dispatch regroup order", "permuted tokens"),
    "routed experts": ("expert fc1 output", "expert activation", "expert fc2 input", "expert outputs"),
}


def dispatch_buffers(
    model: ModelSpec, *, tp: int, precision: str, imbalance: float, ep: int
) -> tuple[list[SavedTensor], list[SavedTensor]]:
    """(saved, transient) per token of one MoE block's token dispatch (``megakit.nn.moe.dispatch``), the one place
    that prices it. Saved: the sort by expert's order and its inverse (int64, k per token: the permutation's and the
    un-permutation's gathers keep their indices), at EP > 1 the received rows' regrouping and its inverse (per
    received row), and the permuted tokens (fc1's input, per row an expert computes: ``imbalance`` x k per token at
    EP > 1). Transient, at EP > 1: the all-to-all's send and receive buffers, k copies of the rank's tokens each way
    (the dispatch's while it runs, the combine's likewise)."""
    m, p = model.config.moe, PRECISIONS[precision]
    assert m is not None, "dispatch_buffers is for MoE models"
    k, rows = m.top_k / tp, m.top_k * (imbalance if ep > 1 else 1.0) / tp
    saved = [
        SavedTensor("dispatch order", 2 * k, 0.0, 8, "tp"),
        *([SavedTensor("dispatch regroup order", 2 * rows, 0.0, 8, "tp")] if ep > 1 else []),
        SavedTensor("permuted tokens", rows * model.hidden, 0.0, p, "tp"),
    ]
    transient = [SavedTensor("all-to-all send and receive", 2 * rows * model.hidden, 0.0, p, "tp")] if ep > 1 else []
    return saved, transient


def routed_imbalance(model: ModelSpec, imbalance: float, ep: int) -> float:
    """The expert-side load of the busiest rank over the balanced share: the routing regime's factor
    once experts are spread over ranks (one rank holding them all gets every token whatever the
    routing), capped by the capacity factor when one drops tokens."""
    if ep == 1:
        return 1.0
    cf = model.config.moe.capacity_factor if model.config.moe else None
    return min(imbalance, cf) if cf else imbalance


# The default ``--loss-chunks`` (0: this rule): one chunk per 256 MiB of a micro-batch's fp32 logits shard. Chunking
# keeps the GEMMs and FLOPs of the unchunked head (``nn.tensor_parallel.chunked_loss``), so its cost is only smaller
# GEMMs and two small all-reduces per chunk; below 256 MiB the logits are no memory worth saving (every CPU test, small
# models), above it they are (TinyLlama at seq 2048 x 4: 1 GiB -> 4 chunks; Llama-3-8B's 128k vocab at seq 8192: 16).
LOGITS_CHUNK_BYTES = 256 * 2**20


def auto_loss_chunks(tokens: int, vocab_shard: int) -> int:
    """The default chunk count for ``tokens`` per micro-batch and rank and a ``vocab_shard`` of V/tp columns."""
    return max(1, min(tokens, -(-tokens * vocab_shard * 4 // LOGITS_CHUNK_BYTES)))


def parse_loss_chunks(text: str | int | None) -> int:
    """``--loss-chunks``: ``auto`` (or None) is 0, the default rule; else a count of at least 1."""
    if text is None or str(text) == "auto":
        return 0
    try:
        chunks = int(text)
    except ValueError:
        chunks = 0
    if chunks < 1:
        raise UsageError(
            f"--loss-chunks {text}: give a count of at least 1 (1: the head and loss in one piece) or auto"
        )
    return chunks


def loss_chunks_of(model: ModelSpec, *, tp: int, tokens: int, loss_chunks: int) -> int:
    """``loss_chunks`` as the trainer runs it: 0 is ``auto_loss_chunks``."""
    if loss_chunks < 0:
        raise UsageError(f"--loss-chunks {loss_chunks}: give a count of at least 1 (1: no chunking), or 0 for auto")
    return loss_chunks or auto_loss_chunks(tokens, model.padded_vocab(tp) // tp)


def logits_bytes(
    model: ModelSpec,
    *,
    tp: int,
    sequence_parallel: bool,
    precision: str,
    seq_len: int,
    micro_batch: int,
    transient: bool = True,
    loss_chunks: int = 1,
) -> float:
    """The last stage's head for one micro-batch: saved are the final norm's input (+ stats), the
    head's input and the vocab-parallel cross-entropy's fp32 softmax (V/tp per token) and its
    per-token target bookkeeping; transient are the logits shard and, below fp32, their fp32 copy.
    With ``loss_chunks`` K > 1 (``megakit.nn.tensor_parallel.chunked_loss``; 0: ``auto_loss_chunks``): saved are the
    norm's input, the head input's gradient (in place of the input) and the head weight's gradient in
    fp32; transient are one chunk's logits and fp32 softmax."""
    p = PRECISIONS[precision]
    rest = tp if sequence_parallel else 1
    vocab_shard = model.padded_vocab(tp) // tp
    tokens = seq_len * micro_batch
    chunks = loss_chunks_of(model, tp=tp, tokens=tokens, loss_chunks=loss_chunks)
    # LayerNorm keeps its input and fp32 mean/rstd; RMSNorm its input, the normalised input and rstd
    norm = (p * model.hidden + 8) / rest if model.family == "gpt2" else (2 * p * model.hidden + 4) / rest
    if chunks > 1:
        extra = -(-tokens // chunks) * vocab_shard * (p + 4) if transient else 0
        return tokens * (norm + p * model.hidden) + 4 * vocab_shard * model.hidden + extra
    saved = norm + p * model.hidden + 4 * vocab_shard + 10
    extra = vocab_shard * (p + (4 if p < 4 else 0)) if transient else 0
    return tokens * (saved + extra)
