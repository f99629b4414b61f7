"""Experiments: configuration in, run directory with metrics, logs, checkpoints and a report out."""
