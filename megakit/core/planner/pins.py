"""Pinned dimensions: what the user fixed on the command line, and the checks that refuse a pin the
trainer cannot run (one line naming the pin and the fix) before any layout is searched."""

from __future__ import annotations

import dataclasses

from megakit.core.compression import parse_compression
from megakit.core.layout import hybrid_degrees
from megakit.core.partition import check_stage_layers, max_virtual_stages
from megakit.core.planner.hardware import Cluster
from megakit.core.planner.model_spec import ModelSpec
from megakit.errors import UsageError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pins:
    """Dimensions the user fixed (None: searched)."""

    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    cp_mode: str | None = None  # "ring", "a2a" (Ulysses) or "hybrid"; None: the fastest the heads allow
    cp_a2a: int | None = None  # hybrid's all-to-all degree; None: ``hybrid_degree``'s
    ep: int | None = None  # expert parallelism (MoE models), folded over TP x CP x DP
    zero: int | None = None
    micro_batch: int | None = None
    recompute: str | None = None
    vpp: int | None = None
    sequence_parallel: bool | None = None
    schedule: str | None = None  # "1f1b" or "zb-h1" (one chunk per stage); None: 1F1B, interleaved if VPP > 1
    compress: str = "none"  # DP compression the plan uses (megakit's: fp16/int8 with ZeRO 0-1, sign/topk ZeRO 0)
    stage_layers: tuple[int, ...] | None = None  # blocks per virtual stage (--stage-layers; needs --pp)
    loss_chunks: int = 0  # --loss-chunks: the head and loss over K token chunks; 0: the trainer's auto rule

    def resolved(self) -> "Pins":
        """With ``stage_layers`` and ``--pp`` but no ``--vpp``: the VPP the split's length implies."""
        if self.stage_layers is None or self.vpp is not None or not self.pp or len(self.stage_layers) % self.pp:
            return self
        return dataclasses.replace(self, vpp=len(self.stage_layers) // self.pp)

    @property
    def layout_pinned(self) -> bool:
        return self.tp is not None or self.pp is not None or self.cp is not None

    @property
    def memory_pinned(self) -> bool:
        """Every dimension that decides memory is pinned: the layout is judged, not searched
        (``verdict``), against the GPU's whole memory rather than the threshold."""
        return None not in (self.tp, self.pp, self.zero, self.micro_batch, self.recompute)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def hybrid_degree(model: ModelSpec, cluster: Cluster, tp: int, cp: int, pinned: int | None = None) -> int:
    """Hybrid CP's all-to-all degree at TP ``tp`` and CP ``cp``: ``pinned`` or else the largest, above 1 and below CP,
    that divides CP and each TP rank's heads and keeps TP x it inside a node (the all-to-all on NVLink, the ring
    across nodes: USP's placement); 0 where there is none."""
    ok = [a for a in hybrid_degrees(cp, model.heads // tp) if tp * a <= cluster.gpus_per_node]
    if pinned is not None:
        return pinned if pinned in ok else 0
    return ok[-1] if ok else 0


def _tp_rule(model: ModelSpec, tp: int) -> str:
    return f"TP must divide {', '.join(model.config.tp_conflicts(tp))}"


def check_pins(
    model: ModelSpec, cluster: Cluster, pins: Pins, global_batch: int, *, seq_len: int | None = None
) -> None:
    """Refuse, in one line naming the fix, a pinned dimension the model, the cluster or the batch cannot take,
    before the search runs (the rest of the layout is searched around the pins)."""
    world = cluster.num_gpus
    node = cluster.gpus_per_node
    stages = parse_compression(pins.compress).zero_stages
    if pins.compress != "none" and pins.zero not in (None, *stages):
        raise UsageError(
            f"--compress {pins.compress} runs with ZeRO {' or '.join(map(str, stages))} only (higher "
            f"stages reduce inside DeepSpeed's backward); drop --zero or pin --zero {stages[-1]}"
        )
    _check_cp(model, cluster, pins, seq_len=seq_len)
    _check_tp_pp(model, pins, world, node)
    _check_ep(model, pins, world)
    _check_pipeline(model, pins)
    if pins.micro_batch is not None and global_batch % pins.micro_batch:
        raise UsageError(f"--micro-batch {pins.micro_batch} does not divide --global-batch {global_batch}")


def _check_cp(model: ModelSpec, cluster: Cluster, pins: Pins, *, seq_len: int | None) -> None:
    """``--cp`` must cut the sequence into 2 x CP chunks, divide the GPUs, and suit its mode's heads and node."""
    world, node = cluster.num_gpus, cluster.gpus_per_node
    if pins.cp is not None:
        s = model.seq_len if seq_len is None else seq_len
        if pins.cp < 1:
            raise UsageError(f"--cp {pins.cp} must be a positive integer")
        if s % (2 * pins.cp):
            raise UsageError(
                f"--cp {pins.cp} does not divide the sequence: context parallelism cuts the {s} tokens "
                f"into 2 x CP = {2 * pins.cp} equal chunks; pick a CP with 2 x CP dividing --seq-len"
            )
        if world % ((pins.tp or 1) * (pins.pp or 1) * pins.cp):
            raise UsageError(
                f"--cp {pins.cp} (x --tp {pins.tp or 1} x --pp {pins.pp or 1}) does not divide the "
                f"{world} GPUs; pick a CP that divides the GPU count"
            )
        heads = model.heads // (pins.tp or 1)
        if pins.cp_mode == "a2a" and heads % pins.cp:
            raise UsageError(
                f"--cp-mode a2a splits each TP rank's {heads} attention heads over --cp {pins.cp}, which "
                f"does not divide them; pick a --cp dividing {heads}, or --cp-mode ring"
            )
        if pins.cp_mode == "hybrid" and not hybrid_degree(model, cluster, pins.tp or 1, pins.cp, pins.cp_a2a):
            given = f"--cp-a2a {pins.cp_a2a}" if pins.cp_a2a is not None else "it"
            raise UsageError(
                f"--cp-mode hybrid runs an all-to-all inside groups of --cp-a2a GPUs and a ring across "
                f"them; {given} must be above 1, below --cp {pins.cp}, divide CP and each TP rank's "
                f"{heads} heads, and keep TP x it within a {node}-GPU node; or use --cp-mode ring or a2a"
            )
    if pins.cp_a2a is not None and pins.cp_mode != "hybrid":
        raise UsageError(
            f"--cp-a2a {pins.cp_a2a} sets the all-to-all degree of --cp-mode hybrid; add --cp-mode "
            "hybrid or drop --cp-a2a"
        )


def _check_tp_pp(model: ModelSpec, pins: Pins, world: int, node: int) -> None:
    """``--tp`` must shard the model inside a node and ``--pp`` fit its layers, both dividing the GPUs."""
    if pins.tp is not None:
        if pins.tp < 1:
            raise UsageError(f"--tp {pins.tp} must be a positive integer")
        if not model.tp_ok(pins.tp):
            ok = [t for t in divisors(node) if model.tp_ok(t)]
            raise UsageError(
                f"--tp {pins.tp} cannot shard this model ({_tp_rule(model, pins.tp)}); "
                f"pick --tp {' or '.join(map(str, ok))}"
            )
        if world % pins.tp:
            raise UsageError(f"--tp {pins.tp} does not divide the {world} GPUs; pick a TP that divides {world}")
        if node % pins.tp:
            raise UsageError(
                f"--tp {pins.tp} does not divide the {node} GPUs per node (a TP group would span "
                f"nodes); pick --tp {' or '.join(str(t) for t in divisors(node) if model.tp_ok(t))}"
            )
    if pins.pp is not None:
        if pins.pp > model.layers:
            raise UsageError(f"--pp {pins.pp} exceeds the model's {model.layers} layers; use at most {model.layers}")
        if world % ((pins.tp or 1) * pins.pp):
            raise UsageError(
                f"--tp {pins.tp or 1} x --pp {pins.pp} does not divide the {world} GPUs; "
                "pick TP x PP that divides the GPU count"
            )


def _check_pipeline(model: ModelSpec, pins: Pins) -> None:
    """ZeRO, interleaving, the stages' layers and the schedule: the pipelines megakit runs."""
    if pins.zero is not None and pins.zero not in (0, 1, 2, 3):
        raise UsageError(f"--zero {pins.zero} does not exist; use 0, 1, 2 or 3")
    if pins.zero == 2 and (pins.pp or 1) > 1:
        raise UsageError(
            f"--zero 2 cannot run with --pp {pins.pp} (megakit's pipeline runs ZeRO 0, 1 and 3); use "
            "--zero 1 or 3 with a pipeline"
        )
    if pins.zero == 3 and (pins.pp or 1) > 1 and ((pins.vpp or 1) > 1 or pins.schedule == "zb-h1"):
        what = f"--vpp {pins.vpp}" if (pins.vpp or 1) > 1 else "--schedule zb-h1"
        raise UsageError(
            f"--zero 3 with --pp {pins.pp} runs 1F1B with one model chunk per stage, not {what}; "
            f"drop {what.split()[0]}, or use --zero 1"
        )
    if pins.vpp is not None and pins.vpp < 1:
        raise UsageError(f"--vpp {pins.vpp} must be a positive integer")
    if pins.vpp is not None and pins.vpp > 1 and pins.pp == 1:
        raise UsageError(
            f"--vpp {pins.vpp} interleaves pipeline stages but --pp is 1; pin --pp 2 or more, or drop --vpp"
        )
    if (
        pins.vpp is not None
        and pins.pp
        and pins.pp * pins.vpp > max_virtual_stages(model.layers)
        and pins.stage_layers is None
    ):  # beyond one block each plus an embedding-only and a loss-only stage
        raise UsageError(
            f"--pp {pins.pp} x --vpp {pins.vpp} = {pins.pp * pins.vpp} virtual stages exceed the "
            f"{model.layers} layers plus an embedding-only and a loss-only stage; lower --vpp to at most "
            f"{max_virtual_stages(model.layers)} virtual stages in all"
        )
    if pins.stage_layers is not None:
        if pins.pp is None:
            raise UsageError(
                "--stage-layers gives the layers of each virtual stage, so it needs the layout: pin --pp "
                "(and --vpp when interleaving)"
            )
        check_stage_layers(pins.stage_layers, layers=model.layers, pp=pins.pp, vpp=pins.vpp or 1)
    if pins.schedule not in (None, "1f1b", "zb-h1"):
        raise UsageError(f"--schedule {pins.schedule} is not one of 1f1b, zb-h1 (interleaving: pin --vpp)")
    if pins.schedule is not None and (pins.vpp or 1) > 1:
        raise UsageError(
            f"--schedule {pins.schedule} runs one model chunk per stage, got --vpp {pins.vpp}; "
            "drop --vpp, or drop --schedule to interleave"
        )


def _check_ep(model: ModelSpec, pins: Pins, world: int) -> None:
    """``--ep`` needs experts, must divide them, and must divide DP x CP when TP and PP are pinned (under any ZeRO
    stage: ZeRO-3 shards the experts over their EDP ranks, ``megakit.train.engine.experts``)."""
    moe = model.moe
    if pins.ep is None:
        return
    if pins.ep < 1:
        raise UsageError(f"--ep {pins.ep} must be a positive integer")
    if moe is None:
        if pins.ep > 1:
            raise UsageError(
                f"--ep {pins.ep} needs a Mixture-of-Experts model, and {model.name} is dense; "
                "drop --ep or plan an MoE config (e.g. --model mixtral-8x7b)"
            )
        return
    stage = world // pins.pp if pins.pp is not None else world  # TP x CP x DP: the ranks EP folds over
    if moe.experts % pins.ep or stage % pins.ep:
        ok = ", ".join(str(e) for e in divisors(stage) if moe.experts % e == 0)
        ranks = (
            f"TP x CP x DP = {stage} (the {world} GPUs over --pp {pins.pp})"
            if pins.pp is not None
            else f"the {world} GPUs"
        )
        raise UsageError(
            f"--ep {pins.ep} must divide the {moe.experts} experts and {ranks}, the ranks expert "
            f"parallelism folds over; pick --ep {ok}"
        )
