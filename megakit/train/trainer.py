"""Hybrid 3D training: megakit's TP model and 1F1B executor, with one DeepSpeed engine per pipeline stage.

DeepSpeed stays the engine for ZeRO, precision, the optimizer, the LR schedule,
gradient clipping and accumulation: ``deepspeed.initialize(model=stage, mpu=topology,
config=ds_config)`` on every rank, so ZeRO shards and reduces over the DP group only
and ``train_batch_size = micro × accumulation × DP``.

- PP = 1: DeepSpeed counts micro-batches (``engine.step()`` after each backward only
  steps at the accumulation boundary); ZeRO 0-1 all-reduce once, at the boundary.
  (ZeRO 2-3 reduce-scatter gradient buckets during every backward: that is what
  partitioned gradients mean.)
- PP > 1: megakit's executor runs one optimizer step's 1F1B schedule (or GPipe, or
  interleaved 1F1B with ``vpp`` chunks per rank, all under one engine); the last stage
  calls ``engine.backward(loss)``, earlier stages ``engine.backward((out * grad).sum(),
  scale_wrt_gas=False)``, and the schedule's final action calls ``engine.step()``. With
  ``"managed_gradient_accumulation": false`` (DeepSpeed >= 0.19.8) each ``step()`` is
  the boundary, so DP gradients are reduced once per step. ZeRO 0, 1 and, with 1F1B or
  GPipe, 3 (``megakit.train.engine.zero3_pipeline``); not ZeRO 2.

Global gradient norm (clipping): TP shards count once each, replicated parameters
once per stage (``Topology.get_model_parallel_rank`` is the TP rank), and the tied
embedding copy on the last stage is marked ``ds_pipe_replicated`` so DeepSpeed skips it.
DeepSpeed's fp32 ZeRO-0 path ignores that mark and does not report the norm, so there
megakit clips itself (``megakit.train.engine.grad_norm``) with the same rule.

Sequence parallelism and recompute (full or selective) are the model's (``Transformer(sequence_parallel=,
recompute=)``); with SP the stages exchange ``(S/tp, B, H)``. Checkpoints (``--save``,
``--load``, ``--keep``: weights, optimizer state and step, resumed exactly) are in
``megakit.train.resilience.resume``, written in the background with ``--async-save``
(``megakit.interop.checkpoint_async``); ``--spike-guard`` rolls back to the newest
(``megakit.train.resilience.spikes``). A user
mistake that every rank makes alike is marked ``all_ranks`` so that only rank 0 prints it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import os
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megakit.errors import UsageError
from megakit.interop.checkpoint import load_checkpoint
from megakit.interop.checkpoint_async import AsyncWriter
from megakit.interop.peft import lora_extra
from megakit.nn import comm
from megakit.nn.attention.core import use_cp_mode
from megakit.nn.attention.kernels import use_kernel
from megakit.nn.compile import compile_blocks
from megakit.nn.linear_attention.kernels import use_linear_kernels
from megakit.train.data.batches import TokenBatches
from megakit.train.data.token_weighting import weight_by_tokens
from megakit.train.doctor.diagnostics import Diagnostics
from megakit.train.doctor.fault_injection import TrainingFaults, with_seed_fault
from megakit.train.engine.deepspeed_shm import check_shared_memory, unlink_shared_memory, writable_extensions_dir
from megakit.train.engine.dp_sync import DataParallelSync
from megakit.train.engine.ds_config import load_ds_config, scheduled_steps  # noqa: F401 (API: load_ds_config)
from megakit.train.engine.experts import deepspeed_sees_experts
from megakit.train.engine.grad_norm import Zero0Clipper
from megakit.train.engine.moe_step import MoEStep
from megakit.train.engine.optim import decay_groups, start_schedule
from megakit.train.engine.zero3_linear import linear_restored, save_weights_not_views
from megakit.train.engine.zero3_pipeline import within_stage
from megakit.train.observe.evaluate import evaluator
from megakit.train.observe.metrics import StepCommunication, StepMetrics, gpu_peak_tflops, gpu_state
from megakit.train.observe.mtp_losses import MTPLosses
from megakit.train.observe.preference import PreferenceRun
from megakit.train.observe.reporting import Reporter, start_profiler
from megakit.train.resilience.guards import StepGuard, TrainingDiverged
from megakit.train.resilience.preemption import EXIT_STOPPED, StopRequests, reason_text
from megakit.train.resilience.restarts import Attempts, restarts_from_save
from megakit.train.resilience.resume import per_rank_key, restore, restore_own_state, save_run
from megakit.train.resilience.save_lock import hold_save_dir
from megakit.train.resilience.spikes import SpikeGuard
from megakit.train.run import Run, TrainConfig, resolve  # noqa: F401 (API: TrainConfig is the trainer's input)
from megakit.train.steps import pipeline_step, plain_step, rank_device


@dataclass
class TrainResult:
    """What a run hands back: its steps' metrics, evaluations, interventions, last checkpoint and why it stopped."""

    steps: list = field(default_factory=list)  # StepMetrics per step (rank 0 has them all); none: keep_steps=False
    memory: list | None = None  # per-rank rows of --verify-memory
    evals: list = field(default_factory=list)  # {"step", "loss", "perplexity"} per evaluation
    events: list = field(default_factory=list)  # {"step", "kind", "text", ...} per intervention (a skipped step)
    checkpoint: str | None = None  # the last checkpoint this run saved
    stopped: str | None = None  # why the run ended before cfg.steps (a signal, the launcher gone), said on rank 0

    @property
    def losses(self) -> list[float]:
        """Each kept step's loss, in order."""
        return [m.loss for m in self.steps]


# -- the run ---------------------------------------------------------------------------------------
def _describe(topo, rank: int) -> str:
    c = topo.layout.coords(rank)
    cp = f", cp {c['cp']}" if topo.layout.cp > 1 else ""
    return f"rank {rank} (pp {c['pp']}, dp {c['dp']}{cp}, tp {c['tp']})"


def train(cfg: TrainConfig, *, keep_steps: bool = True) -> TrainResult:
    """Run ``cfg.steps`` optimizer steps on the job the launcher started; returns the metrics (``keep_steps``
    False: not each step's, which would grow with the run; scripts/train.py has them in --metrics-out).

    SIGTERM or SIGUSR1 to any rank, or its launcher gone, ends the run early (``TrainResult.stopped``): after a
    step every rank agrees on, saved first with ``--save`` (``megakit.train.resilience.preemption``)."""
    with StopRequests(name=f"rank {os.environ.get('RANK', '0')}") as stops:
        return _train_job(cfg, stops, keep_steps)


def _train_job(cfg: TrainConfig, stops: StopRequests, keep_steps: bool) -> TrainResult:
    from megakit.nn.topology import Topology, init_distributed
    from megakit.train.resilience.faults import from_communication

    try:  # user mistakes fail here, before any process group exists, alike on every rank
        cfg = with_seed_fault(cfg, int(os.environ.get("RANK", "0")))  # only in megakit doctor's tests
        rank0 = os.environ.get("RANK", "0") == "0"
        run = resolve(cfg, int(os.environ.get("WORLD_SIZE", 1)), say=print if rank0 else (lambda *_: None))
    except UsageError as error:
        raise everywhere(error) from None
    init_distributed(timeout_s=cfg.collective_timeout_s)
    _check_placement(cfg, run.layout)
    try:  # DeepSpeed's CPU op and its /dev/shm buffers fail with a traceback or SIGSEGV; these say why in one line
        writable_extensions_dir(say=print if rank0 else (lambda *_: None))
        check_shared_memory()  # after _check_placement's gather: no rank has written its buffer yet
    except UsageError as error:
        raise everywhere(error) from None
    topo = Topology(run.layout, timeout_s=cfg.collective_timeout_s)
    _seed_default_generators(cfg.seed, topo)
    try:  # one writer per --save: rank 0 holds its lock for the run (released below, on every way out)
        save_lock = hold_save_dir(cfg.save, rank=topo.rank, checkpoint=run.checkpoint, start=run.start_step)
    except UsageError as error:
        raise everywhere(error) from None
    try:  # a start that fails here (the watchdog's store timing out) must not keep the lock for the process's life
        watchdog = _start_watchdog(cfg, topo, stops)
        writer = AsyncWriter(comm.side_group(cfg.collective_timeout_s)) if cfg.async_save else None  # --async-save
    except BaseException:
        if save_lock is not None:
            save_lock.release()
        raise
    try:
        with linear_restored(), within_stage(topo, zero3=run.zero_stage == 3, device=rank_device()):  # ZeRO-3's
            result = _train(run, topo, watchdog, writer, stops, keep_steps)
    except (UsageError, TrainingDiverged) as error:
        _drain(writer)
        if isinstance(error, TrainingDiverged) or getattr(error, "all_ranks", False):  # every rank raised it
            _leave_together(watchdog)
        else:  # this rank's own: its exit ends the job
            watchdog.stop(done=True)
        raise
    except Exception as error:
        _drain(writer)
        if dist.get_world_size() > 1 and not isinstance(error, AssertionError) and from_communication(error):
            why = watchdog.diagnose()
            detail = str(error).splitlines()[0] if str(error) else ""
            raise RuntimeError(
                f"{_describe(topo, topo.rank)}: communication failed: {why} ({type(error).__name__}: {detail[:120]})"
            ) from error
        if dist.get_world_size() > 1:  # its traceback is the one to read; its peers will report it gone
            error.add_note(f"megakit: raised on {_describe(topo, topo.rank)} itself, not by a peer or the network")
        raise
    finally:  # after any save in flight has been drained
        if save_lock is not None:
            save_lock.release()
    _leave_together(watchdog)
    return result


def _drain(writer: AsyncWriter | None) -> None:
    """On the way out with an error, let a save in flight finish (the writers' collectives run on their own
    group, so the peers' finish too); its own error aside, the one already raised is the one to report."""
    with contextlib.suppress(Exception):
        if writer is not None:
            writer.wait()


def _leave_together(watchdog) -> None:
    """Stop the watchdog, then wait for every rank: rank 0 hosts the store the watchdogs talk to, so
    it must not exit while another rank's watchdog is still in a store call (that rank would abort)."""
    watchdog.stop(done=True)
    comm.barrier(comm.WORLD)


def _check_placement(cfg: TrainConfig, layout) -> None:
    """Refuse (alike on every rank) a TP group that the launcher spread over several nodes."""
    from megakit.train.cluster.placement import check_tp_within_nodes, gather_places

    try:
        warning = check_tp_within_nodes(layout.groups("tp"), gather_places(), allow=cfg.allow_cross_node_tp)
    except UsageError as error:
        raise everywhere(error) from None
    if warning and dist.get_rank() == 0:
        print(f"megakit: {warning}", flush=True)


def _seed_default_generators(seed: int, topo) -> None:
    """Seed torch's (CPU and GPU), Python's and NumPy's default generators from ``seed`` and this rank's place.

    megakit's own streams (weights, data order, dropout masks) never draw from them; this
    makes whatever else does (a library, a user's hook) repeatable, and no rank unseeded.
    """
    import random

    import numpy as np

    from megakit.nn.weights import index_seed

    cp = f"/cp{topo.cp_rank}" if topo.cp > 1 else ""
    value = index_seed(seed, f"default/pp{topo.pp_rank}/dp{topo.dp_rank}{cp}", topo.tp_rank)
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value % 2**32)


def everywhere(error: UsageError) -> UsageError:
    """Mark ``error`` as raised alike on every rank, so that only rank 0 needs to print it."""
    error.all_ranks = True
    return error


def _start_watchdog(cfg: TrainConfig, topo, stops: StopRequests):
    from megakit.nn.topology import attempt_prefix
    from megakit.train.resilience.faults import Watchdog, connect_store

    store = None
    if dist.get_world_size() > 1:
        store = connect_store(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ.get("MASTER_PORT", 29500)),
            timeout_s=max(5.0, cfg.stall_timeout_s / 2),
        )
        if attempt_prefix() is not None:  # a torchrun restart: not the dead attempt's heartbeats
            store = dist.PrefixStore(attempt_prefix(), store)
    peers = {r for kind in ("tp", "cp", "dp", "pp") for r in topo.group_ranks(kind)}  # the ranks this one waits on
    return Watchdog(
        topo.rank,
        dist.get_world_size(),
        stall_s=cfg.stall_timeout_s,
        peers=peers,
        describe=lambda r: _describe(topo, r),
        store=store,
        store_gone_with_launcher=_store_went_with_launcher(stops, agent_store=attempt_prefix() is not None),
    ).start()


def _store_went_with_launcher(stops: StopRequests, *, agent_store: bool):
    """The watchdog's test for a lost store that is no peer's death: only torchrun's agent hosts the store
    (``agent_store``); under DeepSpeed's launcher rank 0 does, so a lost store there is rank 0 gone, even once
    the ``deepspeed`` command is gone too, and the watchdog must end the rank rather than leave it to hang."""
    return lambda: agent_store and stops.launcher_gone()


def _build(run: Run, topo, doctor=None):
    """This rank's stage model wrapped in a DeepSpeed engine (and the ZeRO-0 clipper when needed)."""
    import deepspeed

    from megakit.nn.lora import add_lora
    from megakit.nn.model import build_stage_chunks
    from megakit.nn.tensor_parallel.fp8 import convert_to_fp8

    cfg, ds_config = run.cfg, run.ds_config
    chunks = build_stage_chunks(
        run.model,
        topo,
        vpp=cfg.vpp,
        method=cfg.stage_layers or "params",
        seed=cfg.seed,
        device=rank_device(),
        sequence_parallel=run.sequence_parallel,  # this rank's shard
        recompute=cfg.recompute,
        loss_chunks=run.loss_chunks,
        mtp=cfg.mtp,
        mtp_weight=cfg.mtp_weight,
    )
    for chunk in chunks if cfg.lora is not None else ():  # the base frozen, the adapters drawn from the seed
        add_lora(chunk, cfg.lora, config=run.model, seed=cfg.seed, tp_group=topo.tp_group)
    for chunk in chunks:  # before DeepSpeed: its hooks sit on the parameters, outside the compiled blocks
        convert_to_fp8(chunk, cfg.fp8)  # the weights stay the module's own: checkpoints see plain parameters
        use_kernel(chunk, run.attention)
        use_linear_kernels(chunk, cfg.linear_attention_kernels)
        use_cp_mode(chunk, cfg.cp_mode, topo)
        if run.compile:
            compile_blocks(chunk, backend=cfg.compile_backend)
    if topo.pp > 1 and topo.is_last_stage and run.model.tie_embeddings:
        chunks[-1].embed.weight.ds_pipe_replicated = True  # the first stage's copy counts in the norm
    stage = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)  # interleaved: one engine, all chunks
    if run.zero_stage == 3:  # F.linear would keep each gathered weight alive until backward
        save_weights_not_views(stage)
    if run.lora_base:  # the frozen weights under the adapters
        try:
            load_checkpoint(run.lora_base, stage, topo, base=True)
        except UsageError as error:
            raise everywhere(error) from None
    if run.checkpoint:  # before deepspeed.initialize: the engine copies its master weights from the model
        try:
            load_checkpoint(run.checkpoint, stage, topo)
        except UsageError as error:
            raise everywhere(error) from None  # load_checkpoint raises on every rank when any rank fails
    if doctor is not None:
        doctor.weights_built(stage)  # before DeepSpeed broadcasts DP rank 0's weights
    clipper = None
    if run.zero_stage == 0 and run.precision == "fp32":
        clipper = Zero0Clipper(stage.parameters(), topo, float(ds_config.get("gradient_clipping", 0.0)))
        ds_config = {**ds_config, "gradient_clipping": 0.0}
    if run.cfg.optimizer == "muon":  # ZeRO 1-2 step megakit's client optimizer (muon_zero), which DeepSpeed asks
        ds_config = {**ds_config, "zero_allow_untested_optimizer": True}
    experts = run.model.moe.experts if run.model.moe else 0
    quiet = contextlib.nullcontext() if cfg.deepspeed_logs else contextlib.redirect_stdout(io.StringIO())
    with deepspeed_sees_experts(stage, topo, experts, zero3=run.zero_stage == 3), quiet:  # quiet: its CPU op's build
        engine, optimizer, _, _ = deepspeed.initialize(
            model=stage, mpu=topo, config=ds_config, **_optimizer(run, stage, topo)
        )
    unlink_shared_memory()
    if run.cfg.optimizer == "muon":
        from megakit.train.engine.muon_zero import bind

        bind(optimizer)  # ZeRO 1-2: the flat partitions' layout (nothing at ZeRO 0)
    if clipper is not None:
        optimizer.register_step_pre_hook(clipper)
    return engine, clipper


def _optimizer(run: Run, stage, topo) -> dict:
    """``deepspeed.initialize``'s optimizer arguments: the ds_config's optimizer over the decay groups, or megakit's
    Muon + AdamW (``--optimizer muon``), built here as a client optimizer."""
    if run.cfg.optimizer != "muon":
        return {"model_parameters": decay_groups(stage)}
    from megakit.train.engine.muon import MuonWithAdamW, QKClip, muon_groups

    cfg = run.cfg
    experts = run.zero_stage > 0 and getattr(topo, "ep", 1) > 1  # ZeRO 1-2 partition the experts over EDP
    groups = muon_groups(stage, weight_decay=cfg.muon_weight_decay, experts=experts)
    clip = QKClip(stage, tau=cfg.qk_clip, group=topo.dp_group) if cfg.qk_clip else None
    optimizer = MuonWithAdamW(
        groups, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay, tp_group=topo.tp_group, qk_clip=clip
    )
    return {"optimizer": optimizer}


def _not_scheduler_start(record) -> bool:
    """DeepSpeed's schedulers warn when built (at iteration -1, where megakit places them right after) and when the
    warm-up outlasts the run; the banner's LR line says the latter once, in megakit's words."""
    message = record.getMessage()
    return "before it has started" not in message and "is less than warmup_num_steps" not in message


@dataclass(kw_only=True)
class _Loop:
    """What one run's steps share, built once by ``_setup``: the engine and everything that watches a step."""

    engine: object
    clipper: Zero0Clipper | None
    batches: TokenBatches
    evaluate: object  # evaluator(...) or None (no --eval-every)
    dp_sync: DataParallelSync
    run_step: object
    faults: TrainingFaults
    guard: StepGuard
    doctor: Diagnostics | None
    device: torch.device
    probe: object  # MemoryProbe or None (no --verify-memory)
    moe: MoEStep | None
    mtp: MTPLosses | None
    reporter: Reporter
    attempts: Attempts
    flops_per_step: float
    peak: float | None
    communication: StepCommunication
    profiler: object
    spikes: SpikeGuard | None
    pairs: PreferenceRun | None = None  # --objective dpo|ipo|simpo: the reference, each step's weighting, metrics


def _quiet_deepspeed(run: Run) -> None:
    """DeepSpeed's logger at the level --deepspeed-logs asks, without the warnings megakit says in its own words."""
    logger = logging.getLogger("DeepSpeed")
    logger.setLevel(logging.INFO if run.cfg.deepspeed_logs else logging.WARNING)
    logger.addFilter(_not_scheduler_start)  # added once (a filter already there is not added again)
    # DeepSpeed 0.19.8 calls collectives torch 2.13 renamed; the warning repeats every step
    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")


def _restored_engine(run: Run, topo, doctor):
    """The engine built, the checkpoint's optimizer state and LR slot restored: ``(engine, clipper, dp_sync)``."""
    engine, clipper = _build(run, topo, doctor)
    if run.checkpoint:
        try:
            restore(engine, topo, run.checkpoint, run.start_step)  # optimizer state
        except UsageError as error:
            raise everywhere(error) from None  # load_state raises on every rank when any rank fails
    start_schedule(engine.lr_scheduler, run.start_step)
    return engine, clipper


def _restore_own_state(run: Run, topo, engine, dp_sync: DataParallelSync) -> None:
    """Each DP rank's own moments and residuals, at the layout that saved them (after the data loader is built)."""
    if run.checkpoint:
        try:
            restore_own_state(
                engine,
                topo,
                run.checkpoint,
                dp_sync,
                per_rank_key(run, topo),
                say=print if topo.rank == 0 else lambda *_: None,
            )
        except UsageError as error:
            raise everywhere(error) from None


def _setup(run: Run, topo) -> _Loop:
    """Build the engine and the step's helpers (loader, guards, metrics, profiler) in the order they depend on."""
    from megakit.nn.model import model_flops_per_token

    _quiet_deepspeed(run)
    cfg, plan, start = run.cfg, run.batch, run.start_step
    doctor = Diagnostics(run, topo, cfg.doctor_out) if cfg.doctor_out else None  # facts for megakit doctor
    engine, clipper = _restored_engine(run, topo, doctor)
    batches = TokenBatches(run.corpus.train, plan, **run.corpus.loader_options(cfg))
    evaluate = evaluator(run, topo, engine, rank_device()) if cfg.eval_every else None
    pairs = None  # a pair objective: the reference pass runs here, before the first step
    if cfg.objective != "lm":
        pairs = PreferenceRun(run, topo, engine, batches, rank_device() or torch.device("cpu"))
    dp_sync = DataParallelSync(run, topo, engine)
    _restore_own_state(run, topo, engine, dp_sync)
    run_step = pipeline_step(run, topo, engine, dp_sync) if topo.pp > 1 else plain_step(engine, dp_sync)
    faults = TrainingFaults(topo.rank, list(engine.module) if cfg.vpp > 1 else [engine.module])  # tests only
    guard = StepGuard(
        topo,
        max_skipped=0 if doctor is not None else cfg.max_skipped_steps,
        precision=run.precision,
        describe=lambda r: _describe(topo, r),
        device=rank_device(),
    )  # the doctor sees the first NaN
    if doctor is not None:
        batches, run_step = doctor.attach(engine, batches, run_step)
    device = rank_device() or torch.device("cpu")
    probe = None
    if cfg.verify_memory:
        from megakit.train.observe.memory_probe import MemoryProbe

        probe = MemoryProbe(engine, topo, run)
    moe = None
    if run.model.moe is not None:  # the balancing losses' scale, the expert bias, per-layer metrics
        moe = MoEStep(
            engine.module,
            topo,
            layers=run.model.layers,
            accumulation=plan.accumulation,
            mtp=run.model.mtp_layers if cfg.mtp else 0,
        )
    mtp = MTPLosses(engine.module, topo, run.model.mtp_layers) if cfg.mtp else None  # each depth's loss, logged
    reporter = Reporter(run, topo)
    restarting = restarts_from_save(cfg.load, cfg.init)
    attempts = Attempts(cfg.save if restarting else None, start=start, active=topo.rank == 0)
    flops_per_step = (
        model_flops_per_token(run.model, plan.seq_len, mtp=run.model.mtp_depth(cfg.mtp))
        * plan.global_batch
        * plan.seq_len
    )
    peak = gpu_peak_tflops()
    communication = StepCommunication(sync_cuda=torch.cuda.is_available())
    profiler = start_profiler(cfg.profile, steps=cfg.steps - start, rank=topo.rank)
    spikes = SpikeGuard(cfg.spike_guard, saved=run.spike_window) if cfg.spike_guard else None
    return _Loop(
        engine=engine,
        clipper=clipper,
        batches=batches,
        evaluate=evaluate,
        dp_sync=dp_sync,
        run_step=run_step,
        faults=faults,
        guard=guard,
        doctor=doctor,
        device=device,
        probe=probe,
        moe=moe,
        mtp=mtp,
        reporter=reporter,
        attempts=attempts,
        flops_per_step=flops_per_step,
        peak=peak,
        communication=communication,
        profiler=profiler,
        spikes=spikes,
        pairs=pairs,
    )


def _train(
    run: Run, topo, watchdog, writer: AsyncWriter | None, stops: StopRequests, keep_steps: bool = True
) -> TrainResult:
    """The steps from the run's start to ``--steps``: each step, then a spike's roll-back, an evaluation, a save or
    a stop as the step's end calls for; ``watchdog`` watches from its own thread."""
    cfg, start = run.cfg, run.start_step
    loop = _setup(run, topo)
    result = TrainResult()
    step, offset = start, run.data_offset  # step s reads the batch of step s + offset (spikes skip batches)
    while step < cfg.steps:
        metrics, spike = _step(run, topo, loop, stops, result, step=step, offset=offset)
        if keep_steps:
            result.steps.append(metrics)
        loop.reporter.log(metrics)
        if metrics.compiling:
            loop.reporter.compiled(metrics)
        loop.attempts.finished(step)
        if spike:  # the newest checkpoint back into the engine; the batches since then are skipped
            _wait(writer)
            back, event = loop.spikes.roll_back(
                spike,
                step=step,
                offset=offset,
                engine=loop.engine,
                topo=topo,
                run=run,
                dp_sync=loop.dp_sync,
                reporter=loop.reporter,
            )
            result.events.append(event)
            if back is not None:
                step, offset = back
                continue
        done, step = step + 1, step + 1
        if _after_step(run, topo, loop, writer, stops, result, done=done, offset=offset, loss=metrics.loss):
            break
    _finish(loop, writer, stops, result)
    return result


def _micro_batches(loop: _Loop, topo, step: int) -> list:
    """The step's micro-batches on this rank's device: ``(x, y, rows, forward extras)`` each."""
    batches, device = loop.batches, loop.device
    extras = batches.forward_extras(step, topo.dp_rank)
    if loop.pairs is not None:  # each row's reference log-probabilities
        extras = loop.pairs.extras(step, topo.dp_rank, extras)
    return [
        (x.to(device), y.to(device), rows, {k: t.to(device) for k, t in more.items()})
        for (x, y), rows, more in zip(
            batches.micro_batches(step, topo.dp_rank),
            batches.sample_numbers(step, topo.dp_rank),
            extras,
        )
    ]


def _grads(loop: _Loop) -> tuple[float, bool, bool]:
    """``(grad norm, finite, the optimizer step applied)``: from megakit's ZeRO-0 clipper, else from DeepSpeed."""
    if loop.clipper is not None:
        return loop.clipper.norm, loop.clipper.finite, loop.clipper.applied
    grad_norm = float(loop.engine.get_global_grad_norm() or float("nan"))
    grads_finite = math.isfinite(grad_norm) and grad_norm >= 0  # DeepSpeed masks inf/nan as -1
    return grad_norm, grads_finite, loop.engine.was_step_applied()


def _step(run: Run, topo, loop: _Loop, stops: StopRequests, result: TrainResult, *, step: int, offset: int):
    """One optimizer step, kept on the device until the guard's check: ``(its StepMetrics, a loss spike or None)``.
    A skipped step (non-finite gradients) spends its batch and LR slot, so data and LR stay functions of the step."""
    plan, engine, moe, doctor = run.batch, loop.engine, loop.moe, loop.doctor
    loop.faults.at_step(step)
    waited = time.perf_counter()  # the loader's share of the step (reads from memory-mapped shards)
    micro_batches = _micro_batches(loop, topo, step + offset)
    waited = time.perf_counter() - waited
    lr = engine.get_lr()[0]
    t0 = time.perf_counter()
    with loop.communication.measure(
        not torch.cuda.is_available() or step % 10 == 1 or doctor is not None
    ):  # on GPU it synchronises
        with loop.probe.step() if loop.probe else contextlib.nullcontext():
            if moe is not None:
                moe.before_step(engine)
            if loop.pairs is not None:  # the mean over the step's pairs
                loop.pairs.weight(engine.module, micro_batches)
            else:
                weight_by_tokens(engine.module, micro_batches, topo, loop.device)  # sum(loss) / sum(tokens) of the step
            with run.attention.context():  # the SDPA backend --attention-kernel pinned, forward and backward
                loss = loop.faults.spiked(step + offset, loop.run_step(micro_batches))
            loop.dp_sync.after_step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    comm_seconds, comm_calls = loop.communication.result or (None, None)
    a2a = moe is not None or run.layout.cp_a2a > 1  # MoE dispatch, Ulysses CP: bytes counted from shapes (host)
    a2a_bytes = loop.communication.all_to_all_bytes if loop.communication.result and a2a else None
    dp_bytes, dp_bytes_dense = loop.dp_sync.take_bytes()
    grad_norm, grads_finite, applied = _grads(loop)
    if doctor is not None:
        doctor.after_step(loss=loss, lr=lr, seconds=seconds, comm_seconds=comm_seconds, grad_norm=grad_norm)
    loss, skipped = loop.guard.check(step, loss, grads_finite=grads_finite, applied=applied, stop=stops.reason)
    moe_metrics = moe.after_step(applied=not skipped) if moe is not None else None  # the expert bias moves here
    mtp_losses = loop.mtp.after_step() if loop.mtp is not None else None
    preference = loop.pairs.after_step() if loop.pairs is not None else None  # TRL's rewards/* and logps/*
    if skipped:  # the batch and the LR slot are spent: data and LR stay functions of the step
        start_schedule(engine.lr_scheduler, step + 1)
        result.events.append(loop.reporter.event(step, "skipped", skipped, skipped_steps=loop.guard.skipped))
    spike = loop.spikes.check(step, loss) if loop.spikes is not None else None
    if loop.profiler is not None:
        loop.profiler.step()
    metrics = StepMetrics(
        step=step,
        loss=loss,
        lr=lr,
        grad_norm=grad_norm,
        seconds=seconds,
        samples=plan.global_batch,
        tokens=plan.global_batch * plan.seq_len,
        flops=loop.flops_per_step,
        comm_seconds=comm_seconds,
        comm_calls=comm_calls,
        world_size=dist.get_world_size(),
        peak_tflops=loop.peak,
        data_seconds=waited,
        dp_bytes=dp_bytes,
        dp_bytes_dense=dp_bytes_dense,
        skipped=bool(skipped),
        moe=moe_metrics,
        mtp=mtp_losses,
        preference=preference,
        all_to_all_bytes=a2a_bytes,
        compiling=run.compile and step == run.start_step,
        **dict(zip(("gpu_util", "gpu_mem_gib"), gpu_state())),
    )
    return metrics, spike


def _after_step(
    run: Run,
    topo,
    loop: _Loop,
    writer: AsyncWriter | None,
    stops: StopRequests,
    result: TrainResult,
    *,
    done: int,
    offset: int,
    loss: float,
) -> bool:
    """Evaluate, save and stop as step ``done``'s end calls for; True when the run stops here (a signal, the
    launcher gone). Every rank decides alike: the stop is learnt from the guard's all-reduce."""
    cfg = run.cfg
    stopping = bool(loop.guard.stops) and done < cfg.steps  # every rank learnt it from the guard's all-reduce
    evaluating = loop.evaluate is not None and not stopping and (done % cfg.eval_every == 0 or done == cfg.steps)
    saving = cfg.save and (
        done == cfg.steps or (cfg.save_every and done % cfg.save_every == 0) or (stopping and cfg.save_on_signal)
    )
    if evaluating or saving:
        loop.dp_sync.synchronize()  # one model on every DP rank (compressed updates may be pending)
    if evaluating:
        result.evals.append(loop.reporter.eval(done, *loop.evaluate()))
    if saving:
        result.checkpoint = _save(run, topo, loop, writer, done=done, offset=offset, loss=loss)
    if stopping:
        _wait(writer)
        result.stopped = _stopped(
            loop.guard.stops,
            topo,
            step=done,
            saved=cfg.save if saving else None,
            why="no --save" if not cfg.save else "--no-save-on-signal",
            gone=stops.gone if stops.launcher_gone() else None,
        )
    return stopping


def _save(run: Run, topo, loop: _Loop, writer: AsyncWriter | None, *, done: int, offset: int, loss: float) -> str:
    """Save step ``done`` to --save with what a resume needs to continue exactly (data position, LR schedule,
    spike window); returns where it went."""
    cfg, plan = run.cfg, run.batch
    extra = {
        "loss": loss if math.isfinite(loss) else None,
        "seed": cfg.seed,
        "global_batch": plan.global_batch,
        "lr_total_steps": scheduled_steps(run.ds_config),  # a resume continues this schedule
        "optimizer": cfg.optimizer,  # whose state the checkpoint holds (Muon's momentum, or Adam's moments)
        "data": {
            "samples": (done + offset) * plan.global_batch,
            "skipped_batches": offset,
            "corpus": run.corpus.fingerprint,
        },
        **({"spike_guard": loop.spikes.state()} if loop.spikes else {}),
        **({"lora": lora_extra(cfg.lora, run.lora_base)} if cfg.lora else {}),  # the spec and base a resume needs
    }
    try:
        saved = save_run(
            cfg.save,
            loop.engine,
            topo,
            run.model,
            step=done,
            series=cfg.keep > 0,
            keep=cfg.keep,
            extra=extra,
            tokenizer=run.corpus.tokenizer_dir,
            dp_sync=loop.dp_sync,
            rank_key=per_rank_key(run, topo),
            writer=writer,
        )
    except UsageError as error:
        raise everywhere(error) from None  # save_checkpoint raises on every rank when any rank fails
    return str(saved)


def _finish(loop: _Loop, writer: AsyncWriter | None, stops: StopRequests, result: TrainResult) -> None:
    """The run's end: the last save on disk, the profiler's and the memory probe's reports, the reporter closed."""
    _wait(writer)  # the last save is on disk before the run returns
    stops.leaving()  # a later signal (DeepSpeed's launch.py passing scancel's on) does not end the rank now
    if loop.profiler is not None:
        loop.profiler.stop()
        loop.reporter.attention_kernels(loop.profiler)
    if loop.probe is not None:
        result.memory = loop.probe.report()
        loop.reporter.memory(result.memory)
    loop.reporter.close(checkpoint=result.checkpoint)


def _stopped(stops: dict[int, int], topo, *, step: int, saved: str | None, why: str, gone: str | None) -> str:
    """The line a stop ends with (rank 0 prints it): why, where, and what was saved. ``gone``: the launcher's
    process this rank finds gone, if it does."""
    first, reason = next(iter(stops.items()))
    what = reason_text(reason, gone)
    where = _describe(topo, first) + (f" and {len(stops) - 1} more rank(s)" if len(stops) > 1 else "")
    kept = f"saved to {saved} (--load auto resumes there)" if saved else f"nothing saved ({why})"
    if topo.rank == 0:
        print(f"megakit: {what} {where}: stopped at step {step}, {kept}; exit status {EXIT_STOPPED}", flush=True)
    return what


def _wait(writer: AsyncWriter | None) -> None:
    """Until the save in flight is on disk (``--async-save``); its error, raised alike on every rank."""
    try:
        if writer is not None:
            writer.wait()
    except UsageError as error:
        raise everywhere(error) from None
