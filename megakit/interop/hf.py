"""Translate full (TP-gathered) megakit weights to and from Hugging Face transformers' layout.

Generic: each family's weight-key table (``megakit.core.families``, a ``WeightMap`` of plain strings and transform
names) says what goes where; this module applies it (rename, transpose, fuse q/k/v, stack or interleave experts,
MTP parts).

megakit keeps q, k and v (and gate, up) as separate ``(out, in)`` matrices under
layout-independent names; transformers' GPT-2 fuses q/k/v into ``c_attn`` and stores
``Conv1D`` weights as ``(in, out)``, while its Llama family (also Mistral, Qwen2) uses
``nn.Linear`` like megakit. ``tests/nn/test_model.py`` proves the mapping by comparing
logits with transformers' own models.

MoE layers: megakit's names are transformers 5's in-memory ones (``mlp.gate.weight``, stacked
``mlp.experts.gate_up_proj`` / ``down_proj``, ``mlp.shared_expert*``), but safetensors files -- the
hub's, and what transformers 5's ``save_pretrained`` writes -- keep one matrix per expert:
Mixtral's ``block_sparse_moe.experts.{j}.w1`` (gate), ``w3`` (up), ``w2`` (down), Qwen-MoE's
``mlp.experts.{j}.{gate,up,down}_proj``. Import stacks them (stacked files are read too), export
unstacks them, byte for byte. A key in an MoE layer's MLP that nothing reads is an error naming
it, never a silently dropped weight (Megatron #5844).
"""

from __future__ import annotations

import torch

from megakit.core.families import WeightMap, family_of
from megakit.core.model_config import ModelConfig
from megakit.errors import UsageError
from megakit.interop import hf_mamba
from megakit.interop.hf_linear import linear_from_hf, linear_to_hf

_MOE_EXTRA = (  # our names of the optional MoE tensors beside the router and the experts
    "gate.e_score_correction_bias",
    "shared_expert_gate.weight",
    *(f"shared_expert.{x}_proj.weight" for x in ("gate", "up", "down")),
)


def _weights(config: ModelConfig) -> WeightMap:
    """The weight-key table of ``config``'s family (``megakit.core.families``)."""
    return family_of(config).weights


def _moved(t: torch.Tensor, how: str) -> torch.Tensor:
    """``t`` under a table's transform: ``rename`` (as it is) or ``transpose`` (GPT-2's ``Conv1D``; its own inverse)."""
    return t.t().contiguous() if how == "transpose" else t


def _gpt_oss_to_hf(ours: str, theirs: str, state: dict) -> dict[str, torch.Tensor]:
    """gpt-oss keeps its experts stacked in ``x @ W`` layout, gate and up columns interleaved: ``gate_up_proj``
    ``(E, H, 2F)`` with gate ``[..., ::2]``, up ``[..., 1::2]`` (its bias alike), ``down_proj`` ``(E, F, H)``."""
    ours, theirs = ours + "mlp.", theirs + "mlp."
    gate_up, bias = _get(state, ours + "experts.gate_up_proj"), _get(state, ours + "experts.gate_up_proj_bias")
    f = gate_up.shape[1] // 2
    interleaved = torch.stack([gate_up[:, :f], gate_up[:, f:]], dim=2).flatten(1, 2)  # (E, 2F, H): g0 u0 g1 u1 ...
    return {
        theirs + "router.weight": _get(state, ours + "gate.weight"),
        theirs + "router.bias": _get(state, ours + "gate.bias"),
        theirs + "experts.gate_up_proj": interleaved.transpose(1, 2).contiguous(),
        theirs + "experts.gate_up_proj_bias": torch.stack([bias[:, :f], bias[:, f:]], dim=2).flatten(1, 2),
        theirs + "experts.down_proj": _get(state, ours + "experts.down_proj").transpose(1, 2).contiguous(),
        theirs + "experts.down_proj_bias": _get(state, ours + "experts.down_proj_bias"),
    }


def _gpt_oss_from_hf(ours: str, theirs: str, hf: dict) -> dict[str, torch.Tensor]:
    """``_gpt_oss_to_hf``'s inverse: the layout is transformers' documented one (``GptOssExperts``), never guessed
    from the shapes, which are square for the released models (F = H = 2880; Megatron-Bridge warns of the same)."""
    ours, theirs = ours + "mlp.", theirs + "mlp."
    gate_up, bias = _get(hf, theirs + "experts.gate_up_proj"), _get(hf, theirs + "experts.gate_up_proj_bias")
    return {
        ours + "gate.weight": _get(hf, theirs + "router.weight"),
        ours + "gate.bias": _get(hf, theirs + "router.bias"),
        ours + "experts.gate_up_proj": torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1)
        .transpose(1, 2)
        .contiguous(),
        ours + "experts.gate_up_proj_bias": torch.cat([bias[:, ::2], bias[:, 1::2]], dim=-1),
        ours + "experts.down_proj": _get(hf, theirs + "experts.down_proj").transpose(1, 2).contiguous(),
        ours + "experts.down_proj_bias": _get(hf, theirs + "experts.down_proj_bias"),
    }


def _moe_to_hf(config: ModelConfig, block: str, layer: str, state: dict) -> dict[str, torch.Tensor]:
    """The MoE weights of our block ``block`` (a name prefix) in the per-expert layout of safetensors files, under
    their layer prefix ``layer``."""
    w = _weights(config)
    if w.experts == "interleave":
        return _gpt_oss_to_hf(block, layer, state)
    ours, theirs = block + "mlp.", layer + w.expert_prefix
    gate, up, down = w.expert_names
    out = {theirs + "gate.weight": state[ours + "gate.weight"]}
    gate_up, down_w = state[ours + "experts.gate_up_proj"], _get(state, ours + "experts.down_proj")
    f = gate_up.shape[1] // 2
    for j in range(gate_up.shape[0]):
        out[theirs + f"experts.{j}.{gate}.weight"] = gate_up[j, :f]
        out[theirs + f"experts.{j}.{up}.weight"] = gate_up[j, f:]
        out[theirs + f"experts.{j}.{down}.weight"] = down_w[j]
    out.update({theirs + _shared_name(config, x): state[ours + x] for x in _MOE_EXTRA if ours + x in state})
    return out


def _shared_name(config: ModelConfig, name: str) -> str:
    """transformers' name of a shared-expert tensor: DeepSeek-V3's ``shared_experts``, Qwen2-MoE's ``shared_expert``."""
    return name.replace("shared_expert.", _weights(config).shared_expert + ".")


def _moe_from_hf(config: ModelConfig, block: str, layer: str, hf: dict) -> dict[str, torch.Tensor]:
    """The MoE weights of their layer ``layer`` (a name prefix) from a per-expert (or already stacked) transformers
    checkpoint, under our block prefix ``block``."""
    w = _weights(config)
    if w.experts == "interleave":
        return _gpt_oss_from_hf(block, layer, hf)
    moe, ours = config.moe, block + "mlp."
    theirs = layer + (w.expert_prefix if layer + w.expert_prefix + "gate.weight" in hf else "mlp.")
    gate, up, down = w.expert_names
    out = {ours + "gate.weight": _get(hf, theirs + "gate.weight")}
    if theirs + "experts.gate_up_proj" in hf:
        out[ours + "experts.gate_up_proj"] = hf[theirs + "experts.gate_up_proj"]
        out[ours + "experts.down_proj"] = _get(hf, theirs + "experts.down_proj")
    else:
        experts = range(moe.experts)
        out[ours + "experts.gate_up_proj"] = torch.stack(
            [
                torch.cat(
                    [_get(hf, theirs + f"experts.{j}.{gate}.weight"), _get(hf, theirs + f"experts.{j}.{up}.weight")]
                )
                for j in experts
            ]
        )
        out[ours + "experts.down_proj"] = torch.stack(
            [_get(hf, theirs + f"experts.{j}.{down}.weight") for j in experts]
        )
    wanted = {"gate.e_score_correction_bias": moe.expert_bias, "shared_expert_gate.weight": moe.shared_gate}
    wanted |= {f"shared_expert.{x}_proj.weight": bool(moe.shared_ffn) for x in ("gate", "up", "down")}
    out.update({ours + x: _get(hf, theirs + _shared_name(config, x)) for x in _MOE_EXTRA if wanted[x]})
    return out


class _Reads(dict):
    """A dict that remembers which keys were read (to name the ones nothing read)."""

    def __init__(self, data: dict) -> None:
        super().__init__(data)
        self.read: set = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)


def _get(state: dict, name: str) -> torch.Tensor:
    if name not in state:
        raise UsageError(f"weights lack {name!r}; they are not a complete checkpoint of this model")
    return state[name]


def to_hf_state_dict(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full megakit weights (``megakit.nn.model.full_state_dict``) -> transformers' names and layouts."""
    if config.layer_pattern:  # Nemotron-H: its mixers' in_proj and conv1d packed (interop.hf_mamba)
        return hf_mamba.state_to_hf(state, config)
    w = _weights(config)
    out = {theirs: _get(state, ours) for ours, theirs in w.embeddings}
    for i in range(config.layers):
        out.update(_block_to_hf(config, f"layers.{i}.", w.layer.format(i=i), state))
    out.update({theirs: _get(state, ours) for ours, theirs in w.final})
    out["lm_head.weight"] = _get(state, "embed.weight" if config.tie_embeddings else "lm_head.weight")
    for k in range(config.mtp_layers):
        if f"mtp.{k}.norm.weight" in state:  # trained or imported with --mtp
            out.update(mtp_to_hf(config, k, state))
    return out


def _block_to_hf(config: ModelConfig, ours: str, theirs: str, state: dict) -> dict[str, torch.Tensor]:
    """Our block under the name prefix ``ours`` as transformers' decoder layer ``theirs`` (its family's table)."""
    w = _weights(config)
    out = {theirs + hf: _moved(state[ours + suffix], how) for suffix, hf, how in w.block if ours + suffix in state}
    for kind, hf, how in w.fused_qkv:  # q, k, v concatenated (GPT-2's c_attn); a bias only where there is one
        parts = [ours + f"attn.{x}_proj.{kind}" for x in "qkv"]
        if kind == "weight" or parts[0] in state:
            out[theirs + hf] = _moved(torch.cat([_get(state, p) for p in parts]), how)
    if ours + "attn.conv_q" in state:  # a Gated DeltaNet block (Qwen3-Next, Qwen3.5): its own layouts
        out.update(linear_to_hf(config.linear, config.hf_type, ours, theirs, state))
    if ours + "mlp.experts.gate_up_proj" in state:  # by the keys: export converts one block at a time
        out.update(_moe_to_hf(config, ours, theirs, state))
    return out


def _block_from_hf(config: ModelConfig, ours: str, theirs: str, hf: dict, *, moe: bool) -> dict[str, torch.Tensor]:
    """``_block_to_hf``'s inverse; ``moe``: the block's MLP is a mixture of experts."""
    w = _weights(config)
    out = {
        ours + suffix: _moved(_get(hf, theirs + name), how)
        for suffix, name, how in w.block
        if w.block_required or theirs + name in hf
    }
    widths = (config.heads * config.head_dim, *(2 * (config.kv_heads * config.head_dim,)))
    for kind, name, how in w.fused_qkv:
        fused = _moved(_get(hf, theirs + name), how)
        for x, part in zip("qkv", fused.split(widths)):
            out[ours + f"attn.{x}_proj.{kind}"] = part.contiguous()
    if theirs + "linear_attn.conv1d.weight" in hf:  # a Gated DeltaNet block
        out.update(linear_from_hf(config.linear, config.hf_type, ours, theirs, hf))
    if moe:
        out.update(_moe_from_hf(config, ours, theirs, hf))
    return out


# DeepSeek-V3's Multi-Token Prediction module k sits in its checkpoints as decoder layer L + k, with the
# module's own tensors beside the block and copies of the shared embedding and head (megakit.nn.mtp).
def mtp_to_hf(config: ModelConfig, k: int, state: dict) -> dict[str, torch.Tensor]:
    """Our MTP module ``k`` (0-based) as ``model.layers.{L + k}.*``: its parts, its block, the shared copies."""
    ours, theirs = f"mtp.{k}.", f"model.layers.{config.layers + k}."
    out = {theirs + hf: _get(state, ours + part) for part, hf in _weights(config).mtp}
    out.update(_block_to_hf(config, ours + "block.", theirs, state))
    out[theirs + "embed_tokens.weight"] = _get(state, "embed.weight").clone()  # own storage: safetensors refuses
    out[theirs + "shared_head.head.weight"] = _get(
        state,
        "embed.weight"
        if config.tie_embeddings  # shared ones
        else "lm_head.weight",
    ).clone()
    return out


def _mtp_from_hf(config: ModelConfig, k: int, hf: dict, main: dict) -> dict[str, torch.Tensor]:
    """``mtp_to_hf``'s inverse; the copies of the embedding and head must equal the main model's ``main``."""
    ours, theirs = f"mtp.{k}.", f"model.layers.{config.layers + k}."
    out = {ours + part: _get(hf, theirs + name) for part, name in _weights(config).mtp}
    moe = config.moe is not None and config.moe.is_moe_layer(config.layers + k)
    out.update(_block_from_hf(config, ours + "block.", theirs, hf, moe=moe))
    for copy, source in (
        ("embed_tokens.weight", "embed.weight"),
        ("shared_head.head.weight", "embed.weight" if config.tie_embeddings else "lm_head.weight"),
    ):
        if theirs + copy in hf and not torch.equal(hf[theirs + copy], main[source]):
            raise UsageError(
                f"{theirs + copy} differs from the main model's; megakit's MTP modules share the "
                "embedding and the head with it, as DeepSeek-V3 trains them"
            )
    return out


def from_hf_state_dict(config: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' weights -> full megakit weights (load with ``megakit.nn.model.load_full_state_dict``)."""
    if config.layer_pattern:  # Nemotron-H: its mixers' in_proj and conv1d split (interop.hf_mamba)
        return hf_mamba.state_from_hf(hf, config)
    hf, w = _Reads(hf), _weights(config)
    out = {ours: _get(hf, theirs) for ours, theirs in w.embeddings}
    for i in range(config.layers):
        moe = config.moe is not None and config.moe.is_moe_layer(i)
        out.update(_block_from_hf(config, f"layers.{i}.", w.layer.format(i=i), hf, moe=moe))
    out.update({ours: _get(hf, theirs) for ours, theirs in w.final})
    if not config.tie_embeddings:
        out["lm_head.weight"] = _get(hf, "lm_head.weight")
    for k in range(config.mtp_layers):
        if f"model.layers.{config.layers + k}.eh_proj.weight" in hf:  # transformers' save_pretrained drops them
            out.update(_mtp_from_hf(config, k, hf, out))
    unread = sorted(k for k in set(hf) - hf.read if ".mlp." in k or ".block_sparse_moe." in k or "expert" in k)
    if config.moe is not None and unread:
        raise UsageError(
            f"weights hold {unread[0]!r} ({len(unread)} MLP/expert tensors in all) that megakit's "
            f"model of this config has no place for; check num_experts, the dense layers and "
            "shared-expert fields of config.json"
        )
    return out


def hf_config(config: ModelConfig) -> dict:
    """A transformers config.json dict for ``config``: ``config.to_hf()``, the one writer."""
    return config.to_hf()


def exact_param_count(raw: dict) -> int:
    """Build the transformers model on the meta device and count parameters (tied ones once)."""
    try:
        from accelerate import init_empty_weights
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as error:  # pragma: no cover - both are dependencies
        raise UsageError(
            f"exact parameter counts need transformers and accelerate ({error}); pip install them"
        ) from error
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # e.g. a tiny vocab below GPT-2's default bos id is fine here
    try:
        config = AutoConfig.for_model(raw["model_type"], **fields)
        with torch.device("meta"), init_empty_weights():  # the device too: DeepSeek-V3's stacked experts are
            model = AutoModelForCausalLM.from_config(config)  # made by torch.empty, which accelerate does not patch
        model.tie_weights()  # tied embeddings share one tensor (counted once below)
    except Exception as error:  # transformers raises many types for bad configs
        raise UsageError(
            f"transformers cannot build this config ({error.__class__.__name__}: "
            f"{str(error).splitlines()[0][:120]}); fix the config.json"
        ) from error
    finally:
        hf_logging.set_verbosity(verbosity)
    return sum({id(p): p.numel() for p in model.parameters()}.values())
