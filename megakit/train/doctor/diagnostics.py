"""The facts ``megakit doctor`` judges, collected on every rank of a real job (``train.py --doctor-out FILE``).

FAQ 6 (a loss that will not go down) lists what to look at: the same seed and initial
weights everywhere, balanced data without overlap, finite gradient norms, the learning
rate, the distributed curve against one process. Each is a fact about particular ranks,
so every rank records its own and rank 0 gathers them (``comm.gather_object``) and
rewrites FILE after every step: a job that dies of a NaN has already written the step
that killed it.

Per rank: its grid place, seed, node, host, backend and device; an xxh3 hash of every
weight tensor as the rank built it and again after ``deepspeed.initialize`` (which
broadcasts DP rank 0's weights, so only the first shows a rank that built others; at
ZeRO-3 the module then holds only partitions, so the second is left out).
Per step and rank: a hash of every sample's tokens (what it actually trained on), its
token count, its own loss, the norm of its own gradients before the DP reduction (a
tensor hook sees each micro-batch's gradient before DeepSpeed does), and its step and
communication seconds. The faults of ``megakit.train.doctor.fault_injection`` are played here
(all but a wrong seed, which ``train`` gives the rank before resolving its run).
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import xxhash

from megakit.nn import comm
from megakit.train.doctor.fault_injection import VARIABLE, FaultyBatches, injected
from megakit.train.run import DOCUMENT_FLAGS, MOE_FLAGS


def tensor_hash(tensor: torch.Tensor) -> str:
    """xxh3-64 of the tensor's bytes (any dtype, any device)."""
    data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return xxhash.xxh3_64_hexdigest(data.tobytes())


def weight_hashes(module: torch.nn.Module) -> dict[str, str]:
    """The weights DP replicas must share; routed experts (``ep_dim``) differ between EP ranks by design."""
    return {
        name: tensor_hash(param) for name, param in module.named_parameters() if getattr(param, "ep_dim", None) is None
    }


class Diagnostics:
    """One rank's collector; the trainer calls ``weights_built``, ``attach`` and ``after_step``."""

    def __init__(self, run, topo, out: str) -> None:
        self.run, self.topo, self.out = run, topo, Path(out)
        self.faults = injected(topo.rank)
        self.step = run.start_step
        self.built: dict[str, str] = {}
        self.samples: list[str] = []
        self.tokens = self.micro_batches = 0
        self.squares: torch.Tensor | None = None
        self.facts = {
            "config": _config_facts(run, topo),
            "faults": os.environ.get(VARIABLE, ""),
            "ranks": [],
            "steps": [],
        }
        if topo.rank == 0 and self.facts["faults"]:
            print(f"megakit: injecting faults to test the doctor: {self.facts['faults']}", flush=True)

    def weights_built(self, stage: torch.nn.Module) -> None:
        """Before ``deepspeed.initialize``: the weights this rank made from its seed (or loaded)."""
        self.built = weight_hashes(stage)

    def attach(self, engine, batches, run_step):
        """After ``deepspeed.initialize``: record this rank's start facts, hook its gradients, and return the
        ``(batches, run_step)`` the trainer should use (wrapped to record each step and play the faults)."""
        from megakit.train.cluster.placement import here

        module = engine.module
        params = [p for p in module.parameters() if p.requires_grad]
        self.squares = torch.zeros((), dtype=torch.float64, device=params[0].device)
        for param in params:
            param.register_hook(self._on_gradient)
        place = here()
        mine = {
            "rank": self.topo.rank,
            "tp": self.topo.tp_rank,
            "pp": self.topo.pp_rank,
            "dp": self.topo.dp_rank,
            "seed": self.run.cfg.seed,
            "node": place.node,
            "host": place.host,
            "pid": place.pid,
            "backend": dist.get_backend(),
            "device": _device_name(params[0].device),
            "built": self.built,
            "weights": weight_hashes(module) if self.run.zero_stage < 3 else None,
            "tp_split": [n for n, p in module.named_parameters() if getattr(p, "tensor_model_parallel", False)],
        }
        self._gather(mine, lambda rows: self.facts.update(ranks=rows))
        if self.faults.overlap or self.faults.unbalanced:
            batches = FaultyBatches(batches, self.faults)

        def step(micro_batches):
            self.samples = [tensor_hash(row) for inputs, *_ in micro_batches for row in inputs]
            self.tokens = sum(inputs.numel() for inputs, *_ in micro_batches)
            self.micro_batches = len(micro_batches)
            self.squares.zero_()
            if self.faults.sleep_s:
                time.sleep(self.faults.sleep_s)
            return run_step(micro_batches)

        return batches, step

    def _on_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """Each parameter's gradient of one micro-batch, before accumulation and the DP reduction."""
        if self.faults.nan_from_step is not None and self.step >= self.faults.nan_from_step:
            grad = grad + float("nan")
        self.squares += grad.detach().double().pow(2).sum()
        return grad

    def local_grad_norm(self) -> float:
        """RMS over this step's micro-batches of their gradient norm (the engine scales each by 1/accumulation,
        undone here; with fp16 it includes the loss scale, alike on every rank)."""
        n = max(self.micro_batches, 1)
        return math.sqrt(float(self.squares) / n) * n

    def after_step(self, *, loss, lr: float, seconds: float, comm_seconds: float | None, grad_norm: float) -> None:
        """Gather this step's facts to rank 0 and rewrite the file (collective: call on every rank)."""
        mine = {
            "rank": self.topo.rank,
            "loss": float(loss),
            "samples": self.samples,
            "tokens": self.tokens,
            "local_grad_norm": self.local_grad_norm(),
            "seconds": seconds,
            "comm_seconds": comm_seconds,
        }
        record = {"step": self.step, "lr": lr, "grad_norm": grad_norm}
        self._gather(mine, lambda rows: self.facts["steps"].append({**record, "ranks": rows}))
        self.step += 1

    def _gather(self, mine: dict, keep) -> None:
        rows = comm.gather_object(mine, 0, comm.WORLD)
        if self.topo.rank != 0:
            return
        keep(rows)
        tmp = self.out.with_name(f".{self.out.name}.tmp")
        tmp.write_text(json.dumps(self.facts, allow_nan=True))
        os.replace(tmp, self.out)


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type


def _config_facts(run, topo) -> dict:
    cfg, batch = run.cfg, run.batch
    return {
        "model": cfg.model,
        "data": cfg.data,
        "max_bytes": cfg.max_bytes,
        "seed": cfg.seed,
        "steps": cfg.steps,
        "start_step": run.start_step,
        "seq_len": batch.seq_len,
        "micro_batch": batch.micro_batch,
        "accumulation": batch.accumulation,
        "global_batch": batch.global_batch,
        "tp": topo.tp,
        "pp": topo.pp,
        "dp": topo.dp,
        "cp": topo.cp,
        "vpp": cfg.vpp,
        "world": dist.get_world_size(),
        "precision": run.precision,
        "zero_stage": run.zero_stage,
        "ds_config": run.ds_config,
        "compress": getattr(cfg, "compress", "none"),
        "local_sgd": getattr(cfg, "local_sgd", None),
        "documents": {name: getattr(cfg, name) for name in DOCUMENT_FLAGS},
        "moe": {name: getattr(cfg, name) for name in MOE_FLAGS},
    }
