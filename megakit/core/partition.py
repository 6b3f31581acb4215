"""Split a transformer's layers into contiguous pipeline stages of balanced cost.

With interleaving (``vpp`` > 1) there are ``pp * vpp`` virtual stages and chunk ``c`` of PP rank
``s`` is virtual stage ``c * pp + s`` (the order interleaved 1F1B runs them in). The layers need
not divide evenly: like Megatron's ``--decoder-first/last-pipeline-num-layers``, any virtual stage
may hold fewer blocks, and a user may pin the whole split (``--stage-layers 3,2,2,3``).
The first virtual stage also holds the token (and position) embedding and the last
one the final norm and LM head, so their cost counts there: with a large vocabulary
the end stages get fewer blocks. Where the virtual stages outnumber the blocks (by one
or two) an end holds none: only the embedding, or only the final norm, head and loss, as
Megatron's pipeline layouts place them (``"E|(t|)*94,L"``; its ``account_for_embedding_in_pipeline_split``
and ``account_for_loss_in_pipeline_split``): 94 blocks fill PP 32 x VPP 3 = 96 virtual stages.
Costs are parameters (memory balance, DeepSpeed's ``partition_method="parameters"``; an MoE model's dense
blocks weigh as their time does, ``_dense_block_weight``) or
forward FLOPs per token (time balance, where the LM head's 2·V·h matters and the embedding
lookup costs nothing). The split that minimises the most expensive stage is found exactly by
dynamic programming, and among those the most even one (least sum of squared stage costs).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from megakit.errors import UsageError

METHODS = ("params", "flops")


def layer_costs(
    config, method: str = "params", *, seq_len: int | None = None, mtp: int = 0
) -> tuple[list[float], float, float]:
    """``(per block, embedding, head)`` cost of a ``ModelConfig`` (its own counts: ``block_params``,
    ``embedding_params``, ``head_params``; ``block_flops`` in the weight-matrices convention). ``mtp``: the
    Multi-Token Prediction modules trained (``ModelConfig.mtp_depth``), which sit with the head on the last stage."""
    if method not in METHODS:
        raise UsageError(
            f"unknown partition method {method!r}; use one of {', '.join(METHODS)} or a list of layer counts"
        )
    kinds = [config.is_moe_layer(i) for i in range(config.layers)]  # an MoE model's dense blocks cost less
    if method == "params":
        cost = {moe: config.block_params(moe=moe).total for moe in set(kinds)}
        if len(cost) == 2:  # dense blocks beside MoE ones weigh as their time says (_dense_block_weight)
            cost[False] = _dense_block_weight(config, cost[True])
        embedding = config.embedding_params()
        head = config.head_params(separate=True)  # a copy of the embedding when tied, plus the final norm
    else:  # forward FLOPs per token: 2 per multiply-add; attention scores and values 2·2·s·q
        cost = {
            moe: config.block_flops(seq_len or config.max_seq_len, convention="matmul", moe=moe)[0]
            for moe in set(kinds)
        }
        embedding = 0.0
        head = config.head_flops()
    head += sum(_mtp_cost(config, method, k, seq_len) for k in range(1, mtp + 1))
    if config.linear is not None or config.layer_pattern:  # a hybrid: each block weighs as its own mixer and MLP
        return _hybrid_costs(config, method, cost, kinds, seq_len), float(embedding), float(head)
    return [float(cost[k]) for k in kinds], float(embedding), float(head)


def _hybrid_costs(config, method: str, cost: dict, kinds: list[bool], seq_len: int | None) -> list[float]:
    """A hybrid's blocks (Qwen3-Next's Gated DeltaNet and attention, Nemotron-H's Mamba-2, attention and MLP) each at
    its own cost, not its kind's mean: by FLOPs its own; by parameters its own, scaled as its kind is
    (``_dense_block_weight``: by one where the blocks are all dense or all MoE), so the kind's total stays."""
    if method == "flops":
        return [config.own_block_flops(i, seq_len or config.max_seq_len) for i in range(config.layers)]
    own = [config.own_block_params(i).total for i in range(config.layers)]
    return [cost[k] / config.block_params(moe=k).total * own[i] for i, k in enumerate(kinds)]


def _dense_block_weight(config, moe_block: float) -> float:
    """A dense block's weight in the parameter balance of a model that also has MoE blocks: an MoE block's
    parameters times the dense block's forward FLOPs over the MoE block's (at ``max_seq_len``: the trainer's and the
    planner's split agree without a sequence length).

    By parameters a dense block weighs ~1/20 of DeepSeek-V3's MoE block (256 experts), so its three dense blocks
    and an MoE one would share the first virtual stage, which holds the most micro-batches in flight (1F1B and
    interleaved): 4 blocks' activations there, 2 elsewhere. But expert parallelism shards the experts' parameters
    (E/EP per GPU) while a block's activations and time follow its active width, where DeepSeek-V3's dense FFN
    (18432) equals its nine experts' (9 x 2048). Weighed by time, as Megatron's uniform layout splits, the split is
    the published one, ``Et|(tt|)*30mL`` (``--stage-layers 1,2*30,0`` at PP 8 x VPP 4)."""
    flops = {moe: config.block_flops(config.max_seq_len, convention="matmul", moe=moe)[0] for moe in (True, False)}
    return moe_block * flops[False] / flops[True]


def _mtp_cost(config, method: str, depth: int, seq_len: int | None) -> float:
    """MTP module ``depth``'s cost on the last stage: its block, ``eh_proj`` and norms, and either (params) the
    embedding copy that stage keeps unless the head already is one (tied), or (flops) one more head product."""
    module = config.mtp_module_params(depth)
    if method == "params":
        return module.total + (config.embedding_params() if depth == 1 and not config.tie_embeddings else 0)
    block, _ = config.block_flops(
        seq_len or config.max_seq_len, convention="matmul", moe=config.is_moe_layer(config.layers + depth - 1)
    )
    return block + 2 * 2 * config.hidden**2 + config.head_flops()


def parse_stage_layers(text: str | None) -> tuple[int, ...] | None:
    """``"3,2,2,3"`` -> ``(3, 2, 2, 3)``, ``"0,1*94,0"`` -> ``(0, 1, ..., 1, 0)`` (``N*K``: K stages of N blocks;
    None stays None): what ``--stage-layers`` gives."""
    if text is None:
        return None
    counts = []
    try:
        for part in str(text).split(","):
            count, star, repeat = part.partition("*")
            times = int(repeat) if star else 1  # "2*" (no repeat) is refused with the rest
            if times < 1:
                raise ValueError(part)
            counts += [int(count)] * times
    except ValueError:
        raise UsageError(
            f"--stage-layers {text!r} is not a list of layer counts; write one integer per virtual "
            "stage, comma-separated, N*K for K stages of N, e.g. --stage-layers 3,2,2,3 or 0,1*94,0"
        ) from None
    return tuple(counts)


def check_stage_layers(counts, *, layers: int, pp: int, vpp: int = 1) -> tuple[int, ...]:
    """The pinned split ``counts`` (layers per virtual stage), refused unless it has ``pp * vpp``
    entries summing to ``layers``, each at least 1 except the first and the last: those may hold only the
    embedding or only the head, as Megatron's pipeline layouts and the Zero Bubble runs place them."""
    counts, stages = tuple(counts), pp * vpp
    shown = ",".join(map(str, counts))
    if len(counts) != stages:
        raise UsageError(
            f"--stage-layers {shown} gives {len(counts)} layer counts for --pp {pp} x --vpp {vpp} = "
            f"{stages} virtual stages; give one per virtual stage (chunk c of stage s is virtual stage "
            f"c x PP + s)"
        )
    ends = {0, stages - 1} if stages > 1 else set()  # the embedding's and the head's virtual stages
    if any(not isinstance(c, int) or c < (0 if i in ends else 1) for i, c in enumerate(counts)):
        raise UsageError(
            f"--stage-layers {shown} has an entry below 1 in the middle or below 0; every virtual stage "
            "but the first and the last (which hold the embedding and the head) needs at least one layer "
            "(lower --pp or --vpp for fewer stages)"
        )
    if sum(counts) != layers:
        raise UsageError(
            f"--stage-layers {shown} sums to {sum(counts)} layers but the model has {layers}; make the "
            f"counts add up to {layers}"
        )
    return counts


def max_virtual_stages(layers: int) -> int:
    """The most virtual stages ``layers`` blocks fill: one each, plus an embedding-only first and a loss-only last."""
    return layers + 2


def _balanced_counts(block: list[float], embedding: float, head: float, stages: int) -> list[int]:
    n = len(block)
    # blocks each virtual stage needs at least: one, but the ends none where the stages outnumber the blocks
    least = [0 if n < stages and k in (0, stages - 1) else 1 for k in range(stages)]
    lo = [sum(least[:k]) for k in range(stages + 1)]  # the fewest blocks the first k stages hold
    prefix = [0.0]
    for w in block:
        prefix.append(prefix[-1] + w)

    def cost(k: int, i: int, j: int) -> float:  # stage k holds blocks [i, j)
        return prefix[j] - prefix[i] + (embedding if k == 0 else 0.0) + (head if k == stages - 1 else 0.0)

    def solve(combine, limit):
        """DP over (stages used, blocks used); ``combine(prefix_value, stage_cost)``; stages costing more
        than ``limit`` are skipped: the first ``i`` worth trying is found by bisection (costs only fall
        as ``i`` grows), which makes the DP ~n² instead of ~stages·n² (the planner calls it often)."""
        best = [[None] * (n + 1) for _ in range(stages + 1)]
        cut = [[0] * (n + 1) for _ in range(stages + 1)]
        best[0][0] = 0.0
        for k in range(1, stages + 1):
            extra = (embedding if k == 1 else 0.0) + (head if k == stages else 0.0)
            for j in range(lo[k], n - (lo[stages] - lo[k]) + 1):
                start = max(lo[k - 1], bisect.bisect_left(prefix, prefix[j] + extra - limit, 0, j))
                while start > lo[k - 1] and cost(k - 1, start - 1, j) <= limit:  # bisect's float slack
                    start -= 1
                for i in range(start, j - least[k - 1] + 1):
                    c = cost(k - 1, i, j)
                    if best[k - 1][i] is None or c > limit:
                        continue
                    value = combine(best[k - 1][i], c)
                    if best[k][j] is None or value < best[k][j] - 1e-9 * abs(value):
                        best[k][j], cut[k][j] = value, i
        return best[stages][n], cut

    # An upper bound on the optimum (the most even split's slowest stage), with slack far above the DP's
    # 1e-9 tie tolerance, so the pruning never changes which split wins.
    even = [n // stages + (1 if k < n % stages else 0) for k in range(stages)]
    edges = [sum(even[:k]) for k in range(stages + 1)]
    upper = max(cost(k, edges[k], edges[k + 1]) for k in range(stages)) * (1 + 1e-6) + 1e-12
    if n < stages:  # that split has empty stages in the middle: no bound (one or a few splits exist)
        upper = float("inf")
    # the smallest possible slowest stage; then, among splits that reach it, the most even one
    bound, _ = solve(max, upper)
    _, cut = solve(lambda total, c: total + c * c, bound * (1 + 1e-9))
    counts, j = [], n
    for k in range(stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def partition_layers(
    config, pp: int, vpp: int = 1, method="params", *, seq_len: int | None = None, mtp: int = 0
) -> list[range]:
    """The global layer indices of each virtual stage (``pp * vpp`` ranges, in pipeline order).

    ``method`` is "params", "flops", or a list of layer counts per virtual stage (``check_stage_layers``).
    Virtual stage ``c * pp + r`` is chunk ``c`` of PP rank ``r``. ``mtp``: the MTP modules trained, which weigh
    on the last virtual stage (``layer_costs``), so it gets fewer blocks. Up to two more virtual stages than
    layers: the balanced split leaves the ends without a block (embedding only, loss only) as its costs say.
    """
    stages = pp * vpp
    if not isinstance(pp, int) or not isinstance(vpp, int) or pp < 1 or vpp < 1:
        raise UsageError(f"--pp and --vpp must be positive integers, got {pp!r} and {vpp!r}")
    if stages > max_virtual_stages(config.layers) and isinstance(method, str):  # a pinned split: check_stage_layers
        raise UsageError(
            f"{config.layers} layers cannot fill --pp {pp} x --vpp {vpp} = {stages} virtual stages, even "
            "with an embedding-only first and a loss-only last one; lower --pp/--vpp to at most "
            f"{max_virtual_stages(config.layers)} virtual stages in all"
        )
    if isinstance(method, str):
        block, embedding, head = layer_costs(config, method, seq_len=seq_len, mtp=mtp)
        counts: Sequence[int] = _balanced_counts(block, embedding, head, stages)
    else:
        counts = check_stage_layers(method, layers=config.layers, pp=pp, vpp=vpp)
    ranges, start = [], 0
    for count in counts:
        ranges.append(range(start, start + count))
        start += count
    return ranges
