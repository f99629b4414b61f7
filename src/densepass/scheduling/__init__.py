"""Adaptive Batch Scheduling (ABS; abs-condenser-openqa §3.2, eq. 1-4) and batch-order baselines.

Start with ``greedy.py`` (the fast exact scheduler), ``similarity.py`` (the bilinear similarities it
relies on) and ``reference.py`` (the slow, literal reading of eq. 3-4 that the tests compare against);
``concurrent.py`` grows many greedy batches per pass over U (the setting for large training sets).
"""

from densepass.scheduling.concurrent import iter_concurrent_batches
from densepass.scheduling.conflicts import build_conflicts
from densepass.scheduling.greedy import schedule_batches
from densepass.scheduling.similarity import BilinearSimilarity, batch_hardness

__all__ = ["BilinearSimilarity", "batch_hardness", "build_conflicts", "iter_concurrent_batches", "schedule_batches"]
