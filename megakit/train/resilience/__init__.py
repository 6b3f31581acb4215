"""What keeps a run going: its checkpoints (``--save``/``--load``, resumed exactly), ``--load auto`` after a
crash, the NaN guard, the loss-spike rollback, the watchdog that names a dead or frozen rank, and the stop on
notice (a signal or a lost launcher: save, then exit 75).

Imports the rooms below it (``engine``, for the schedule a rollback restarts; ``cluster``, for a rank's host;
``data``) and megakit's lower layers: not ``observe`` or the ``doctor``, no entry point."""
