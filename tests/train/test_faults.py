"""A rank's own exception is told apart from a failed collective, on real gloo processes.

The trainer asks the watchdog who is silent only for an error raised inside communication; an
error of the rank's own (an index out of range in a layer) is reported as that rank's, not
blamed on "the network or a peer's error".
"""

import datetime
import time

import torch
from multiproc import run_ranks


def _classify(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from megakit.nn import comm
    from megakit.train.resilience.faults import from_communication

    out = {}
    try:
        torch.zeros(3).index_select(0, torch.tensor([5]))  # the rank's own mistake, as evaluation's once was
    except Exception as error:
        out["own"] = from_communication(error)
    short = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=2))
    if rank == 0:  # rank 1 never joins this all-reduce: the collective itself fails
        try:
            comm.all_reduce(torch.ones(2), short)
        except Exception as error:
            out["collective"] = from_communication(error)
    else:
        time.sleep(4)
    return out


def test_a_rank_s_own_error_is_not_a_communication_failure():
    first, second = run_ranks(_classify, 2)
    assert first == {"own": False, "collective": True}, first
    assert second == {"own": False}, second


def test_a_lost_store_is_rank_0_gone_unless_torchrun_s_agent_hosted_it():
    """Under DeepSpeed's launcher rank 0 hosts the store: with the ``deepspeed`` command gone as well (``scancel``),
    a lost store is still rank 0's death, which the watchdog must not take for the run stopping on its own."""
    import os

    from megakit.train.resilience.preemption import StopRequests
    from megakit.train.trainer import _store_went_with_launcher

    stops = StopRequests(name="rank 1", links=[(os.getpid(), -1, "the deepspeed command (pid -1)")])  # gone
    assert stops.launcher_gone()
    assert not _store_went_with_launcher(stops, agent_store=False)()
    assert _store_went_with_launcher(stops, agent_store=True)()
    assert not _store_went_with_launcher(StopRequests(name="rank 1", links=[]), agent_store=True)()
