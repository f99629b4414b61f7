"""Hot reload of the served index: an index updated on disk (``densepass index-update``: a new version, its
manifest swapped last; ``index.living``) is loaded in the background and swapped in without a failed request.

:class:`ReloadableSearcher` wraps the search pipeline. A reload loads the index's current version in a worker
thread while the old pipeline keeps answering, then replaces the reference in one assignment; the micro-batcher
reads that reference once per batch (``search_batch``), so each batch is searched wholly by the old or wholly by
the new index, and no request waits for the load or fails because of it. A reload that fails (a damaged version,
a missing model) leaves the old pipeline serving and says why.

Two triggers, both off by default:

- ``POST /admin/reload`` with the operator's token in the ``X-Admin-Token`` header (``--admin-token`` or
  ``DENSEPASS_ADMIN_TOKEN``; compared in constant time): 401 without the right token, 404 when the service has
  no token; with ``--api-key`` the route needs the key too. One process only (not with ``--workers``).
- ``--watch-index SECONDS``: every process polls the index's ``manifest.json`` (its inode, size and modification
  time: no file is read) and reloads when it changed.

``GET /health`` reports the index version served (``index_version``) and the reloads done.
"""

import argparse
import asyncio
import hmac
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from densepass.errors import ConfigError, DensepassError
from densepass.io import MANIFEST

logger = logging.getLogger("densepass.serve")

ADMIN_TOKEN_ENV = "DENSEPASS_ADMIN_TOKEN"
ADMIN_HEADER = "x-admin-token"
MIN_TOKEN_CHARS = 16
MAX_WATCH_S = 86_400  # --watch-index's largest interval
RELOAD_ERROR = "last_reload_error"  # describe()'s key for why the last reload failed (not shown on /health)


def manifest_stamp(directory: Path) -> tuple[int, int, int] | None:
    """(inode, size, modification time) of the index's manifest: changes when an update swaps it (a rename: a new
    inode); None when it cannot be read."""
    try:
        info = os.stat(directory / MANIFEST)
    except OSError:
        return None
    return info.st_ino, info.st_size, info.st_mtime_ns


class ReloadableSearcher:
    """A searcher whose pipeline ``load()`` makes (loading the current version of the index at ``directory``) and
    that ``reload`` replaces while the service runs (see the module docstring). Other attributes are the current
    pipeline's (``index``, ``reranker``: what the embeddings and rerank routes look for)."""

    def __init__(self, load: Callable[[], Any], directory: str | Path) -> None:
        self._load = load
        self.directory = Path(directory)
        self.stamp = manifest_stamp(self.directory)
        self.current = load()
        self.reloads = 0
        self.last_error: str | None = None
        self._lock = threading.Lock()  # one reload at a time
        self._stop = threading.Event()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "current":
            raise AttributeError(name)
        return getattr(self.current, name)

    def search_batch(self, queries: list[str], k: int) -> list[list[Any]]:
        """The current pipeline's answer (the reference is read once: one batch, one index)."""
        return self.current.search_batch(queries, k)

    def describe(self) -> dict:
        """The current pipeline's description, with the index version and the reloads done."""
        current = self.current  # read once: a reload may swap it meanwhile
        facts = dict(current.describe())
        facts["index_version"] = getattr(getattr(current, "index", None), "version", 0)
        facts["reloads"] = self.reloads
        if self.last_error is not None:
            facts[RELOAD_ERROR] = self.last_error
        return facts

    def reload(self) -> dict:
        """Load the index's current version and swap it in; the old pipeline answers until then. A failure raises
        (``DensepassError``, one line) and keeps the old one."""
        with self._lock:
            stamp = manifest_stamp(self.directory)
            try:
                fresh = self._load()
            except DensepassError as err:
                self.last_error = str(err)
                raise
            # the error is cleared before the new pipeline is seen: a reader that sees the new version never
            # sees the failure it replaced
            self.last_error, self.stamp = None, stamp
            self.current = fresh
            self.reloads += 1
            logger.info("reloaded %s: index version %s", self.directory, self.describe()["index_version"])
        return self.describe()

    def watch(self, interval_s: float) -> threading.Thread:
        """Poll the manifest every ``interval_s`` seconds in a daemon thread and reload when it changed (a failed
        reload is logged, the old index kept, and tried again at the next change). Any failure, not only a
        ``DensepassError`` (say an ``OSError`` when a later update removed the version being read), leaves the
        watch running: an exception out of the thread would end the watching for good, unnoticed."""

        def poll() -> None:
            while not self._stop.wait(interval_s):
                stamp = manifest_stamp(self.directory)
                if stamp is None or stamp == self.stamp:
                    continue
                try:
                    self.reload()
                except Exception as err:  # noqa: BLE001 - logged; the watch goes on
                    self.stamp = stamp
                    if not isinstance(err, DensepassError):
                        self.last_error = f"{type(err).__name__}: {err}"
                    logger.error("reloading %s failed, the old index is kept: %s", self.directory, self.last_error)

        thread = threading.Thread(target=poll, name="densepass-watch-index", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        """End the watch thread (if any)."""
        self._stop.set()


def admin_token(value: str | None) -> str | None:
    """The operator's token: ``value`` (``--admin-token``), else ``$DENSEPASS_ADMIN_TOKEN``, else None (no admin
    route); one shorter than ``MIN_TOKEN_CHARS`` is a one-line error."""
    token = value if value is not None else os.environ.get(ADMIN_TOKEN_ENV) or None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the admin token must have at least {MIN_TOKEN_CHARS} characters, got {len(token)}")
    return token


def admin_reload_route(searcher: Any, token: str, shown: Callable[[Any], Any] = lambda facts: facts) -> Callable:
    """The handler of ``POST /admin/reload``: 401 without ``X-Admin-Token: TOKEN``; else the reload, in a worker
    thread (the event loop keeps answering), answered with ``/health``'s searcher facts (``shown``: as ``/health``
    shows them, without the server's paths), or 409 with the reason
    when the new version does not load (the old one keeps serving). (No ``from __future__ import annotations`` in
    this module: FastAPI reads the handler's ``Request`` annotation, imported here, as a class.)"""
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def reload(request: Request) -> JSONResponse:
        given = request.headers.get(ADMIN_HEADER, "")
        if not hmac.compare_digest(given.encode(), token.encode()):
            return JSONResponse({"error": f"this route needs the operator's token in {ADMIN_HEADER}"}, status_code=401)
        if not hasattr(searcher, "reload"):
            return JSONResponse({"error": "this service's searcher cannot reload"}, status_code=404)
        try:
            facts = await asyncio.to_thread(searcher.reload)
        except DensepassError as err:
            return JSONResponse({"error": " ".join(f"reload failed, the old index serves: {err}".split())}, 409)
        return JSONResponse({"reloaded": True, "searcher": shown(facts)})

    return reload


def add_reload_arguments(parser: argparse.ArgumentParser) -> None:
    """``densepass serve``'s ``--admin-token`` and ``--watch-index``."""
    parser.add_argument(
        "--admin-token",
        default=None,
        metavar="TOKEN",
        help=f"enable POST /admin/reload for requests with 'X-Admin-Token: TOKEN' (default: ${ADMIN_TOKEN_ENV} if "
        "set; off without one)",
    )
    parser.add_argument(
        "--watch-index",
        type=float,
        default=None,
        metavar="SECONDS",
        help="reload the index when an update swaps its manifest, checked every SECONDS (default: off)",
    )


def check_reload_arguments(args: argparse.Namespace) -> str | None:
    """The admin token of ``args`` (``admin_token``), after the checks: a positive ``--watch-index``, and no
    admin route with several workers (it would reload one of them)."""
    token = admin_token(args.admin_token)
    if args.watch_index is not None and not 0 < args.watch_index <= MAX_WATCH_S:  # NaN too; inf: an OverflowError
        raise ConfigError(  # in the watch thread, which would end it at once
            f"--watch-index takes a number of seconds above 0 and at most {MAX_WATCH_S} (a day), got {args.watch_index}"
        )
    if token is not None and getattr(args, "workers", 1) > 1:
        raise ConfigError("POST /admin/reload would reach one worker of --workers: use --watch-index instead")
    return token
