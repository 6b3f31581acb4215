"""``megakit plan --emit-launch``: the plan as a Slurm batch script or a DeepSpeed hostfile.

- **slurm**: one ``torchrun`` per node (``srun --ntasks-per-node=1``), meeting at a c10d
  rendezvous on the allocation's first node (``MASTER_ADDR``, unless set), with
  ``--max-restarts``: when a worker dies, every node's agent restarts its workers and
  ``--load auto`` resumes from the newest intact checkpoint. Before that, ``train.py --check`` runs once on
  the first node: torchrun restarts workers whatever their exit status, so a mistake in the flags would
  otherwise be made, and reported, ``MAX_RESTARTS + 1`` times. torchrun numbers each node's
  workers consecutively, so a TP group (consecutive ranks, TP dividing GPUs per node) stays
  inside a node, as the trainer checks. Arguments given to the script (``sbatch job.sh
  --steps 1000 --data data/mine``) are appended to train.py's, and argparse takes the last
  of a repeated flag, so they can override the plan's too.
- **hostfile**: DeepSpeed's ``host slots=N`` lines with placeholder names, and its
  ``deepspeed --hostfile`` line as a comment at the top (DeepSpeed skips ``#`` lines).

Pure text (no torch); the caller writes it atomically.
"""

from __future__ import annotations

import shlex

KINDS = ("slurm", "hostfile")
MAX_RESTARTS = 3  # torchrun's restarts of the whole job before it gives up
RDZV_PORT = 29500


def _quoted(words: list[str]) -> str:
    return " ".join(shlex.quote(w) for w in words)


def slurm_script(*, nodes: int, gpus_per_node: int, train_flags: list[str], summary: str) -> str:
    """An sbatch script for ``nodes`` x ``gpus_per_node``; every option is ``--name=value`` (one word each)."""
    return f"""#!/bin/bash
# {summary}
# Written by megakit plan --emit-launch slurm. Submit from the megakit checkout:
#   sbatch THIS_FILE [more train.py flags, e.g. --steps 100000 --data data/mine]
# --save must be on a filesystem every node sees. One torchrun per node; they meet at a c10d
# rendezvous on the first node; --max-restarts={MAX_RESTARTS} restarts every worker when one dies and
# --load auto resumes from the newest intact checkpoint.
#SBATCH --job-name=megakit
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus_per_node}
#SBATCH --output=megakit-%j.log
set -euo pipefail
MASTER_ADDR="${{MASTER_ADDR:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}}"
MASTER_PORT="${{MASTER_PORT:-{RDZV_PORT}}}"
# One process checks the flags, the ds_config, the data and the checkpoint first: a mistake ends the job
# here in one line (exit 2), rather than in every worker, {MAX_RESTARTS} times over torchrun's restarts.
WORLD_SIZE=$((SLURM_NNODES * {gpus_per_node})) python scripts/train.py {_quoted(train_flags)} "$@" --check
srun --nodes="$SLURM_NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \\
  torchrun --nnodes="$SLURM_NNODES" --nproc-per-node={gpus_per_node} --max-restarts={MAX_RESTARTS} \\
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \\
    scripts/train.py {_quoted(train_flags)} "$@"
"""


def hostfile(*, nodes: int, gpus_per_node: int, command: str, summary: str) -> str:
    """A DeepSpeed hostfile with ``node1`` ... ``nodeN`` to replace, its launch line on top."""
    hosts = "".join(f"node{i} slots={gpus_per_node}\n" for i in range(1, nodes + 1))
    return (
        f"# {summary}\n"
        "# Written by megakit plan --emit-launch hostfile. Replace node1... with your hosts; DeepSpeed starts\n"
        "# every node's processes over ssh from the first (pdsh): it needs passwordless ssh to each, and the\n"
        "# same checkout and Python environment on all. Run from the megakit checkout on node1:\n"
        f"#   {command}\n{hosts}"
    )
