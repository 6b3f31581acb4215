"""Host conversions per training step (``scripts/host_syncs.py``: ``item``, ``tolist``, ``float(t)``, ``int(t)``,
``if t:``, ``range(t)``, counted by call site, start-up and the last step left out) stay constant in micro-batches
and layers: on a GPU each one waits for the device.

One launcher job of 2 processes, 3 steps of each family (``host_syncs.FAMILIES``) at 2 micro-batches and 2 layers,
then at 4 and 4: dense llama-tiny; moe-tiny at EP 1 (the z loss on), at EP 1 with a capacity (drops) and at EP 2
(with the expert bias); MLA (deepseek-v3-tiny, its first layer dense, the expert bias on); gpt-oss-tiny (sliding
windows, sinks); moe-tiny at PP 2 (the aux loss on). The one site allowed to grow is the all-to-all's: at EP > 1,
one device-to-host copy of the split sizes per MoE layer per micro-batch, in ``megakit/nn/moe/dispatch.py``; at EP 1
the dispatcher makes none.
"""

import collections
import json
import sys

import pytest
import torch
from jobs import deepspeed
from paths import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
from host_syncs import DISPATCH, FAMILIES, METHODS, SETTINGS, HostSyncs, by_family, per_step, write_cases  # noqa: E402


def test_the_probe_counts_each_conversion_at_its_caller_and_leaves_torch_as_it_was():
    """No processes: each of the eight methods counted at this file's line, ``item`` twice (a tensor's ``__format__``
    calls it inside torch: counted for its caller); afterwards ``torch.Tensor`` is what it was; steps between marks."""
    saved = {name: torch.Tensor.__dict__.get(name) for name in METHODS}
    t, probe = torch.tensor(2), HostSyncs()
    probe.install()
    try:
        float(t), int(t), bool(t), t.item(), t.tolist(), range(t), f"{torch.tensor(0.5):.1f}", t.cpu(), t.numpy()
        line = sys._getframe().f_lineno - 1
    finally:
        probe.uninstall()
    assert {name: torch.Tensor.__dict__.get(name) for name in METHODS} == saved
    here = f"tests/train/test_host_syncs.py:{line} {sys._getframe().f_code.co_qualname}"
    assert probe.counts == {f"{name} {here}": 2 if name == "item" else 1 for name in METHODS}, probe.counts
    marks = [collections.Counter(a=n, b=1) for n in (5, 20, 21, 22)]  # at each step's top: step 0 makes 15
    assert per_step(marks) == {"a": 1.0}  # steps 1 and 2: 1 each (the last step, 3, has no mark after it)


@pytest.fixture(scope="module")
def counts(tmp_path_factory) -> dict:
    """family -> per setting: each rank's ``{site: calls per step}``."""
    work = tmp_path_factory.mktemp("host_syncs")
    out = deepspeed(2, "scripts/host_syncs.py", str(write_cases(work)), str(work / "counts.json"), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return by_family(json.loads((work / "counts.json").read_text()))


def _without_dispatch(sites: dict) -> dict:
    return {site: n for site, n in sites.items() if DISPATCH not in site}


@pytest.mark.slow
def test_host_conversions_do_not_grow_with_micro_batches_or_layers(counts):
    """Every site but the dispatcher's: the same calls per step at 2 micro-batches and 2 layers as at 4 and 4, on
    every rank; the MoE statistics (``engine/moe_step.py``) copy to the host once per step."""
    for family, (small, large) in counts.items():
        for rank, (a, b) in enumerate(zip(small, large)):
            a, b = _without_dispatch(a), _without_dispatch(b)
            grown = {
                site: (a.get(site, 0), b.get(site, 0))
                for site in a.keys() | b.keys()
                if a.get(site, 0) != b.get(site, 0)
            }
            assert not grown, f"{family} rank {rank}: calls per step at (2, 2) -> (4, 4) micro-batches, layers: {grown}"
            if family != "dense":
                assert sum(n for site, n in b.items() if "engine/moe_step.py:" in site) == 1, (family, rank, b)
            assert any("resilience/guards.py:" in site for site in b), b  # the probe counts: the NaN guard's copy


@pytest.mark.slow
def test_dispatch_converts_only_the_all_to_all_split_sizes(counts):
    """EP 1: no call in the dispatcher; EP 2: at most one per MoE layer per micro-batch (the split sizes)."""
    over = []
    for family, (_, flags, moe_layers) in FAMILIES.items():
        ep = int(flags[flags.index("--ep") + 1]) if "--ep" in flags else 1
        for (micro_batches, layers), ranks in zip(SETTINGS, counts[family]):
            for rank, sites in enumerate(ranks):
                dispatch = {site: n for site, n in sites.items() if DISPATCH in site}
                allowed = 0 if ep == 1 else moe_layers(layers) * micro_batches
                if sum(dispatch.values()) > allowed:
                    over.append(
                        f"{family} rank {rank} at {micro_batches} micro-batches x {layers} layers: "
                        f"{dispatch}, at most {allowed}"
                    )
    assert not over, "\n".join(over)
