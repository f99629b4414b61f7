"""The HTTP search service: a FastAPI app around a :class:`~densepass.serve.searcher.Searcher`.

``POST /search`` (micro-batched, see :mod:`densepass.serve.batching`), ``GET /health``, the search page at
``GET /`` and FastAPI's OpenAPI docs (``/docs``, ``/openapi.json``). Every error is a one-line JSON
``{"error": "..."}``: 4xx for bad requests (including input the searcher rejects with a ``DensepassError``),
503 with Retry-After when the queue is full, 500 without a trace for anything unexpected (the trace goes
to the server log). :func:`run_server` serves an app with uvicorn.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from densepass.errors import DensepassError
from densepass.serve.batching import MicroBatcher, Unavailable
from densepass.serve.searcher import Searcher
from densepass.serve.settings import ServeSettings
from densepass.version import __version__

logger = logging.getLogger("densepass.serve")

PAGE_SECURITY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'",
    "X-Content-Type-Options": "nosniff",
}


class SearchRequest(BaseModel):
    """Body of ``POST /search``: ``queries`` (a list of strings) or ``query`` (one string), and ``k``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    queries: list[str] | None = Field(None, description="queries, answered in this order")
    query: str | None = Field(None, description="one query, instead of `queries`")
    k: int = Field(10, description="hits per query, at least 1")


class Hit(BaseModel):
    """One hit; optional fields (e.g. ``answer``, ``start``, ``end``) appear when the index has them."""

    model_config = ConfigDict(extra="allow")
    id: str
    score: float
    title: str
    text: str


class SearchResponse(BaseModel):
    """Answer of ``POST /search``: one ranked list of hits per query, and the time the request took."""

    results: list[list[Hit]]
    took_ms: float


class ErrorResponse(BaseModel):
    """Every error: one line."""

    error: str


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """``{"error": message}`` (on one line) with HTTP ``status``."""
    return JSONResponse({"error": " ".join(str(message).split())}, status_code=status, headers=headers)


def request_queries(body: SearchRequest, settings: ServeSettings) -> list[str]:
    """The queries of a request, checked against ``settings``; raises ``ValueError`` with a one-line reason."""
    if (body.query is None) == (body.queries is None):
        raise ValueError("give either 'query' (a string) or 'queries' (a list of strings)")
    queries = [body.query] if body.query is not None else body.queries
    if not queries:
        raise ValueError("'queries' is empty")
    if len(queries) > settings.max_queries_per_request:
        raise ValueError(f"too many queries: {len(queries)} (at most {settings.max_queries_per_request})")
    for i, query in enumerate(queries):
        where = "the query" if body.query is not None else f"query {i}"
        if not query.strip():
            raise ValueError(f"{where} is empty or whitespace only")
        if len(query) > settings.max_query_chars:
            raise ValueError(f"{where} has {len(query)} characters (at most {settings.max_query_chars})")
    if not 1 <= body.k <= settings.max_k:
        raise ValueError(f"k must be between 1 and {settings.max_k}, got {body.k}")
    return queries


def validation_message(err: RequestValidationError) -> tuple[int, str]:
    """HTTP status and one-line message for a body FastAPI could not parse or validate."""
    first = err.errors()[0]
    loc = first.get("loc", ())
    if first.get("type") == "json_invalid":
        at = f" at character {loc[1]}" if len(loc) > 1 else ""
        return 400, f"malformed JSON{at}: {(first.get('ctx') or {}).get('error', first.get('msg'))}"
    where = ".".join(str(part) for part in loc[1:])
    if not where:
        return 422, f"the request body must be a JSON object sent as application/json ({first.get('msg')})"
    more = f" (and {len(err.errors()) - 1} more problems)" if len(err.errors()) > 1 else ""
    return 422, f"{where}: {first.get('msg')}{more}"


class BodyLimit:
    """ASGI middleware: 413 for request bodies over ``max_bytes`` (by Content-Length, or counted as they stream)."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass the request on, answering 413 once its body exceeds the limit."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body larger than {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await error_response(
                413 if length.isdigit() else 400, too_large if length.isdigit() else "bad Content-Length"
            )(scope, receive, send)
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                raise HTTPException(413, too_large)
            return message

        await self.app(scope, limited_receive, send)


def create_app(searcher: Searcher, settings: ServeSettings | None = None) -> FastAPI:
    """The search service's FastAPI app over ``searcher`` (used read-only), with ``settings`` (default:
    :class:`ServeSettings`). Its lifespan starts the batcher and, on shutdown, searches what is still
    waiting before it stops."""
    settings = settings or ServeSettings()
    batcher = MicroBatcher(searcher, settings.max_batch_size, settings.max_wait_ms, settings.max_queue)
    page = resources.files("densepass.serve").joinpath("static/index.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        batcher.start()
        try:
            yield
        finally:
            await batcher.close()

    app = FastAPI(
        title="densepass search",
        version=__version__,
        lifespan=lifespan,
        description='Search a densepass index: `POST /search` with `{"queries": [...], "k": 10}` or '
        '`{"query": "...", "k": 10}`. Limits: at most '
        f"{settings.max_queries_per_request} queries of at most {settings.max_query_chars} "
        f"characters per request, k from 1 to {settings.max_k}, bodies of at most "
        f'{settings.max_body_bytes} bytes. Errors are `{{"error": "..."}}`.',
    )
    app.state.batcher = batcher
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        return error_response(*validation_message(err))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return error_response(err.status_code, err.detail, getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception) -> JSONResponse:
        return error_response(500, f"internal server error ({type(err).__name__}); see the server log")

    errors = {
        status: {"model": ErrorResponse, "description": what}
        for status, what in [
            (400, "malformed JSON, or input the searcher rejects"),
            (413, "request body too large"),
            (422, "wrong field types or values out of the limits"),
            (503, "queue full or shutting down (Retry-After)"),
            (500, "unexpected failure (details in the server log)"),
        ]
    }

    @app.post("/search", response_model=SearchResponse, responses=errors)
    async def search(body: SearchRequest) -> Any:
        """Search: one ranked list of hits per query, best first, at most k each."""
        started = time.perf_counter()
        try:
            queries = request_queries(body, settings)
        except ValueError as err:
            return error_response(422, str(err))
        try:
            results = await batcher.search(queries, body.k)
        except Unavailable as err:
            return error_response(503, str(err), {"Retry-After": "1"})
        except DensepassError as err:
            return error_response(400, str(err))
        except Exception as err:  # noqa: BLE001 - the trace goes to the log, not to the client
            logger.error("search failed for %d queries", len(queries), exc_info=err)
            return error_response(500, f"search failed ({type(err).__name__}); see the server log")
        return JSONResponse({"results": results, "took_ms": (time.perf_counter() - started) * 1000})

    @app.get("/health")
    async def health() -> dict:
        """Status, the searcher's description, queue depth, batching settings and what was served so far."""
        return {
            "status": "shutting down" if batcher.closing else "ok",
            "searcher": searcher.describe(),
            "queue_depth": batcher.waiting,
            "batching": {
                "enabled": settings.batching,
                "max_batch_size": settings.max_batch_size,
                "max_wait_ms": settings.max_wait_ms,
                "max_queue": settings.max_queue,
            },
            "limits": {
                "max_queries_per_request": settings.max_queries_per_request,
                "max_query_chars": settings.max_query_chars,
                "max_k": settings.max_k,
                "max_body_bytes": settings.max_body_bytes,
            },
            "served": {
                "batches": batcher.batches,
                "queries": batcher.queries,
                "searcher_calls": batcher.searcher_calls,
            },
        }

    @app.get("/", include_in_schema=False)
    async def search_page() -> HTMLResponse:
        return HTMLResponse(page, headers=PAGE_SECURITY)

    return app


def run_server(
    searcher: Searcher,
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: ServeSettings | None = None,
    log_level: str = "info",
    shutdown_timeout_s: float = 30.0,
) -> None:
    """Serve ``searcher`` with uvicorn until Ctrl-C or SIGTERM; then requests in flight are finished (for at
    most ``shutdown_timeout_s`` seconds) before the batcher stops."""
    import uvicorn

    uvicorn.run(
        create_app(searcher, settings),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=shutdown_timeout_s,
    )
