"""densepass: train, index, evaluate and serve neural passage retrievers.

The public API, loaded on first use (``import densepass`` itself stays cheap, so the command line
starts fast)::

    import densepass as dp

    model = dp.BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    index = dp.DenseIndex.build(model, ["tar archiving utility", "X11 window manager"])
    hits = dp.SearchPipeline(index).search("window manager", k=1)
"""

from __future__ import annotations

import importlib
from typing import Any

from densepass.errors import ConfigError, DataError, DataWarning, DensepassError
from densepass.version import __version__

_WHERE = {
    # models
    "BiEncoder": "densepass.models.biencoder",
    "BiEncoderConfig": "densepass.config",
    "CrossEncoder": "densepass.models.cross_encoder",
    "SpladeEncoder": "densepass.models.splade",
    "ColBERT": "densepass.models.colbert",
    "load_model": "densepass.models.load",
    # data
    "Corpus": "densepass.data.dataset",
    "RetrievalDataset": "densepass.data.dataset",
    "load_dataset": "densepass.data",
    "load_corpus": "densepass.data",
    # indexes and search
    "Index": "densepass.index.base",
    "SearchResults": "densepass.index.base",
    "DenseIndex": "densepass.index.dense",
    "CompactIndex": "densepass.index.binary",
    "BM25Index": "densepass.index.bm25",
    "HybridIndex": "densepass.index.hybrid",
    "SpladeIndex": "densepass.index.splade",
    "ColbertIndex": "densepass.index.colbert",
    "PhraseEncoder": "densepass.phrase.model",
    "PhraseIndex": "densepass.phrase.index",
    "load_index": "densepass.index.base",
    "SearchPipeline": "densepass.pipelines.search",
    "Hit": "densepass.pipelines.search",
    # evaluation
    "evaluate_run": "densepass.evaluation.metrics",
    "paired_significance": "densepass.evaluation.metrics",
    "read_trec_run": "densepass.evaluation.metrics",
    "write_trec_run": "densepass.evaluation.metrics",
    # training (dp.losses: the loss objects)
    "train": "densepass.pipelines.training",
    "TrainOutput": "densepass.pipelines.training",
    "TrainConfig": "densepass.config",
    "NegativesConfig": "densepass.config",
    "ScheduleConfig": "densepass.config",
    "MixConfig": "densepass.config",
    # experiments
    "ExperimentConfig": "densepass.config",
    "load_config": "densepass.config",
    "run_experiment": "densepass.pipelines.experiment",
}

_MODULES = ("losses",)  # subpackages reached as attributes: dp.losses.InfoNCE

__all__ = ["ConfigError", "DataError", "DataWarning", "DensepassError", "__version__", *_WHERE, *_MODULES]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        module = importlib.import_module(f"densepass.{name}")
        globals()[name] = module
        return module
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'densepass' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
