"""Launched by test_guards.py: train each case of a JSON list in one process group, with the fault
injection of MEGAKIT_INJECT_FAULT, and write each case's steps, losses, skipped steps and events (rank 0)."""

import json
import os
import sys

import torch.distributed as dist

from megakit.train.trainer import TrainConfig, TrainingDiverged, train


def main() -> int:
    cases_path, results_path = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    results = []
    for case in json.load(open(cases_path)):
        try:
            result = train(TrainConfig(progress=False, **case))
        except TrainingDiverged as error:
            results.append({"error": str(error)})
            continue
        results.append(
            {
                "loss": result.losses,
                "lr": [m.lr for m in result.steps],
                "step": [m.step for m in result.steps],
                "skipped": [m.step for m in result.steps if m.skipped],
                "events": result.events,
            }
        )
    if int(os.environ.get("RANK", 0)) == 0:
        with open(results_path + ".tmp", "w") as f:
            json.dump(results, f)
        os.replace(results_path + ".tmp", results_path)
    if dist.is_initialized():  # as scripts/train.py does: gloo's groups torn down here, not by exit's destructors
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
