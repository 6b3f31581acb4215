"""FAQ 6's checks for a loss that will not go down, judged from the facts a real job gathered.

Each check returns a ``Verdict``: pass or fail, the numbers it judged, and on failure
what to change. The facts come from ``megakit.train.doctor.diagnostics`` (one JSON file);
``single_process`` adds what one process would have done with the same global batch
(``megakit.train.doctor.reference``), which checks 2 and 4 compare against.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

GRAD_RATIO_LIMIT = 2.0  # DP ranks' own gradient norms (median over steps) within this factor
STRAGGLER_LIMIT = 1.5  # slowest rank's busy time against the median
STRAGGLER_COST = 0.2  # ... and the others waiting at least this share of the step for it
LOSS_LIMIT = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # relative; fp32 differs by summation order only
OVERSCALED_LIMIT = 1.5  # peak LR above linear scaling by more than this
REFERENCE_MAX_PARAMS = 2e9  # the single-process run must fit this machine


@dataclass(frozen=True)
class Verdict:
    """One check's outcome: passed, failed or not judged, its numbers, and the fix when it failed."""

    name: str
    passed: bool | None  # None: not judged (say why in ``numbers``)
    numbers: str
    fix: str = ""  # what to change, when it failed

    def to_dict(self) -> dict:
        """The verdict as JSON for ``--json``."""
        return {"name": self.name, "passed": self.passed, "numbers": self.numbers, "fix": self.fix}


def _who(rank: dict) -> str:
    return f"rank {rank['rank']} (pp {rank['pp']}, dp {rank['dp']}, tp {rank['tp']})"


def grid(config: dict) -> str:
    """The job's parallel degrees, e.g. "TP 2 x PP 1 x DP 2", with CP when there is any."""
    cp = config.get("cp", 1)
    return f"TP {config['tp']}" + (f" x CP {cp}" if cp > 1 else "") + f" x PP {config['pp']} x DP {config['dp']}"


def _groups(ranks: list[dict], *keys: str) -> list[list[dict]]:
    """Ranks with equal ``keys`` coordinates, each group in rank order."""
    out: dict[tuple, list[dict]] = {}
    for r in ranks:
        out.setdefault(tuple(r[k] for k in keys), []).append(r)
    return list(out.values())


def _g(x: float) -> str:
    return f"{x:.4g}"


# -- 1. identical initial weights ------------------------------------------------------------------
def _differences(ranks: list[dict], which: str) -> list[str]:
    """Where ranks that should hold the same tensors do not: DP replicas of one (pp, tp) shard (every
    tensor), and the TP ranks of one (pp, dp) replica (the tensors TP does not split)."""
    found = []
    for group in _groups(ranks, "pp", "tp"):
        first = group[0]
        for r in group[1:]:
            bad = [n for n, h in first[which].items() if r[which].get(n) != h]
            if bad:
                found.append(f"{_who(r)} differs from DP rank {first['dp']} in {len(bad)}/{len(first[which])} tensors")
    for group in _groups(ranks, "pp", "dp"):
        first = group[0]
        shared = [n for n in first[which] if n not in set(first["tp_split"])]
        for r in group[1:]:
            bad = [n for n in shared if r[which].get(n) != first[which][n]]
            if bad:
                found.append(
                    f"{_who(r)} differs from TP rank {first['tp']} in {len(bad)} replicated tensors "
                    f"({', '.join(bad[:2])}{', ...' if len(bad) > 2 else ''})"
                )
    return found


def check_weights(facts: dict) -> Verdict:
    """Replicas hold the same weights after building and after training."""
    ranks = facts["ranks"]
    built = _differences(ranks, "built")
    trained = _differences(ranks, "weights") if ranks[0]["weights"] is not None else []
    seeds = sorted({r["seed"] for r in ranks})
    tensors = sum(len(r["built"]) for r in ranks)
    numbers = (
        f"{tensors} tensors hashed on {len(ranks)} ranks; seeds {', '.join(map(str, seeds))}; as each rank "
        f"built them: {'; '.join(built) or 'identical where they should be'}; after deepspeed.initialize: "
        + ("; ".join(trained) or "identical" if ranks[0]["weights"] is not None else "partitioned (ZeRO-3)")
    )
    if not built and not trained and len(seeds) == 1:
        return Verdict("identical initial weights", True, numbers)
    if len(seeds) > 1:
        odd = [f"rank {r['rank']} --seed {r['seed']}" for r in ranks if r["seed"] != ranks[0]["seed"]]
        fix = (
            f"start every rank with the same --seed ({', '.join(odd)}; rank 0 has {ranks[0]['seed']}): the weights, "
            "the data order and the dropout masks derive from it. DeepSpeed's broadcast at initialize copies DP "
            "rank 0's weights, but not its data order"
        )
    elif built and not trained:
        fix = (
            "ranks built different weights from one seed: make the initialisation a function of the seed alone "
            "(no unseeded generator); DeepSpeed's broadcast hid it for the DP replicas"
        )
    else:
        fix = (
            "ranks train from different weights: load the same checkpoint on every rank and make TP-replicated "
            "parameters (norms, biases) identical across the TP group"
        )
    return Verdict("identical initial weights", False, numbers, fix)


# -- 2. data balance and overlap -------------------------------------------------------------------
def check_data(facts: dict, expected: list[list[str]] | None = None) -> Verdict:
    """``expected``: per step, the hashes of the samples one process would train on (the seed's global batch)."""
    info = {r["rank"]: r for r in facts["ranks"]}
    problems, fixes = [], []
    replicas_disagree = imbalance = foreign = missing = 0
    seen: dict[str, set[int]] = {}  # sample hash -> the DP ranks that trained it
    token_counts = set()
    for index, step in enumerate(facts["steps"]):
        by_dp: dict[int, dict] = {}  # DP rank -> its first rank's row
        for row in step["ranks"]:
            first = by_dp.setdefault(info[row["rank"]]["dp"], row)
            replicas_disagree += first["samples"] != row["samples"]  # a TP/PP peer of the same replica
        tokens = {d: by_dp[d]["tokens"] for d in sorted(by_dp)}
        token_counts.update(tokens.values())
        if len(set(tokens.values())) > 1:
            imbalance += 1
            if imbalance == 1:
                problems.append(
                    f"tokens per DP rank at step {step['step']}: " + ", ".join(f"dp {d} {t}" for d, t in tokens.items())
                )
        for d, row in by_dp.items():
            for h in row["samples"]:
                seen.setdefault(h, set()).add(d)
        if expected is not None and index < len(expected):
            got = {h for row in by_dp.values() for h in row["samples"]}
            foreign += len(got - set(expected[index]))
            missing += len(set(expected[index]) - got)
    shared = [h for h, ranks in seen.items() if len(ranks) > 1]
    if imbalance:
        fixes.append(
            "give every DP rank micro_batch x accumulation samples per step (a sampler that drops the "
            "remainder, as DistributedSampler(drop_last=True) or megakit's TokenBatches do)"
        )
    if shared:
        pairs = sorted({tuple(sorted(seen[h])) for h in shared})
        problems.append(
            f"{len(shared)} samples trained by more than one DP rank (dp "
            + "; dp ".join(" and ".join(map(str, p)) for p in pairs)
            + ")"
        )
        fixes.append(
            "shard by the DP rank: DP rank d takes the d-th slice of each global batch "
            "(DistributedSampler(num_replicas=dp, rank=dp_rank)); a shard keyed by 0 or by the global rank "
            "repeats samples"
        )
    if foreign or missing:
        problems.append(f"{foreign} samples outside the seed's global batches trained, {missing} of theirs not")
        fixes.append("every rank must read the same data in the same order: the same --data and --seed everywhere")
    if replicas_disagree:
        problems.append(f"the TP/PP ranks of one DP replica read different samples ({replicas_disagree} times)")
        fixes.append(
            "the ranks of one DP replica (its TP and PP ranks) must read the same batch: key the shard by "
            "the DP rank, not the global rank"
        )
    counts = "/".join(str(t) for t in sorted(token_counts))
    numbers = f"{len(facts['steps'])} steps x {facts['config']['dp']} DP ranks, tokens per rank and step {counts}; " + (
        "; ".join(problems)
        if problems
        else "no sample on two DP ranks"
        + ("" if expected is None else "; each step trained exactly the seed's global batch")
    )
    return Verdict("data balance and no overlap", not problems, numbers, "; ".join(fixes))


# -- 3. gradient norms -----------------------------------------------------------------------------
def check_gradients(facts: dict) -> Verdict:
    """Every rank's gradients are finite and the DP replicas' norms agree."""
    info = {r["rank"]: r for r in facts["ranks"]}
    for step in facts["steps"]:
        bad = [row for row in step["ranks"] if not math.isfinite(row["local_grad_norm"])]
        if bad:
            good = [row for row in step["ranks"] if math.isfinite(row["local_grad_norm"])]
            where = ", ".join(_who(info[row["rank"]]) for row in bad)
            finite = ", ".join(f"rank {row['rank']} ({_g(row['local_grad_norm'])})" for row in good)
            others = f"; finite on {finite}" if good else ""
            numbers = (
                f"step {step['step']}: this rank's own gradients (before the DP reduction) non-finite on "
                f"{where}{others}" + ("; the DP all-reduce then spreads it to every rank" if good else "")
            )
            return Verdict(
                "finite, similar gradient norms",
                False,
                numbers,
                f"look at {where}: its data (a corrupt or extreme sample), its device (ECC errors, "
                "nvidia-smi -q), or an overflow (lower the LR, enable gradient_clipping, bf16 not fp16)",
            )
    medians = {}
    for rank in info:
        values = [row["local_grad_norm"] for step in facts["steps"] for row in step["ranks"] if row["rank"] == rank]
        medians[rank] = statistics.median(values) if values else float("nan")
    worst, where = 1.0, None
    for group in _groups(list(info.values()), "pp", "tp"):
        norms = [medians[r["rank"]] for r in group]
        if len(norms) > 1 and min(norms) > 0 and max(norms) / min(norms) > worst:
            worst, where = max(norms) / min(norms), group[norms.index(max(norms))]
    numbers = (
        "each rank's own gradient norm before the DP reduction, median over steps: "
        + ", ".join(f"rank {r} {_g(v)}" for r, v in medians.items())
        + f"; largest/smallest among DP replicas {worst:.2f} (limit {GRAD_RATIO_LIMIT:g})"
    )
    if worst <= GRAD_RATIO_LIMIT:
        return Verdict("finite, similar gradient norms", True, numbers)
    return Verdict(
        "finite, similar gradient norms",
        False,
        numbers,
        f"{_who(where)} has {worst:.1f}x the gradients of another replica: the DP ranks train on different "
        "data or weights (checks 1 and 2) or different micro-batch sizes",
    )


# -- 4. the distributed loss against one process ---------------------------------------------------
def job_losses(facts: dict) -> list[float]:
    """The job's loss per step: the mean over ranks of their own (DP-local, pipeline-broadcast) losses."""
    return [statistics.fmean(row["loss"] for row in step["ranks"]) for step in facts["steps"]]


def check_loss(facts: dict, reference: list[float] | None, *, why_not: str = "") -> Verdict:
    """The job's losses equal one process's on the same data, within the fp32 bound."""
    name = "loss against a single process"
    if reference is None:
        return Verdict(name, None, f"skipped: {why_not}")
    config = facts["config"]
    losses = job_losses(facts)
    finite = [i for i, x in enumerate(losses) if math.isfinite(x) and i < len(reference)]
    finite = finite[: next((k for k, i in enumerate(finite) if i != k), len(finite))]  # the leading finite steps
    if not finite:
        return Verdict(name, False, "no step with a finite loss to compare", "see the gradient check")
    gaps = [abs(losses[i] - reference[i]) / abs(reference[i]) for i in finite]
    limit = LOSS_LIMIT[config["precision"]]
    numbers = (
        f"steps 0-{finite[-1]}, distributed {' '.join(f'{losses[i]:.4f}' for i in finite)} vs one process "
        f"{' '.join(f'{reference[i]:.4f}' for i in finite)}; largest relative gap {max(gaps):.1e} at step "
        f"{gaps.index(max(gaps))} (limit {limit:g}, {config['precision']})"
    )
    if max(gaps) <= limit:
        return Verdict(name, True, numbers)
    lossy = [
        flag
        for flag, on in (
            (f"--compress {config['compress']}", config.get("compress", "none") != "none"),
            (f"--local-sgd {config['local_sgd']}", config.get("local_sgd")),
        )
        if on
    ]
    fix = (
        "the distributed job does not compute what one process computes on the same global batch: fix the checks "
        "above that failed (seeds, shards)"
    )
    if lossy:
        fix += f"; {' and '.join(lossy)} change the trajectory by design: rerun without to separate the two"
    return Verdict(name, False, numbers, fix)


def single_process(facts: dict, steps: int) -> tuple[list[float] | None, list[list[str]] | None, str]:
    """``(losses, sample hashes per step, why not)`` of one process training the job's global batches: the same
    data (loss masks, packed documents and mixtures as the job read them) and the same ``--moe-*`` flags."""
    from megakit.core.model_config import ModelConfig
    from megakit.train.data.batches import BatchPlan, TokenBatches
    from megakit.train.data.corpus import open_corpus
    from megakit.train.doctor.diagnostics import tensor_hash
    from megakit.train.doctor.reference import reference_run
    from megakit.train.run import TrainConfig

    c = facts["config"]
    documents, moe = c.get("documents", {}), c.get("moe", {})
    plan = BatchPlan(
        seq_len=c["seq_len"], micro_batch=c["micro_batch"], accumulation=c["accumulation"], dp=c["dp"], seed=c["seed"]
    )
    corpus = open_corpus(c["data"], max_bytes=c["max_bytes"])
    options = corpus.loader_options(TrainConfig(ds_config=c["ds_config"], model=c["model"], **documents))
    batches = TokenBatches(corpus.train, plan, **options)
    start = c["start_step"]
    samples = [[tensor_hash(row) for row in batches.global_batch(start + i)[0]] for i in range(steps)]
    params = ModelConfig.load(c["model"]).num_params()
    if start:
        return None, samples, f"the job resumed at step {start}; the single process starts from scratch"
    if params > REFERENCE_MAX_PARAMS:
        return (
            None,
            samples,
            (
                f"{params / 1e9:.1f}B parameters do not train in one process here; run the doctor "
                "with a smaller --model of the same family"
            ),
        )
    ref = reference_run(
        c["ds_config"],
        model=c["model"],
        steps=steps,
        dp=c["dp"],
        seq_len=c["seq_len"],
        seed=c["seed"],
        data=c["data"],
        max_bytes=c["max_bytes"],
        moe=moe,
        documents=documents,
    )
    return ref["loss"], samples, ""


# -- 5. the learning rate --------------------------------------------------------------------------
def check_lr(facts: dict, *, base_lr: float | None = None, base_batch: int | None = None) -> Verdict:
    """Linear scaling (FAQ 4: batch 64 / lr 0.1 -> batch 512 / lr 0.8) from ``base_lr`` at ``base_batch``
    sequences, and a warm-up whenever it raised the LR (Goyal et al. 2017). Without a base the ds_config's
    LR is taken as tuned for this global batch."""
    config = facts["config"]
    ds = config["ds_config"]
    observed = [step["lr"] for step in facts["steps"]]
    peak = float(ds["optimizer"].get("params", {}).get("lr") or max(observed))
    scheduler = ds.get("scheduler") or {}
    warmup_steps = int(scheduler.get("params", {}).get("warmup_num_steps", 0)) if scheduler else 0
    first = observed[0] if observed else peak
    warms_up = first < 0.5 * peak
    glob = config["global_batch"]
    schedule = f"{scheduler['type']}, warm-up {warmup_steps} steps" if scheduler else "no scheduler (constant LR)"
    last = config["start_step"] + len(observed) - 1
    numbers = [
        f"peak {_g(peak)} at global batch {glob}; {schedule}; LR at steps {config['start_step']}-{last}: "
        + " ".join(_g(x) for x in observed)
    ]
    scale = None
    if base_lr is None:
        numbers.append("no --base-lr: the ds_config's LR taken as tuned for this batch")
    else:
        scale = glob / base_batch
        linear = base_lr * scale
        numbers.append(
            f"linear scaling from --base-lr {_g(base_lr)} at batch {base_batch}: x{scale:g} = {_g(linear)}"
            f" (peak is {peak / linear:.2f}x that)"
        )
        if peak > OVERSCALED_LIMIT * linear:
            return Verdict(
                "learning rate, scaling and warm-up",
                False,
                "; ".join(numbers),
                f"lower optimizer.params.lr to {_g(linear)} (= {_g(base_lr)} x {glob} / {base_batch}); "
                "beyond linear scaling the loss oscillates or diverges",
            )
    if config["start_step"] == 0 and not warms_up and scale is not None and scale > 1 and peak > base_lr:
        numbers.append(f"the first step already runs at {first / peak:.0%} of the peak: no warm-up")
        return Verdict(
            "learning rate, scaling and warm-up",
            False,
            "; ".join(numbers),
            "a linearly scaled LR needs a warm-up: a WarmupCosineLR or WarmupLR scheduler in the ds_config "
            "with warmup_num_steps a few % of the run (`megakit plan --emit-config` writes one)",
        )
    return Verdict("learning rate, scaling and warm-up", True, "; ".join(numbers))


# -- 6. backend and interconnect -------------------------------------------------------------------
def check_backend(facts: dict) -> Verdict:
    """One backend and device kind over the job, and what the nodes are."""
    ranks, config = facts["ranks"], facts["config"]
    backends = sorted({r["backend"] for r in ranks})
    devices = sorted({r["device"] for r in ranks})
    nodes = sorted({r["node"] for r in ranks})
    hosts = {r["host"] for r in ranks}
    dp_nodes = max(len({r["node"] for r in group}) for group in _groups(ranks, "pp", "tp"))
    numbers = (
        f"{'/'.join(backends)} on {', '.join(devices)}; {len(ranks)} ranks on {len(nodes)} node(s) "
        f"({', '.join(nodes)}), {len(hosts)} host(s); {grid(config)}"
        + (f"; the DP all-reduce crosses {dp_nodes} nodes" if dp_nodes > 1 else "; DP stays inside a node")
    )
    if any(d != "cpu" for d in devices) and backends != ["nccl"]:
        return Verdict(
            "backend and interconnect",
            False,
            numbers,
            "use NCCL on GPUs (init_process_group(backend='nccl')); gloo copies every gradient through the host",
        )
    return Verdict("backend and interconnect", True, numbers)


# -- 7. stragglers ---------------------------------------------------------------------------------
def check_stragglers(facts: dict) -> Verdict:
    """Busy time per rank and step: the step's seconds minus its seconds in communication, waiting included
    (in synchronous training the others wait for the slowest, so its own time stands out, not the step's).

    A straggler is slow in nearly every step: a rank counts as one when it is the slowest of the ranks doing
    the same work (its pipeline stage) by more than ``STRAGGLER_LIMIT`` x their median, costing the others
    more than ``STRAGGLER_COST`` of the step, in at least 3/4 of the steps; so a rank the host's scheduler
    held up once, or a few milliseconds of jitter in a short step, is not blamed."""
    steps = facts["steps"][1:] if len(facts["steps"]) > 2 else facts["steps"]  # the first step warms up
    stage = {r["rank"]: r["pp"] for r in facts["ranks"]}
    busy: dict[int, list[float]] = {}
    slow_steps: dict[int, int] = {}
    measured = 0
    for step in steps:
        times = {
            row["rank"]: row["seconds"] - row["comm_seconds"]
            for row in step["ranks"]
            if row["comm_seconds"] is not None
        }
        measured += len(times) > 1
        step_seconds = statistics.median(row["seconds"] for row in step["ranks"])
        for rank, value in times.items():
            busy.setdefault(rank, []).append(value)
        for pp in set(stage.values()):
            peers = {rank: value for rank, value in times.items() if stage[rank] == pp}
            if len(peers) < 2:
                continue
            slowest = max(peers, key=peers.get)
            typical = statistics.median_low(peers.values())
            if peers[slowest] > STRAGGLER_LIMIT * typical and peers[slowest] - typical > STRAGGLER_COST * step_seconds:
                slow_steps[slowest] = slow_steps.get(slowest, 0) + 1
    if not measured:
        return Verdict("stragglers", None, "no step with measured communication time")
    medians = {rank: statistics.median(values) for rank, values in sorted(busy.items())}
    worst = max(slow_steps, key=slow_steps.get, default=max(medians, key=medians.get))
    count = slow_steps.get(worst, 0)
    typical = statistics.median_low(v for r, v in medians.items() if stage[r] == stage[worst])
    numbers = (
        "busy seconds per step (step minus communication), median per rank: "
        + ", ".join(f"rank {r} {v:.3f}" for r, v in medians.items())
        + f"; rank {worst} the slowest of its stage by more than {STRAGGLER_LIMIT:g}x their median and "
        f"{STRAGGLER_COST:.0%} of the step in {count}/{measured} steps "
        f"({medians[worst] / typical if typical > 0 else 1.0:.2f}x over all steps)"
    )
    if count < math.ceil(0.75 * measured):
        return Verdict("stragglers", True, numbers)
    info = {r["rank"]: r for r in facts["ranks"]}
    return Verdict(
        "stragglers",
        False,
        numbers + f"; the others wait ~{medians[worst] - typical:.3f} s a step",
        f"{_who(info[worst])} on {info[worst]['node']} is slow on its own: check its device (clocks, "
        "temperature, another process on it), its data loading and its host's load; synchronous training "
        "runs at the slowest rank's pace",
    )


def judge(facts: dict, *, base_lr: float | None = None, base_batch: int | None = None) -> list[Verdict]:
    """All seven checks, in the FAQ's order (the single-process run is computed here, on this process)."""
    losses, samples, why_not = single_process(facts, len(facts["steps"]))
    return [
        check_weights(facts),
        check_data(facts, samples),
        check_gradients(facts),
        check_loss(facts, losses, why_not=why_not),
        check_lr(facts, base_lr=base_lr, base_batch=base_batch),
        check_backend(facts),
        check_stragglers(facts),
    ]
