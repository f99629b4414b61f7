"""Hot reload of the served index (serve.reload): requests in a loop while the index is updated on disk and
reloaded (by POST /admin/reload, or by the manifest watch) all succeed, and the new version answers after the
swap; the admin route is off by default and refuses a wrong token."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn

from densepass.errors import ConfigError
from densepass.index import BM25Index
from densepass.index.living import update_index
from densepass.pipelines.search import SearchPipeline
from densepass.serve import create_app
from densepass.serve.app import uvicorn_config
from densepass.serve.reload import ReloadableSearcher, admin_token

TOKEN = "s3cret-operator-token"
TEXTS = ["tar archiver", "kernel driver", "audio editor", "kernel module loader", "music player"]


@contextlib.contextmanager
def serving(app):
    """``app`` served by uvicorn in a thread on a free loopback port; yields its base URL."""
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
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def saved_index(tmp_path: Path) -> Path:
    return BM25Index.build([{"id": str(i), "text": t} for i, t in enumerate(TEXTS)]).save(tmp_path / "index")


class Load:
    """The pipeline loader, slowed down: a reload takes long enough for requests to arrive meanwhile."""

    def __init__(self, folder: Path, delay_s: float = 0.0):
        self.folder, self.delay_s = folder, delay_s

    def __call__(self) -> SearchPipeline:
        time.sleep(self.delay_s)
        return SearchPipeline.load(self.folder)


def hammer(url: str, stop: threading.Event, outcomes: list) -> None:
    """POST /search in a loop until ``stop``, recording (status, ids of the top hits)."""
    with httpx.Client(base_url=url, timeout=30, trust_env=False) as client:
        while not stop.is_set():
            response = client.post("/search", json={"query": "kernel", "k": 5})
            ids = [hit["id"] for hit in response.json()["results"][0]] if response.status_code == 200 else None
            outcomes.append((response.status_code, ids))


def test_requests_during_an_admin_reload_all_succeed_and_the_new_version_answers_after(tmp_path):
    folder = saved_index(tmp_path)
    searcher = ReloadableSearcher(Load(folder, delay_s=0.3), folder)
    outcomes: list = []
    stop = threading.Event()
    with serving(create_app(searcher, admin_token=TOKEN)) as url, httpx.Client(base_url=url, trust_env=False) as http:
        assert http.get("/health").json()["searcher"]["index_version"] == 0
        threads = [threading.Thread(target=hammer, args=(url, stop, outcomes)) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.2)
        update_index(folder, delete=["1"], upsert=[{"id": "9", "text": "kernel headers"}])
        before = len(outcomes)
        assert http.post("/admin/reload", headers={"X-Admin-Token": TOKEN}, timeout=30).status_code == 200
        during = len(outcomes) - before
        time.sleep(0.2)
        stop.set()
        for thread in threads:
            thread.join(30)
        health = http.get("/health").json()["searcher"]
    assert during > 0  # requests were answered while the new version loaded
    assert all(status == 200 for status, _ in outcomes), [o for o in outcomes if o[0] != 200][:3]
    assert outcomes[0][1] == ["1", "3"] and outcomes[-1][1] == ["9", "3"]  # old index, then the new one
    assert {tuple(ids) for _, ids in outcomes} == {("1", "3"), ("9", "3")}  # each batch wholly one or the other
    assert health["index_version"] == 1 and health["reloads"] == 1 and health["passages"] == 5


def test_the_admin_route_is_off_by_default_and_needs_the_token(tmp_path):
    folder = saved_index(tmp_path)
    searcher = ReloadableSearcher(Load(folder), folder)
    with serving(create_app(searcher)) as url, httpx.Client(base_url=url, trust_env=False) as http:
        assert http.post("/admin/reload", headers={"X-Admin-Token": TOKEN}).status_code == 404
    with serving(create_app(searcher, admin_token=TOKEN)) as url, httpx.Client(base_url=url, trust_env=False) as http:
        assert http.post("/admin/reload").status_code == 401
        assert http.post("/admin/reload", headers={"X-Admin-Token": TOKEN + "x"}).status_code == 401
        (folder / "manifest.json").write_text("{}")  # a damaged index: the old one keeps serving
        refused = http.post("/admin/reload", headers={"X-Admin-Token": TOKEN})
        assert refused.status_code == 409 and "the old index serves" in refused.json()["error"]
        assert http.post("/search", json={"query": "audio"}).json()["results"][0][0]["id"] == "2"
    with pytest.raises(ConfigError, match="at least 16 characters"):
        admin_token("short")


def test_the_watch_reloads_when_an_update_swaps_the_manifest(tmp_path):
    folder = saved_index(tmp_path)
    searcher = ReloadableSearcher(Load(folder), folder)
    searcher.watch(0.05)
    try:
        update_index(folder, delete=["2"])
        deadline = time.monotonic() + 20
        while searcher.describe()["index_version"] != 1:
            assert time.monotonic() < deadline, "the watch did not reload"
            time.sleep(0.05)
        assert [hit.id for hit in searcher.search_batch(["audio editor"], 5)[0]] == []
    finally:
        searcher.stop()


def test_densepass_serve_with_a_watch_and_a_token_reloads_an_updated_index(tmp_path):
    import os
    import subprocess
    import sys

    folder = saved_index(tmp_path)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = {**os.environ, "DENSEPASS_ADMIN_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
    command = ["serve", str(folder), "--port", str(port), "--watch-index", "0.2", "--access-log", "off"]
    process = subprocess.Popen([sys.executable, "-m", "densepass", *command], env=env, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False) as http:
            deadline = time.monotonic() + 120
            while True:
                assert process.poll() is None and time.monotonic() < deadline, "the service did not start"
                with contextlib.suppress(httpx.TransportError):
                    if http.get("/health").status_code == 200:
                        break
                time.sleep(0.2)
            assert http.get("/health").json()["searcher"]["index_version"] == 0
            update_index(folder, delete=["0"])  # the watch swaps it in
            deadline = time.monotonic() + 30
            while http.get("/health").json()["searcher"]["index_version"] != 1:
                assert time.monotonic() < deadline, "the watch did not reload"
                time.sleep(0.1)
            update_index(folder, delete=["2"])
            reloaded = http.post("/admin/reload", headers={"X-Admin-Token": TOKEN})  # the token, from the environment
            assert reloaded.status_code == 200 and reloaded.json()["searcher"]["index_version"] == 2
            assert http.post("/search", json={"query": "tar audio", "k": 5}).json()["results"][0] == []
    finally:
        process.terminate()
        process.wait(30)


def test_the_watch_outlives_a_reload_that_fails_with_an_unexpected_error(tmp_path):
    folder = saved_index(tmp_path)
    calls = []

    def flaky() -> SearchPipeline:  # the first reload fails as a read of a version removed meanwhile would
        calls.append(1)
        if len(calls) == 2:
            raise OSError("No such file or directory: v000001/passages.jsonl")
        return SearchPipeline.load(folder)

    searcher = ReloadableSearcher(flaky, folder)
    thread = searcher.watch(0.05)
    try:
        update_index(folder, delete=["2"])
        deadline = time.monotonic() + 20
        while len(calls) < 2 or searcher.describe().get("last_reload_error") is None:
            assert time.monotonic() < deadline, "the watch did not try to reload"
            time.sleep(0.05)
        assert "OSError" in searcher.describe()["last_reload_error"]
        assert thread.is_alive()
        update_index(folder, delete=["3"])  # the next change is reloaded
        while searcher.describe()["index_version"] != 2:
            assert time.monotonic() < deadline, "the watch stopped after the failure"
            time.sleep(0.05)
        assert thread.is_alive() and "last_reload_error" not in searcher.describe()
    finally:
        searcher.stop()


@pytest.mark.parametrize("seconds", ["0", "-1", "nan", "inf", "1e12"])
def test_a_watch_interval_that_is_not_a_positive_number_of_seconds_up_to_a_day_is_one_line(tmp_path, capsys, seconds):
    """An infinite or huge interval ended the watch thread at once (OverflowError in its wait)."""
    from densepass.cli import main

    assert main(["serve", str(tmp_path / "no-index"), "--port", "0", "--watch-index", seconds]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("densepass: error: --watch-index takes a number of seconds above 0") and "\n" not in err


def test_a_reader_that_sees_the_new_version_never_sees_the_error_it_replaced(tmp_path):
    """Readers (``/health``) take no lock: at the moment the new pipeline becomes visible, the last failure must
    already be cleared, or a reader scheduled between the two stores reports the new version with the old error."""
    folder = saved_index(tmp_path)
    seen = []

    class Probed(ReloadableSearcher):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "current" and hasattr(self, "last_error"):
                seen.append(self.describe())  # what a reader would see right after the swap

    searcher = Probed(lambda: SearchPipeline.load(folder), folder)
    searcher.last_error = (
        "OSError: No such file or directory: v000001/passages.jsonl"  # a failed reload, as the watch records it
    )
    update_index(folder, delete=["2"])
    searcher.reload()
    assert seen[-1]["index_version"] == 1 and "last_reload_error" not in seen[-1]


def test_the_reload_answer_shows_the_searcher_as_health_does(tmp_path):
    """The operator's reload answered the searcher's facts raw: a model's absolute path on the server."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from densepass.serve.app import public
    from densepass.serve.reload import admin_reload_route

    class Reloading:
        def reload(self):
            return {"index": "exact", "model": str(tmp_path / "models" / "mine"), "index_version": 3}

    app = FastAPI()
    app.add_api_route("/admin/reload", admin_reload_route(Reloading(), TOKEN, public), methods=["POST"])
    with TestClient(app) as http:
        answer = http.post("/admin/reload", headers={"X-Admin-Token": TOKEN})
    assert answer.status_code == 200 and str(tmp_path) not in answer.text
    assert answer.json() == {"reloaded": True, "searcher": public(Reloading().reload())}
