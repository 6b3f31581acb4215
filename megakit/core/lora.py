"""``LoraSpec``: which linear layers get a LoRA adapter, its rank and its scaling (Hu et al. 2021, arXiv:2106.09685).

A LoRA adapter adds ``scaling * B(A(dropout(x)))`` to a frozen linear layer's output, ``A`` ``(rank, in)`` and ``B``
``(out, rank)``; only ``A`` and ``B`` train. Targets are named as Hugging Face names the modules (``q_proj``,
``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``, ``up_proj``, ``down_proj``, or the last component of any other
linear module's name) or peft's ``all-linear``; ``resolve`` turns them into the names a model has. The fields and
their meaning are peft's ``LoraConfig``'s, so ``to_peft``/``from_peft`` write and read its ``adapter_config.json``.
Pure Python: the planner reads it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from megakit.errors import UsageError

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # Llama's, by HF name
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer but the output head
ROUTED_EXPERTS = ("experts", "gate_up_proj", "w1", "w2", "w3")  # names that would reach MoE's routed experts


@dataclass(frozen=True, kw_only=True)
class LoraSpec:
    """A LoRA adapter for every target module: ``rank`` r, ``alpha``, ``dropout`` on the adapter's input,
    ``targets`` (HF module names or ``all-linear``), ``rslora`` (scale by ``alpha / sqrt(r)``, Kalajdzievski 2023)
    and ``dora`` (weight-decomposed LoRA, Liu et al. 2024)."""

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = (ALL_LINEAR,)
    rslora: bool = False
    dora: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise UsageError(f"LoRA rank must be a positive integer, got {self.rank!r}; try --lora-rank 8")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0):
            raise UsageError(f"LoRA alpha must be a positive number, got {self.alpha!r}; try --lora-alpha 16")
        if not (isinstance(self.dropout, int | float) and 0.0 <= self.dropout < 1.0):
            raise UsageError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}")
        if isinstance(self.targets, str):
            object.__setattr__(self, "targets", (self.targets,))
        targets = tuple(t.strip() for t in self.targets)
        if not targets or any(not t for t in targets):
            raise UsageError(f"LoRA targets must name modules, got {self.targets!r}; e.g. --lora-targets q_proj,v_proj")
        if ALL_LINEAR in targets and len(targets) > 1:
            raise UsageError(f"LoRA target {ALL_LINEAR} already names every linear layer; give it alone")
        experts = [t for t in targets if t in ROUTED_EXPERTS]
        if experts:
            raise UsageError(
                f"LoRA on routed experts ({', '.join(experts)}) is not supported; target the attention, dense MLPs "
                "and shared experts (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"
            )
        object.__setattr__(self, "targets", targets)

    @property
    def scaling(self) -> float:
        """The factor on ``B(A(x))``: ``alpha / rank``, or ``alpha / sqrt(rank)`` with ``rslora``."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def resolve(self, available: Iterable[str]) -> tuple[str, ...]:
        """The names of ``available`` (the leaf names of a model's linear layers, e.g. ``q_proj``) that get adapters,
        in ``available``'s order; a target that matches none is a ``UsageError`` listing those that exist."""
        names = tuple(dict.fromkeys(available))
        if self.targets == (ALL_LINEAR,):
            if not names:
                raise UsageError("LoRA target all-linear matches no linear layer: the model has none to adapt")
            return names
        missing = [t for t in self.targets if t not in names]
        if missing:
            raise UsageError(
                f"LoRA target {', '.join(missing)} matches no module of this model; "
                f"the linear layers are named {', '.join(names) or '(none)'}"
            )
        return tuple(n for n in names if n in self.targets)

    def params(self, in_features: int, out_features: int) -> int:
        """Trainable parameters of one adapter on an ``in -> out`` linear layer (``dora`` adds a magnitude per
        output)."""
        return self.rank * (in_features + out_features) + (out_features if self.dora else 0)

    def to_peft(self, *, targets: Iterable[str], base_model: str = "") -> dict:
        """peft's ``adapter_config.json`` for this spec, with the resolved ``targets``."""
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base_model,
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": self.dropout,
            "target_modules": sorted(targets),
            "use_rslora": self.rslora,
            "use_dora": self.dora,
            "bias": "none",
            "fan_in_fan_out": False,
            "inference_mode": True,
            "init_lora_weights": True,
            "modules_to_save": None,
            "rank_pattern": {},
            "alpha_pattern": {},
        }

    @classmethod
    def from_peft(cls, config: dict) -> LoraSpec:
        """The spec of a peft ``adapter_config.json``; what megakit cannot reproduce exactly is a ``UsageError``."""
        if config.get("peft_type", "LORA") != "LORA":
            raise UsageError(f"the adapter is peft type {config.get('peft_type')!r}; megakit imports LORA adapters")
        unsupported = [
            key
            for key, plain in (("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none"), ("fan_in_fan_out", False))
            if config.get(key) not in (plain, None)
        ]
        if config.get("modules_to_save"):
            unsupported.append("modules_to_save")
        if unsupported:
            raise UsageError(
                f"the peft adapter sets {', '.join(unsupported)}, which megakit does not import; "
                "export it without them (one rank and alpha for every module, no bias, no saved modules)"
            )
        targets = config.get("target_modules") or ()
        return cls(
            rank=int(config["r"]),
            alpha=float(config.get("lora_alpha", 8)),
            dropout=float(config.get("lora_dropout", 0.0)),
            targets=(targets,) if isinstance(targets, str) else tuple(targets),
            rslora=bool(config.get("use_rslora", False)),
            dora=bool(config.get("use_dora", False)),
        )


def parse_targets(text: str) -> tuple[str, ...]:
    """``--lora-targets``' comma-separated names."""
    return tuple(t.strip() for t in text.split(",") if t.strip())
