"""Muon for the hidden matrices, AdamW for the rest: ``--optimizer muon``, exact at every layout megakit runs it.

The math is ``torch.optim.Muon``'s own (its Newton-Schulz, coefficients and 5 steps, and its ``match_rms_adamw``
learning-rate adjustment ``0.2 sqrt(max(A, B))``, so Muon reuses AdamW's lr and weight decay, Moonshot's point):
this module calls torch's functions, so one process equals ``torch.optim.Muon`` on the same matrices.

"The same matrices" are the model's own weights as Hugging Face stores them unfused: q, k, v, o, gate, up and
down each (megakit keeps them apart already), and per expert its gate, its up and its down -- megakit's stacked
``experts.gate_up_proj (E, 2F, H)`` is E x 2 matrices, ``experts.down_proj`` E. Embeddings, the head, the
routers' gates, norms and biases step with AdamW (``torch.optim.AdamW``, the same groups ``decay_groups`` gives).

Distributed. Newton-Schulz needs a whole matrix, so a TP shard (column-parallel: split by rows, ``tp_dim`` 0;
row-parallel: by columns, ``tp_dim`` 1) is all-gathered over TP, every TP rank orthogonalises the whole matrix and
keeps its own slice. Chosen over the layer-wise way (one owner per matrix, gather to it, scatter back) because one
all-gather moves the same bytes as the owner's gather and needs no second collective, every rank ends bit-equal
without a broadcast, and the redundant Newton-Schulz FLOPs (``megakit plan --optimizer muon`` prices them) are a
few percent of a step at the sizes TP is used. PP stages, EP ranks (each holds whole experts), SP and CP (their
gradients are reduced before the step) and DP at ZeRO 0 (every rank holds the same averaged gradient) need nothing
more. DeepSpeed's ZeRO 1-3 hand a client optimizer flat fp32 partitions, not matrices, so they are refused, as is
DeepSpeed's own Muon (``deepspeed/runtime/zero/muon``), which is not torch's: it scales by ``sqrt(max(1, A/B))``,
iterates in fp16 ("gram" Newton-Schulz) by default and orthogonalises TP shards alone.

State: ``momentum_buffer`` per Muon parameter (one fp32 moment, the parameter's shape, split over TP like it) and
``exp_avg``/``exp_avg_sq`` per AdamW parameter, so megakit's layout-free checkpoints save and reshard both.
"""

from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS
from torch.optim._muon import _adjust_lr as adjust_lr
from torch.optim._muon import _zeropower_via_newtonschulz as newton_schulz

from megakit.errors import UsageError
from megakit.nn import comm as C
from megakit.train.engine.optim import decay_groups

OPTIMIZERS = ("adamw", "muon")
ADJUST_LR = "match_rms_adamw"
ADAMW_BETAS = (0.9, 0.95)
# weights that are not hidden matrices although 2-D: embeddings, the head, the routers' gates
_ADAMW_NAMES = ("embed.weight", "lm_head.weight", "mlp.gate.weight", "shared_expert_gate.weight")


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """A hidden matrix (or a stack of experts' matrices): Muon; anything else: AdamW."""
    return param.ndim >= 2 and not name.endswith("bias") and not name.endswith(_ADAMW_NAMES)


def matrices(name: str, update: torch.Tensor) -> list[torch.Tensor]:
    """The views of ``update`` Newton-Schulz runs on, one per matrix as torch.optim.Muon sees the unfused model:
    each expert's gate and up apart (``gate_up_proj``: gate rows, then up), each expert's down."""
    if update.ndim == 2:
        return [update]
    stack = update.reshape(-1, *update.shape[-2:])
    if name.endswith("gate_up_proj"):
        return [half for expert in stack for half in expert.chunk(2, dim=0)]
    return list(stack)


def muon_groups(module: torch.nn.Module, *, weight_decay: float) -> list[dict]:
    """``module``'s trainable parameters as optimizer groups: Muon's (decayed), then AdamW's decayed and not."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if uses_muon(n, p)]
    ids = {id(p) for p in hidden}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in decay_groups(module)]
    names = {id(p): n for n, p in named}
    groups = [{"name": "muon", "use_muon": True, "params": hidden, "names": [names[id(p)] for p in hidden]}]
    groups += [{**g, "use_muon": False} for g in rest if g["params"]]
    for group in groups:
        group.setdefault("weight_decay", weight_decay)
    return [g for g in groups if g["params"]]


def check_muon(ds_config: dict, *, lr: float, weight_decay: float) -> None:
    """One line for what ``--optimizer muon`` cannot run: an optimizer the ds_config names too, a ZeRO stage that
    hands the optimizer flat partitions, a precision whose optimizer does the same, a bad lr or weight decay."""
    if "optimizer" in ds_config:
        kind = ds_config["optimizer"].get("type")
        raise UsageError(
            f'--optimizer muon builds the optimizer itself, but the ds_config has an "optimizer" section ({kind}); '
            "remove it (ds_configs/muon.json has none) and set --muon-lr and --muon-weight-decay"
        )
    stage = int(ds_config.get("zero_optimization", {}).get("stage", 0))
    if stage != 0:
        raise UsageError(
            f"--optimizer muon with ZeRO {stage}: DeepSpeed's ZeRO 1-3 hand the optimizer flat partitions, and "
            "Newton-Schulz needs whole matrices; use ZeRO 0 (ds_configs/muon.json)"
        )
    for key in ("bf16", "fp16"):
        if ds_config.get(key, {}).get("enabled"):
            raise UsageError(
                f"--optimizer muon with {key}: DeepSpeed's {key} optimizer steps flat fp32 copies, not matrices; "
                "train in fp32 (ds_configs/muon.json)"
            )
    if not lr > 0 or not weight_decay >= 0:
        raise UsageError(f"--muon-lr must be above 0 and --muon-weight-decay at least 0, got {lr:g} and {weight_decay:g}")


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer for DeepSpeed (a client optimizer at ZeRO 0): Muon's groups, AdamW's groups, one lr.

    ``tp_group``: the TP group, over which split matrices are all-gathered (``None``: one rank). The LR schedule
    sets every group's ``lr``; Muon's matrices step at ``adjust_lr(lr)``."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        betas: tuple[float, float] = ADAMW_BETAS,
        eps: float = 1e-8,
        tp_group=None,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, betas=betas, eps=eps)
        super().__init__(groups, defaults)
        self.tp_group = tp_group
        adam = [g for g in self.param_groups if not g["use_muon"]]
        self.adamw = torch.optim.AdamW(adam, lr=lr, betas=betas, eps=eps) if adam else None
        if self.adamw is not None:
            self.adamw.state = self.state  # one state: the checkpoints read ``self.state``

    @torch.no_grad()
    def step(self, closure=None):
        """Muon's matrices, then AdamW's step (the same ``state`` entries torch.optim.AdamW keeps)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["use_muon"]:
                for name, p in zip(group["names"], group["params"]):
                    if p.grad is not None:
                        self._muon(name, p, group)
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.adamw.step()
        return loss

    def _muon(self, name: str, p: torch.Tensor, group: dict) -> None:
        """torch.optim.Muon's step for ``p`` (``_single_tensor_muon``), on the whole matrices of a TP shard."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        update = grad.lerp(buf, momentum) if group["nesterov"] else buf
        tp_dim = getattr(p, "tp_dim", None) if C.size(self.tp_group) > 1 else None
        whole = C.all_gather(update.contiguous(), self.tp_group, dim=tp_dim) if tp_dim is not None else update
        orthogonal = torch.empty(whole.shape, dtype=p.dtype, device=p.device)
        out = matrices(name, orthogonal)
        scale = []
        for src, dst in zip(matrices(name, whole), out):
            dst.copy_(newton_schulz(src, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS))
            scale.append(adjust_lr(group["lr"], ADJUST_LR, src.shape))
        if tp_dim is not None:
            orthogonal = C.split(orthogonal, self.tp_group, dim=tp_dim)
        assert len(set(scale)) == 1, (name, p.shape)  # a stack's matrices share one shape
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(orthogonal, alpha=-scale[0])
