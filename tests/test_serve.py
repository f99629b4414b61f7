"""The search service (densepass.serve): the micro-batcher on its own, then the real app served by uvicorn on
127.0.0.1 and queried with a real HTTP client, a headless browser on the search page, and a smoke run of
benchmarks/bench_serve.py. The searcher is the fake of ``serve_fake.py`` (word overlap, call log)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

import densepass
from densepass.errors import ConfigError
from densepass.serve import ServeSettings, add_settings_arguments, create_app, hit_to_json, settings_from_args
from densepass.serve.app import uvicorn_config
from densepass.serve.microbatch import BatchFailed, MicroBatcher, Unavailable
from densepass.serve.settings import exposure_warning
from serve_fake import PASSAGES, DepthSearcher, FakeSearcher

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def reference(searcher: FakeSearcher, query: str, k: int) -> list[dict]:
    """What the service must answer for ``query``: the fake's own ranking, serialised like the service does."""
    return [hit_to_json(hit) for hit in searcher.search_one(query, k)]


@contextlib.contextmanager
def serving(searcher: FakeSearcher, settings: ServeSettings | None = None, **app_options):
    """Serve ``create_app(searcher, settings, **app_options)`` with uvicorn in a thread on a free 127.0.0.1 port;
    yields ``(base_url, server, app)`` and stops the server (graceful shutdown) at the end."""
    app = create_app(searcher, settings, **app_options)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn_config(app, log_config=None, log_level="warning", access_log=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server, app
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=30, trust_env=False)


def async_client(url: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    return httpx.AsyncClient(base_url=url, timeout=30, trust_env=False, limits=limits)


def wait_until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


SMALL = ServeSettings(max_queries_per_request=4, max_query_chars=50, max_k=20, max_body_bytes=2000, max_queue=64)


@pytest.fixture(scope="module")
def service():
    """One service over the fake with small limits, for the request and validation tests."""
    searcher = FakeSearcher()
    with serving(searcher, SMALL) as (url, _, _):
        yield url, searcher


# --- the micro-batcher on its own (deterministic: the requests are queued before the worker starts) ---


def run_batcher(searcher: FakeSearcher, jobs: list[tuple[list[str], int]], max_batch_size: int = 64):
    """Queue ``jobs`` (queries, k), then start the worker; returns each job's results or exception."""

    async def main():
        batcher = MicroBatcher(searcher, max_batch_size, max_wait_ms=0, max_queue=1000)
        tasks = [asyncio.create_task(batcher.search(queries, k)) for queries, k in jobs]
        await asyncio.sleep(0)  # every task has queued its job
        batcher.start()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        await batcher.close()
        return outcomes

    return asyncio.run(main())


def test_requests_waiting_together_are_searched_in_one_call_and_each_gets_its_own_slice():
    searcher = FakeSearcher()
    jobs = [(["video player"], 1), (["mail server", "image photos"], 3), (["python language"], 2)]
    outcomes = run_batcher(searcher, jobs)
    assert searcher.batches == [(["video player", "mail server", "image photos", "python language"], 3)]
    for (queries, k), results in zip(jobs, outcomes):
        assert results == [reference(searcher, q, k) for q in queries]
    assert len(outcomes[0][0]) == 1  # cut to its own k, though the batch asked for 3


def test_a_batch_never_exceeds_max_batch_size_and_a_request_is_never_split():
    searcher = FakeSearcher()
    sizes = [1, 2, 1, 4, 1]
    jobs = [([f"video {i}"] * n, 2) for i, n in enumerate(sizes)]
    outcomes = run_batcher(searcher, jobs, max_batch_size=3)
    assert [len(queries) for queries, _ in searcher.batches] == [3, 1, 4, 1]  # the 4-query request goes alone
    assert [len(results) for results in outcomes] == sizes


def test_a_bad_query_in_a_batch_fails_only_its_own_request():
    searcher = FakeSearcher()
    outcomes = run_batcher(searcher, [(["video"], 2), (["forbidden word"], 2), (["mail"], 2), (["explode"], 2)])
    assert outcomes[0] == [reference(searcher, "video", 2)] and outcomes[2] == [reference(searcher, "mail", 2)]
    assert "forbidden" in str(outcomes[1]) and isinstance(outcomes[3], RuntimeError)
    assert searcher.calls == 5  # the failed batch, then each request alone


def test_requests_of_different_k_are_batched_apart_when_the_ranking_depends_on_k():
    searcher = DepthSearcher()
    query = "video mail image"
    assert reference(searcher, query, 1) != reference(searcher, query, 3)[:1]  # its top hit depends on k
    outcomes = run_batcher(searcher, [([query], 1), ([query], 3), (["mail server"], 1)])
    assert outcomes == [[reference(searcher, q, k)] for q, k in [(query, 1), (query, 3), ("mail server", 1)]]
    assert searcher.batches == [([query, "mail server"], 1), ([query], 3)]  # the k=3 request keeps its turn


def test_only_index_kinds_whose_top_k_is_nested_share_batches_across_k():
    together = {}
    for kind, options in [
        ("exact", {"search_precision": "fp32"}),
        ("splade", {}),
        ("exact", {"search_precision": "int8"}),  # a first pass of rescore x k candidates
        ("binary-flat", {}),
        ("faiss-hnsw", {}),
        ("hybrid", {}),
        ("faiss-flat", {}),  # ties at the k-th score by row (faiss_search), as exact
        ("bm25", {}),  # the same (bm25.top_k)
    ]:
        searcher = FakeSearcher()
        searcher.nested_top_k = None  # not declared: the index's kind decides
        searcher.index = SimpleNamespace(kind=kind, **options)
        run_batcher(searcher, [(["video"], 1), (["mail"], 3)])
        together[kind, options.get("search_precision")] = len(searcher.batches) == 1
    assert together == {
        ("exact", "fp32"): True,
        ("splade", None): True,
        ("exact", "int8"): False,
        ("binary-flat", None): False,
        ("faiss-hnsw", None): False,
        ("hybrid", None): False,
        ("faiss-flat", None): True,
        ("bm25", None): True,
    }


def test_a_failure_in_the_worker_fails_its_batch_and_later_requests_are_served(caplog):
    async def main():
        searcher = FakeSearcher()
        batcher = MicroBatcher(searcher, max_batch_size=64, max_wait_ms=0, max_queue=100)
        failures = [OSError("the metrics folder is gone")]

        def on_batch(operation: str, items: int) -> None:
            if failures:
                raise failures.pop()

        batcher.on_batch = on_batch
        first = [asyncio.create_task(batcher.search([q], 1)) for q in ["video", "mail"]]
        await asyncio.sleep(0)  # both in the first batch
        batcher.start()
        failed = await asyncio.wait_for(asyncio.gather(*first, return_exceptions=True), 10)
        later = await asyncio.wait_for(batcher.search(["mail"], 1), 10)
        await batcher.close()
        return failed, later, searcher

    with caplog.at_level(logging.ERROR, logger="densepass.serve"):
        failed, later, searcher = asyncio.run(main())
    assert all(isinstance(err, BatchFailed) for err in failed), failed
    assert "micro-batch failed (OSError: the metrics folder is gone)" in str(failed[0])
    assert later == [reference(searcher, "mail", 1)]
    assert any(record.exc_info and "metrics folder" in str(record.exc_info[1]) for record in caplog.records)


def test_a_worker_that_stopped_is_reported_by_health_and_refuses_requests():
    app = create_app(FakeSearcher(), ServeSettings())

    async def kill_the_worker():
        task = app.state.batcher._task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    with TestClient(app, base_url="http://127.0.0.1") as http:
        http.portal.call(kill_the_worker)
        health = http.get("/health")  # first: before the fix a search would wait forever
        assert health.status_code == 503 and health.json()["status"] == "worker stopped"
        refused = http.post("/search", json={"query": "video"})
    assert refused.status_code == 503 and "worker has stopped" in refused.json()["error"]


def test_a_request_without_k_gets_at_most_max_k_hits():
    searcher = FakeSearcher()
    query = "video player mail image python web"  # matches every passage
    with TestClient(create_app(searcher, ServeSettings(max_k=2)), base_url="http://127.0.0.1") as http:
        answer = http.post("/search", json={"query": query})
        too_many = http.post("/search", json={"query": query, "k": 3})
    assert answer.status_code == 200 and answer.json()["results"] == [reference(searcher, query, 2)]
    assert too_many.status_code == 422 and "between 1 and 2, got 3" in too_many.json()["error"]
    assert searcher.batches == [([query], 2)]


def test_closing_the_batcher_searches_the_waiting_requests_then_refuses_new_ones():
    async def main():
        searcher = FakeSearcher()
        batcher = MicroBatcher(searcher, max_batch_size=2, max_wait_ms=10_000, max_queue=100)
        batcher.start()
        tasks = [asyncio.create_task(batcher.search([f"video {i}"], 1)) for i in range(5)]
        await asyncio.sleep(0)
        await batcher.close()  # does not wait the 10 s for fuller batches
        assert batcher.stopped and all(task.done() for task in tasks)
        with pytest.raises(Unavailable, match="shutting down"):
            await batcher.search(["video"], 1)
        return [task.result() for task in tasks], searcher

    results, searcher = asyncio.run(main())
    assert results == [[reference(searcher, f"video {i}", 1)] for i in range(5)]


def test_the_settings_reject_values_that_cannot_work():
    for bad in [
        dict(max_batch_size=0),
        dict(max_wait_ms=-1.0),
        dict(max_k=2.5),
        dict(max_queue=True),
        dict(max_queries_per_request=10, max_queue=5),
    ]:
        with pytest.raises(ConfigError):
            ServeSettings(**bad)


UNBOUNDED_SETTINGS = [
    ("max_wait_ms", float("nan")),
    ("max_wait_ms", float("inf")),
    ("max_wait_ms", 1e308),
    ("max_wait_ms", 1000.5),
    ("max_wait_ms", 10**400),
    ("read_timeout_s", 0.0),
    ("read_timeout_s", float("nan")),
    ("read_timeout_s", 1e9),
    ("max_batch_size", 10**6),
    ("max_queue", 10**12),
    ("max_queries_per_request", 10**6),
    ("max_query_chars", 10**9),
    ("max_k", 10**9),
    ("max_body_bytes", 10**12),
]


@pytest.mark.parametrize("name, value", UNBOUNDED_SETTINGS, ids=[f"{n}={v!r}"[:40] for n, v in UNBOUNDED_SETTINGS])
def test_every_setting_is_bounded_and_nan_is_refused_naming_the_flag(name, value):
    extra = {"max_queue": 10**6} if name == "max_queries_per_request" else {}
    with pytest.raises(ConfigError) as err:
        ServeSettings(**{name: value, **extra})
    message = str(err.value)
    assert f"--{name.replace('_', '-')}" in message and "\n" not in message
    ServeSettings(max_wait_ms=1000, read_timeout_s=600, max_queue=10**6, max_queries_per_request=10_000)  # the bounds


@pytest.mark.parametrize("value", ["1e308", "nan", "inf", "-inf", "1001"])
def test_cli_serve_refuses_an_unbounded_max_wait_before_loading_the_index(tmp_path, capsys, value):
    from densepass.cli import main

    assert main(["serve", str(tmp_path / "no-index"), f"--max-wait-ms={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--max-wait-ms" in err and "from 0 to 1000" in err, err
    assert "no-index" not in err  # refused before the (missing) index was looked at


@pytest.mark.parametrize("port", ["70000", "-1", "65536"])
def test_cli_serve_refuses_a_port_out_of_range_in_one_line_before_loading_the_index(tmp_path, capsys, port):
    from densepass.cli import main

    assert main(["serve", str(tmp_path / "no-index"), "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"densepass: error: --port must be an integer from 0 to 65535 (0: any free port), got {port}"
    with pytest.raises(ConfigError, match="--port"):
        from densepass.serve import run_server

        run_server(FakeSearcher(), port=int(port))


def test_cli_serve_refuses_a_taken_port_or_an_unknown_host_before_loading_the_index(tmp_path, capsys):
    from densepass.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        assert main(["serve", str(tmp_path / "no-index"), "--port", port]) == 2
        err = capsys.readouterr().err.strip()
        assert (
            err.startswith(f"densepass: error: cannot listen on --host 127.0.0.1 --port {port}: ") and "\n" not in err
        )
        with pytest.raises(ConfigError, match=f"could not listen on 127.0.0.1:{port}"):
            from densepass.serve import run_server

            run_server(FakeSearcher(), port=int(port), log_level="critical")
    assert main(["serve", str(tmp_path / "no-index"), "--host", "127.0.0.1 "]) == 2
    assert (
        capsys.readouterr().err.strip()
        == "densepass: error: --host must be an address or host name to listen on, got '127.0.0.1 '"
    )


def test_cli_serve_warns_in_one_line_that_a_non_loopback_host_has_no_authentication(tmp_path, capsys):
    from densepass.cli import main

    # 192.0.2.7 (TEST-NET-1) is no address of this machine: the warning comes, then binding it fails
    assert main(["serve", str(tmp_path / "no-index"), "--host", "192.0.2.7", "--port", "8123"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == f"densepass: warning: {exposure_warning('192.0.2.7', 8123)}"
    assert lines[1].startswith("densepass: error: ") and len(lines) == 2  # (cannot listen, or then no index)


@pytest.mark.parametrize("host, shown", [("0.0.0.0", "0.0.0.0"), ("::", "[::]"), ("search.example.com", None)])
def test_a_non_loopback_host_is_warned_about_naming_the_missing_authentication(host, shown):
    warning = exposure_warning(host, 8123)
    assert warning.startswith(f"--host {host}: the service has no authentication; ") and "\n" not in warning
    assert f"anyone who can reach {shown or host}:8123 can search the index" in warning


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "::1", "127.0.0.2"])
def test_a_loopback_host_is_not_warned_about(host):
    assert exposure_warning(host, 8000) is None


def test_the_host_allow_list_is_loopback_the_bound_address_and_the_given_names():
    loopback = ("localhost", "127.0.0.1", "::1")
    assert ServeSettings().host_allow_list() == loopback
    assert ServeSettings().host_allow_list("0.0.0.0") == loopback and ServeSettings().host_allow_list("::") == loopback
    assert ServeSettings().host_allow_list("192.0.2.7") == (*loopback, "192.0.2.7")
    given = ServeSettings(allowed_hosts=("Search.Example.com", "[2001:db8::1]", "*.corp.example"))
    assert given.host_allow_list("[::1]") == (*loopback, "search.example.com", "2001:db8::1", "*.corp.example")
    assert ServeSettings(allowed_hosts=("*",)).host_allow_list("0.0.0.0") is None
    for bad in ["example.com:8000", "a b", "http://example.com", "*example.com", ""]:
        with pytest.raises(ConfigError, match="--allowed-hosts"):
            ServeSettings(allowed_hosts=(bad,))
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    args = parser.parse_args(["--allowed-hosts", "a.example, b.example,"])
    assert settings_from_args(args).allowed_hosts == ("a.example", "b.example")


def test_the_settings_flags_round_trip_through_argparse():
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    assert settings_from_args(parser.parse_args([])) == ServeSettings()
    settings = settings_from_args(parser.parse_args(["--max-batch-size", "1", "--max-wait-ms", "0.5"]))
    assert settings.max_batch_size == 1 and settings.max_wait_ms == 0.5 and not settings.batching


# --- the service over HTTP ---


def test_a_search_returns_the_ranked_hits_of_each_query(service):
    url, searcher = service
    with client(url) as http:
        response = http.post("/search", json={"queries": ["video player", "mail server", "zzz"], "k": 2})
        single = http.post("/search", json={"query": "image photos"})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["results"] == [reference(searcher, q, 2) for q in ["video player", "mail server", "zzz"]]
    assert [h["id"] for h in body["results"][0]] == ["p0", "p5"] and body["results"][2] == []
    assert "answer" not in body["results"][0][0]  # None fields are dropped
    assert body["took_ms"] >= 0
    assert single.status_code == 200 and single.json()["results"] == [reference(searcher, "image photos", 10)]


BAD_REQUESTS = [
    ("malformed JSON", b'{"query": "video pl', 400, "malformed JSON"),
    ("not an object", b"[1, 2]", 422, "JSON object"),
    ("empty body", b"", 422, "JSON object"),
    ("query of the wrong type", {"query": 5}, 422, "query"),
    ("a non-string in queries", {"queries": ["video", 5]}, 422, "queries.1"),
    ("k as a string", {"query": "video", "k": "3"}, 422, "k"),
    ("k as a float", {"query": "video", "k": 2.5}, 422, "k"),
    ("k as a boolean", {"query": "video", "k": True}, 422, "k"),
    ("an unknown field", {"querys": ["video"]}, 422, "querys"),
    ("neither query nor queries", {"k": 3}, 422, "either"),
    ("both query and queries", {"query": "a", "queries": ["b"]}, 422, "either"),
    ("an empty query", {"query": ""}, 422, "empty"),
    ("a whitespace-only query", {"queries": ["video", " \t\n"]}, 422, "query 1 is empty or whitespace"),
    ("no queries", {"queries": []}, 422, "empty"),
    ("a lone surrogate", b'{"query": "\\ud800"}', 422, "the query has a lone surrogate U+D800 at character 0"),
    ("a lone low surrogate", {"queries": ["video", "a\udc00b"]}, 422, "query 1 has a lone surrogate U+DC00"),
    ("a zero-width-only query", {"query": "\u200b"}, 422, "no visible character"),
    ("zero-width and no-break spaces", {"queries": ["video", "\u200b\u00a0\ufeff\u2060"]}, 422, "query 1 has no"),
    ("a Hangul filler", {"query": " \u3164 "}, 422, "no visible character"),
    ("control characters only", {"query": "\u0000\u0007"}, 422, "no visible character"),
    ("too many queries", {"queries": ["video"] * 5}, 422, "too many queries: 5 (at most 4)"),
    ("a too-long query", {"query": "v" * 51}, 422, "51 characters (at most 50)"),
    ("k = 0", {"query": "video", "k": 0}, 422, "between 1 and 20, got 0"),
    ("k too large", {"query": "video", "k": 21}, 422, "between 1 and 20, got 21"),
    ("an oversized body", {"queries": ["video"], "k": 1, "pad": "x" * 3000}, 413, "larger than 2000 bytes"),
    ("a query the searcher rejects", {"query": "forbidden"}, 400, "forbidden word"),
]


@pytest.mark.parametrize(
    "content, status, fragment", [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_every_malformed_request_is_a_one_line_json_4xx(service, content, status, fragment):
    url, _ = service
    body = content if isinstance(content, bytes) else json.dumps(content).encode()
    with client(url) as http:
        response = http.post("/search", content=body, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    assert set(response.json()) == {"error"} and fragment in response.json()["error"]
    assert "\n" not in response.json()["error"] and "Traceback" not in response.text


def test_a_streamed_body_over_the_limit_is_a_413(service):
    url, _ = service

    def chunks():  # no Content-Length: chunked transfer, counted as it arrives
        yield b'{"query": "'
        for _ in range(10):
            yield b"v" * 500
        yield b'"}'

    with client(url) as http:
        response = http.post("/search", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and "larger than 2000 bytes" in response.json()["error"]


def test_unknown_paths_and_methods_are_json_errors_too(service):
    url, _ = service
    with client(url) as http:
        missing, wrong_method = http.get("/nope"), http.get("/search")
    assert (missing.status_code, missing.json()) == (404, {"error": "Not Found"})
    assert (wrong_method.status_code, wrong_method.json()) == (405, {"error": "Method Not Allowed"})


def test_an_unexpected_searcher_failure_is_a_500_without_a_trace_but_logged(service, caplog):
    url, _ = service
    with caplog.at_level(logging.ERROR, logger="densepass.serve"), client(url) as http:
        response = http.post("/search", json={"query": "explode"})
    assert response.status_code == 500
    assert response.json() == {"error": "search failed (RuntimeError); see the server log"}
    logged = [r for r in caplog.records if r.name == "densepass.serve"]
    assert logged and logged[0].exc_info and "exploded" in str(logged[0].exc_info[1])


def test_health_and_the_openapi_docs_describe_the_service(service):
    url, _ = service
    with client(url) as http:
        health = http.get("/health").json()
        schema = http.get("/openapi.json").json()
        docs = http.get("/docs")
    assert health["status"] == "ok" and health["searcher"] == {"kind": "fake word overlap", "passages": len(PASSAGES)}
    assert health["queue_depth"] == 0
    assert health["batching"] == {"enabled": True, "max_batch_size": 64, "max_wait_ms": 2.0, "max_queue": 64}
    assert health["limits"]["max_k"] == 20 and health["served"]["searcher_calls"] >= 0
    assert health["limits"]["read_timeout_s"] == 10.0
    assert {"/search", "/health"} <= set(schema["paths"]) and "/" not in schema["paths"]
    assert {"408", "413", "422", "503"} <= set(schema["paths"]["/search"]["post"]["responses"])
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_the_search_page_is_served_without_external_resources(service):
    url, _ = service
    with client(url) as http:
        page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text and "innerHTML" not in page.text


def test_queries_with_visible_characters_around_zero_width_ones_are_searched(service):
    url, searcher = service
    with client(url) as http:
        response = http.post("/search", json={"queries": ["video\u200bplayer", "?!", "\u00a0mail\u00a0"], "k": 2})
    assert response.status_code == 200, response.text
    assert response.json()["results"] == [reference(searcher, q, 2) for q in ["video\u200bplayer", "?!", " mail "]]


ALLOWED_BY_DEFAULT = [
    "localhost",
    "localhost:1",
    "LOCALHOST:8000",
    "127.0.0.1",
    "127.0.0.1:65535",
    "[::1]:8000",
    "[::1]",
]
REFUSED_BY_DEFAULT = [
    "evil.example",
    "evil.example:8000",
    "localhost.evil.example",
    "127.0.0.1.nip.io",
    "[::2]:80",
    "localhost:80:80",
    "[::1",
    "localhost:port",
    "0.0.0.0:8000",
]


def test_a_request_naming_another_host_is_a_400_and_never_searched(service):
    url, searcher = service
    calls = searcher.calls
    with client(url) as http:
        for host in ALLOWED_BY_DEFAULT:
            response = http.get("/health", headers={"Host": host})
            assert response.status_code == 200, (host, response.text)
        for host in REFUSED_BY_DEFAULT:
            response = http.post("/search", json={"query": "video"}, headers={"Host": host})
            assert response.status_code == 400, (host, response.text)
            assert set(response.json()) == {"error"} and "is not allowed" in response.json()["error"]
            assert "--allowed-hosts" in response.json()["error"]
            assert http.get("/", headers={"Host": host}).status_code == 400  # the search page too
    assert searcher.calls == calls
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # HTTP/1.0 allows no Host header
        sock.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        answer = read_until_closed(sock, time.monotonic() + 5)
    assert answer is not None and answer.startswith(b"HTTP/1.1 400") and b"exactly one Host header" in answer


def test_allowed_hosts_add_names_and_star_allows_any():
    settings = ServeSettings(allowed_hosts=("search.example.com", "*.corp.example"))
    with serving(FakeSearcher(), settings) as (url, _, _), client(url) as http:
        for host, status in [
            ("search.example.com", 200),
            ("search.example.com.:443", 200),
            ("a.corp.example:8000", 200),
            ("b.a.corp.example", 200),
            ("localhost:9", 200),
            ("corp.example", 400),
            ("evil.example", 400),
        ]:
            assert http.get("/health", headers={"Host": host}).status_code == status, host
    with serving(FakeSearcher(), ServeSettings(allowed_hosts=("*",))) as (url, _, _), client(url) as http:
        assert all(http.get("/health", headers={"Host": host}).status_code == 200 for host in REFUSED_BY_DEFAULT[:5])


def read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent on ``sock`` before it closed the connection, or None if it was still open at
    ``deadline`` (a ``time.monotonic()``)."""
    data = b""
    for _ in range(10_000):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            return None
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return None


HEADERS = b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"


def test_a_stalled_body_gets_408_and_its_connection_closed_within_the_read_timeout():
    searcher = FakeSearcher()
    with serving(searcher, ServeSettings(read_timeout_s=0.5)) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        started = time.monotonic()
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(30)]
        try:
            for sock in sockets:
                sock.sendall(HEADERS + b'{"query": "vid')  # 14 of the 100 bytes promised, then nothing
            answers = [read_until_closed(sock, started + 5) for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        took = time.monotonic() - started
        with client(url) as http:  # the service still answers
            assert http.post("/search", json={"query": "video"}).status_code == 200
    assert all(answer is not None for answer in answers), "a connection was still open after 5 s"
    for answer in answers:
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower()
        assert json.loads(body) == {"error": "the request body did not arrive within 0.5 s"}
    assert 0.4 < took < 5 and searcher.calls == 1


def test_connections_that_do_not_send_their_headers_in_time_are_closed():
    with serving(FakeSearcher(), ServeSettings(read_timeout_s=0.5)) as (url, _, _):
        port = int(url.rsplit(":", 1)[1])
        started = time.monotonic()
        partial = [b"", b"GET /hea", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"]  # never the blank line
        sockets = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in partial]
        try:
            for sock, data in zip(sockets, partial):
                sock.sendall(data)
            answers = [read_until_closed(sock, started + 5) for sock in sockets]
        finally:
            for sock in sockets:
                sock.close()
        assert answers == [b"", b"", b""] and time.monotonic() - started < 5

        # one header byte at a time (slowloris) never resets the clock
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            started, closed = time.monotonic(), False
            for _ in range(50):  # 5 s of dripping at most
                try:
                    sock.sendall(b"X")
                except OSError:
                    closed = True
                    break
                time.sleep(0.1)
                if read_until_closed(sock, time.monotonic() + 0.01) is not None:
                    closed = True
                    break
            assert closed and time.monotonic() - started < 3

        # and after a first request on a kept-alive connection, the second one's headers are timed too
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            first = sock.recv(65536)
            sock.sendall(b"GET /health HTTP/1.1\r\nHo")
            started = time.monotonic()
            assert first.startswith(b"HTTP/1.1 200") and read_until_closed(sock, started + 5) is not None
            assert time.monotonic() - started < 3


def test_concurrent_requests_are_answered_correctly_by_fewer_searcher_calls():
    searcher = FakeSearcher(delay_s=0.02)
    queries = [f"{a} {b}" for a in ["video", "mail", "image", "python"] for b in ["player", "server", "editor", "web"]]
    queries = (queries * 2)[:32]

    async def main(url):
        async with async_client(url) as http:
            return await asyncio.gather(
                *(http.post("/search", json={"query": q, "k": 1 + i % 4}) for i, q in enumerate(queries))
            )

    with serving(searcher, ServeSettings(max_wait_ms=50)) as (url, _, _):
        responses = asyncio.run(main(url))
        with client(url) as http:
            served = http.get("/health").json()["served"]
    for i, (query, response) in enumerate(zip(queries, responses)):
        assert response.status_code == 200 and response.json()["results"] == [reference(searcher, query, 1 + i % 4)]
    assert searcher.calls < len(queries) and sum(len(qs) for qs, _ in searcher.batches) == len(queries)
    assert served == {"batches": searcher.calls, "queries": 32, "searcher_calls": searcher.calls}


def test_batching_off_makes_one_searcher_call_per_request():
    searcher = FakeSearcher(delay_s=0.01)

    async def main(url):
        async with async_client(url) as http:
            return await asyncio.gather(*(http.post("/search", json={"query": f"video {i}"}) for i in range(16)))

    with serving(searcher, ServeSettings(max_batch_size=1, max_wait_ms=50)) as (url, _, _):
        responses = asyncio.run(main(url))
    assert all(r.status_code == 200 for r in responses)
    assert searcher.calls == 16 and all(len(queries) == 1 for queries, _ in searcher.batches)


def test_a_full_queue_is_a_503_with_retry_after():
    searcher = FakeSearcher()
    searcher.gate = threading.Event()
    settings = ServeSettings(max_batch_size=1, max_queue=2, max_queries_per_request=2)

    async def main(url):
        async with async_client(url) as http:
            first = asyncio.create_task(http.post("/search", json={"query": "video"}))
            await asyncio.to_thread(searcher.entered.wait, 10)  # the first request is being searched
            waiting = [asyncio.create_task(http.post("/search", json={"query": q})) for q in ["mail", "image"]]
            while (await http.get("/health")).json()["queue_depth"] < 2:
                await asyncio.sleep(0.01)
            refused = await http.post("/search", json={"query": "python"})
            searcher.gate.set()
            return refused, await asyncio.gather(first, *waiting)

    with serving(searcher, settings) as (url, _, _):
        refused, answered = asyncio.run(main(url))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert "queue is full (2 queries waiting, at most 2)" in refused.json()["error"]
    assert [r.status_code for r in answered] == [200, 200, 200]


def test_shutdown_finishes_the_request_in_flight_and_stops_the_batcher():
    searcher = FakeSearcher()
    searcher.gate = threading.Event()
    answer = {}
    with serving(searcher) as (url, server, app):

        def ask():
            with client(url) as http:
                answer["response"] = http.post("/search", json={"query": "video player", "k": 2})

        asking = threading.Thread(target=ask)
        asking.start()
        assert searcher.entered.wait(10)
        server.should_exit = True  # shutdown starts while the request is being searched
        time.sleep(0.3)
        searcher.gate.set()
        asking.join(30)
    assert answer["response"].status_code == 200
    assert answer["response"].json()["results"] == [reference(searcher, "video player", 2)]
    assert app.state.batcher.stopped and app.state.batcher.closing
    with pytest.raises(httpx.ConnectError), client(url) as http:
        http.get("/health")


def test_sigterm_drains_the_request_in_flight_of_run_server():
    with socket.socket() as probe:  # a free port for the subprocess
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    fake = [sys.executable, str(ROOT / "tests" / "serve_fake.py"), "--port", str(port), "--delay-ms", "1500"]
    process = subprocess.Popen(fake, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        with client(url) as http:
            for _ in range(300):  # up to 30 s to start
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None, process.communicate()[1][-2000:]
                time.sleep(0.1)
            answer = {}
            asking = threading.Thread(target=lambda: answer.update(r=http.post("/search", json={"query": "video"})))
            asking.start()
            time.sleep(0.5)  # the request is being searched (1.5 s)
            process.send_signal(signal.SIGTERM)
            asking.join(30)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert answer["r"].status_code == 200 and answer["r"].json()["results"] == [reference(FakeSearcher(), "video", 10)]
    assert process.returncode in (0, -signal.SIGTERM) and "Traceback" not in stderr, stderr[-2000:]


# --- the search page in a headless browser ---


@pytest.mark.skipif(
    not CHROMIUM.exists(), reason=f"no Chromium at {CHROMIUM} (scripts/setup.sh installs it with apt-get where it can)"
)
def test_the_search_page_shows_ranked_hits_in_a_headless_browser(tmp_path):
    from playwright.sync_api import expect, sync_playwright

    searcher = FakeSearcher()
    with serving(searcher) as (url, _, _), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url + "/")
            # waits go through expect(): the page's CSP forbids eval, which wait_for_function needs
            expect(page.locator("#about")).to_contain_text("word overlap")
            page.fill("#query", "video player")
            page.select_option("#k", "5")
            page.click("#submit")
            expect(page.locator("#results li .title")).to_have_text(["vlc", "mpv"])
            assert page.locator("#results li .hit-id").all_text_contents() == ["p0", "p5"]
            expect(page.locator("#status")).to_contain_text("2 hits in")
            page.screenshot(path=str(tmp_path / "search-page.png"), full_page=True)

            page.fill("#query", "html pdf markup")  # the passage's markup is shown as text, never parsed
            page.click("#submit")
            expect(page.locator("#results .title").first).to_have_text("htmldoc")
            assert "<b>HTML</b>" in page.locator("#results .text").first.text_content()
            assert page.locator("#results b, #results script").count() == 0

            page.fill("#query", "forbidden")
            page.click("#submit")
            expect(page.locator("#error")).to_be_visible()
            expect(page.locator("#error")).to_contain_text("forbidden word")
            expect(page.locator("#results li")).to_have_count(0)
        finally:
            browser.close()
    assert (tmp_path / "search-page.png").stat().st_size > 0


# --- the load-test client ---


def test_the_load_test_client_compares_a_batched_and_an_unbatched_service(tmp_path):
    queries = tmp_path / "queries.txt"
    queries.write_text("video player\nmail server\n\nimage photos\n")
    out = tmp_path / "bench.json"
    fake = f"{sys.executable} {ROOT / 'tests' / 'serve_fake.py'} --port {{port}} --delay-ms 2"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(densepass.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_serve.py"),
            "--queries",
            str(queries),
            "--start",
            f"batched={fake}",
            "--start",
            f"off={fake} --max-batch-size 1",
            "--concurrency",
            "1",
            "8",
            "--requests",
            "40",
            "--seconds",
            "20",
            "--warmup",
            "2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "batched ÷ off" in done.stdout and "queries/s ratio" in done.stdout
    report = json.loads(out.read_text())
    assert [(r["service"], r["concurrency"]) for r in report["results"]] == [
        ("batched", 1),
        ("batched", 8),
        ("off", 1),
        ("off", 8),
    ]
    assert all(r["requests"] == 40 and r["errors"] == 0 and r["p50_ms"] <= r["p99_ms"] for r in report["results"])
    assert [s["health"]["batching"]["enabled"] for s in report["services"]] == [True, False]
    assert next(r for r in report["results"] if r["service"] == "off")["mean_batch"] == 1.0
    assert len(report["ratios"]) == 2 and all(r["queries_per_s_ratio"] > 0 for r in report["ratios"])


def test_the_cli_builds_without_the_serving_stack_and_serving_says_what_is_missing():
    # every command but `serve` runs where FastAPI is not installed (e.g. a bare GPU machine)
    code = (
        "import sys; sys.modules['fastapi'] = None\n"
        "from densepass.cli import build_parser\n"
        "assert build_parser().parse_args(['evaluate', 'd', 'r.trec']).func.__name__ == '_evaluate'\n"
        "import densepass.serve as serve\n"
        "try:\n    serve.create_app\nexcept ImportError as err:\n    print('missing:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("missing:") and "fastapi" in done.stdout
