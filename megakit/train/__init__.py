"""The training application: the trainer and its DeepSpeed glue, data, metrics, reporting,
faults, placement checks, resume and the memory probe."""
