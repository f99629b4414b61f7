"""The HTTP search service: ``create_app(searcher, settings)`` (FastAPI, micro-batched) and ``run_server``.

A searcher is anything with ``search_batch(queries, k)`` and ``describe()`` (:class:`Searcher`), e.g. the
search pipeline over a saved index. This package sits at the top layer, beside the CLI.
"""

from densepass.serve.searcher import Searcher, hit_to_json
from densepass.serve.settings import ServeSettings, add_settings_arguments, settings_from_args

__all__ = [
    "Searcher",
    "ServeSettings",
    "add_settings_arguments",
    "create_app",
    "hit_to_json",
    "run_server",
    "settings_from_args",
]


def __getattr__(name: str):
    """``create_app`` and ``run_server`` import FastAPI on first use, so the CLI's other commands run without it."""
    if name in ("create_app", "run_server"):
        from densepass.serve import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
