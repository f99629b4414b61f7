"""Metrics (through ranx), answer-string accuracy, run files."""

from densepass.evaluation.metrics import Run, evaluate_run, make_run

__all__ = ["Run", "evaluate_run", "make_run"]
