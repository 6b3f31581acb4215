"""``megakit doctor``: the facts a real job gathers on every rank, the faults planted to test it, the
single-process reference run and the checks that judge the facts against it.

Imports ``run`` (``TrainConfig``, to rebuild the job's configuration for the reference run) and the rooms below
it (``data``, ``engine``, ``cluster``): not ``resilience`` (but through ``run``), not ``steps`` or ``trainer``,
which call into it."""
