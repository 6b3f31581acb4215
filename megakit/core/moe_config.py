"""``MoEConfig``: the Mixture-of-Experts part of a model description.

A model with ``ModelConfig.moe`` set replaces the MLP of every layer not listed in
``dense_layers`` with a routed block: a token-choice top-k router, ``experts`` SwiGLU experts
of width ``ffn``, and optionally shared experts (``shared_ffn``, gated by a sigmoid in
Qwen2-MoE). Read from the Hugging Face fields of Mixtral, Qwen2-MoE, Qwen3-MoE and
DeepSeek-V3 (``from_hf``) and written back (``to_hf``). Pure Python: the planner reads it.

Routing, as the three anchors (Megatron-Core, DeepSpeed AutoEP, torchtitan) converge on it:
scores = softmax or sigmoid of the fp32 router logits; the top-k experts are chosen on the
scores plus the aux-loss-free ``expert bias`` (DeepSeek-V3; the bias only chooses, it never
weighs), limited to the best ``group_top_k`` of ``groups`` expert groups; the chosen scores
are renormalised to sum to one when ``normalize_top_k`` and multiplied by ``route_scale``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megakit.errors import UsageError

SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    experts: int
    top_k: int
    ffn: int  # each routed expert's intermediate width
    shared_ffn: int = 0  # total width of the shared experts (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output x sigmoid(Linear(h, 1))
    score: str = "softmax"
    normalize_top_k: bool = True
    route_scale: float = 1.0
    groups: int = 1  # group-limited routing (DeepSeek-V3's n_group)
    group_top_k: int = 1  # groups a token may use (topk_group)
    expert_bias: bool = False  # aux-loss-free load balancing (DeepSeek-V3's e_score_correction_bias)
    bias_update_rate: float = 1e-3
    dense_layers: tuple[int, ...] = field(default=())  # layers that keep a dense MLP of ModelConfig.ffn
    aux_loss_coeff: float = 0.0  # load-balancing loss (Switch/GShard), per micro-batch
    seq_aux_loss_coeff: float = 0.0  # the same, per sequence (DeepSeek-V3)
    z_loss_coeff: float = 0.0  # router z-loss (ST-MoE)
    capacity_factor: float | None = None  # None: dropless
    force_balance: bool = False  # benchmarking aid: experts chosen from random logits (Megatron's
    # --moe-router-force-load-balancing), the load balanced in expectation whatever the data; never a model's own
    # gpt-oss: a bias on the router and on every expert's two matrices, and its clamped SwiGLU:
    # (clamp(up, -limit, limit) + 1) x g sigmoid(alpha g), g = min(gate, limit)
    router_bias: bool = False
    expert_biases: bool = False
    swiglu_limit: float = 0.0  # 0: the plain SwiGLU
    swiglu_alpha: float = 1.0

    def __post_init__(self) -> None:
        for name in ("experts", "top_k", "ffn", "groups", "group_top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"MoE field {name} must be a positive integer, got {value!r}")
        if self.top_k > self.experts:
            raise UsageError(
                f"MoE top-k {self.top_k} exceeds the {self.experts} experts; "
                "route each token to at most as many experts as there are"
            )
        if self.score not in SCORES:
            raise UsageError(f"MoE router score {self.score!r} is not one of {', '.join(SCORES)}")
        if self.experts % self.groups or self.group_top_k > self.groups:
            raise UsageError(
                f"MoE expert groups {self.groups} (top {self.group_top_k}) must divide the "
                f"{self.experts} experts and be at least the groups used"
            )
        if self.group_top_k * (self.experts // self.groups) < self.top_k:
            raise UsageError(
                f"MoE group-limited routing keeps {self.group_top_k} of {self.groups} groups, "
                f"fewer experts than top-k {self.top_k}; raise topk_group"
            )
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise UsageError(
                f"MoE capacity factor must be > 0, got {self.capacity_factor}; leave it unset for dropless routing"
            )
        for name in ("aux_loss_coeff", "seq_aux_loss_coeff", "z_loss_coeff", "shared_ffn"):
            if not 0 <= getattr(self, name) < float("inf"):  # NaN fails too: it would skip every step
                raise UsageError(f"MoE field {name} must be a finite number >= 0, got {getattr(self, name)}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    # -- Hugging Face ------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, data: dict, *, layers: int, source: str = "config") -> "MoEConfig":
        """The MoE fields of a Mixtral, gpt-oss, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 config.json."""
        kind = data.get("model_type")
        if data.get("router_jitter_noise"):
            raise UsageError(
                f"model config {source} sets router_jitter_noise, which megakit does not implement; set it to 0"
            )
        common = dict(
            top_k=data["num_experts_per_tok"],
            aux_loss_coeff=float(data.get("router_aux_loss_coef", 0.0)) if data.get("output_router_logits") else 0.0,
        )
        if kind == "mixtral":
            return cls(experts=data["num_local_experts"], ffn=data["intermediate_size"], **common)
        if kind == "gpt_oss":  # top-k of the biased logits, softmax over the k: Mixtral's routing with a bias
            return cls(
                experts=data["num_local_experts"],
                ffn=data["intermediate_size"],
                router_bias=True,
                expert_biases=True,
                swiglu_limit=float(data.get("swiglu_limit", 7.0)),
                swiglu_alpha=float(data.get("swiglu_alpha", 1.702)),
                **common,
            )
        if kind in ("qwen2_moe", "qwen3_moe"):
            step = data.get("decoder_sparse_step", 1) or 1
            only = set(data.get("mlp_only_layers") or ())
            dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
            shared = data.get("shared_expert_intermediate_size", 0) if kind == "qwen2_moe" else 0
            experts = data["num_experts"] if "num_experts" in data else data["num_local_experts"]  # transformers 4 | 5
            return cls(
                experts=experts,
                ffn=data["moe_intermediate_size"],
                shared_ffn=shared,
                shared_gate=bool(shared),
                normalize_top_k=bool(data.get("norm_topk_prob", False)),
                dense_layers=dense,
                **common,
            )
        if kind == "deepseek_v3":
            if data.get("topk_method", "noaux_tc") != "noaux_tc":
                raise UsageError(
                    f"model config {source} uses topk_method {data['topk_method']!r}; "
                    "megakit implements DeepSeek-V3's noaux_tc"
                )
            return cls(
                experts=data["n_routed_experts"],
                ffn=data["moe_intermediate_size"],
                shared_ffn=data.get("n_shared_experts", 0) * data["moe_intermediate_size"],
                score=data.get("scoring_func", "sigmoid"),
                normalize_top_k=bool(data.get("norm_topk_prob", True)),
                route_scale=float(data.get("routed_scaling_factor", 1.0)),
                groups=data.get("n_group", 1) or 1,
                group_top_k=data.get("topk_group", 1) or 1,
                expert_bias=True,
                dense_layers=tuple(range(min(data.get("first_k_dense_replace", 0), layers))),
                **common,
            )
        raise UsageError(f"model config {source} has model_type {kind!r}, which has no MoE reader")

    def to_hf(self, kind: str, *, layers: int) -> dict:
        """The MoE fields of a ``kind`` config.json (``from_hf`` reads them back unchanged)."""
        out: dict = {
            "num_experts_per_tok": self.top_k,
            "router_aux_loss_coef": self.aux_loss_coeff,
            "output_router_logits": self.aux_loss_coeff > 0,
        }
        if kind == "mixtral":
            return out | {"num_local_experts": self.experts, "intermediate_size": self.ffn}
        if kind == "gpt_oss":
            return out | {
                "num_local_experts": self.experts,
                "intermediate_size": self.ffn,
                "swiglu_limit": self.swiglu_limit,
                "swiglu_alpha": self.swiglu_alpha,
            }
        if kind in ("qwen2_moe", "qwen3_moe"):
            out |= {
                "num_experts": self.experts,
                "moe_intermediate_size": self.ffn,
                "decoder_sparse_step": 1,
                "mlp_only_layers": list(self.dense_layers),
                "norm_topk_prob": self.normalize_top_k,
            }
            if kind == "qwen2_moe":
                out["shared_expert_intermediate_size"] = self.shared_ffn
            return out
        if kind in ("deepseek_v3", "kimi_k2"):
            first = len(self.dense_layers)
            return out | {
                "n_routed_experts": self.experts,
                "moe_intermediate_size": self.ffn,
                "n_shared_experts": self.shared_ffn // self.ffn,
                "scoring_func": self.score,
                "norm_topk_prob": self.normalize_top_k,
                "routed_scaling_factor": self.route_scale,
                "n_group": self.groups,
                "topk_group": self.group_top_k,
                "first_k_dense_replace": first,
                "topk_method": "noaux_tc",
            }
        raise UsageError(f"cannot write MoE fields for model_type {kind!r}")
