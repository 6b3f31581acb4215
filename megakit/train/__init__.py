"""The training application. Its entry points stay here: ``run`` (``TrainConfig`` resolved once into a ``Run``),
``trainer`` (the loop) and ``steps`` (one optimizer step, with or without a pipeline). Below them, one room a
concern: ``engine`` (DeepSpeed's engine and megakit's glue around it), ``data`` (what a step trains on),
``observe`` (what a run measures and where its numbers go), ``resilience`` (checkpoints and what keeps a run
going), ``doctor`` (``megakit doctor``'s facts, checks and reference run) and ``cluster`` (the machine the job
runs on). A room imports only the tiers below it (``pyproject.toml``'s contracts; docs/architecture.md)."""
