"""The calling rank's process groups over the ``Layout`` grid, built once, and joining the job.

``Topology`` answers DeepSpeed's ``mpu`` questions, so ZeRO shards and reduces over the ranks
that hold the same weights: the DP group, or DP x CP with context parallelism (each CP rank's
gradient covers its part of the sequence). The rank order is ``megakit.core.layout``'s (TP
fastest, then CP, then DP, then PP).
"""

from __future__ import annotations

import datetime
import os
from functools import cached_property

from megakit.core.layout import Layout
from megakit.errors import UsageError


def default_backend() -> str:
    """NCCL when this process has a GPU, gloo otherwise."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(*, timeout_s: float = 300.0) -> None:
    """Join the job described by the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR...).

    A bounded timeout turns a dead peer into an error instead of a hang.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # started without a launcher (`python scripts/train.py`): a world of one
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend=backend, timeout=timeout)
        return
    global _attempt
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    _attempt = _new_attempt_prefix(store)
    dist.init_process_group(
        backend=backend,
        timeout=timeout,
        store=dist.PrefixStore(_attempt, store),
        rank=int(os.environ["RANK"]),
        world_size=int(os.environ["WORLD_SIZE"]),
    )


_attempt: str | None = None  # this attempt's store key prefix under torchrun's agents (init_distributed sets it)


def attempt_prefix() -> str | None:
    """This attempt's store key prefix when torchrun's agents run the job (the watchdog's heartbeats use it
    too), else None."""
    return _attempt


def _new_attempt_prefix(store) -> str:
    """A store key prefix of its own for each attempt of a job that torchrun's agents restart.

    The agents' TCPStore outlives the workers and torch 2.13's ``env://`` rendezvous adds no per-attempt
    prefix, so a restarted rank could read a dead one's address (gloo then waits for ever to connect)
    or heartbeat. TORCHELASTIC_RESTART_COUNT cannot name the attempt: each node's agent counts its own
    restarts, and an agent whose workers were restarted because another node's failed does not count
    one, so two nodes could take different prefixes and never meet. Every attempt starts every rank
    once, so the number of times this rank has started, counted in the store itself, is the same on
    every rank."""
    starts = store.add(f"megakit/starts/rank_{os.environ['RANK']}", 1)
    return f"megakit/attempt_{starts}/"


class Topology:
    """The calling rank's place in the grid and its process groups (built once, passed in).

    Every rank must construct it, in the same order, because ``new_group`` is collective.
    The methods named ``get_*`` are the ``mpu`` interface that ``deepspeed.initialize`` uses.
    """

    def __init__(self, layout: Layout, *, timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("call megakit.nn.topology.init_distributed() before building a Topology")
        if dist.get_world_size() != layout.world_size:
            raise UsageError(
                f"world size {dist.get_world_size()} != TP x PP x CP x DP = "
                f"{layout.tp} x {layout.pp} x {layout.cp} x {layout.dp}; "
                "launch exactly that many processes or change --tp/--pp/--cp"
            )
        self.layout = layout
        self.rank = dist.get_rank()
        timeout = datetime.timedelta(seconds=timeout_s)
        self._groups = {}
        self._ranks = {}
        kinds = ("tp", "cp", "dp", "dpcp", "pp", "mp", "embedding", "ep", "edp")
        for kind in kinds + (("cp_a2a", "cp_ring") if layout.hybrid_cp else ()):
            for ranks in layout.groups(kind):
                group = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self._groups[kind], self._ranks[kind] = group, ranks
        coords = layout.coords(self.rank)
        self.tp_rank, self.dp_rank, self.pp_rank = coords["tp"], coords["dp"], coords["pp"]
        self.cp_rank = coords["cp"]
        folded = layout.ep_coords(self.rank)
        self.ep_rank, self.edp_rank = folded["ep"], folded["edp"]

    @classmethod
    def from_world(cls, *, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, timeout_s: float = 300.0) -> "Topology":
        """Build the grid over the already-initialised world; DP takes the remaining ranks."""
        import torch.distributed as dist

        return cls(Layout.for_world(dist.get_world_size(), tp=tp, pp=pp, cp=cp, ep=ep), timeout_s=timeout_s)

    # -- sizes, groups and neighbours ---------------------------------------------------------
    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def cp(self) -> int:
        return self.layout.cp

    @property
    def ep(self) -> int:
        return self.layout.ep

    @property
    def ep_group(self):
        """The ranks that split each MoE layer's experts between them (all-to-all token dispatch)."""
        return self._groups["ep"]

    @property
    def edp_group(self):
        """The ranks holding the same experts: expert gradients are averaged (and ZeRO-sharded) here."""
        return self._groups["edp"]

    @property
    def cp_group(self):
        """The ring of ranks that share one sequence (``megakit.nn.attention.ring``)."""
        return self._groups["cp"]

    @property
    def cp_a2a_group(self):
        """Hybrid CP: the ranks of this rank's all-to-all (``Layout.groups("cp_a2a")``), else None."""
        return self._groups.get("cp_a2a")

    @property
    def cp_ring_group(self):
        """Hybrid CP: the ring joining this rank's all-to-all group to the others (``"cp_ring"``), else None."""
        return self._groups.get("cp_ring")

    @property
    def tp_group(self):
        return self._groups["tp"]

    @property
    def dp_group(self):
        return self._groups["dp"]

    @property
    def pp_group(self):
        return self._groups["pp"]

    @property
    def mp_group(self):
        return self._groups["mp"]

    @property
    def embedding_group(self):
        """First and last stage of this pipeline (same TP and DP coordinate): tied embeddings sync here."""
        return self._groups["embedding"]

    def group_ranks(self, kind: str) -> list[int]:
        """The global ranks of this rank's ``kind`` group, in group order."""
        return list(self._ranks[kind])

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def stage_rank(self, stage: int) -> int:
        """Global rank of ``stage`` in this rank's pipeline (same TP and DP coordinate)."""
        return self.layout.rank(pp=stage, dp=self.dp_rank, cp=self.cp_rank, tp=self.tp_rank)

    @cached_property
    def next_rank(self) -> int | None:
        return None if self.is_last_stage else self.stage_rank(self.pp_rank + 1)

    @cached_property
    def prev_rank(self) -> int | None:
        return None if self.is_first_stage else self.stage_rank(self.pp_rank - 1)

    def __repr__(self) -> str:
        cp = f", cp={self.cp_rank}/{self.cp}" if self.cp > 1 else ""
        return (
            f"Topology(rank={self.rank}, tp={self.tp_rank}/{self.tp}{cp}, dp={self.dp_rank}/{self.dp}, "
            f"pp={self.pp_rank}/{self.pp})"
        )

    # -- DeepSpeed mpu interface -------------------------------------------------------------
    def get_model_parallel_rank(self) -> int:
        """The TP rank, as in Megatron-DeepSpeed's mpu (not the index in the TP x PP group).

        DeepSpeed's gradient norm counts a replicated (non-TP) parameter only where this is
        0, then sums over ``get_model_parallel_group()`` (TP x PP): so every stage's
        replicated parameters count exactly once and TP shards count once each.
        """
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        """DeepSpeed mpu: the size of the TP x PP group."""
        return self.tp * self.pp

    def get_model_parallel_group(self):
        """DeepSpeed mpu: the TP x PP group, over which the gradient norm is summed."""
        return self.mp_group

    # DeepSpeed's "data parallel" is every rank holding the same weights: DP x CP (Megatron's
    # data-parallel group "with context parallel"). It averages gradients over DP x CP, so a CP
    # rank's loss is CP times its share (``megakit.nn.attention.ring.sequence_mean``).
    def get_data_parallel_rank(self) -> int:
        """DeepSpeed mpu: this rank's place in DP x CP."""
        return self.dp_rank * self.cp + self.cp_rank

    def get_data_parallel_world_size(self) -> int:
        """DeepSpeed mpu: the size of DP x CP."""
        return self.dp * self.cp

    def get_data_parallel_group(self):
        """DeepSpeed mpu: the DP x CP group that averages (and ZeRO-shards) gradients."""
        return self._groups["dpcp"]

    def get_data_parallel_group_ranks(self) -> list[int]:
        """DeepSpeed mpu: the global ranks of the DP x CP group."""
        return self.group_ranks("dpcp")

    def get_tensor_model_parallel_rank(self) -> int:
        """DeepSpeed mpu: the TP rank."""
        return self.tp_rank

    def get_tensor_model_parallel_world_size(self) -> int:
        """DeepSpeed mpu: the TP size."""
        return self.tp

    def get_tensor_model_parallel_group(self):
        """DeepSpeed mpu: the TP group."""
        return self.tp_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        """DeepSpeed mpu: the global rank of TP rank 0 in this rank's TP group."""
        return self._ranks["tp"][0]

    def get_pipeline_model_parallel_rank(self) -> int:
        """DeepSpeed mpu: the pipeline stage."""
        return self.pp_rank

    def get_pipeline_model_parallel_world_size(self) -> int:
        """DeepSpeed mpu: the number of pipeline stages."""
        return self.pp

    def get_pipeline_model_parallel_group(self):
        """DeepSpeed mpu: the PP group."""
        return self.pp_group

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
