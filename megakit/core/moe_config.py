"""``MoEConfig``: the Mixture-of-Experts part of a model description.

A model with ``ModelConfig.moe`` set replaces the MLP of every layer not listed in
``dense_layers`` with a routed block: a token-choice top-k router, ``experts`` SwiGLU experts
of width ``ffn`` (Nemotron-3's: non-gated squared ReLU, ``activation``), and optionally shared
experts (``shared_ffn``, gated by a sigmoid in Qwen2-MoE). Read from the Hugging Face fields of
Mixtral, Qwen2-MoE, Qwen3-MoE, gpt-oss, DeepSeek-V3 and Nemotron-3 by their families
(``megakit.core.families``; ``from_hf`` and ``to_hf`` dispatch to them). Pure Python: the planner reads it.

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
ACTIVATIONS = ("swiglu", "relu2")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """The experts and their routing (the module docstring says how they route)."""

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
    # "swiglu": gated experts (``gate_up_proj``); "relu2": Nemotron-3's non-gated squared-ReLU experts and shared
    # expert, ``down(relu(up x)^2)`` (``experts.up_proj`` (E, F, H))
    activation: str = "swiglu"

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
        if self.activation not in ACTIVATIONS:
            raise UsageError(f"MoE expert activation {self.activation!r} is not one of {', '.join(ACTIVATIONS)}")
        if self.activation == "relu2" and (self.expert_biases or self.swiglu_limit or self.shared_gate):
            raise UsageError(
                "non-gated relu2 experts (Nemotron-3) take no expert biases, SwiGLU limit or shared-expert gate"
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

    @property
    def matrices(self) -> int:
        """Weight matrices per expert: gate, up and down (SwiGLU), or up and down (relu2)."""
        return 3 if self.activation == "swiglu" else 2

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block ``layer`` has routed experts (not one of ``dense_layers``)."""
        return layer not in self.dense_layers

    # -- Hugging Face: each MoE family reads and writes its own fields (megakit.core.families) ------------------
    @classmethod
    def from_hf(cls, data: dict, *, layers: int, source: str = "config") -> "MoEConfig":
        """The MoE fields of a Mixtral, gpt-oss, Qwen2-MoE, Qwen3-MoE or DeepSeek-V3 config.json."""
        from megakit.core.families import FAMILIES

        kind = data.get("model_type")
        family = next((f for f in FAMILIES if kind in f.model_types), None)
        if family is None or family.read_moe is None:
            raise UsageError(f"model config {source} has model_type {kind!r}, which has no MoE reader")
        return family.read_moe(data, layers=layers, source=source)

    def to_hf(self, kind: str, *, layers: int) -> dict:
        """The MoE fields of a ``kind`` config.json (``from_hf`` reads them back unchanged)."""
        from megakit.core.families import FAMILIES

        family = next((f for f in FAMILIES if kind in f.model_types), None)
        if family is None or family.write_moe is None:
            raise UsageError(f"cannot write MoE fields for model_type {kind!r}")
        return family.write_moe(self, kind, layers=layers)


def read_common(data: dict, source: str) -> dict:
    """The routing fields every MoE family's config.json spells alike (top-k, the load-balancing loss)."""
    if data.get("router_jitter_noise"):
        raise UsageError(
            f"model config {source} sets router_jitter_noise, which megakit does not implement; set it to 0"
        )
    return dict(
        top_k=data["num_experts_per_tok"],
        aux_loss_coeff=float(data.get("router_aux_loss_coef", 0.0)) if data.get("output_router_logits") else 0.0,
    )


def write_common(moe: MoEConfig) -> dict:
    """``read_common``'s inverse."""
    return {
        "num_experts_per_tok": moe.top_k,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "output_router_logits": moe.aux_loss_coeff > 0,
    }
