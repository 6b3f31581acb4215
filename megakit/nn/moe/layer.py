"""The Mixture-of-Experts block (in place of the MLP on a config's MoE layers), with expert parallelism.

``MoE(config, ...)`` holds, under Hugging Face transformers 5's in-memory names (so the HF
mapping is a rename-free stack/unstack, ``megakit.interop.hf``):

- ``gate.weight`` ``(E, H)``: the router (``megakit.nn.moe.router``, fp32), and, with the aux-loss-free
  balancing, the buffer ``gate.e_score_correction_bias`` ``(E,)`` (fp32; only chooses experts);
- ``experts.gate_up_proj`` ``(E/EP, 2F, H)`` (gate rows first, then up, as ``MixtralExperts``) and
  ``experts.down_proj`` ``(E/EP, H, F)``: this rank's SwiGLU experts; rank ``r`` of the EP group
  holds experts ``[r E/EP, (r+1) E/EP)``; Nemotron-3's non-gated squared-ReLU experts hold
  ``experts.up_proj`` ``(E/EP, F, H)`` in place of ``gate_up_proj``;
- optionally ``shared_expert.{gate,up,down}_proj.weight`` (every token, width ``shared_ffn``; no gate when
  non-gated) and
  Qwen2-MoE's ``shared_expert_gate.weight`` ``(1, H)`` (the shared output times its sigmoid).

Layout. Experts are not split over TP (expert TP = 1). The block works on *this TP rank's part of
the tokens*: with sequence parallelism that is its ``S/tp`` rows as they come; without it the
replicated ``(S, B, H)`` input is cut into ``S/tp`` rows (forward: keep the slice, backward:
all-gather) and the output gathered back (forward: all-gather, backward: keep the slice); Megatron
requires SP for MoE with TP, megakit does the slicing itself instead. The router and the shared
expert are replicated over TP: each TP rank's partial gradient is summed over TP in backward
(``tensor_parallel.replicated``). Tokens go to the experts' EP ranks by ``megakit.nn.moe.dispatch``;
the EP group is folded over TP x CP x DP (``megakit.core.layout``), so with EP > 1 the TP ranks of a
group may hold different experts, and an expert's gradient is summed over the ranks that hold it
(EDP, by the trainer), never over TP. At EP 1 every rank holds every expert, replicated over TP like
the router. The result equals the single-process block at every TP x CP x EP layout (dropless routing).

Gradient reduction (for the trainer). After backward, dense parameters hold their TP x CP share
(CP times it, megakit's CP convention) and are averaged over DP x CP. An expert's gradient on a
rank already sums the contributions of every token of its EP group (the all-to-all's backward
brought them, from every TP rank of the group too), so: **sum expert gradients over the EDP group
and divide by DP x CP** -- the divisor of the dense average (as DeepSpeed's ZeRO-1/2 does for its
MoE parameter groups). The EDP sum covers every token slice of the stage once (EP x EDP = TP x CP x
DP); simply averaging over EDP would leave them EP / TP times too large.

Balancing losses (``moe.router``): the block adds ``aux_loss_coeff * aux + seq_aux_loss_coeff *
seq_aux + z_loss_coeff * z`` to the training objective by itself, Megatron's
``MoEAuxLossAutoScaler`` way: forward: the output unchanged; backward: the output's gradient,
and ``loss_scale`` as the gradient of that sum -- so every pipeline stage's MoE layers train their
router without the loss having to travel to the last stage. The trainer sets ``loss_scale`` to
what its loss is multiplied by before backward (``1 / gradient_accumulation_steps``, times the fp16
loss scale) with ``set_aux_loss_scale``. Each loss is a mean over one micro-batch of one DP replica,
so the gradient does not depend on TP, CP, EP or PP; ``seq_aux`` and ``z`` not on the micro-batch
size either (``aux`` is defined per micro-batch: a different cut is a different loss).

Metrics: ``stats`` (the last micro-batch: tokens per expert on this rank, the dropped
fraction, the three losses, the all-to-all bytes this rank sent and received in
forward -- backward moves as many; their time is the door's ``comm.metered``), and ``step_tokens``,
the step's assignments per expert on this rank, counted once per forward (not again when recomputation re-runs it in
backward); ``update_expert_bias`` sums them over the job once per optimizer step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megakit.core.moe_config import MoEConfig
from megakit.errors import UsageError
from megakit.nn import comm as C
from megakit.nn.moe.dispatch import make_dispatcher
from megakit.nn.moe.grouped_mm import grouped_mm
from megakit.nn.moe.router import balance_losses, capacity_keep, route
from megakit.nn.tensor_parallel.collectives import copy_to_tp, gather_from_tp, scatter_to_tp
from megakit.nn.tensor_parallel.layers import mark
from megakit.nn.tensor_parallel.lora import replicated_delta


def _param(*shape, dtype, device, ep: bool = False) -> nn.Parameter:
    p = mark(nn.Parameter(torch.empty(*shape, dtype=dtype, device=device)), None)  # replicated over TP
    p.ep_dim = 0 if ep else None  # experts: split over EP along dim 0 (global index = EP rank x local + i)
    return p


class _Weight(nn.Module):
    def __init__(self, rows: int, cols: int, *, dtype, device) -> None:
        super().__init__()
        self.weight = _param(rows, cols, dtype=dtype, device=device)
        self.lora_scaling = None  # megakit.nn.lora adds lora_A, lora_B and sets it (shared experts)

    def apply_to(self, x: torch.Tensor, tp_group) -> torch.Tensor:
        """``x W^T`` with the weight replicated over TP (its gradient summed), plus a LoRA adapter's output."""
        y = F.linear(x, copy_to_tp(self.weight, tp_group))
        return y if self.lora_scaling is None else y + replicated_delta(self, x, tp_group)


class Router(nn.Module):
    """``weight`` ``(E, H)``; ``e_score_correction_bias`` ``(E,)`` fp32 buffer with the expert bias."""

    def __init__(self, config: MoEConfig, hidden: int, *, dtype, device) -> None:
        super().__init__()
        self.weight = _param(config.experts, hidden, dtype=dtype, device=device)
        if config.router_bias:  # gpt-oss: a learned bias on the logits
            self.bias = _param(config.experts, dtype=dtype, device=device)
        if config.expert_bias:
            self.register_buffer(
                "e_score_correction_bias", torch.zeros(config.experts, dtype=torch.float32, device=device)
            )


class SharedExpert(nn.Module):
    """A SwiGLU MLP every token goes through (its TP-replicated weights see this rank's tokens); ``gated`` False:
    Nemotron-3's ``down(relu(up x)^2)``, no gate."""

    def __init__(self, hidden: int, ffn: int, *, dtype, device, gated: bool = True) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        if gated:
            self.gate_proj = _Weight(ffn, hidden, **kw)
        self.up_proj, self.down_proj = _Weight(ffn, hidden, **kw), _Weight(hidden, ffn, **kw)

    def forward(self, x: torch.Tensor, tp_group) -> torch.Tensor:
        """The shared expert on every token; its weights enter the TP region so their gradients are summed."""
        if not hasattr(self, "gate_proj"):
            return self.down_proj.apply_to(F.relu(self.up_proj.apply_to(x, tp_group)).square(), tp_group)
        # gate before up: the order autograd sums x's gradient in (a routed model's losses follow its rounding)
        gate, up = self.gate_proj.apply_to(x, tp_group), self.up_proj.apply_to(x, tp_group)
        return self.down_proj.apply_to(F.silu(gate) * up, tp_group)


class Experts(nn.Module):
    """This rank's SwiGLU experts, stacked. ``grouped``: ``torch._grouped_mm`` over device offsets ("auto": in
    fp32/bf16/fp16 when the strides allow it, CPU or CUDA; no host sync, one graph under ``--compile``) or a
    loop over experts (the same numbers; fp64, or widths the kernel cannot take: one copy of the counts to host).
    gpt-oss's (``biases``, ``limit``): a bias on both matrices, and the clamped SwiGLU (``MoEConfig``).
    ``gated`` False: Nemotron-3's non-gated squared ReLU, ``up_proj`` ``(E/EP, F, H)`` in place of ``gate_up_proj``
    (transformers' ``NemotronHExperts``), through the same two products."""

    def __init__(
        self,
        local: int,
        hidden: int,
        ffn: int,
        *,
        dtype,
        device,
        grouped: bool | str = "auto",
        biases: bool = False,
        limit: float = 0.0,
        alpha: float = 1.0,
        gated: bool = True,
    ) -> None:
        super().__init__()
        self.first = "gate_up_proj" if gated else "up_proj"  # the first product's stacked weight
        setattr(self, self.first, _param(local, (1 + gated) * ffn, hidden, dtype=dtype, device=device, ep=True))
        self.down_proj = _param(local, hidden, ffn, dtype=dtype, device=device, ep=True)
        if biases:
            self.gate_up_proj_bias = _param(local, 2 * ffn, dtype=dtype, device=device, ep=True)
            self.down_proj_bias = _param(local, hidden, dtype=dtype, device=device, ep=True)
        self.grouped, self.limit, self.alpha = grouped, limit, alpha

    def _glu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU of ``[gate | up]``, or gpt-oss's: ``(clamp(up, -l, l) + 1) x g sigmoid(alpha g)``,
        ``g = min(gate, l)``; non-gated: ``relu(up)^2``."""
        if self.first == "up_proj":
            return F.relu(gate_up).square()
        gate, up = gate_up.chunk(2, dim=-1)
        if not self.limit:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        return (up.clamp(-self.limit, self.limit) + 1) * gate * torch.sigmoid(gate * self.alpha)

    def _biases(self, tp_group) -> tuple:
        if not hasattr(self, "gate_up_proj_bias"):
            return None, None
        return copy_to_tp(self.gate_up_proj_bias, tp_group), copy_to_tp(self.down_proj_bias, tp_group)

    def use_grouped(self, x: torch.Tensor) -> bool:
        """ "auto": the kernel's dtypes (fp32, bf16, fp16 on the CPU; on CUDA bf16 on Hopper or Blackwell only,
        where torch has the fused kernel: elsewhere its fallback copies the offsets to the host and loops, waiting
        at every product), rows and widths 16-byte aligned."""
        if self.grouped != "auto":
            return bool(self.grouped)
        aligned = all(n * x.element_size() % 16 == 0 for n in (x.shape[-1], self.down_proj.shape[-1]))
        if x.is_cuda:
            kernel = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
        else:
            kernel = x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        return hasattr(torch, "_grouped_mm") and aligned and x.shape[0] > 0 and kernel

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int], tp_group=None) -> torch.Tensor:
        """``rows`` ``(M, H)`` grouped by local expert (``counts[e]`` each, on the device), then rows no expert
        computes (dropped assignments: zeros out) -> ``(M, H)``."""
        counts = torch.as_tensor(counts, dtype=torch.int64, device=rows.device)
        gate_up, down = copy_to_tp(getattr(self, self.first), tp_group), copy_to_tp(self.down_proj, tp_group)
        bias_up, bias_down = self._biases(tp_group)
        if self.use_grouped(rows):
            if torch.compiler.is_compiling():
                return self._grouped(rows, counts, gate_up, down, bias_up, bias_down)
            try:
                return self._grouped(rows, counts, gate_up, down, bias_up, bias_down)
            except RuntimeError:  # a device or build without the kernel: the loop, from now on
                if self.grouped is True:
                    raise
                self.grouped = False
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):  # a copy to the host: only where the kernel cannot run (fp64 tests)
            h = self._glu(F.linear(rows[start : start + n], gate_up[e], None if bias_up is None else bias_up[e]))
            out.append(F.linear(h, down[e], None if bias_down is None else bias_down[e]))
            start += n
        if start < rows.shape[0]:
            out.append(rows.new_zeros(rows.shape[0] - start, down.shape[1]))
        return torch.cat(out) if out else rows[:0]

    def _grouped(self, rows, counts, gate_up, down, bias_up, bias_down) -> torch.Tensor:
        """Two ``torch._grouped_mm`` over device offsets, static shapes. The kernel leaves rows past the last
        offset unwritten, in the output and in the input's gradient: both are masked to zeros, so a dropped
        row adds nothing forward or backward. Only rows routed to expert e see its bias."""
        ends = counts.cumsum(0)
        offs = ends.to(torch.int32)
        position = torch.arange(rows.shape[0], device=rows.device)
        valid = (position < ends[-1]).unsqueeze(-1)  # (M, 1)
        expert = (
            None if bias_up is None else torch.searchsorted(ends, position, right=True).clamp(max=counts.numel() - 1)
        )  # (M,) each row's expert
        h = grouped_mm(torch.where(valid, rows, 0), gate_up.transpose(1, 2), offs)  # (M, 2F)
        h = torch.where(valid, h if expert is None else h + bias_up[expert], 0)
        out = grouped_mm(self._glu(h), down.transpose(1, 2), offs)  # (M, H)
        return torch.where(valid, out if expert is None else out + bias_down[expert], 0)


class _AttachLoss(torch.autograd.Function):
    """forward: ``out`` unchanged; backward: ``out``'s gradient, and ``scale`` as ``loss``'s (see module doc)."""

    @staticmethod
    def forward(ctx, out, loss, scale):
        ctx.scale, ctx.dtype = scale, loss.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=ctx.dtype, device=grad.device), None


def _in_backward() -> bool:
    """True while autograd runs a backward pass (a checkpointed block recomputing its forward)."""
    task = getattr(torch._C, "_current_graph_task_id", None)  # private; tested by test_moe's recompute case
    return task is not None and task() != -1


class MoE(nn.Module):
    """The routed block: ``(S', B, H) -> (S', B, H)``; see the module docstring."""

    SUMMED = ("dropped", "aux", "seq_aux", "z")  # ``stats`` summed over the step's forwards in ``step_sums``

    def __init__(
        self,
        config: MoEConfig,
        hidden: int,
        *,
        group=None,
        sequence_parallel: bool = False,
        cp_group=None,
        ep_group=None,
        dtype=torch.float32,
        device=None,
        grouped: bool | str = "auto",
    ) -> None:
        super().__init__()
        ep = C.size(ep_group)
        if config.experts % ep:
            raise UsageError(
                f"--ep {ep} does not divide the {config.experts} experts; choose an EP that divides "
                "the number of experts"
            )
        self.config, self.hidden = config, hidden
        self.tp_group = group if C.size(group) > 1 else None
        self.split_sequence = self.tp_group is not None and not sequence_parallel
        self.cp_group = cp_group if C.size(cp_group) > 1 else None
        self.ep_group, self.ep, self.ep_rank = ep_group, ep, C.rank(ep_group)
        self.dispatcher = make_dispatcher(config.experts, ep_group)
        kw = dict(dtype=dtype, device=device)
        self.gate = Router(config, hidden, **kw)
        self.experts = Experts(
            config.experts // ep,
            hidden,
            config.ffn,
            grouped=grouped,
            biases=config.expert_biases,
            limit=config.swiglu_limit,
            alpha=config.swiglu_alpha,
            gated=config.activation == "swiglu",
            **kw,
        )
        if config.shared_ffn:
            self.shared_expert = SharedExpert(hidden, config.shared_ffn, gated=config.activation == "swiglu", **kw)
            if config.shared_gate:
                self.shared_expert_gate = _Weight(1, hidden, **kw)
        self.register_buffer(
            "step_tokens", torch.zeros(config.experts, dtype=torch.int64, device=device), persistent=False
        )
        # 0 while a checkpointed block recomputes its forward in backward (``counting``): set eagerly, read as a
        # tensor, so the compiled block neither breaks nor recompiles on it
        self.register_buffer("counting", torch.ones((), dtype=torch.int64, device=device), persistent=False)
        # the step's sums of ``SUMMED`` over its forwards, and how many (the trainer's metrics, ``engine.moe_step``):
        # buffers, not a hook's Python state, so every layer shares one compiled graph and nothing waits
        self.register_buffer(
            "step_sums", torch.zeros(len(self.SUMMED), dtype=torch.float64, device=device), persistent=False
        )
        self.register_buffer("step_forwards", torch.zeros((), dtype=torch.float64, device=device), persistent=False)
        self.loss_scale = 1.0
        self.stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Routes each token to its top-k experts over EP and adds the shared expert, if any."""
        if self.split_sequence:
            if x.shape[0] % C.size(self.tp_group):
                raise UsageError(
                    f"sequence length {x.shape[0]} is not divisible by TP {C.size(self.tp_group)}; "
                    "MoE layers split the tokens over TP (pad the batch or change --tp)"
                )
            x = scatter_to_tp(x, self.tp_group, 0)  # forward: keep S/tp rows; backward: all-gather
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)  # token i is position i // B of sequence i % B
        cfg, tp = self.config, self.tp_group
        fp = torch.promote_types(tokens.dtype, torch.float32)  # fp32, or fp64 in fp64 tests
        router_bias = copy_to_tp(self.gate.bias, tp).to(fp) if cfg.router_bias else None
        logits = F.linear(tokens.to(fp), copy_to_tp(self.gate.weight, tp).to(fp), router_bias)  # (N, E)
        bias = getattr(self.gate, "e_score_correction_bias", None)
        if cfg.force_balance and self.training:  # --moe-force-balance: a draw of this rank's default generator,
            # seeded from --seed and its place in the grid (Megatron's apply_random_logits); the router learns nothing
            logits = torch.randn(logits.shape, dtype=logits.dtype, device=logits.device)
        experts, weights, scores = route(logits, cfg, bias)
        keep = (
            None if cfg.capacity_factor is None else capacity_keep(experts, weights, cfg.experts, cfg.capacity_factor)
        )
        rows, counts, plan = self.dispatcher.dispatch(tokens, experts, keep)
        experts_tp = tp if self.ep == 1 else None  # EP > 1: the experts' gradient is summed over EDP instead
        slots = self.dispatcher.combine(self.experts(rows, counts, experts_tp), plan)  # (N, k, H)
        y = (slots * weights.unsqueeze(-1).to(slots.dtype)).sum(1)  # fixed order: deterministic
        if cfg.shared_ffn:
            shared = self.shared_expert(tokens, tp)
            if cfg.shared_gate:
                shared = torch.sigmoid(F.linear(tokens, copy_to_tp(self.shared_expert_gate.weight, tp))) * shared
            y = y + shared
        losses = balance_losses(logits, scores, experts, batch=b, config=cfg, tp_group=tp, cp_group=self.cp_group)
        total = cfg.aux_loss_coeff * losses.aux + cfg.seq_aux_loss_coeff * losses.seq_aux + cfg.z_loss_coeff * losses.z
        if (
            torch.is_grad_enabled()
            and total.requires_grad
            and (cfg.aux_loss_coeff or cfg.seq_aux_loss_coeff or cfg.z_loss_coeff)
        ):
            y = _AttachLoss.apply(y, total, self.loss_scale)
        self._record(experts, keep, losses, plan, h * tokens.element_size())
        y = y.view(s, b, h)
        return gather_from_tp(y, self.tp_group, 0) if self.split_sequence else y

    @torch.no_grad()
    def _record(self, experts, keep, losses, plan, row_bytes: int) -> None:
        flat = experts.reshape(-1)  # bincount would wait for the device (its length depends on the values)
        counts = torch.zeros(self.config.experts, dtype=torch.int64, device=flat.device).scatter_add_(
            0, flat, torch.ones_like(flat)
        )
        moved = getattr(plan, "moved", None)  # rows to and from other EP ranks in dispatch; combine moves as many
        a2a = torch.zeros((), dtype=torch.int64) if moved is None else 2 * row_bytes * moved
        if self.training:
            self.step_tokens += counts * self.counting
        # the step's loads and bias norm come from ``step_tokens`` and the bias, once a step (``engine.moe_step``)
        self.stats = {
            "tokens_per_expert": counts,
            "dropped": (1 - keep.float().mean()) if keep is not None else losses.aux.new_zeros(()),
            "aux": losses.aux.detach(),
            "seq_aux": losses.seq_aux.detach(),
            "z": losses.z.detach(),
            "a2a_bytes": a2a,
        }  # sent + received by this rank in forward (backward: as much)
        if self.training:
            self.step_sums += torch.stack([self.stats[f] for f in self.SUMMED]).to(self.step_sums) * self.counting
            self.step_forwards += self.counting


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE layers, whose load-balance losses and counts the trainer collects."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def counting(module: nn.Module):
    """``module`` (a block) as a function for ``torch.utils.checkpoint``: eagerly, before each run, its MoE
    layers learn whether it is the forward (count the tokens) or the recompute in backward (do not)."""
    layers = moe_layers(module)
    if not layers:
        return module

    def run(*args):
        forward = not _in_backward()
        for m in layers:
            m.counting.fill_(forward)
        return module(*args)

    return run


def set_aux_loss_scale(model: nn.Module, scale: float) -> None:
    """What the trainer multiplies its loss by before backward (1 / accumulation steps, x fp16 scale)."""
    for m in moe_layers(model):
        m.loss_scale = float(scale)


@torch.no_grad()
def update_expert_bias(model: nn.Module, topo=None, *, move: bool = True) -> torch.Tensor | None:
    """Once per optimizer step: sum each MoE layer's ``step_tokens`` over every rank that routes tokens
    for it (DP x CP, then TP; one all-reduce each for all layers), move the expert bias by
    ``bias_update_rate * sign(mean load - load)`` (DeepSeek-V3; layers with ``expert_bias``) unless
    ``move`` is False (a skipped step changes no state) or the router is frozen (a LoRA fine-tune: the bias is
    the base's, which an adapter checkpoint does not keep), and zero the counts. Returns the summed
    counts ``(layers, E)`` (metrics), None without MoE layers.
    Collective over DP x CP and TP: every rank of a pipeline stage calls it."""
    layers = moe_layers(model)
    if not layers:
        return None
    counts = torch.stack([m.step_tokens for m in layers])
    if topo is not None:
        C.all_reduce(counts, topo.get_data_parallel_group() if topo.dp * topo.cp > 1 else None)
        C.all_reduce(counts, topo.tp_group if topo.tp > 1 else None)
    for m, load in zip(layers, counts.double()):
        bias = getattr(m.gate, "e_score_correction_bias", None)
        if bias is not None and m.config.expert_bias and move and m.gate.weight.requires_grad:
            bias += (m.config.bias_update_rate * torch.sign(load.mean() - load)).to(bias.dtype)
        m.step_tokens.zero_()
    return counts
