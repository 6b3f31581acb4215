"""How one optimizer step runs on this rank: DeepSpeed's own accumulation when there is one stage, megakit's
pipeline executor (1F1B, interleaved, zero bubble) when there are several. Each returns ``step(micro_batches) ->
mean loss``, so the training loop does not care which."""

from __future__ import annotations

import torch

from megakit.train.run import Run


def plain_step(engine, dp_sync):
    """PP = 1: DeepSpeed accumulates; ``step()`` after each micro-batch only updates at the boundary."""

    def run(micro_batches) -> torch.Tensor:
        losses = []
        for i, (inputs, labels, rows, extras) in enumerate(micro_batches):
            loss = engine(inputs, labels, sample_ids=rows, **extras)
            engine.backward(loss)
            if i == len(micro_batches) - 1:
                dp_sync.before_step()
            engine.step()
            losses.append(loss.detach().float())
        return torch.stack(losses).mean()

    return run


def rank_device() -> torch.device | None:
    """This rank's GPU (``init_distributed`` selected it from LOCAL_RANK), or None on CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None


def pipeline_step(run: Run, topo, engine, dp_sync):
    """PP > 1: one 1F1B (or chosen) schedule per step; DeepSpeed does backward scaling, DP reduction and step."""
    from megakit.core.schedules import build_schedule
    from megakit.nn.pipeline.executor import PipelineExecutor, activation_shape
    from megakit.train.engine.dp_sync import gradient_of
    from megakit.train.engine.zero3_pipeline import accumulate_from_zero, count_norm_over_stages

    plan, vpp = run.batch, run.cfg.vpp
    if run.zero_stage == 3:
        count_norm_over_stages(engine.optimizer, topo)

    def backward(scalar, is_loss):  # the loss is scaled by 1 / accumulation, as with PP = 1; an output's handle not
        engine.backward(scalar, scale_wrt_gas=is_loss)

    schedule = build_schedule(run.schedule, topo.pp, plan.accumulation, vpp)
    # zero bubble splits each backward itself (loss / accumulation, into .grad, DeepSpeed's gradient hooks firing)
    # and so calls no engine.backward: its chunk is the bare module, whose outputs carry no engine backward hooks
    bare = vpp > 1 or schedule.split_backward
    chunks = [engine] if not bare else list(engine.module) if vpp > 1 else [engine.module]  # no hooks needed, ZeRO 0-1
    executor = PipelineExecutor(
        chunks,
        topo,
        schedule=schedule,
        backward=None if schedule.split_backward else backward,
        activation_shape=activation_shape(
            run.model,
            micro_batch_size=plan.micro_batch,
            seq_len=plan.seq_len // topo.cp,
            tp=topo.tp,
            sequence_parallel=run.sequence_parallel,
        ),
        activation_dtype=run.dtype,
        device=rank_device(),  # stages exchange the weights' type
        reduce_grads=dp_sync.before_step,
        optimizer_step=engine.step,
        broadcast_loss=True,
        gradient=gradient_of(engine),
    )

    mtp = run.cfg.mtp and topo.is_last_stage  # the prediction modules embed the ids shifted by each depth

    def step(micro_batches) -> torch.Tensor:
        if run.zero_stage == 3:
            accumulate_from_zero(engine.optimizer)
        inputs = [x for x, _, _, _ in micro_batches] if topo.is_first_stage else None
        labels = [y for _, y, _, _ in micro_batches] if topo.is_last_stage else None
        extras = [{**more, "input_ids": x} if mtp else more for x, _, _, more in micro_batches]
        return torch.tensor(
            executor.step(inputs, labels, sample_ids=[rows for _, _, rows, _ in micro_batches], extras=extras)
        )

    return step
