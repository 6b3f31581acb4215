"""Tensor and pipeline parallelism: the rank grid, TP layers, schedules and their executor."""
