"""DeepSpeed's expert machinery, switched on for megakit's MoE layers: expert gradients and ZeRO 0-3 over EDP.

With ``--ep N`` an MoE layer's experts are split over the EP group, and each expert is
replicated over the expert-data-parallel group (EDP: the TP x CP x DP ranks with the same EP
rank). DeepSpeed 0.19.8 already knows this grid (classic ``deepspeed.moe``): a parameter
with ``allreduce = False`` and a ``group_name`` is an expert (``deepspeed.moe.utils.is_moe_param``),
and ``deepspeed.utils.groups`` holds the EP and EDP groups under that name. Given those,

- the engine broadcasts an expert's initial weights over EDP only (over DP x CP it would
  overwrite every EP rank's experts with DP rank 0's);
- ZeRO 0: the boundary all-reduce sums expert gradients over EDP and dense ones over
  DP x CP, both divided by DP x CP (``_reduce_expert_gradients``). An expert's gradient on
  its EP rank already sums the tokens that every rank of the EP group sent it, so this is
  the mean over the global batch, as for the dense weights;
- ZeRO 1-2: the experts get optimizer groups of their own (``split_params_into_different_
  moe_groups_for_optimizer``, from the named groups of ``megakit.train.engine.optim``), whose fp32
  master, moments and gradient partitions are sharded and reduce-scattered over EDP
  (``_configure_moe_settings``), again divided by DP x CP; its gradient norm sums every rank's
  squares over DP x CP, then over TP x PP. The EP group is folded over TP x CP x DP
  (``megakit.core.layout``), so the TP ranks of a stage may hold different experts: each expert is
  marked ``model_parallel`` (DeepSpeed's ``is_model_parallel_parameter``), counted on every TP rank
  rather than on TP rank 0 only, and the two sums then see each element of each expert's EDP
  partition once;
- ZeRO 3: each expert weight is partitioned over EDP instead of DP x CP, its gradient
  reduce-scattered over EDP (divided by DP x CP) and its fp32 master and moments kept in optimizer
  sub-groups of their own. DeepSpeed 0.19.8 does this for its AutoEP layers (PR #8060, "constrained
  ZeRO-3"): ``engine._resolve_zero3_param_placement`` gives a parameter whose
  ``ds_zero_placement_family`` is ``"autoep_expert"`` the EDP group named by
  ``ds_zero_partition_group_name`` as its ``ds_process_group``, ``stage3`` groups the optimizer's
  sub-groups by that group, and its gradient norm counts such a sub-group on every rank and sums it
  over EDP, then EP. megakit's experts get the same two tags, and the stand-in is an ``AutoEPMoELayer``
  (stage 3 refuses the native ``MoE``). Gathering for forward and backward, and a save's
  ``GatheredParameters``, then run over EDP.

Why DeepSpeed's and not megakit's own reduction: at ZeRO 0 megakit could reduce (as
``dp_sync`` does), but at ZeRO 1-3 the optimizer state must be partitioned over EDP inside
DeepSpeed's optimizer, which only this path does (torch's ``fully_shard`` over the EDP mesh would
need the experts kept out of DeepSpeed's optimizer, its own Adam beside it, and a norm and a
checkpoint path of its own). DeepSpeed turns it on only when the model holds one of its own expert
modules (``engine.has_moe_layers``); so while ``deepspeed.initialize`` runs, the stage carries a
parameterless stand-in of that class, taken out again right after. ZeRO 3 with a pipeline stays
refused for every model (``ds_config.load_ds_config``), and ZeRO 3's options that DeepSpeed does
not run with AutoEP (hpZ, quantized gradients) are refused with ``--ep`` (``run._check_expert_parallel``).
"""

from __future__ import annotations

import contextlib

import torch

MARKER = "_deepspeed_sees_experts"


def group_name(ep: int) -> str:
    """The name DeepSpeed files the EP/EDP groups under (its own convention)."""
    return f"ep_size_{ep}"


def is_expert(param) -> bool:
    """Marked for DeepSpeed as an expert (``mark_experts``)."""
    return getattr(param, "allreduce", True) is False


def expert_parameters(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The routed experts' stacked weights (``param.ep_dim``, ``megakit.nn.moe.layer``); the router and the shared
    expert are dense."""
    return {n: p for n, p in module.named_parameters() if getattr(p, "ep_dim", None) is not None}


def mark_experts(module: torch.nn.Module, ep: int, *, zero3: bool = False) -> int:
    """Tag ``module``'s routed-expert parameters as DeepSpeed's experts of group ``ep_size_<ep>`` (under ``zero3``
    also as partitioned over that group's EDP ranks); returns how many. At EP 1 nothing is tagged: every rank holds
    every expert, a dense weight."""
    params = expert_parameters(module) if ep > 1 else {}
    for p in params.values():  # frozen by LoRA: no optimizer state, so not DeepSpeed's experts (no MoE group), but
        if not p.requires_grad:  # each EP rank holds its own: ds_optim_param keeps its start-up broadcast off them
            p.ds_optim_param = True
    params = {n: p for n, p in params.items() if p.requires_grad}
    for p in params.values():
        p.allreduce, p.group_name = False, group_name(ep)
        p.model_parallel = True  # held by one rank of each EDP group, whatever its TP rank: counted in the norm there
        if zero3:  # what DeepSpeed's AutoEP layers set on their experts (auto_ep_layer.py)
            p.ds_zero_placement_family, p.ds_zero_partition_group_name = "autoep_expert", group_name(ep)
    return len(params)


def register_groups(topo) -> None:
    """File the topology's EP and EDP groups where DeepSpeed's expert code looks them up (by name)."""
    from deepspeed.utils import groups

    name = group_name(topo.ep)
    groups._EXPERT_PARALLEL_GROUP[name] = topo.ep_group  # noqa: SLF001 (DeepSpeed's registry of expert groups)
    groups._EXPERT_PARALLEL_GROUP_RANKS[name] = topo.group_ranks("ep")  # noqa: SLF001
    groups._EXPERT_DATA_PARALLEL_GROUP[name] = topo.edp_group  # noqa: SLF001
    groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = topo.group_ranks("edp")  # noqa: SLF001


def _marker(experts: int, *, zero3: bool) -> torch.nn.Module:
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    from deepspeed.moe.layer import MoE

    class ExpertsHere(AutoEPMoELayer if zero3 else MoE):
        """Tells the engine this model has expert layers (it checks ``isinstance(m, MoE)``, at ZeRO 3
        ``AutoEPMoELayer``); no parameters, never called. The class's ``__init__`` (which would build experts of
        its own) is not run."""

        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.num_experts = experts

        def set_deepspeed_parallelism(self, *args, **kwargs) -> None:
            pass  # megakit's topology built the groups

        def forward(self, *args, **kwargs):
            raise RuntimeError("the DeepSpeed MoE marker is not a layer")

    return ExpertsHere()


@contextlib.contextmanager
def deepspeed_sees_experts(stage: torch.nn.Module, topo, experts: int, *, zero3: bool = False):
    """Around ``deepspeed.initialize``: with EP > 1, mark the experts, register the groups and let the engine
    find an expert module in ``stage`` (``zero3``: the ds_config's stage is 3). Nothing at EP 1."""
    if getattr(topo, "ep", 1) == 1 or not mark_experts(stage, topo.ep, zero3=zero3):
        yield
        return
    register_groups(topo)
    stage.add_module(MARKER, _marker(experts, zero3=zero3))
    try:
        yield
    finally:
        del stage._modules[MARKER]  # noqa: SLF001 (the one way to take a child module out again)
