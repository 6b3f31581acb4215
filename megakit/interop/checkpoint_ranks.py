"""The collectives a checkpoint's save and load run on: gathers, broadcasts and the one rule for errors
(a failure on any rank is raised on every rank, so no rank waits for ever in the next collective).
``topo`` None is a single process: no collectives, the same answers."""

from __future__ import annotations

from megakit.errors import UsageError
from megakit.nn import comm as C


def coords(topo) -> tuple[int, int, int, int, int, int]:
    """(tp, pp, dp, tp_rank, pp_rank, dp_rank); CP ranks hold the same weights, so they count as DP here."""
    if topo is None:
        return 1, 1, 1, 0, 0, 0
    cp, cp_rank = getattr(topo, "cp", 1), getattr(topo, "cp_rank", 0)
    return topo.tp, topo.pp, topo.dp * cp, topo.tp_rank, topo.pp_rank, topo.dp_rank * cp + cp_rank


def rank(topo) -> int:
    """This rank, or 0 in a single process (``topo`` None)."""
    return 0 if topo is None else topo.rank


def all_gather(obj, topo, group=None) -> list:
    """Every rank's ``obj`` (over ``group``, else the world); ``[obj]`` in a single process."""
    if topo is None:
        return [obj]
    return C.all_gather_object(obj, C.WORLD if group is None else group)


def gather_to_0(obj, topo, group=C.WORLD) -> list | None:
    """Every rank's ``obj`` on rank 0 of ``group`` (None elsewhere); ``[obj]`` in a single process."""
    return [obj] if topo is None else C.gather_object(obj, 0, group)


def broadcast_from_0(obj, topo, group=C.WORLD):
    """Rank 0's ``obj`` on every rank of ``group``; ``obj`` itself in a single process."""
    return obj if topo is None else C.broadcast_object(obj, 0, group)


def failure(error: BaseException) -> tuple[bool, str]:
    """(is it the user's mistake, message): what other ranks learn about a rank's error."""
    if isinstance(error, UsageError):
        return True, str(error)
    return False, f"{type(error).__name__}: {error}"


def collectively(work, topo):
    """``work()`` on every rank; if it fails on any rank, raise on every rank (an all-gather of the outcome)."""
    local_error, result = None, None
    try:
        result = work()
    except Exception as error:
        local_error = error
    raise_failures(all_gather(None if local_error is None else failure(local_error), topo), local_error)
    return result


def raise_failures(failures: list, local: BaseException | None) -> None:
    """Raise on every rank if any rank failed: the local error itself, else the first rank's."""
    bad = [(rank, f) for rank, f in enumerate(failures) if f is not None]
    if local is not None:
        raise local
    if bad:
        rank, (usage, message) = bad[0]
        raise (UsageError if usage else RuntimeError)(f"{message} (on rank {rank})")
