"""What running the service needs around its routes: an optional bearer token (:class:`BearerAuth`),
Prometheus metrics (:class:`Metrics`, ``GET /metrics``) and one JSON line per request (:class:`Observe`, the
access log).

Metrics: ``densepass_requests_total`` (by route, method and status), ``densepass_request_seconds`` (latency by
route), ``densepass_batch_items`` (items per micro-batch, by operation) and ``densepass_queue_depth`` (items
waiting for the worker). With several worker processes (``--workers``) each process counts its own; when
``PROMETHEUS_MULTIPROC_DIR`` names a folder (``run_server`` makes one for its workers), ``/metrics`` adds up
every process's, in prometheus-client's multiprocess mode.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

access_logger = logging.getLogger("densepass.serve.access")
access_logger.propagate = False  # run_server gives it a handler (stderr or --access-log), nothing else does

OPEN_PATHS = ("/health",)  # answered without the key (load balancers and the search page's description)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """The service's Prometheus metrics, in a registry of their own (several apps in one process do not mix)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "densepass_requests", "HTTP requests answered", ["route", "method", "status"], registry=self.registry
        )
        self.latency = Histogram(
            "densepass_request_seconds",
            "time from a request's arrival to its answer",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_items = Histogram(
            "densepass_batch_items",
            "items (queries, texts, pairs) per micro-batch",
            ["operation"],
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "densepass_queue_depth",
            "items waiting for the micro-batcher",
            registry=self.registry,
            multiprocess_mode="livesum",
        )

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type: this process's metrics, or every worker's in multiprocess
        mode."""
        from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = self.registry
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
        return generate_latest(registry), CONTENT_TYPE_LATEST


# the methods counted under their own name in densepass_requests_total; a client's made-up one is "other", so that a
# request (even one refused for want of the key) cannot add a time series
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"})
# the status counted for a request the client left before any answer started (nginx's "client closed request"):
# a timed-out or cancelled upload is not a server error on the dashboards
CLIENT_CLOSED = 499


class BearerAuth:
    """ASGI middleware: with a ``key``, every request but ``/health`` must send ``Authorization: Bearer KEY``
    (compared in constant time, ``hmac.compare_digest``), else 401 in the route's error shape. ``GET /`` without
    it gets 401 too, with the search page as its body: the page holds no data, and asks for the key, which it
    then sends with its searches."""

    def __init__(self, app: ASGIApp, key: str | None, refuse: Callable[[str, str], Any], page: Callable[[], Any]):
        self.app = app
        self.key = key.encode("utf-8") if key else None
        self.refuse = refuse  # (path, message) -> the 401 response
        self.page = page  # () -> the search page's response, with status 401

    def allows(self, scope: Scope) -> bool:
        """Whether the request names the key."""
        headers = [value for name, value in scope["headers"] if name == b"authorization"]
        if len(headers) != 1:
            return False
        scheme, _, token = headers[0].partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key or b"")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Pass requests with the key (and every request when there is none) on; answer the others 401."""
        if self.key is None or scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.allows(scope):
            return await self.app(scope, receive, send)
        if scope["path"] == "/" and scope["method"] == "GET":
            return await self.page()(scope, receive, send)
        await self.refuse(scope["path"], "missing or wrong API key: send the header 'Authorization: Bearer KEY'")(
            scope, receive, send
        )


class Observe:
    """ASGI middleware, the outermost: for each request, counts it and its latency in :class:`Metrics` (route as
    one of ``routes``, ``other`` for any other path) and writes one JSON line to the access log: time, method,
    route, path, status, latency in ms, and the items it asked for (queries, texts, pairs: ``batch_size``)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: Callable[[], list[str]], queue_depth: Callable):
        self.app = app
        self.metrics, self.routes, self.queue_depth = metrics, routes, queue_depth

    def route(self, path: str) -> str:
        """The route template ``path`` belongs to (bounded label values), or ``other``."""
        for template in self.routes():
            if "{" in template:
                prefix = template.split("{", 1)[0]
                if template.endswith(":path}"):  # the rest of the path, "/" included (``/v1/models/org/name``)
                    if path.startswith(prefix) and len(path) > len(prefix):
                        return template
                elif path.startswith(prefix) and path.count("/") == template.count("/"):
                    return template
            elif path == template:
                return template
        return "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve the request, then count it and log it."""
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, status = time.perf_counter(), CLIENT_CLOSED  # no answer started: the client left first
        scope.setdefault("state", {})

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            if status == CLIENT_CLOSED:  # the app failed before answering: a server error, as uvicorn answers it
                status = 500
            raise
        finally:
            took = time.perf_counter() - started
            route = self.route(scope["path"])
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"  # a bounded label set
            self.metrics.requests.labels(route, method, str(status)).inc()
            self.metrics.latency.labels(route).observe(took)
            self.metrics.queue_depth.set(self.queue_depth())
            if access_logger.handlers:
                record = {
                    "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "method": scope["method"],
                    "route": route,
                    "path": scope["path"][:200],
                    "status": status,
                    "latency_ms": round(took * 1000, 3),
                    "batch_size": scope["state"].get("items"),
                    "client": (scope.get("client") or ("",))[0],
                }
                access_logger.info(json.dumps(record))


def access_log_handler(target: str) -> logging.Handler:
    """A handler writing the access log's lines to stderr (``-``) or appended to the file ``target``."""
    handler: logging.Handler = logging.StreamHandler() if target == "-" else logging.FileHandler(target)
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler
