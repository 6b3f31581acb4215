"""What a run measures and where its numbers go: each step's cost, the validation loss, the memory against the
planner's prediction, and the progress bar, log lines, TensorBoard and metrics file.

Imports the rooms below it (``data``, for the validation split; ``engine``, ``cluster``) and megakit's lower
layers: not ``resilience`` or the ``doctor``, no entry point."""
