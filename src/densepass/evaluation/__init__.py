"""Metrics (through ranx), answer-string accuracy, run files."""

from densepass.evaluation.metrics import Run, evaluate_run, make_run, paired_significance

__all__ = ["Run", "evaluate_run", "make_run", "paired_significance"]
