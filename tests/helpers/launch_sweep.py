"""Run several training cases in ONE job started by the real ``deepspeed`` launcher (saves launcher starts).

    deepspeed --num_gpus N tests/helpers/launch_sweep.py CASES.json RESULTS.json

CASES.json: a list of ``TrainConfig`` keyword dicts (``ds_config`` may be a dict). Rank 0
writes, per case, the per-step losses, grad norms, LRs, communication shares and calls and
the --verify-memory rows, the graphs torch.compile has built so far (``dynamo_graphs``), and what each rank's
default generators give after the case
(``default_draws``: per rank, torch's initial seed and one draw each of torch, Python and NumPy), and
last ``{"replaced": [...]}``: the torch.distributed functions, and ``F.linear``, that are no longer
torch's own after all the runs (none may be).
"""

import json
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from megakit.train.trainer import TrainConfig, TrainingDiverged, train


def _default_draws() -> list:
    """Every rank's default generators now (the next case seeds them again), gathered by rank."""
    mine = [torch.initial_seed(), torch.rand(1).item(), random.random(), float(np.random.rand())]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def main() -> int:
    cases_path, results_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    cases = json.load(open(cases_path))
    results = []
    for case in cases:
        try:
            result = train(TrainConfig(progress=False, log_every=10**9, **case))
        except TrainingDiverged as error:
            results.append({"error": str(error)})
            continue
        results.append(
            {
                "loss": result.losses,
                "grad_norm": [m.grad_norm for m in result.steps],
                "lr": [m.lr for m in result.steps],
                "memory": result.memory,
                "comm_calls": [m.comm_calls for m in result.steps],
                "comm_share": [m.comm_share for m in result.steps],
                "evals": result.evals,
                "dp_bytes": [[m.dp_bytes, m.dp_bytes_dense] for m in result.steps],
                "moe": [m.moe for m in result.steps],
                "mtp": [m.mtp for m in result.steps],
                "all_to_all_bytes": [m.all_to_all_bytes for m in result.steps],
                "default_draws": _default_draws(),
                "dynamo_graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"],
            }
        )  # so far, all cases
    names = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "broadcast",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "barrier",
        "all_gather_object",
    )
    results.append(
        {
            "replaced": [
                n
                for n in names
                if getattr(dist, n) is not getattr(distributed_c10d, n)
                or getattr(dist, n).__module__ != "torch.distributed.distributed_c10d"
            ]
            + (["F.linear"] if torch.nn.functional.linear is not torch._C._nn.linear else [])
        }
    )  # ZeRO-3's
    if int(os.environ.get("RANK", 0)) == 0:
        tmp = results_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(results, f)
        os.replace(tmp, results_path)
    if dist.is_initialized():  # as scripts/train.py does: gloo's groups torn down here, not by exit's destructors
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
