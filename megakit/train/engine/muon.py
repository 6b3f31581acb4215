"""Muon for the hidden matrices, AdamW for the rest: ``--optimizer muon``, exact at every layout megakit runs it.

The math is ``torch.optim.Muon``'s own (its Newton-Schulz, coefficients and 5 steps, and its ``match_rms_adamw``
learning-rate adjustment ``0.2 sqrt(max(A, B))``, so Muon reuses AdamW's lr and weight decay, Moonshot's point):
this module calls torch's functions, so one process equals ``torch.optim.Muon`` on the same matrices.

"The same matrices" are the model's own weights as Hugging Face stores them unfused: q, k, v, o, gate, up and down
each (megakit keeps them apart already), and per expert its gate, its up and its down -- megakit's stacked
``experts.gate_up_proj (E, 2F, H)`` is E x 2 matrices, ``experts.down_proj`` E. Embeddings, the head, the routers'
gates, norms and biases step with AdamW (``torch.optim.AdamW``, the same groups ``decay_groups`` gives).

Distributed. Newton-Schulz needs a whole matrix, so TP shards (column-parallel: split by rows, ``tp_dim`` 0; row-
parallel: by columns, ``tp_dim`` 1) go layer-wise over TP, as Megatron's and torchtitan's: each split matrix has one
owner TP rank (the largest first, to the least loaded), one all-to-all brings it its shards, it orthogonalises the
whole matrix, and a second all-to-all returns each rank its slice (``orthogonalise_over_tp``). Chosen over an all-
gather with Newton-Schulz on every TP rank because the planner's cost of that grows with TP: every rank would run
all the FLOPs (Llama-3-8B at TP 8: 666 TFLOP per GPU and step instead of 83) and receive (TP-1)/TP of the split
matrices' bytes instead of about 2 (TP-1)/TP^2 (23 GiB instead of 5.7 GiB); the same at TP 2. PP stages, EP ranks
(each holds whole experts), SP and CP (their gradients are reduced before the step) and DP at ZeRO 0 (every rank
holds the same averaged gradient) need nothing more. DeepSpeed's ZeRO 1-2 hand a client optimizer one flat fp32
partition per group: the momentum is elementwise and steps it there, and each weight goes whole to one owner DP
rank and back, layer-wise over DP as over TP (``megakit.train.engine.muon_zero``); bf16 and fp16 then step the fp32
masters. ZeRO 3 (each weight partitioned alone) and bf16/fp16 at ZeRO 0 (DeepSpeed's BF16 optimizer flattens
without handing out its layout) are refused. DeepSpeed's own Muon (``deepspeed/runtime/zero/muon``, its ZeRO 1-2
orthogonalise in ``get_flat_partition``) is not used, as it is not torch's: it scales by ``sqrt(max(1, A/B))``,
iterates in fp16 ("gram" Newton-Schulz) by default and orthogonalises TP shards alone. Its hooks stay off here:
they look for a ``use_muon`` attribute on the weights (megakit's groups carry a ``use_muon`` key) or an
``isinstance`` of its ``MuonWithAuxAdam``.

State: ``momentum_buffer`` per Muon parameter (one fp32 moment, the parameter's shape, split over TP like it; at
ZeRO 1-2 one per flat partition, partitioned over DP like the masters) and ``exp_avg``/``exp_avg_sq`` per AdamW
parameter, so megakit's layout-free checkpoints save and reshard both (``state_keys`` says which a weight has).
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
_ADAMW_NAMES = ("embed.weight", "lm_head.weight", "mlp.gate.weight", "mixer.gate.weight", "shared_expert_gate.weight")


def uses_muon(name: str, param: torch.Tensor) -> bool:
    """A hidden matrix (or a stack of experts' matrices): Muon; anything else: AdamW, the short depthwise conv
    filters of Gated DeltaNet and Mamba-2 too (``(C, K)`` taps, not a matrix: Moonlight and Megatron keep them on
    AdamW, and torch.optim.Muon refuses transformers' ``(C, 1, K)`` conv weight)."""
    leaf = name.rsplit(".", 2)
    conv = any(part.startswith("conv_") for part in leaf[-2:])
    return param.ndim >= 2 and not conv and not name.endswith("bias") and not name.endswith(_ADAMW_NAMES)


def matrices(name: str, update: torch.Tensor) -> list[torch.Tensor]:
    """The views of ``update`` Newton-Schulz runs on, one per matrix as torch.optim.Muon sees the unfused model:
    each expert's gate and up apart (``gate_up_proj``: gate rows, then up), each expert's down."""
    if update.ndim == 2:
        return [update]
    stack = update.reshape(-1, *update.shape[-2:])
    if name.endswith("gate_up_proj"):
        return [half for expert in stack for half in expert.chunk(2, dim=0)]
    return list(stack)


def muon_groups(module: torch.nn.Module, *, weight_decay: float, experts: bool = False) -> list[dict]:
    """``module``'s trainable parameters as optimizer groups: Muon's (decayed), then AdamW's decayed and not.

    ``experts`` (ZeRO 1-2 with EP): DeepSpeed's experts (``megakit.train.engine.experts``) in groups of their own,
    as its ZeRO optimizer partitions them over their EDP group (``split_params_into_different_moe_groups_for_
    optimizer``, which DeepSpeed runs itself only for an optimizer of the ds_config)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if uses_muon(n, p)]
    ids = {id(p) for p in hidden}
    rest = [{**g, "params": [p for p in g["params"] if id(p) not in ids]} for g in decay_groups(module)]
    names = {id(p): n for n, p in named}
    groups = [{"name": "muon", "use_muon": True, "params": hidden, "names": [names[id(p)] for p in hidden]}]
    groups += [{**g, "use_muon": False} for g in rest if g["params"]]
    for group in groups:
        group.setdefault("weight_decay", weight_decay)
    if experts:
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        groups = split_params_into_different_moe_groups_for_optimizer(groups)
        for group in (g for g in groups if g["use_muon"]):
            group["names"] = [names[id(p)] for p in group["params"]]
    return [g for g in groups if g["params"]]


def check_muon(ds_config: dict, *, lr: float, weight_decay: float) -> None:
    """One line for what ``--optimizer muon`` cannot run: an optimizer the ds_config names too, ZeRO 3 (flat
    partitions of whole weights it cannot exchange), bf16/fp16 at ZeRO 0 (DeepSpeed's BF16/FP16 optimizer flattens
    without the layout ZeRO 1-2 give), the optimizer offloaded to the CPU, a bad lr or weight decay."""
    if "optimizer" in ds_config:
        kind = ds_config["optimizer"].get("type")
        raise UsageError(
            f'--optimizer muon builds the optimizer itself, but the ds_config has an "optimizer" section ({kind}); '
            "remove it (ds_configs/muon.json has none) and set --muon-lr and --muon-weight-decay"
        )
    zero = ds_config.get("zero_optimization", {})
    stage = int(zero.get("stage", 0))
    if stage == 3:
        raise UsageError(
            "--optimizer muon with ZeRO 3: each weight is partitioned over DP, and Newton-Schulz needs whole "
            "matrices; use ZeRO 1 or 2 (ds_configs/muon_zero1.json)"
        )
    for key in ("bf16", "fp16"):
        if stage == 0 and ds_config.get(key, {}).get("enabled"):
            raise UsageError(
                f"--optimizer muon with {key} at ZeRO 0: DeepSpeed's {key} optimizer steps flat fp32 copies, not "
                "matrices; use ZeRO 1 (ds_configs/muon_zero1.json), or train in fp32 (ds_configs/muon.json)"
            )
    if stage and zero.get("offload_optimizer", {}).get("device", "none") != "none":
        raise UsageError(
            "--optimizer muon with the optimizer offloaded: its DP exchange runs on the accelerator's partitions; "
            'drop "offload_optimizer" from the ds_config'
        )
    if not lr > 0 or not weight_decay >= 0:
        raise UsageError(
            f"--muon-lr must be above 0 and --muon-weight-decay at least 0, got {lr:g} and {weight_decay:g}"
        )


class QKClip:
    """MuonClip's QK-clip (Kimi K2, arXiv 2507.20534): after each step, a head whose largest attention logit in the
    step's forwards passed ``tau`` has its query and key weights scaled so that it would be ``tau``.

    Each attention module records its heads' largest logit (``Attention.max_logits``, a second ``q k^T`` in the
    forward); the maximum over the ranks holding the same weights (``group``: DP) gives ``gamma = min(1, tau / max)``
    per head. With as many K/V heads as query heads, the head's rows of ``W_q`` and ``W_k`` (and biases) are scaled
    by ``sqrt(gamma)`` each; with grouped K/V heads shared by several query heads, ``W_q``'s rows by ``gamma`` (the
    shared key stays), as Kimi K2 does for MLA's shared rotary key. TP splits the heads with the rows: no exchange.
    Under ZeRO 1-2 the fp32 masters are the weights' truth: each rank scales its fragments of them."""

    def __init__(self, module: torch.nn.Module, *, tau: float, group=None) -> None:
        from megakit.nn.attention.core import Attention

        self.tau, self.group = tau, group
        self.attention = [m for m in module.modules() if isinstance(m, Attention)]
        for m in self.attention:
            m.max_logits = torch.zeros(m.heads, device=m.q_proj.weight.device)

    @torch.no_grad()
    def clip(self) -> None:
        """Scale the heads above ``tau`` and start the next step's maxima (no host sync: on device)."""
        if not self.attention:
            return
        logits = torch.stack([m.max_logits for m in self.attention])  # (attention modules, heads/tp)
        logits = C.all_reduce(logits, self.group, op=torch.distributed.ReduceOp.MAX)
        gamma = self.tau / logits.clamp(min=self.tau)
        for m, g in zip(self.attention, gamma):
            scaled = [(m.q_proj, g)] if m.kv_heads != m.heads else [(m.q_proj, g.sqrt()), (m.k_proj, g.sqrt())]
            for proj, factor in scaled:
                rows = factor.repeat_interleave(m.head_dim)  # (heads * head_dim,): each head's rows
                _scale_rows(proj.weight, rows)
                if proj.bias is not None:
                    _scale_rows(proj.bias, rows)
            m.max_logits = torch.zeros_like(m.max_logits)


def _scale_rows(param: torch.Tensor, rows: torch.Tensor) -> None:
    """``param``'s rows times ``rows``. ZeRO 1-2 (a DeepSpeed fragment mapping): the fp32 master's fragment this
    rank holds, copied into the weight's same elements (DeepSpeed's all-gather after the step spreads them)."""
    if not hasattr(param, "_hp_mapping"):  # ZeRO 0 in fp32: the weight is the master
        param.mul_(rows.to(param.dtype).view(-1, *[1] * (param.ndim - 1)))
        return
    if param._hp_mapping is None:  # no fragment on this rank
        return
    address, master = param._hp_mapping.lp_fragment_address, param._hp_mapping.get_hp_fragment()
    factor = rows.repeat_interleave(param[0].numel()) if param.ndim > 1 else rows  # per element, row-major
    master.mul_(factor.narrow(0, address.start, address.numel).to(master.dtype))
    param.view(-1).narrow(0, address.start, address.numel).copy_(master)


def check_qk_clip(config, *, tau: float, optimizer: str, cp: int) -> None:
    """One line where QK-clip has no attention logits it can clip by scaling W_q and W_k."""
    if tau == 0:
        return
    if optimizer != "muon" or not tau > 0:
        raise UsageError(
            f"--qk-clip {tau:g} is MuonClip's: use it with --optimizer muon and a tau above 0 (Kimi K2: 100)"
        )
    cannot = "--qk-clip cannot clip this model's attention logits by scaling W_q and W_k:"
    if config.mla is not None:
        raise UsageError(f"{cannot} its attention is MLA (latent q and k, not q/k heads); drop --qk-clip")
    if config.qk_norm:
        raise UsageError(f"{cannot} it normalises each head's q and k (qk_norm), so no scale reaches a logit")
    if config.attention_sinks or config.dropout > 0:
        raise UsageError(f"{cannot} its attention sinks or dropout run outside the path that records the logits")
    if cp > 1:
        raise UsageError(f"--qk-clip with --cp {cp}: CP splits each query's keys over ranks; use --cp 1")


class MuonWithAdamW(torch.optim.Optimizer):
    """One optimizer for DeepSpeed (a client optimizer at ZeRO 0-2): Muon's groups, AdamW's groups, one lr.

    ``tp_group``: the TP group, over which split matrices go to their owners (``None``: one rank). The LR schedule
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
        qk_clip: QKClip | None = None,
    ) -> None:
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=True, betas=betas, eps=eps)
        super().__init__(groups, defaults)
        self.tp_group, self.qk_clip = tp_group, qk_clip
        self.names = {id(p): n for g in groups if g["use_muon"] for n, p in zip(g["names"], g["params"], strict=True)}
        self.muon_params = set(self.names)  # ids of the weights (and, under ZeRO, flat partitions) Muon steps
        self.flat: dict = {}  # ZeRO 1-2: id of a Muon group's flat partition -> its layout (``muon_zero.bind``)
        self.last_group = self.param_groups[-1]
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
            if group["use_muon"] and id(group["params"][0]) in self.flat:
                self._step_flat(group)
            elif group["use_muon"]:
                named = [(n, p) for n, p in zip(group["names"], group["params"]) if p.grad is not None]
                updates = [self._momentum(p, group) for _, p in named]
                split = [getattr(p, "tp_dim", None) if C.size(self.tp_group) > 1 else None for _, p in named]
                whole = [i for i, d in enumerate(split) if d is None]
                orthogonal = dict(zip(whole, (orthogonalise(named[i][0], updates[i]) for i in whole)))
                shards = [i for i, d in enumerate(split) if d is not None]
                tp_updates = [(named[i][0], updates[i], split[i]) for i in shards]
                orthogonal |= dict(zip(shards, orthogonalise_over_tp(tp_updates, self.tp_group)))
                for i, (name, p) in enumerate(named):
                    p.mul_(1 - group["lr"] * group["weight_decay"])
                    p.add_(orthogonal[i], alpha=-self._matrix_lr(group["lr"], name, p.shape, split[i]))
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.adamw.step()
        if self.qk_clip is not None and (not self.flat or self.param_groups[-1] is self.last_group):
            self.qk_clip.clip()  # ZeRO 1-2 step one group a call: after the last
        return loss

    def _step_flat(self, group: dict) -> None:
        """ZeRO 1-2: the same step on this rank's flat fp32 partition, each weight orthogonalised whole by its owner
        DP rank (``muon_zero.orthogonalise_flat``)."""
        from megakit.train.engine.muon_zero import orthogonalise_flat

        partition = group["params"][0]
        flat = self.flat[id(partition)]
        update = self._momentum(partition, group)
        partition.mul_(1 - group["lr"] * group["weight_decay"])
        for bucket in flat.buckets:  # a bucket's buffers are freed before the next one's exchange
            for j, piece, orthogonal in orthogonalise_flat(update, flat, self.tp_group, bucket):
                split = flat.tp_dims[j] if C.size(self.tp_group) > 1 else None
                lr = self._matrix_lr(group["lr"], flat.names[j], flat.shapes[j], split)
                partition.narrow(0, piece.at, piece.numel).add_(orthogonal, alpha=-lr)

    def _matrix_lr(self, lr: float, name: str, shape: torch.Size, split: int | None) -> float:
        """``match_rms_adamw``'s lr for weight ``name`` (this rank's ``shape``, split over TP along ``split``): by the
        shape of one of its whole matrices, as torch.optim.Muon sees it."""
        whole = shape if split is None else _gathered(shape, split, self.tp_group)
        return adjust_lr(lr, ADJUST_LR, matrices(name, _meta(whole))[0].shape)

    def state_keys(self, param: torch.Tensor) -> tuple[str, ...]:
        """The moments ``param`` (a weight, or a ZeRO flat partition) has: Muon's momentum or AdamW's two; the
        checkpoints ask, as under ZeRO 1-2 a rank without a fragment of ``param`` cannot see it."""
        return ("momentum_buffer",) if id(param) in self.muon_params else ("exp_avg", "exp_avg_sq")

    def _momentum(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """torch.optim.Muon's momentum and Nesterov blend (``_single_tensor_muon``): the update to orthogonalise."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["step"] = torch.tensor(0.0)
        state["step"] += 1
        buf, grad, momentum = state["momentum_buffer"], p.grad, group["momentum"]
        buf.lerp_(grad, 1 - momentum)
        return grad.lerp(buf, momentum) if group["nesterov"] else buf


def _meta(shape) -> torch.Tensor:
    return torch.empty(shape, device="meta")


def _gathered(shape, dim: int, group) -> torch.Size:
    return torch.Size(n * C.size(group) if d == dim else n for d, n in enumerate(shape))


def orthogonalise(name: str, update: torch.Tensor) -> torch.Tensor:
    """torch.optim.Muon's Newton-Schulz on each whole matrix of ``update`` (``matrices``), in ``update``'s shape."""
    out = torch.empty_like(update)
    for src, dst in zip(matrices(name, update), matrices(name, out)):
        dst.copy_(newton_schulz(src, (DEFAULT_A, DEFAULT_B, DEFAULT_C), DEFAULT_NS_STEPS, EPS))
    return out


def owners(sizes: list[int], n: int) -> list[int]:
    """Which of ``n`` ranks orthogonalises each matrix: the largest first, each to the least loaded rank (every
    rank computes the same answer from the same shapes)."""
    load, owner = [0] * n, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(n), key=lambda r: load[r])
        load[owner[i]] += sizes[i]
    return owner


def orthogonalise_over_tp(updates: list[tuple[str, torch.Tensor, int]], group) -> list[torch.Tensor]:
    """Each TP shard's orthogonalised slice, layer-wise over TP: every matrix goes whole to one owner rank.

    One all-to-all sends each shard to its matrix's owner (forward: shards to owners), the owner runs Newton-Schulz
    on the whole matrix (``tp_dim`` 0: column-parallel rows, 1: row-parallel columns, concatenated in rank order),
    and a second all-to-all sends each rank its slice back. Each rank then computes 1/TP of the FLOPs and receives
    about 2 (TP-1)/TP^2 of the split weights' bytes, where an all-gather would cost all the FLOPs and (TP-1)/TP."""
    if not updates:
        return []
    n, me = C.size(group), C.rank(group)
    own = owners([u.numel() for _, u, _ in updates], n)
    send = torch.cat([u.reshape(-1) for r in range(n) for (_, u, _), o in zip(updates, own) if o == r])
    numel = [sum(u.numel() for (_, u, _), o in zip(updates, own) if o == r) for r in range(n)]
    received = C.all_to_all_single(send, group, send_splits=numel, recv_splits=[numel[me]] * n)
    mine = [i for i, o in enumerate(own) if o == me]
    per_source = received.split(numel[me]) if mine else [received] * n
    results = []
    for k, i in enumerate(mine):  # the source blocks hold my matrices' shards in the same order
        name, u, dim = updates[i]
        offset = sum(updates[j][1].numel() for j in mine[:k])
        whole = torch.cat([block[offset : offset + u.numel()].view(u.shape) for block in per_source], dim=dim)
        results.append(orthogonalise(name, whole).chunk(n, dim=dim))
    back = [chunks[r].reshape(-1) for r in range(n) for chunks in results]  # rank r's slices, in matrix order
    back = torch.cat(back) if back else send.new_empty(0)
    returned = C.all_to_all_single(back, group, send_splits=[numel[me]] * n, recv_splits=numel)
    out, offsets = [None] * len(updates), [sum(numel[:r]) for r in range(n)]
    for i, ((_, u, _), o) in enumerate(zip(updates, own)):
        out[i] = returned[offsets[o] : offsets[o] + u.numel()].view(u.shape)
        offsets[o] += u.numel()
    return out
