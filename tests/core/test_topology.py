"""The rank grid as pure data, and the process groups it builds on real gloo processes."""

import pytest
from multiproc import run_ranks

from megakit.core.layout import Layout
from megakit.errors import UsageError


def test_worked_example_from_docstring():
    layout = Layout(tp=2, pp=4, dp=2)
    assert layout.groups("tp")[:3] == [[0, 1], [2, 3], [4, 5]]
    assert layout.groups("dp")[:3] == [[0, 2], [1, 3], [4, 6]]
    assert layout.groups("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    assert layout.groups("mp")[0] == [0, 1, 4, 5, 8, 9, 12, 13]
    assert layout.groups("embedding") == [[0, 12], [1, 13], [2, 14], [3, 15]]


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 4), (4, 2, 1), (2, 3, 2), (8, 4, 3)])
def test_rank_coords_round_trip_and_groups_partition_the_world(tp, pp, dp):
    layout = Layout(tp=tp, pp=pp, dp=dp)
    for rank in range(layout.world_size):
        assert layout.rank(**layout.coords(rank)) == rank
    for kind in ("tp", "dp", "pp", "mp"):
        flat = sorted(r for group in layout.groups(kind) for r in group)
        assert flat == list(range(layout.world_size)), kind
    # TP is innermost: every TP group is a run of consecutive ranks.
    for group in layout.groups("tp"):
        assert group == list(range(group[0], group[0] + tp))


def test_bad_layouts_name_the_numbers():
    with pytest.raises(UsageError, match="not divisible by TP x PP = 2 x 2 = 4"):
        Layout.for_world(6, tp=2, pp=2)
    with pytest.raises(UsageError, match="--tp must be a positive integer"):
        Layout(tp=0)


def _groups_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    from megakit.nn.topology import Topology

    topo = Topology.from_world(tp=2, pp=2)
    seen = {}
    for kind, group in (("tp", topo.tp_group), ("dp", topo.dp_group), ("pp", topo.pp_group)):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group)
        seen[kind] = t.item()
    return seen, topo.get_data_parallel_world_size(), topo.next_rank, topo.prev_rank


def test_process_groups_reduce_over_the_right_ranks():
    results = run_ranks(_groups_worker, 8)
    layout = Layout(tp=2, pp=2, dp=2)
    for rank, (seen, dp_size, nxt, prv) in enumerate(results):
        for kind in ("tp", "dp", "pp"):
            group = next(g for g in layout.groups(kind) if rank in g)
            assert seen[kind] == sum(group)
        assert dp_size == 2
        c = layout.coords(rank)
        assert nxt == (layout.rank(pp=1, dp=c["dp"], tp=c["tp"]) if c["pp"] == 0 else None)
        assert prv == (layout.rank(pp=0, dp=c["dp"], tp=c["tp"]) if c["pp"] == 1 else None)
