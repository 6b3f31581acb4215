"""Validation loss and perplexity, on the model being trained, without touching the training stream.

The validation split is read in a fixed order (``corpus.ValidationBatches``): eval batch
``k`` is split over DP ranks as a training step's batch is, so each sample is computed once
per evaluation in the whole job, and the loss is the mean over the valid tokens of every
micro-batch of every DP rank, as a single process would compute it, and as training weights its
loss (``token_weighting``; with CP every rank of a ring holds the whole sequence's loss, so one of
them counts it). The forward is the training one (the same
stage modules, TP collectives and, with PP, the stages' activations sent along the
pipeline), run under ``torch.no_grad`` in eval mode: no dropout, no recompute, no
gradients, no optimizer state, and nothing drawn from a random generator, so the training
losses after an evaluation are those of a run without one.
"""

from __future__ import annotations

import math

import torch

from megakit.nn import comm
from megakit.nn.model import set_loss_tokens


def _forward_pipeline(chunks, topo, inputs, labels, extras, *, shape, dtype, device) -> torch.Tensor | None:
    """One micro-batch forward through every virtual stage (chunk ``c`` of PP rank ``r`` is stage ``c * pp + r``);
    returns the loss on the rank that holds the last stage, else None.

    Each rank's sends and receives follow the order of the stages, so they pair up without a schedule.
    """
    pp, last = topo.pp, topo.pp * len(chunks) - 1
    loss = None
    for c, chunk in enumerate(chunks):
        stage = c * pp + topo.pp_rank
        if stage == 0:
            x = inputs
        else:
            x = comm.recv(torch.empty(shape, dtype=dtype, device=device), topo.stage_rank((stage - 1) % pp))
        if stage == last:
            loss = chunk(x, labels, **extras)
        else:
            comm.isend(chunk(x, **extras).contiguous(), topo.stage_rank((stage + 1) % pp)).wait()
    return loss


def evaluate(modules, topo, batches, *, shape, dtype, device) -> float:
    """The mean validation loss over ``batches.batches`` eval batches; the same float on every rank.

    ``modules``: this rank's model chunks (a list; one with PP = 1). Collective over the world:
    the stages' P2P with PP > 1, and one small all-reduce at the end.
    """
    total = validation_sums(modules, topo, batches, shape=shape, dtype=dtype, device=device)
    return float(total[0] / total[1].clamp(min=1))


def validation_sums(modules, topo, batches, *, shape, dtype, device) -> torch.Tensor:
    """``[sum of the token losses, valid tokens]`` (float64) over ``batches``, the same on every rank."""
    was_training = [m.training for m in modules]
    for m in modules:
        m.eval()
        set_loss_tokens(m, None)  # each micro-batch's own mean, weighted by its tokens below
    losses = []  # (mean, valid tokens) per micro-batch whose loss this rank holds
    try:
        with torch.no_grad():
            for k in range(batches.batches):
                for (x, y), extras in zip(
                    batches.micro_batches(k, topo.dp_rank), batches.forward_extras(k, topo.dp_rank)
                ):
                    x, y = x.to(device or "cpu"), y.to(device or "cpu")
                    extras = {name: t.to(device or "cpu") for name, t in extras.items()}
                    if topo.pp == 1:
                        loss = modules[0](x, y, **extras)
                    else:
                        loss = _forward_pipeline(modules, topo, x, y, extras, shape=shape, dtype=dtype, device=device)
                    if loss is not None:
                        losses.append((loss.double(), (y != -100).sum().double()))
    finally:
        for m, mode in zip(modules, was_training):
            m.train(mode)
    holds_loss = bool(losses) and topo.tp_rank == 0 and topo.cp_rank == 0  # TP and CP ranks hold the same loss
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [sum of the token losses, tokens]
    if holds_loss:
        total += torch.stack([torch.stack([mean * n, n]) for mean, n in losses]).sum(0)
    comm.all_reduce(total, comm.WORLD)
    return total


def evaluator(run, topo, engine, device):
    """``evaluate()`` -> ``(validation loss, per data set of a mixture or None)`` of the engine's model now, on every
    rank: the loss over every data set's validation tokens, each data set evaluated on its own split."""
    from megakit.nn.pipeline.executor import activation_shape
    from megakit.train.data.corpus import ValidationBatches

    plan = run.batch
    corpora = run.corpus.parts  # a mixture: each data set's validation split on its own
    sets = [ValidationBatches(c, plan, run.cfg.eval_batches, c.loader_options(run.cfg, "validation")) for c in corpora]
    for c, batches in zip(corpora, sets):
        if batches.batches < run.cfg.eval_batches and topo.rank == 0:
            print(
                f"megakit: the validation split of {c.source} holds {batches.batches} global batches; "
                f"--eval-batches {run.cfg.eval_batches} uses those",
                flush=True,
            )
    modules = [engine] if run.cfg.vpp == 1 else list(engine.module)  # the chunks the pipeline runs
    shape = activation_shape(
        run.model,
        micro_batch_size=plan.micro_batch,
        seq_len=plan.seq_len // topo.cp,
        tp=topo.tp,
        sequence_parallel=run.sequence_parallel,
    )

    def run_all() -> tuple[float, dict | None]:
        """The validation loss over every data set's tokens, and (for a mixture) each data set's own."""
        sums = [validation_sums(modules, topo, b, shape=shape, dtype=run.dtype, device=device) for b in sets]
        total = torch.stack(sums).sum(0)
        per_set = {c.source.removeprefix("--data "): float(t[0] / t[1].clamp(min=1)) for c, t in zip(corpora, sums)}
        return float(total[0] / total[1].clamp(min=1)), per_set if run.corpus.sources else None

    return run_all


def perplexity(loss: float) -> float:
    """exp(loss), infinite past where exp overflows."""
    return math.exp(loss) if loss < 700 else float("inf")
