"""Count the tensors a training step turns into Python numbers, by call site, per step (start-up excluded).

On a GPU each ``.item()``, ``.tolist()``, ``float(t)``, ``int(t)``, ``if t:`` or ``range(t)`` makes the host wait
until the device has drained its queue. The probe wraps those six methods of ``torch.Tensor`` in the trainer's
processes and counts each call by its first frame outside torch; a mark at the top of every step (the trainer's
``TrainingFaults.at_step``) cuts the counts into steps, and the steps after the first and before the last are
averaged, so neither start-up nor the last step's save and evaluation count. On a CPU some calls convert host
tensors: the counts are upper bounds. What matters is how they grow with micro-batches and layers.

    deepspeed --num_gpus 2 scripts/host_syncs.py CASES.json OUT.json

CASES.json: a list of ``scripts/train.py`` command lines (``--steps`` at least 3), run one after the other in the
job; rank 0 writes to OUT.json, per case, its arguments and each rank's calls per step ``{site: count}``. Nothing of this runs in a normal training run: the probe is installed
only by this script, and taken off after each case. ``scripts/bench_moe_step.py`` prints the counts side by side.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")
_TORCH = os.path.dirname(torch.__file__) + os.sep


def _where(path: str) -> str:
    """A site's file, from the repository root or from its installed package."""
    path = os.path.abspath(path)
    if path.startswith(str(ROOT) + os.sep):
        return os.path.relpath(path, ROOT)
    parts = Path(path).parts
    return str(Path(*parts[parts.index("site-packages") + 1:])) if "site-packages" in parts else path


class HostSyncs:
    """``install()`` wraps the methods; ``counts``: calls by site ``"file:line function"``; ``uninstall()``."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._saved: dict = {}

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and (frame.f_code.co_filename.startswith(_TORCH) or frame.f_code.co_filename == __file__):
            frame = frame.f_back  # torch's own helpers (a tensor's __format__ calls item) count for their caller
        if frame is None:
            return "?"
        return f"{_where(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_qualname}"

    def _wrap(self, name: str, original):
        def counted(tensor, *args, **kwargs):
            if not torch.compiler.is_compiling():  # a conversion in a compiled graph is a graph break, not this
                self.counts[f"{name} {self._site()}"] += 1
            return original(tensor, *args, **kwargs)

        counted.__name__ = name
        return counted

    def install(self) -> None:
        assert not self._saved, "installed twice"
        for name in METHODS:
            self._saved[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, self._wrap(name, getattr(torch.Tensor, name)))

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            if original is None:
                delattr(torch.Tensor, name)  # inherited from torch._C.TensorBase again
            else:
                setattr(torch.Tensor, name, original)
        self._saved = {}


def per_step(marks: list[collections.Counter]) -> dict[str, float]:
    """Counts at the top of each step -> calls per step of the steps between the first and the last."""
    assert len(marks) >= 3, f"{len(marks)} steps: run at least 3 (the first and the last are left out)"
    first, last = marks[1], marks[-1]
    steps = len(marks) - 2
    return {site: (last[site] - first[site]) / steps for site in sorted(last) if last[site] != first[site]}


def probed_run(cfg) -> dict[str, float]:
    """Train ``cfg`` with the probe on: this rank's calls per step by site."""
    from megakit.train.doctor.fault_injection import TrainingFaults
    from megakit.train.trainer import train

    probe, marks, at_step = HostSyncs(), [], TrainingFaults.at_step

    def marked(self, step: int) -> None:
        marks.append(collections.Counter(probe.counts))
        at_step(self, step)

    TrainingFaults.at_step = marked
    probe.install()
    try:
        train(cfg, keep_steps=False)
    finally:
        probe.uninstall()
        TrainingFaults.at_step = at_step
    return per_step(marks)


def main(argv: list[str]) -> int:
    cases_path, out = [a for a in argv if not a.startswith("--local_rank")]
    sys.path.insert(0, str(ROOT / "scripts"))
    import torch.distributed as dist
    import train as train_script

    results = []
    for case in json.loads(Path(cases_path).read_text()):
        args = train_script.parse_args(case)
        train_script._quiet_deepspeed(args)
        counts = probed_run(train_script.config(args))
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, counts)
        results.append({"args": case, "ranks": ranks})
    if dist.get_rank() == 0:
        Path(out + ".tmp").write_text(json.dumps(results, indent=1))
        os.replace(out + ".tmp", out)
    dist.destroy_process_group()  # as scripts/train.py does: gloo's groups torn down here, not by exit's destructors
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
