"""The HTTP search service: a FastAPI app around a :class:`~densepass.serve.searcher.Searcher`.

``POST /search`` (micro-batched, see :mod:`densepass.serve.microbatch`), ``GET /health``, the search page at
``GET /`` and FastAPI's OpenAPI docs (``/docs``, ``/openapi.json``). Every error is a one-line JSON
``{"error": "..."}``: 4xx for bad requests (including input the searcher rejects with a ``DensepassError``),
503 with Retry-After when the queue is full, 500 without a trace for anything unexpected (the trace goes
to the server log). A request whose Host header is not on the allow-list gets 400 (DNS rebinding); a body
that does not arrive within ``read_timeout_s`` gets 408 and its connection closed. :func:`run_server` serves
an app with uvicorn (:func:`uvicorn_config`), whose connections must send their headers within
``read_timeout_s`` too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from densepass.errors import ConfigError, DensepassError
from densepass.serve import compat
from densepass.serve.backends import Current, Embedder, PairScorer, short_name
from densepass.serve.compat import ApiError, styled_error
from densepass.serve.microbatch import MicroBatcher, Unavailable
from densepass.serve.operations import BearerAuth, Metrics, Observe, access_log_handler
from densepass.serve.reload import RELOAD_ERROR, admin_reload_route
from densepass.serve.searcher import Searcher
from densepass.serve.settings import ServeSettings, check_address, check_api_key, host_name
from densepass.serve.texts import query_problem
from densepass.version import __version__

logger = logging.getLogger("densepass.serve")

PAGE_SECURITY = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'",
    "X-Content-Type-Options": "nosniff",
}


DEFAULT_K = 10  # hits per query of a request without k (at most --max-k)


class SearchRequest(BaseModel):
    """Body of ``POST /search``: ``queries`` (a list of strings) or ``query`` (one string), and ``k``."""

    model_config = ConfigDict(strict=True, extra="forbid")
    queries: list[str] | None = Field(None, description="queries, answered in this order")
    query: str | None = Field(None, description="one query, instead of `queries`")
    k: int = Field(DEFAULT_K, description=f"hits per query, at least 1 (default {DEFAULT_K}, or --max-k if smaller)")


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
    """The queries of a request, checked against ``settings``; raises ``ValueError`` with a one-line reason. A
    request without ``k`` gets ``DEFAULT_K`` hits, or ``max_k`` where that is smaller (set in ``body``): a service
    started with ``--max-k 5`` answers it instead of refusing a k it was not sent."""
    if "k" not in body.model_fields_set:
        body.k = min(DEFAULT_K, settings.max_k)
    if (body.query is None) == (body.queries is None):
        raise ValueError("give either 'query' (a string) or 'queries' (a list of strings)")
    queries = [body.query] if body.query is not None else body.queries
    if not queries:
        raise ValueError("'queries' is empty")
    if len(queries) > settings.max_queries_per_request:
        raise ValueError(f"too many queries: {len(queries)} (at most {settings.max_queries_per_request})")
    for i, query in enumerate(queries):
        where = "the query" if body.query is not None else f"query {i}"
        if len(query) > settings.max_query_chars:
            raise ValueError(f"{where} has {len(query)} characters (at most {settings.max_query_chars})")
        problem = query_problem(query)
        if problem:
            raise ValueError(f"{where} {problem}")
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


class _BodyTooLarge(Exception):
    pass


class RequestBody:
    """ASGI middleware: reads each request's whole body before the app sees the request. 413 for a body over
    ``max_bytes`` (by Content-Length, or counted as it streams); 408 with ``Connection: close`` for one that has
    not arrived ``timeout_s`` seconds after the app got the headers (a stalled client never holds a connection
    longer); nothing when the client goes away meanwhile."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float):
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the body (or answer 408 / 413), then pass the request on with the body replayed."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        too_large = f"request body larger than {self.max_bytes} bytes"
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if not length.isdigit() or int(length) > self.max_bytes:
            return await styled_error(
                scope["path"], 413 if length.isdigit() else 400, too_large if length.isdigit() else "bad Content-Length"
            )(scope, receive, send)
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout_s)
        except asyncio.TimeoutError:
            message = f"the request body did not arrive within {self.timeout_s:g} s"
            return await styled_error(scope["path"], 408, message, {"Connection": "close"})(scope, receive, send)
        except _BodyTooLarge:
            return await styled_error(scope["path"], 413, too_large)(scope, receive, send)
        if body is None:  # the client disconnected
            return None
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytes | None:
        chunks, received = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


class HostAllowList:
    """ASGI middleware: 400 for a request whose Host header names no allowed host (any port), so that a page
    on another site cannot read answers through DNS rebinding. ``allowed`` holds names as
    :func:`~densepass.serve.settings.host_name` gives them, ``*.domain`` for subdomains; None allows any.
    (Starlette's ``TrustedHostMiddleware`` does the same check, but answers in plain text.)"""

    def __init__(self, app: ASGIApp, allowed: tuple[str, ...] | None):
        self.app = app
        self.allowed = allowed

    def allows(self, header: str | None) -> bool:
        """Whether a Host header value ``header`` (e.g. ``localhost:8000``, ``[::1]:8000``) is allowed."""
        if self.allowed is None:
            return True
        if not header:
            return False
        header = header.strip()
        if header.startswith("["):  # an IPv6 literal, then perhaps a port
            name, bracket, port = header[1:].partition("]")
            if not bracket or (port and not (port.startswith(":") and port[1:].isdigit())):
                return False
        else:
            name, colon, port = header.partition(":")
            if colon and not port.isdigit():
                return False
        name = host_name(name)
        return any(
            name == pattern or (pattern.startswith("*.") and name.endswith(pattern[1:])) for pattern in self.allowed
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass allowed requests on; answer the others 400."""
        if scope["type"] != "http" or self.allowed is None:
            return await self.app(scope, receive, send)
        hosts = [value for key, value in scope["headers"] if key == b"host"]
        header = hosts[0].decode("latin-1") if len(hosts) == 1 else None
        if self.allows(header):
            return await self.app(scope, receive, send)
        if header is None:
            message = "the request needs exactly one Host header"
        else:
            message = f"Host {header[:100]!r} is not allowed (the service's --allowed-hosts adds names)"
        await styled_error(scope["path"], 400, message)(scope, receive, send)


def create_app(
    searcher: Searcher,
    settings: ServeSettings | None = None,
    host: str | None = None,
    *,
    api_key: str | None = None,
    embedder: Embedder | None = None,
    reranker: PairScorer | None = None,
    admin_token: str | None = None,
) -> FastAPI:
    """The search service's FastAPI app over ``searcher`` (used read-only), with ``settings`` (default:
    :class:`ServeSettings`); ``host`` is the address it will listen on, accepted in the Host header when it is a
    specific one (see :meth:`ServeSettings.host_allow_list`). Its lifespan starts the batcher and, on shutdown,
    searches what is still waiting before it stops.

    ``embedder`` (``POST /v1/embeddings``, ``/embed``) and ``reranker`` (``POST /rerank``) default to the
    searcher's current bi-encoder and second stage (``backends.Current``: found again after a reload); their work
    goes through the same micro-batcher, its queue and its limits. ``api_key``: every route but ``/health`` then needs
    ``Authorization: Bearer API_KEY`` (:class:`~densepass.serve.operations.BearerAuth`). ``admin_token``: ``POST
    /admin/reload`` swaps in the index's current version (:mod:`densepass.serve.reload`); no route without it."""
    settings = settings or ServeSettings()
    if api_key is not None:  # "" would be no key at all, while /health said one was set
        check_api_key(api_key)
    current = Current(searcher, embedder, reranker)  # found again after a reload swapped the index
    batcher = MicroBatcher(searcher, settings.max_batch_size, settings.max_wait_ms, settings.max_queue)
    metrics = Metrics()
    batcher.on_batch = lambda operation, items: metrics.batch_items.labels(operation.split(":")[0]).observe(items)
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
        '`{"query": "...", "k": 10}`; embeddings through OpenAI\'s API (`POST /v1/embeddings`) and Text '
        "Embeddings Inference's (`POST /embed`), reranking through TEI's `POST /rerank`. Limits: at most "
        f"{settings.max_queries_per_request} queries (texts) of at most {settings.max_query_chars} "
        f"characters per request, k from 1 to {settings.max_k}, bodies of at most "
        f"{settings.max_body_bytes} bytes, sent within {settings.read_timeout_s:g} s. "
        'Errors are `{"error": "..."}` (in OpenAI\'s and TEI\'s own shapes on their routes).',
    )
    app.state.batcher = batcher
    app.state.settings = settings
    app.state.metrics = metrics
    app.state.current = current

    def page_response(status: int = 200) -> HTMLResponse:
        return HTMLResponse(page, status_code=status, headers=PAGE_SECURITY)

    def unauthorized(path: str, message: str) -> JSONResponse:
        return styled_error(path, 401, message, {"WWW-Authenticate": "Bearer"})

    app.add_middleware(RequestBody, max_bytes=settings.max_body_bytes, timeout_s=settings.read_timeout_s)
    app.add_middleware(
        BearerAuth, key=api_key, refuse=unauthorized, page=lambda: page_response(401)
    )  # after the Host check: a request to a host not allowed learns nothing
    app.add_middleware(HostAllowList, allowed=settings.host_allow_list(host))
    app.add_middleware(  # the outermost: every answer is counted and logged, refusals too
        Observe,
        metrics=metrics,
        routes=lambda: [route.path for route in app.routes],
        queue_depth=lambda: batcher.waiting,
    )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, err: RequestValidationError) -> JSONResponse:
        status, message = validation_message(err)
        first = err.errors()[0]  # OpenAI's param: the field at fault; malformed JSON has none (its loc is an offset)
        field = () if first.get("type") == "json_invalid" else first.get("loc", ())[1:2]
        param = ".".join(str(part) for part in field) or None
        return styled_error(request.url.path, status, message, param=param)

    @app.exception_handler(ApiError)
    async def refused(request: Request, err: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if err.status == 503 else None
        return styled_error(request.url.path, err.status, err.message, headers, err.param, err.code, err.reason)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> JSONResponse:
        return styled_error(request.url.path, err.status_code, err.detail, getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, err: Exception) -> JSONResponse:
        logger.error("%s failed", request.url.path, exc_info=err)
        message = f"internal server error ({type(err).__name__}); see the server log"
        return styled_error(request.url.path, 500, message)

    errors = {
        status: {"model": ErrorResponse, "description": what}
        for status, what in [
            (400, "malformed JSON, input the searcher rejects, or a Host header not allowed"),
            (401, "the service has an API key and the request did not send it"),
            (408, "the request body did not arrive in time (the connection is closed)"),
            (413, "request body too large (TEI routes: a text longer than the model reads, without truncate)"),
            (422, "wrong field types or values out of the limits (400 on OpenAI's routes)"),
            (503, "queue full or shutting down (Retry-After)"),
            (500, "unexpected failure (details in the server log)"),
        ]
    }

    async def search(body: SearchRequest, request: Request) -> Any:
        """Search: one ranked list of hits per query, best first, at most k each."""
        started = time.perf_counter()
        try:
            queries = request_queries(body, settings)
        except ValueError as err:
            return error_response(422, str(err))
        request.state.items = len(queries)
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

    async def health() -> Any:
        """Status, the searcher's description, queue depth, batching settings and what was served so far; 503
        when the batcher's worker has stopped without a shutdown (no request would be answered)."""
        dead = batcher.stopped and not batcher.closing
        facts = {
            "status": "shutting down" if batcher.closing else "worker stopped" if dead else "ok",
            "process": os.getpid(),  # which worker answered (--workers)
            "searcher": public(searcher.describe()),
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
                "read_timeout_s": settings.read_timeout_s,
            },
            "served": {
                "batches": batcher.batches,
                "queries": batcher.queries,
                "searcher_calls": batcher.searcher_calls,
            },
            "api_key": api_key is not None,
            "embeddings": public(described(current.embedder())),
            "rerank": public(described(current.reranker())),
        }
        return JSONResponse(facts, status_code=503) if dead else facts

    async def prometheus() -> Response:
        """Prometheus metrics: requests by route and status, latencies, micro-batch sizes, queue depth."""
        metrics.queue_depth.set(batcher.waiting)
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    async def search_page() -> HTMLResponse:
        return page_response()

    with_errors = {"responses": errors}
    # every route, in one place: (method, path, handler, options of FastAPI's add_api_route)
    routes: list[tuple[str, str, Any, dict[str, Any]]] = [
        ("POST", "/search", search, {"response_model": SearchResponse, "responses": errors}),
        ("GET", "/health", health, {}),
        ("POST", "/v1/embeddings", compat.openai_embeddings(batcher, settings, current.embedder), with_errors),
        ("GET", "/v1/models", compat.openai_models(current.embedder), {}),
        ("GET", "/v1/models/{model:path}", compat.openai_model(current.embedder), {}),  # org/name ids hold "/"
        ("POST", "/embed", compat.tei_embed(batcher, settings, current.embedder), with_errors),
        ("POST", "/rerank", compat.tei_rerank(batcher, settings, current.reranker), with_errors),
        ("GET", "/metrics", prometheus, {}),
        ("GET", "/", search_page, {"include_in_schema": False}),
    ]
    if admin_token is not None:
        reload = admin_reload_route(searcher, admin_token, public)
        routes.append(("POST", "/admin/reload", reload, {"include_in_schema": False}))
    for method, path, handler, options in routes:
        app.add_api_route(path, handler, methods=[method], **options)
    return app


def _timed_h11_protocol(read_timeout_s: float) -> type:
    """uvicorn's h11 protocol, closing a connection that has not sent a whole request line and headers within
    ``read_timeout_s`` of connecting, or of the first byte of its next request (uvicorn alone waits forever;
    its keep-alive timeout covers only idle connections between requests)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            self._header_timer: asyncio.TimerHandle | None = None
            super().connection_made(transport)
            self._watch_headers()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            self._stop_header_timer()
            super().connection_lost(exc)

        def _watch_headers(self) -> None:
            """Start the clock while a request's headers are awaited (once per request); stop it once they came."""
            if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
                self._stop_header_timer()
            elif self._header_timer is None:
                self._header_timer = self.loop.call_later(read_timeout_s, self._headers_timed_out)

        def _stop_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_timed_out(self) -> None:
            self._header_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                logger.info("closing a connection that sent no complete headers within %g s", read_timeout_s)
                with contextlib.suppress(h11.LocalProtocolError):
                    self.conn.send(h11.ConnectionClosed())
                self.transport.close()

    return TimedH11Protocol


def uvicorn_config(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, **options: Any) -> Any:
    """The ``uvicorn.Config`` that serves ``app`` (from :func:`create_app`): the h11 protocol with the header
    read timeout of the app's settings; ``options`` go to ``uvicorn.Config`` (``log_level``...)."""
    import uvicorn

    settings: ServeSettings = app.state.settings
    return uvicorn.Config(app, host=host, port=port, http=_timed_h11_protocol(settings.read_timeout_s), **options)


def __getattr__(name: str) -> Any:
    """``TimedH11Protocol``: the protocol of :func:`_timed_h11_protocol` with the read timeout of
    ``$DENSEPASS_READ_TIMEOUT_S`` (default 10 s), for worker processes, which import it by name."""
    if name == "TimedH11Protocol":
        return _timed_h11_protocol(float(os.environ.get("DENSEPASS_READ_TIMEOUT_S", "10")))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def configure_access_log(target: str | None) -> None:
    """Send the access log's JSON lines to stderr (``-``) or the file ``target``; None: nowhere."""
    from densepass.serve.operations import access_logger

    for handler in list(access_logger.handlers):
        access_logger.removeHandler(handler)
        handler.close()
    if target is not None:
        access_logger.addHandler(access_log_handler(target))
        access_logger.setLevel(logging.INFO)


def public(facts: Any) -> Any:
    """``facts`` as ``/health`` (open without the API key) shows them: a ``model`` saved on the server named as a
    client names it (``backends.short_name``: the folder's name, ``org/name``), never by its path there; a failed
    reload's message, which names paths on the server, only as ``last_reload_failed`` (the message is in the
    server's log and in the 409 answer to the operator's ``POST /admin/reload``)."""
    if isinstance(facts, dict):
        shown = {k: _public_model(v) if k == "model" else public(v) for k, v in facts.items() if k != RELOAD_ERROR}
        return {**shown, "last_reload_failed": True} if RELOAD_ERROR in facts else shown
    if isinstance(facts, list):
        return [public(v) for v in facts]
    return facts


def _public_model(value: Any) -> Any:
    # a local folder, or an absolute path (one moved since it loaded too); a Hub id (org/name) stays as it is
    return short_name(value) if isinstance(value, str) and (os.path.isabs(value) or os.path.exists(value)) else value


def described(thing: Any) -> dict | None:
    """``thing.describe()``, or None for no thing."""
    return thing.describe() if thing is not None else None


def run_server(
    searcher: Searcher,
    host: str = "127.0.0.1",
    port: int = 8000,
    settings: ServeSettings | None = None,
    log_level: str = "info",
    shutdown_timeout_s: float = 30.0,
    *,
    api_key: str | None = None,
    access_log: str | None = None,
    admin_token: str | None = None,
) -> None:
    """Serve ``searcher`` with uvicorn until Ctrl-C or SIGTERM; then the server takes no new connections, and the
    requests in flight, those waiting in the micro-batcher included, are finished and answered (for at most
    ``shutdown_timeout_s`` seconds) before the batcher stops. A ``port`` outside 0..65535 is a one-line
    ``ConfigError``, and so is an address it cannot listen on (after uvicorn logged why). ``api_key``: every route
    but ``/health`` needs it as a bearer token; without one, anyone who can reach a ``host`` other than loopback
    can search (the CLI warns). ``access_log``: one JSON line per request to stderr (``-``) or a file."""
    import uvicorn

    check_address(host, port)
    app = create_app(searcher, settings, host=host, api_key=api_key, admin_token=admin_token)
    configure_access_log(access_log)
    config = uvicorn_config(
        app, host, port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s, access_log=False
    )
    server = uvicorn.Server(config)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except SystemExit:  # uvicorn exits when it cannot bind (it logged why)
        if server.started:
            raise
    finally:
        configure_access_log(None)
    if not server.started:
        raise ConfigError(f"could not listen on {host}:{port} (see the log above)")


def run_workers(
    app_factory: str,
    argv: list[str],
    workers: int,
    host: str,
    port: int,
    settings: ServeSettings,
    log_level: str = "info",
    shutdown_timeout_s: float = 30.0,
    api_key: str | None = None,
) -> None:
    """Serve with ``workers`` processes behind one port (uvicorn's supervisor). Each process calls
    ``app_factory`` (``module:function``, e.g. the CLI's ``densepass.cli:serve_worker_app``), which loads the
    index and models itself from the ``densepass serve`` arguments ``argv`` (:func:`worker_argv`) and makes its
    app with :func:`worker_app`; so memory grows with every worker. Their metrics are added up (prometheus-client's
    multiprocess mode, in a temporary folder this function makes and removes). SIGTERM reaches every worker, and
    each drains as one process does; a worker ends with the parent, even when the parent is killed."""
    import shutil
    import tempfile

    import uvicorn

    check_address(host, port)
    metrics_dir = tempfile.mkdtemp(prefix="densepass-metrics-")
    failed = Path(metrics_dir) / WORKER_ERROR_FILE  # where a worker whose load failed writes why (worker_failed)
    os.environ[WORKER_ERROR_ENV] = str(failed)
    os.environ["DENSEPASS_SERVE_ARGV"] = json.dumps(argv)
    os.environ["DENSEPASS_READ_TIMEOUT_S"] = repr(settings.read_timeout_s)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    os.environ["DENSEPASS_SERVE_PARENT"] = str(os.getpid())
    if api_key is not None:
        os.environ["DENSEPASS_API_KEY"] = api_key
    try:
        uvicorn.run(
            app_factory,
            factory=True,
            host=host,
            port=port,
            workers=workers,
            http="densepass.serve.app:TimedH11Protocol",
            log_level=log_level,
            timeout_graceful_shutdown=shutdown_timeout_s,
            access_log=False,
        )
        reason = failed.read_text(encoding="utf-8", errors="replace").strip() if failed.is_file() else ""
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if reason:
        raise ConfigError(reason)


WORKER_ERROR_ENV = "DENSEPASS_SERVE_ERROR_FILE"
WORKER_ERROR_FILE = "worker-error.txt"


def worker_failed(err: DensepassError) -> NoReturn:
    """In a worker process of :func:`run_workers` whose index or models did not load (bad input: every worker
    would fail alike, and uvicorn's supervisor would start it again forever, a traceback each time): the one-line
    reason goes to the file ``run_workers`` reads, the supervisor gets SIGTERM (it stops the other workers and
    ``run_workers`` raises the reason as a one-line ``ConfigError``), and this process ends."""
    import signal

    target, parent = os.environ.get(WORKER_ERROR_ENV), os.environ.get("DENSEPASS_SERVE_PARENT")
    if not target or not parent:  # not started by run_workers: the caller's error
        raise err
    with contextlib.suppress(OSError):
        Path(target).write_text(" ".join(str(err).split()) + "\n", encoding="utf-8")
    with contextlib.suppress(OSError):
        os.kill(int(parent), signal.SIGTERM)
    os._exit(2)


def worker_argv() -> list[str]:
    """In a worker process of :func:`run_workers`: the ``densepass serve`` arguments it was started with."""
    return json.loads(os.environ["DENSEPASS_SERVE_ARGV"])


def worker_app(searcher: Searcher, settings: ServeSettings, host: str, access_log: str | None) -> FastAPI:
    """In a worker process of :func:`run_workers`: the app over ``searcher``, with the key the parent was given,
    and this process's access log lines (``-``: stderr; a file: each worker appends its own lines). The worker
    ends with its parent, even one killed by SIGKILL (``processes.die_with_parent``)."""
    from densepass.processes import die_with_parent

    parent = os.environ.get("DENSEPASS_SERVE_PARENT")  # set by run_workers (absent: an app made in-process)
    if parent:
        die_with_parent(int(parent))
    app = create_app(searcher, settings, host=host, api_key=os.environ.get("DENSEPASS_API_KEY") or None)
    configure_access_log(access_log)
    return app
