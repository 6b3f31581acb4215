"""Who keeps the DP replicas in step: DeepSpeed's all-reduce (default), megakit's compressed reduction, or
periodic weight averaging (``--local-sgd H``).

FAQ 3 asks synchronous or asynchronous. Synchronous (every step's gradients averaged,
exactly or through ``--compress fp16/int8``) gives every DP rank the same weights and the
single-process trajectory; prefer it whenever the network keeps up. ``--compress
sign/topk`` averages the weight updates instead, and each rank's weights keep its own
updates until they are sent. ``--local-sgd H``
(post-local SGD, Lin et al. 2020) lets each rank step on its own gradients and averages
the weights every H steps: about H times fewer bytes, at some loss per step -- for
slow, shared or cross-datacenter links where even compressed gradients stall the step.

Both take the reduction away from DeepSpeed (``engine.enable_backward_allreduce = False``,
as DeepSpeed's ``PipelineEngine`` does), so they need ZeRO 0: ZeRO 1-3 optimizers reduce
(and shard) the gradients inside DeepSpeed, where no compressed exchange can be put.
"""

from __future__ import annotations

from megakit.nn.compression import GradientReducer, ModelAverager, UpdateReducer


def dp_gradients(engine) -> list:
    """The gradient tensors DeepSpeed itself would all-reduce at the boundary (``buffered_allreduce_fallback``):
    the bf16 optimizer's fp32 accumulators, or the module's ``.grad``s."""
    if hasattr(engine.optimizer, "get_grads_for_reduction"):
        return list(engine.optimizer.get_grads_for_reduction()[0])
    return list(engine._get_gradients_for_reduction()[0])  # noqa: SLF001 (the same list DeepSpeed reduces)


class DataParallelSync:
    """The trainer's hooks: ``before_step`` at the accumulation boundary, ``after_step`` after the optimizer,
    ``synchronize`` before a save or an evaluation."""

    def __init__(self, run, topo, engine) -> None:
        self.engine, self.gradients, self.updates, self.averager = engine, None, None, None
        cfg, group = run.cfg, topo.get_data_parallel_group()  # DeepSpeed's: DP x CP (CP ranks hold the same weights)
        if run.compression.after_optimizer:
            self.updates = UpdateReducer(run.compression, group, self._params(), error_feedback=cfg.error_feedback)
        elif run.compression.enabled:
            self.gradients = GradientReducer(run.compression, group, error_feedback=cfg.error_feedback)
        elif cfg.local_sgd:
            self.averager = ModelAverager(cfg.local_sgd, group, start_step=run.start_step)
        if self.gradients or self.updates or self.averager:
            engine.enable_backward_allreduce = False

    def _params(self) -> list:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def before_step(self) -> None:
        """Average the DP gradients through the compressor (``fp16``, ``int8``; nothing to do otherwise)."""
        if self.gradients is not None:
            self.gradients.reduce(dp_gradients(self.engine))

    def after_step(self) -> None:
        """``sign``/``topk``: average this step's weight updates through the compressor; local SGD: average the
        weights every H steps."""
        if self.updates is not None:
            self.updates.after_step(self._params())
        if self.averager is not None:
            self.averager.after_step(self._params())

    def synchronize(self) -> None:
        """Make every DP rank hold the same weights, with one dense exchange: ``sign``/``topk`` send what they
        have pending, local SGD averages the weights now."""
        for meter in (self.updates, self.averager):
            if meter is not None:
                meter.synchronize(self._params())

    def take_bytes(self) -> tuple[int | None, int | None]:
        """``(sent, dense)`` DP bytes of this rank since the last call; ``(None, None)`` when DeepSpeed reduces."""
        meter = self.gradients or self.updates or self.averager
        return meter.take_bytes() if meter is not None else (None, None)
