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

At ZeRO 0 megakit takes the reduction away from DeepSpeed (``engine.enable_backward_allreduce
= False``, as DeepSpeed's ``PipelineEngine`` does). At ZeRO 1 the optimizer reduces inside
DeepSpeed; with its reduce-scatter off (``run._check_dp_sync``) every gradient bucket goes
through one method, ``gradient_reduction_w_predivide`` (all-reduce and average), which
``ZeroOneBuckets`` replaces by the compressed exchange: fp16 and int8 compose with ZeRO 1.
Weight updates (sign, Top-K) and local SGD need the whole weights on every rank: ZeRO 0.
ZeRO 2-3 reduce-scatter in the backward's hooks, where nothing is replaced.

Context parallelism: DeepSpeed's "data parallel" group is DP x CP, but a CP rank's gradient
is its part of one sequence's, so the CP ranks are always summed exactly (``_cp_mean``: an
all-reduce over the CP group) and only then compressed or averaged over the pure DP group.
Compressing over DP x CP instead would step each CP rank on a lossy or local share of the
sequence's gradient. With DP 1 there is nothing to compress or average: DeepSpeed's exact
all-reduce (over CP) stays, and no DP bytes are reported.
"""

from __future__ import annotations

import hashlib

import torch

from megakit.nn import comm
from megakit.nn.compression import (
    ByteMeter,
    GradientReducer,
    ModelAverager,
    UpdateReducer,
)


def _cp_mean(tensors: list[torch.Tensor], group) -> None:
    """Replace each tensor by its exact mean over the CP group, in place: one all-reduce per dtype. Each CP rank's
    gradient is CP times its share of the sequence's (``megakit.nn.sequence.sequence_mean``), so the mean is
    the whole sequence's gradient."""
    if comm.size(group) == 1:
        return
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        same = [t for t in tensors if t.dtype == dtype]
        flat = comm.all_reduce(torch.cat([t.reshape(-1) for t in same]), group).div_(comm.size(group))
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))


def dp_gradients(engine) -> list:
    """The gradient tensors DeepSpeed itself would all-reduce at the boundary (``buffered_allreduce_fallback``):
    the bf16 optimizer's fp32 accumulators, or the module's ``.grad``s."""
    if hasattr(engine.optimizer, "get_grads_for_reduction"):
        return list(engine.optimizer.get_grads_for_reduction()[0])
    return list(engine._get_gradients_for_reduction()[0])  # noqa: SLF001 (the same list DeepSpeed reduces)


def gradient_of(engine):
    """``gradient(p)``: the tensor DeepSpeed's optimizer will step ``p`` with. Its bf16 optimizer (bf16 with fp32
    gradient accumulation, ``data_types.grad_accum_dtype``) adds each micro-batch's bf16 gradient into an fp32
    accumulator (``p._hp_grad``) and steps from there, so a sum made on ``p.grad`` after the last backward (tied
    embeddings) would never reach the step; ZeRO 3 steps from its gradient partitions
    (``megakit.train.engine.zero3_pipeline.grad_partition``); the others step from ``.grad``."""
    if engine.zero_optimization_stage() == 3:
        from megakit.train.engine.zero3_pipeline import grad_partition

        return grad_partition(engine.optimizer)
    if hasattr(engine.optimizer, "get_grads_for_reduction"):  # as dp_gradients: the bf16 optimizer
        return lambda p: getattr(p, "_hp_grad", None)
    return lambda p: p.grad


class ZeroOneBuckets(ByteMeter):
    """ZeRO 1: DeepSpeed's optimizer all-reduces its gradient buckets through ``gradient_reduction_w_predivide``
    (reduce-scatter off); this takes that method's place on the optimizer and sends each bucket compressed, every
    parameter's gradient on its own, with one residual per bucket (known by its parameters: a parameter without a
    gradient in some step shifts the buckets)."""

    def __init__(self, optimizer, make_reducer, cp_group=None) -> None:
        super().__init__()
        if not hasattr(optimizer, "gradient_reduction_w_predivide"):
            raise RuntimeError(
                f"DeepSpeed's {type(optimizer).__name__} has no gradient_reduction_w_predivide: "
                "this DeepSpeed reduces ZeRO-1 gradients elsewhere, so --compress needs ZeRO 0"
            )
        self.optimizer, self.make_reducer, self.reducers, self.cp_group = optimizer, make_reducer, {}, cp_group
        optimizer.gradient_reduction_w_predivide = self
        self.loaded: dict[str, dict] = {}  # a checkpoint's residuals, by bucket, until the bucket is first seen

    def __call__(self, tensor: torch.Tensor, communication_data_type) -> torch.Tensor:
        """``tensor`` (a bucket of gradients, end to end) replaced by its DP x CP average, as DeepSpeed's method does:
        exact over CP, then compressed over DP."""
        _cp_mean([tensor], self.cp_group)
        ids, sizes = self._bucket(tensor, communication_data_type)
        key = (communication_data_type, ids)
        if key not in self.reducers:
            self.reducers[key] = self.make_reducer()
            self.reducers[key].load_state(self.loaded.pop(_bucket_name(key), {}))
        self.reducers[key].reduce(list(tensor.split(sizes)))
        return tensor

    def _bucket(self, tensor: torch.Tensor, dtype) -> tuple[tuple, list[int]]:
        """The bucket's parameter ids and sizes, in order (each parameter is compressed on its own, so alike on
        every rank holding it); one part when DeepSpeed's bucket does not say."""
        opt = self.optimizer
        bucket = getattr(opt, "ipg_buckets", {}).get(dtype)
        params = list(bucket.params) if bucket is not None else []
        sizes = [opt.bit16_groups[g][i].numel() for g, i, _ in params]
        if sum(sizes) != tensor.numel():
            return ("whole", tensor.numel()), [tensor.numel()]
        return tuple(pid for _, _, pid in params), sizes

    def take_bytes(self) -> tuple[int, int]:
        """``(sent, dense)`` DP bytes over all buckets since the last call, for the communication metrics."""
        taken = [r.take_bytes() for r in self.reducers.values()]
        return sum(s for s, _ in taken), sum(d for _, d in taken)

    def state(self) -> dict[str, torch.Tensor]:
        """Every bucket's residuals, named by the bucket (its parameters), as ``bucket-HASH/FIELD``."""
        return {
            f"{_bucket_name(key)}/{field}": t
            for key, reducer in self.reducers.items()
            for field, t in reducer.state().items()
        }

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Keep ``state()``'s residuals until their bucket is reduced (DeepSpeed builds buckets in the backward)."""
        for name, t in state.items():
            bucket, field = name.rsplit("/", 1)
            self.loaded.setdefault(bucket, {})[field] = t


def _bucket_name(key: tuple) -> str:
    """A short name for a bucket key (its dtype and parameter ids), the same in every run at the same layout."""
    return "bucket-" + hashlib.sha256(repr(key).encode()).hexdigest()[:16]


class DataParallelSync:
    """The trainer's hooks: ``before_step`` at the accumulation boundary, ``after_step`` after the optimizer,
    ``synchronize`` before a save or an evaluation."""

    def __init__(self, run, topo, engine) -> None:
        self.engine, self.gradients, self.buckets, self.updates, self.averager = engine, None, None, None, None
        self.cp_group = topo.cp_group if topo.cp > 1 else None  # summed exactly, before anything over DP
        self.reduces = False
        if topo.dp == 1:  # nothing to compress or average: DeepSpeed's exact all-reduce (over CP, if any) stays
            return
        cfg, group = run.cfg, topo.dp_group  # DP alone, not DeepSpeed's DP x CP
        if run.compression.after_optimizer:
            self.updates = UpdateReducer(run.compression, group, self._params(), error_feedback=cfg.error_feedback)
        elif run.compression.enabled and run.zero_stage == 1:  # DeepSpeed reduces; megakit compresses its buckets
            self.buckets = ZeroOneBuckets(
                engine.optimizer,
                lambda: GradientReducer(run.compression, group, error_feedback=cfg.error_feedback),
                self.cp_group,
            )
        elif run.compression.enabled:
            self.gradients = GradientReducer(run.compression, group, error_feedback=cfg.error_feedback)
        elif cfg.local_sgd:
            self.averager = ModelAverager(cfg.local_sgd, group, start_step=run.start_step)
        self.reduces = any(m is not None for m in (self.gradients, self.updates, self.averager))
        if self.reduces:  # megakit's before_step reduces instead (ZeRO 1's buckets stay DeepSpeed's)
            engine.enable_backward_allreduce = False

    def _params(self) -> list:
        return [p for p in self.engine.module.parameters() if p.requires_grad]

    def before_step(self) -> None:
        """Where megakit took the reduction from DeepSpeed: sum the CP ranks' gradients exactly, then average the DP
        gradients through the compressor (``fp16``, ``int8``; sign, Top-K and local SGD work after the step)."""
        if not self.reduces:
            return
        grads = dp_gradients(self.engine)
        _cp_mean(grads, self.cp_group)
        if self.gradients is not None:
            self.gradients.reduce(grads)

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
        meter = self.gradients or self.buckets or self.updates or self.averager
        return meter.take_bytes() if meter is not None else (None, None)

    @property
    def own_moments(self) -> bool:
        """Whether each DP rank's optimizer steps on its own gradients (sign, Top-K, local SGD), so that its Adam
        moments are its own; with exact or fp16/int8 gradients every rank steps on the same average."""
        return self.updates is not None or self.averager is not None

    def state(self) -> dict[str, torch.Tensor]:
        """This rank's compression state the next step depends on (error-feedback residuals), on the CPU; call
        after ``synchronize()``. Local SGD keeps none: its period counts from the step."""
        reducer = self.gradients or self.buckets or self.updates
        return {} if reducer is None else {k: t.detach().to("cpu", copy=True) for k, t in reducer.state().items()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Take back what ``state()`` gave at the same layout."""
        reducer = self.gradients or self.buckets or self.updates
        device = next(iter(self._params()), torch.empty(0)).device
        if reducer is not None:
            reducer.load_state({k: t.to(device) for k, t in state.items()})
