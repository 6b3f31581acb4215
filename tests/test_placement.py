"""Which ranks share a node (TP placement) and a host (process look-ups), without processes."""

import pytest

from megakit.core.layout import Layout
from megakit.errors import UsageError
from megakit.train.cluster.placement import Place, check_tp_within_nodes, host_id, node_id


def _places(nodes: list[str]) -> list[Place]:
    return [Place(node=n, host="h", pid=100 + i) for i, n in enumerate(nodes)]


def test_tp_groups_inside_nodes_pass_and_across_nodes_are_refused():
    two_nodes = _places(["node 0"] * 2 + ["node 1"] * 2)
    assert check_tp_within_nodes(Layout(tp=2, pp=2).groups("tp"), two_nodes) is None
    with pytest.raises(
        UsageError,
        match=r"TP group of ranks 0-3 spans 2 nodes \(node 0, node 1\).*"
        r"divides the 2 processes per node \(e.g. --tp 2\)",
    ):
        check_tp_within_nodes(Layout(tp=4).groups("tp"), two_nodes)
    warning = check_tp_within_nodes(Layout(tp=4).groups("tp"), two_nodes, allow=True)
    assert warning.startswith("warning: TP group of ranks 0-3 spans 2 nodes")
    # 3 processes per node cannot hold TP 2 groups [2, 3] whole: the second group crosses
    with pytest.raises(UsageError, match=r"ranks 2-3 spans 2 nodes.*divides the 3 processes per node \(e.g. --tp 1\)"):
        check_tp_within_nodes(Layout(tp=2, dp=3).groups("tp"), _places(["a"] * 3 + ["b"] * 3))


def test_node_comes_from_the_launcher_and_host_from_the_kernel():
    assert node_id({"GROUP_RANK": "1", "CROSS_RANK": "0"}) == "node 1"  # torchrun first
    assert node_id({"CROSS_RANK": "3"}) == "node 3"  # DeepSpeed's launcher
    assert node_id({}) == f"host {host_id()}"  # no launcher word: this host
    boot = open("/proc/sys/kernel/random/boot_id").read().strip()
    assert host_id().startswith(boot + ":") and host_id() == host_id()
