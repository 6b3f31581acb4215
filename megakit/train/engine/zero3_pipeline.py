"""ZeRO 3 under megakit's pipeline executor: what DeepSpeed's stage 3 assumes that a pipeline breaks, set right.

DeepSpeed's own ``PipelineEngine`` refuses ZeRO 2-3; megakit drives the engine with its own schedule
(``megakit.train.steps.pipeline_step``, 1F1B or GPipe: each chunk goes through ``engine.forward`` and
``engine.backward``), and stage 3 then needs four things from it:

- The trace check (``within_stage``). At the start of every forward of the engine's module
  (``parameter_offload._start_of_forward_hook``) ZeRO 3's parameter coordinator closes its trace
  (``PartitionedParameterCoordinator.reset_step``); while the trace is not complete (the first forward, and
  after any change in the order its sub-modules run, which 1F1B's mix of forwards and backwards keeps making)
  it checks that every rank recorded the same modules: ``assert_ints_same_as_other_ranks``, two ``broadcast``s
  from global rank 0 over the WORLD group (``deepspeed/runtime/zero/utils.py``). At PP > 1 the first stage's
  ranks waited there for the last stage's, which waited for the first stage's activations: every ZeRO 3
  pipeline hung in its first forward until gloo's timeout. The ranks that must agree are those that share the
  parameters: the stage's DP group, which runs the same schedule.
- Accumulation (``accumulate_from_zero``): see there.
- The tied embeddings (``grad_partition``): their gradients are summed over the stages where ZeRO 3 keeps them.
- The gradient norm (``count_norm_over_stages``): see there.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


def _same_over(group, device: torch.device | None):
    """``assert_ints_same_as_other_ranks`` over ``group``: each rank's ints equal the group's first rank's. A trace
    checked once is not checked again: 1F1B repeats the same few module orders every step, and each check costs two
    broadcasts and two waits for the device. The stage's ranks run one schedule, so they skip the same ones."""
    source = dist.get_global_rank(group, 0)
    checked: set[tuple[int, ...]] = set()

    def check(ints: list[int]) -> None:
        if tuple(ints) in checked:
            return
        checked.add(tuple(ints))
        length = torch.tensor([len(ints)], dtype=torch.long, device=device)
        dist.broadcast(length, src=source, group=group)
        n = int(length.item())  # every rank takes part in the second broadcast at the source's length, even when
        first = torch.full((n,), -1, dtype=torch.long, device=device)  # its own differs (DeepSpeed's would hang)
        if dist.get_rank() == source:
            first.copy_(torch.tensor(ints, dtype=torch.long))
        dist.broadcast(first, src=source, group=group)
        if n != len(ints) or first.tolist() != list(ints):
            raise RuntimeError(
                f"ZeRO-3's trace differs between rank {source} and rank {dist.get_rank()} of one pipeline stage"
            )

    return check


@contextlib.contextmanager
def within_stage(topo, *, zero3: bool, device: torch.device | None = None):
    """Around a run: under ZeRO 3 with PP > 1, DeepSpeed's trace check over the stage's DP group (see the module's
    docstring), from that group's first rank; DeepSpeed's own is put back afterwards. Otherwise nothing."""
    if not zero3 or topo.pp == 1:
        yield
        return
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    world = coordinator.assert_ints_same_as_other_ranks
    coordinator.assert_ints_same_as_other_ranks = _same_over(topo.get_data_parallel_group(), device)
    try:
        yield
    finally:
        coordinator.assert_ints_same_as_other_ranks = world


def grad_partition(optimizer):
    """``partition(p)``: this rank's share of ``p``'s accumulated, DP-averaged gradient under ZeRO 3 -- where a sum
    made after the last backward (the tied embeddings' over the stages) reaches the step. ZeRO 3 reduces and
    partitions every micro-batch's gradient in the backward; with ``managed_gradient_accumulation`` off it keeps
    the sum in one buffer per parameter until ``step()`` (``finalize_gradient_accumulation_boundary``)."""
    partitions = optimizer._DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition  # noqa: SLF001
    return lambda p: partitions.get(p.ds_id)


def count_norm_over_stages(optimizer, topo) -> None:
    """Give ZeRO 3's optimizer the single-process gradient norm of a pipeline (its clipping and reported norm).

    DeepSpeed's stage 3 (``get_grad_norm_direct``) counts a norm group over its partition group and the
    model-parallel (TP x PP) group, but the AutoEP experts' over their EDP and EP groups only, never over the
    stages; and it counts the last stage's copy of a tied embedding (``ds_pipe_replicated``, which ZeRO 1-2 skip)
    a second time. This counts each element once in the job, as ``megakit.train.engine.grad_norm`` does: the
    stage's dense partitions over DP x CP, its experts' over EDP then EP (on TP rank 0, the EP group being folded
    over TP x CP x DP), all of it over TP x PP. A non-finite norm is DeepSpeed's invalid -1 (the step is skipped).
    """
    from megakit.nn import comm
    from megakit.train.engine.experts import is_expert
    from megakit.train.engine.grad_norm import counted_in_norm

    def norm_groups() -> list[torch.Tensor]:
        pairs = [
            (p, g)
            for i, group in enumerate(optimizer.fp16_groups)
            for p, g in zip(group, optimizer.averaged_gradients[i])
        ]
        device = pairs[0][1].device if pairs else None
        dense = torch.zeros((), dtype=torch.float64, device=device)
        experts = torch.zeros((), dtype=torch.float64, device=device)
        for p, g in pairs:
            if is_expert(p):
                experts.add_(g.detach().double().pow(2).sum())
            elif counted_in_norm(p, topo):
                dense.add_(g.detach().double().pow(2).sum())
        comm.all_reduce(dense, topo.get_data_parallel_group())
        if getattr(topo, "ep", 1) > 1:
            comm.all_reduce(experts, topo.edp_group)
            comm.all_reduce(experts, topo.ep_group)
        if topo.tp_rank == 0:
            dense += experts
        comm.all_reduce(dense, topo.mp_group)
        norm = dense.sqrt().float()
        return [torch.where(torch.isfinite(norm), norm, torch.full_like(norm, -1.0))]

    optimizer._get_norm_groups = norm_groups  # noqa: SLF001 (stage 3's one place for the step's norm)


def accumulate_from_zero(optimizer) -> None:
    """At the start of a pipeline's step under ZeRO 3: every backward of the step adds its gradient partitions to
    buffers that start at zero.

    Stage 3 copies a backward's partitions into their buffers while ``micro_step_id`` is 0 and adds them after;
    ``engine.forward`` advances it when a backward has run since the last forward (``clear_backward_seen_flag``),
    and ``zero_grad`` sets it back to 0 at the step. That assumes each forward is followed by its backward. A
    pipeline's first stage runs 1F1B's warm-up forwards first (F0 F1 B0 B1 at PP 2), so its second backward copied
    over the first's gradients; an interleaved stage runs each chunk's first backward at another point of the step,
    and its chunks' forwards bypass ``engine.forward``. Zeroing the buffers (this rank's 1 / DP share of the
    gradients) and adding from the first backward on is right for every schedule."""
    optimizer.grad_partitions_flat_buffer.zero_()
    optimizer.micro_step_id = 1
