"""Count the tensors a training step turns into Python numbers, by call site, per step (start-up excluded).

On a GPU each ``.item()``, ``.tolist()``, ``float(t)``, ``int(t)``, ``if t:`` or ``range(t)`` makes the host wait
until the device has drained its queue. The probe wraps those six methods of ``torch.Tensor`` in the trainer's
processes and counts each call by its first frame outside torch; a mark at the top of every step (the trainer's
``TrainingFaults.at_step``) cuts the counts into steps, and the steps after the first and before the last are
averaged, so neither start-up nor the last step's save and evaluation count. On a CPU some calls convert host
tensors: the counts are upper bounds. What matters is how they grow with micro-batches and layers.

    deepspeed --num_gpus 2 scripts/host_syncs.py CASES.json OUT.json

CASES.json: a list of ``scripts/train.py`` command lines (``--steps`` at least 3), run one after the other in the
job (``write_cases`` writes issue 54's families); rank 0 writes to OUT.json, per case, its arguments and each
rank's calls per step ``{site: count}``. The ``megakit`` imported (PYTHONPATH) is measured, with its tree's
``scripts/train.py``: another checkout's PYTHONPATH measures that checkout. Nothing of this runs in a normal
training run: the probe is installed only by this script, and taken off after each case.
``scripts/bench_moe_step.py`` prints the counts side by side.
"""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
# Python's conversions and the copies to the host (on CUDA each waits for the device; torch's own waits inside C++,
# e.g. bincount's or a boolean index's, are for torch.cuda.set_sync_debug_mode on a GPU)
METHODS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")
_TORCH = os.path.dirname(torch.__file__) + os.sep
DISPATCH = "megakit/nn/moe/dispatch.py:"  # the one site allowed to grow: the all-to-all's split sizes (EP > 1)

# family -> (preset, train.py flags, MoE layers of an L-layer model on each rank): the families of issue 54
FAMILIES = {
    "dense": ("llama-tiny", [], lambda layers: 0),
    "moe-ep1": ("moe-tiny", ["--moe-z-loss", "0.001"], lambda layers: layers),
    "capacity": ("moe-tiny", ["--moe-capacity-factor", "1.0"], lambda layers: layers),  # EP 1, drops
    "moe-ep2": ("moe-tiny", ["--ep", "2", "--moe-expert-bias"], lambda layers: layers),
    "mla": ("deepseek-v3-tiny", [], lambda layers: layers - 1),  # first_k_dense_replace 1; the expert bias on
    "gpt-oss": ("gpt-oss-tiny", [], lambda layers: layers),
    "pp2": ("moe-tiny", ["--pp", "2", "--moe-aux-loss", "0.01"], lambda layers: layers // 2),  # per stage
}
SETTINGS = ((2, 2), (4, 4))  # (micro-batches, layers): a site growing with either shows


def layered(directory: Path, preset: str, layers: int) -> str:
    """A copy of ``models/<preset>.json`` with ``layers`` blocks (gpt-oss: sliding and full attention in turn)."""
    config = json.loads((ROOT / "models" / f"{preset}.json").read_text())
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
    path = directory / f"{preset}-{layers}.json"
    path.write_text(json.dumps(config))
    return str(path)


def write_cases(directory: Path, families=FAMILIES, settings=SETTINGS) -> Path:
    """CASES.json for ``families`` at each setting (setting-major), 3 steps of 32 tokens, one sample a
    micro-batch; returns its path."""
    cases = []
    for micro_batches, layers in settings:
        ds = json.loads((ROOT / "ds_configs" / "zero1.json").read_text())
        ds.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=micro_batches)
        (directory / f"ds-{micro_batches}.json").write_text(json.dumps(ds))
        for name in families:
            preset, flags, _ = FAMILIES[name]
            cases.append(
                [
                    "--model",
                    layered(directory, preset, layers),
                    "--ds_config",
                    str(directory / f"ds-{micro_batches}.json"),
                    "--seq-len",
                    "32",
                    "--steps",
                    "3",
                    "--no-progress",
                    *flags,
                ]
            )
    path = directory / "cases.json"
    path.write_text(json.dumps(cases))
    return path


def by_family(results: list[dict], families=FAMILIES, settings=SETTINGS) -> dict[str, list[list[dict]]]:
    """OUT.json of ``write_cases``' cases -> family -> per setting: each rank's ``{site: calls per step}``."""
    cases = iter(results)
    table = [[next(cases)["ranks"] for _ in families] for _ in settings]
    return {name: [row[i] for row in table] for i, name in enumerate(families)}


def _where(path: str) -> str:
    """A site's file, from the root of the tree it is in (this one, or the one megakit is imported from) or from
    its installed package."""
    import megakit

    path = os.path.abspath(path)
    for root in (ROOT, Path(megakit.__file__).resolve().parent.parent):
        if path.startswith(str(root) + os.sep):
            return os.path.relpath(path, root)
    parts = Path(path).parts
    return str(Path(*parts[parts.index("site-packages") + 1 :])) if "site-packages" in parts else path


class HostSyncs:
    """``install()`` wraps the methods; ``counts``: calls by site ``"file:line function"``; ``uninstall()``."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self._saved: dict = {}

    def _site(self) -> str:
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith((_TORCH, __file__)):
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
    import torch.distributed as dist

    import megakit

    sys.path.insert(0, str(Path(megakit.__file__).resolve().parent.parent / "scripts"))  # its own tree's train.py
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
