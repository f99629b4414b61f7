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
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

import densepass
from densepass.errors import ConfigError
from densepass.serve import ServeSettings, add_settings_arguments, create_app, hit_to_json, settings_from_args
from densepass.serve.batching import MicroBatcher, Unavailable
from serve_fake import PASSAGES, FakeSearcher

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
def serving(searcher: FakeSearcher, settings: ServeSettings | None = None):
    """Serve ``create_app(searcher, settings)`` with uvicorn in a thread on a free 127.0.0.1 port; yields
    ``(base_url, server, app)`` and stops the server (graceful shutdown) at the end."""
    app = create_app(searcher, settings)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level="warning", access_log=False))
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
    assert {"/search", "/health"} <= set(schema["paths"]) and "/" not in schema["paths"]
    assert {"413", "422", "503"} <= set(schema["paths"]["/search"]["post"]["responses"])
    assert docs.status_code == 200 and "swagger" in docs.text.lower()


def test_the_search_page_is_served_without_external_resources(service):
    url, _ = service
    with client(url) as http:
        page = http.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "connect-src 'self'" in page.headers["content-security-policy"]
    assert "http://" not in page.text and "https://" not in page.text and "innerHTML" not in page.text


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
