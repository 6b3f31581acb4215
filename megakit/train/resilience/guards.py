"""The NaN guard: a step whose loss or gradient norm is not finite is skipped, not the end of the run.

Large runs meet the odd non-finite step (a bad batch, an overflow); OPT and BLOOM skipped
them by hand, Megatron checks for them. Here the optimizer never applies such a step:

- DeepSpeed 0.19.8 already refuses one whose global gradient norm is not finite, on every
  path but one: ZeRO 1-2 (fp32, and bf16 with ``check_grad_overflow``, its default), ZeRO 3,
  its bf16 optimizer and fp16's loss scaler all compute the norm over the whole job and then
  clear the gradients instead of stepping. The exception, fp32 ZeRO 0, is megakit's own
  clipper (``grad_norm.Zero0Clipper``), which clears the gradients the same way on a
  non-finite norm, after an all-reduce of the flag over every rank.
- ``StepGuard.check`` then all-reduces, per rank, "my loss is not finite", "my gradients are
  not finite" and "my optimizer stepped", so every rank takes the same decision and the log
  names the ranks. A step that some ranks applied and others did not is a bug, and raises.
- The same all-reduce carries each rank's request to stop (a signal, its launcher gone: ``preemption``), so
  every rank stops after the same step without a collective or a host read of its own.

A skipped step still consumes its batch and its place in the LR schedule (the trainer sets
the schedule from the step, as a resume does): data and LR stay functions of the step, so a
run resumed from a checkpoint after a skip reproduces the uninterrupted one. After
``max_skipped`` skips in a row (``--max-skipped-steps``) the next non-finite step ends the
run with ``TrainingDiverged``, naming the step and the ranks. fp16 overflows with a finite
loss are the loss scaler's ordinary business (it lowers the scale and raises at its minimum)
and do not count towards that limit.
"""

from __future__ import annotations

import torch

from megakit.nn import comm

DEFAULT_MAX_SKIPPED = 10


class TrainingDiverged(RuntimeError):
    """A loss or gradient became NaN/inf too often; the message names the step and the rank(s)."""


class StepGuard:
    """Decides, alike on every rank, whether a step counts, was skipped, or ends the run."""

    def __init__(self, topo, *, max_skipped: int, precision: str, describe, device=None) -> None:
        self.topo, self.max_skipped, self.precision = topo, max_skipped, precision
        self.describe, self.device = describe, device
        self.skipped = 0  # steps skipped in all
        self.in_a_row = 0  # non-finite steps since the last good one (that count towards the limit)
        self.stops: dict[int, int] = {}  # the ranks that asked to stop after the last step checked, with why

    def check(
        self, step: int, loss: torch.Tensor, *, grads_finite: bool, applied: bool, stop: int = 0
    ) -> tuple[float, str | None]:
        """``(loss averaged over the job, None)`` for a good step, ``(nan, why)`` for a skipped one.

        Collective: one small all-reduce over every rank. Raises ``TrainingDiverged`` when the
        step is one non-finite step too many, and RuntimeError when the ranks disagree on stepping.
        ``stop``: this rank's reason to end the run after this step (``preemption.StopRequests.reason``, 0 for
        none); ``self.stops`` is then every rank's, ``{rank: reason}``, alike everywhere.
        """
        world = torch.distributed.get_world_size()
        loss = loss.detach().double().to(self.device or "cpu")
        flags = torch.zeros(3 * world + 1, dtype=torch.float64, device=self.device)
        loss_ok = bool(torch.isfinite(loss))
        own_loss = self.topo.is_last_stage  # earlier stages only received the last stage's loss
        rank = self.topo.rank
        flags[rank] = float(own_loss and not loss_ok) + 2.0 * float(not grads_finite)
        flags[world + rank] = float(applied)
        flags[2 * world] = (loss if loss_ok else torch.zeros((), device=self.device)) / world
        flags[2 * world + 1 + rank] = stop
        comm.all_reduce(flags, comm.WORLD)
        values = flags.tolist()  # the one host read
        bad = [(r, int(v)) for r, v in enumerate(values[:world]) if v]
        stepped = [bool(v) for v in values[world : 2 * world]]
        self.stops = {r: int(v) for r, v in enumerate(values[2 * world + 1 :]) if v}
        if not bad:
            self.in_a_row = 0
            if not all(stepped):  # a finite step the optimizer refused: cannot happen but by a bug
                raise RuntimeError(
                    f"step {step}: finite everywhere, but the optimizer did not step on ranks "
                    f"{[r for r, s in enumerate(stepped) if not s]}"
                )
            return values[2 * world], None
        what = {1: "loss", 2: "gradient", 3: "loss and gradient"}
        found = "; ".join(f"{self.describe(r)}: non-finite {what[v]}" for r, v in bad)
        if any(stepped):  # the update happened (e.g. bf16 with check_grad_overflow off): nothing to skip
            if not all(stepped):
                raise RuntimeError(f"step {step}: ranks disagree on skipping a non-finite step ({found})")
            raise TrainingDiverged(
                f"NaN/inf at step {step}: {found}; the optimizer applied it (set "
                "check_grad_overflow in the ds_config's bf16 section); lower the learning rate, "
                "enable gradient_clipping, or use bf16 instead of fp16"
            )
        scaler_overflow = self.precision == "fp16" and not any(v & 1 for _, v in bad)
        if not scaler_overflow:
            self.in_a_row += 1
            if self.in_a_row > self.max_skipped:
                raise TrainingDiverged(
                    f"NaN/inf at step {step}: {found}; {self.in_a_row} non-finite step(s) in a row "
                    f"(--max-skipped-steps {self.max_skipped}); lower the learning rate, enable "
                    "gradient_clipping, or use bf16 instead of fp16"
                )
        self.skipped += 1
        why = "fp16 overflow (loss scale lowered)" if scaler_overflow else found
        return float("nan"), f"step {step} skipped ({self.skipped} in all): {why}"
