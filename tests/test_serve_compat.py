"""The service through the APIs other stacks speak (issue 52): a real ``densepass serve`` process on 127.0.0.1
over a tiny random bi-encoder's index with a cross-encoder second stage and an API key, called by the official
``openai`` client, ``langchain-openai`` and TEI's request shapes; the key on every route; Prometheus metrics and
the JSON access log; a SIGTERM under load that loses no accepted request; several worker processes."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import pytest
import torch
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from starlette.routing import Route

import densepass as dp
from conftest import assert_same_ranking_up_to_ties, save_tiny_bert
from densepass.errors import ConfigError
from densepass.models.cross_encoder import CrossEncoder
from densepass.serve import ServeSettings, create_app
from serve_fake import FakeEmbedder, FakeReranker, FakeSearcher

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = [
    "VLC media player: plays audio and video files",
    "GNU Image Manipulation Program: edit photos",
    "a mail transport agent",
    "x",
    "the tar archiving utility " * 15,  # longer than the 32 tokens of the model's passages: cut
]
CPU = torch.device("cpu")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    src = str(Path(dp.__file__).parents[1])
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([src, str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "DENSEPASS_API_KEY": "",  # empty: no key (the server fixture sets one)
    }


def wait_for_health(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5, trust_env=False) as http:
        while True:
            try:
                if http.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if process.poll() is not None:
                raise AssertionError(f"the server exited: {process.communicate()[1][-3000:]}")
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)


def stop(process: subprocess.Popen) -> str:
    """SIGTERM, then the stderr it wrote (killed if it does not stop within 30 s)."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        process.kill()
        return process.communicate()[1]


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    """A saved bi-encoder (a query prompt, 32-token passages, trained prefixes of 8 and 16), its exact index,
    and a cross-encoder whose head is scaled up so that its scores of different texts are far apart."""
    root = tmp_path_factory.mktemp("serve-compat")
    config = dp.BiEncoderConfig(query_prompt="query: ", passage_max_length=32, matryoshka_dims=[8, 16])
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir), config)
    model.save(root / "tiny-bi")
    model = dp.BiEncoder.from_pretrained(str(root / "tiny-bi"))
    passages = [{"id": f"p{i}", "title": f"pkg{i}", "text": text} for i, text in enumerate(TEXTS * 3)]
    dp.DenseIndex.build(model, passages, kind="exact", show_progress=False).save(root / "idx")
    cross = CrossEncoder.new(str(tiny_model_dir), seed=3, max_length=48, device=CPU, precision="fp32")
    with torch.no_grad():
        cross.model.classifier.weight.mul_(300.0)
    cross.save(root / "ce")
    return root, model


@pytest.fixture(scope="module")
def server(models):
    """``densepass serve`` in a subprocess, with the cross-encoder, an API key (from the environment) and the
    access log in a file; yields (url, root, the bi-encoder, the log path)."""
    root, model = models
    port, log = free_port(), root / "access.log"
    command = [sys.executable, "-m", "densepass", "serve", str(root / "idx"), "--port", str(port)]
    command += ["--rerank", str(root / "ce"), "--precision", "fp32", "--rerank-precision", "fp32"]
    command += ["--access-log", str(log), "--max-wait-ms", "5"]
    env = {**subprocess_env(), "DENSEPASS_API_KEY": KEY}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        yield url, root, model, log
    finally:
        stderr = stop(process)
    assert "Traceback" not in stderr, stderr[-3000:]


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def vector(embedding) -> np.ndarray:
    """An embedding as the openai client gives it: a list of floats, or (asked for base64) the string."""
    if isinstance(embedding, str):
        return np.frombuffer(base64.b64decode(embedding), dtype="<f4")
    return np.asarray(embedding, dtype=np.float64)


# float; base64 asked for (the client hands the string over); not given (the client asks for base64, decodes it)
@pytest.mark.parametrize("encoding_format", ["float", "base64", None])
def test_the_openai_client_gets_the_embeddings_of_biencoder_encode(server, encoding_format):
    import openai

    url, _, model, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    options = {} if encoding_format is None else {"encoding_format": encoding_format}
    passages = client.embeddings.create(model="tiny-bi", input=TEXTS, **options)
    queries = client.embeddings.create(model="tiny-bi", input=TEXTS[:3], extra_body={"input_type": "query"}, **options)
    expected_p = model.encode_passages(TEXTS, show_progress=False, precision="fp32")
    expected_q = model.encode_queries(TEXTS[:3], show_progress=False, precision="fp32")
    got_p = [vector(item.embedding) for item in sorted(passages.data, key=lambda item: item.index)]
    got_q = [vector(item.embedding) for item in queries.data]
    if encoding_format == "base64":
        assert all(isinstance(item.embedding, str) for item in passages.data)
    assert cosines(got_p, expected_p).min() >= 0.9999 and cosines(got_q, expected_q).min() >= 0.9999
    assert cosines(got_q, expected_p[:3]).min() < 0.9999  # the query prompt was applied
    counts = [len(ids) for ids in model.tokenizer(TEXTS)["input_ids"]]
    assert passages.usage.prompt_tokens == passages.usage.total_tokens == sum(min(c, 32) for c in counts)
    assert passages.model == "tiny-bi" and [item.index for item in passages.data] == list(range(len(TEXTS)))

    short = client.embeddings.create(model="tiny-bi", input="a mail transport agent", dimensions=8, **options)
    cut = vector(short.data[0].embedding)
    assert cut.shape == (8,) and abs(np.linalg.norm(cut) - 1) < 1e-5
    assert cosines([cut], [expected_p[2][:8]])[0] >= 0.9999


def test_langchain_openai_embeddings_equal_biencoder_encode(server):
    from langchain_openai import OpenAIEmbeddings

    url, _, model, _ = server
    embeddings = OpenAIEmbeddings(
        base_url=f"{url}/v1", api_key=KEY, model="tiny-bi", check_embedding_ctx_length=False, max_retries=0
    )
    expected = model.encode_passages(TEXTS, show_progress=False, precision="fp32")
    assert cosines(embeddings.embed_documents(TEXTS), expected).min() >= 0.9999
    assert cosines([embeddings.embed_query(TEXTS[0])], expected[:1])[0] >= 0.9999
    queries = OpenAIEmbeddings(  # the documented way to embed queries as queries
        base_url=f"{url}/v1",
        api_key=KEY,
        model="tiny-bi",
        check_embedding_ctx_length=False,
        max_retries=0,
        model_kwargs={"extra_body": {"input_type": "query"}},
    )
    expected_q = model.encode_queries(TEXTS[:1], show_progress=False, precision="fp32")
    assert cosines([queries.embed_query(TEXTS[0])], expected_q)[0] >= 0.9999


def test_openai_errors_come_in_openais_shape(server):
    import openai

    url, _, _, _ = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="token ids") as err:
        client.embeddings.create(model="tiny-bi", input=[[101, 2054, 102]])
    assert err.value.body["type"] == "invalid_request_error" and err.value.body["param"] == "input"
    with pytest.raises(openai.NotFoundError, match="tiny-bi") as err:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert err.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError, match="dimensions must be from 1 to 32"):
        client.embeddings.create(model="tiny-bi", input="x", dimensions=33)
    with pytest.raises(openai.AuthenticationError, match="API key"):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong" * 4, max_retries=0).embeddings.create(
            model="tiny-bi", input="x"
        )
    assert "tiny-bi" in [m.id for m in client.models.list().data]


def test_tei_embed_and_rerank_give_densepass_own_vectors_and_order(server):
    url, root, model, _ = server
    with httpx.Client(base_url=url, headers=AUTH, timeout=60, trust_env=False) as http:
        vectors = http.post("/embed", json={"inputs": TEXTS[:4]}).json()
        queries = http.post("/embed", json={"inputs": TEXTS[:2], "prompt_name": "query"}).json()
        too_long = http.post("/embed", json={"inputs": TEXTS})
        cut = http.post("/embed", json={"inputs": TEXTS, "truncate": True})
        query, texts = "audio and video player", TEXTS[:4] + ["a video player for audio files"]
        ranked = http.post("/rerank", json={"query": query, "texts": texts, "raw_scores": True, "return_text": True})
        squashed = http.post("/rerank", json={"query": query, "texts": texts}).json()
        refused = http.post("/rerank", json={"query": query, "texts": ["music " * 60]})
    assert cosines(vectors, model.encode_passages(TEXTS[:4], show_progress=False, precision="fp32")).min() >= 0.9999
    assert cosines(queries, model.encode_queries(TEXTS[:2], show_progress=False, precision="fp32")).min() >= 0.9999
    assert too_long.status_code == 413 and too_long.json()["error_type"] == "Validation"
    assert "input 4 has" in too_long.json()["error"] and cut.status_code == 200 and len(cut.json()) == len(TEXTS)

    reference = CrossEncoder.from_pretrained(str(root / "ce"), device=CPU, precision="fp32")
    expected = reference.score_pairs([query] * len(texts), texts)
    answer = ranked.json()
    assert ranked.status_code == 200 and sorted(a["index"] for a in answer) == list(range(len(texts)))
    assert [a["text"] for a in answer] == [texts[a["index"]] for a in answer]
    scores = np.array([a["score"] for a in answer])
    np.testing.assert_allclose(scores, expected[[a["index"] for a in answer]], rtol=1e-4, atol=1e-4)
    assert np.ptp(expected) > 50 * 1e-4  # the scaled head spreads the scores: the order below means something
    assert_same_ranking_up_to_ties(
        [a["index"] for a in answer], scores, np.argsort(-expected, kind="stable"), np.sort(expected)[::-1], 1e-4
    )
    assert [a["index"] for a in squashed] == [a["index"] for a in answer]
    np.testing.assert_allclose([a["score"] for a in squashed], 1 / (1 + np.exp(-scores)), rtol=1e-6)
    assert refused.status_code == 413 and refused.json()["error_type"] == "Validation"


def test_tei_rerank_with_colbert_orders_by_maxsim(tiny_model_dir):
    from densepass.models.colbert import ColBERT, ColbertReranker

    reranker = ColbertReranker(ColBERT.from_pretrained(str(tiny_model_dir)), device=CPU, precision="fp32")
    query, texts = "audio and video player", TEXTS[:4] + ["a video player for audio files"]
    expected = reranker.score_pairs([query] * len(texts), texts)
    with TestClient(create_app(FakeSearcher(), reranker=reranker), base_url="http://127.0.0.1") as http:
        answer = http.post("/rerank", json={"query": query, "texts": texts, "raw_scores": True}).json()
    assert [a["index"] for a in answer] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([a["score"] for a in answer], np.sort(expected)[::-1], rtol=1e-5)


def test_metrics_parse_and_the_access_log_has_one_json_line_per_request(server):
    from prometheus_client.parser import text_string_to_metric_families

    url, _, _, log = server
    with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
        for _ in range(3):
            assert http.post("/embed", headers=AUTH, json={"inputs": ["a", "b", "c"]}).status_code == 200
        assert http.post("/search", headers=AUTH, json={"query": "video", "k": 2}).status_code == 200
        assert http.get("/metrics").status_code == 401
        text = http.get("/metrics", headers=AUTH).text
    families = {family.name: family for family in text_string_to_metric_families(text)}
    assert {"densepass_requests", "densepass_request_seconds", "densepass_batch_items", "densepass_queue_depth"} <= set(
        families
    )
    counts = {
        (s.labels["route"], s.labels["status"]): s.value
        for s in families["densepass_requests"].samples
        if s.name == "densepass_requests_total"
    }
    assert counts[("/embed", "200")] >= 3 and counts[("/metrics", "401")] >= 1
    batched = [s for s in families["densepass_batch_items"].samples if s.name == "densepass_batch_items_count"]
    assert {s.labels["operation"] for s in batched} >= {"embed", "search"}
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    embeds = [line for line in lines if line["route"] == "/embed" and line["batch_size"] == 3]  # (no other test's)
    assert len(embeds) == 3 and all(line["status"] == 200 and line["latency_ms"] > 0 for line in embeds)
    assert {"time", "method", "route", "path", "status", "latency_ms", "batch_size"} <= set(lines[-1])


def route_paths(app) -> list[tuple[str, str]]:
    """(method, path) of every route of ``app``, path parameters filled in."""
    out = []
    for route in app.routes:
        if isinstance(route, (APIRoute, Route)):
            path = route.path.replace("{model:path}", "org/tiny-bi")
            assert "{" not in path, f"fill in the parameter of {route.path}"
            out.extend((method, path) for method in sorted(route.methods or ["GET"]) if method != "HEAD")
    return out


def test_with_a_key_every_route_but_health_answers_401_without_it():
    app = create_app(FakeSearcher(), ServeSettings(), api_key=KEY)
    routes = route_paths(app)
    assert {path for _, path in routes} >= {"/search", "/v1/embeddings", "/embed", "/rerank", "/metrics", "/"}
    with TestClient(app, base_url="http://127.0.0.1") as http:
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"}, {"Authorization": KEY}):
                response = http.request(method, path, headers=headers, json={})
                expected = 200 if path == "/health" else 401
                assert response.status_code == expected, (method, path, headers, response.text[:200])
            assert http.request(method, path, headers=AUTH, json={}).status_code != 401, (method, path)
        page = http.get("/")  # the page still loads, asks for the key and sends it with its searches
        assert page.status_code == 401 and 'id="key"' in page.text and "Authorization" in page.text
        assert http.get("/health").json()["api_key"] is True
        assert http.post("/search", headers=AUTH, json={"query": "video"}).status_code == 200


@pytest.mark.parametrize("key", ["", "short", "has a space in it 0123", 12345678901234567])
def test_create_app_refuses_a_key_that_would_leave_it_open_or_guessable(key):
    """``api_key=""`` (``os.environ.get("KEY", "")``) turned authentication off while /health said a key was set;
    the library is held to the CLI's rules."""
    with pytest.raises(ConfigError, match="^api_key must be at least 16 printable characters without spaces"):
        create_app(FakeSearcher(), ServeSettings(), api_key=key)


def test_a_made_up_http_method_adds_no_time_series_to_the_metrics():
    """Every request is counted by method, also one refused for want of the key: made-up methods are "other"."""
    app = create_app(FakeSearcher(), ServeSettings(), api_key=KEY)
    with TestClient(app, base_url="http://127.0.0.1", raise_server_exceptions=False) as http:
        for i in range(20):
            http.request(f"X{i:04d}", "/search")
        http.post("/search", headers=AUTH, json={"query": "video"})
        body = http.get("/metrics", headers=AUTH).text
    series = [line for line in body.splitlines() if line.startswith("densepass_requests_total{")]
    methods = {line.split('method="')[1].split('"')[0] for line in series}
    assert methods == {"other", "POST"} and len(series) == 2, series


def test_shorter_embeddings_only_from_a_model_trained_for_them(tiny_model_dir):
    from densepass.serve.backends import Embedder

    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))  # no Matryoshka dimensions
    app = create_app(FakeSearcher(), ServeSettings(), embedder=Embedder(model, str(tiny_model_dir), CPU, "fp32"))
    with TestClient(app, base_url="http://127.0.0.1") as http:
        refused = http.post("/v1/embeddings", json={"input": "x", "dimensions": 8})
        whole = http.post("/v1/embeddings", json={"input": "x", "dimensions": 32, "model": tiny_model_dir.name})
    assert refused.status_code == 400 and "not trained for shorter embeddings" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "dimensions"
    assert whole.status_code == 200 and len(whole.json()["data"][0]["embedding"]) == 32


def test_an_index_at_a_matryoshka_prefix_serves_embeddings_of_its_dimension(models):
    """An index built at ``--dim 16``: ``/v1/embeddings`` and ``/embed`` give 16-dimension vectors, those the index
    holds (cut and normalised again), not the model's 32; ``dimensions`` may still ask for the trained 8."""
    _, model = models
    passages = [{"id": f"p{i}", "title": "", "text": text} for i, text in enumerate(TEXTS)]
    index = dp.DenseIndex.build(
        model, passages, kind="exact", dim=16, show_progress=False, device=CPU, precision="fp32"
    )
    _, stored = index.to_numpy()
    app = create_app(dp.SearchPipeline(index), ServeSettings())
    with TestClient(app, base_url="http://127.0.0.1") as http:
        openai = http.post("/v1/embeddings", json={"input": TEXTS, "input_type": "passage"})
        tei = http.post("/embed", json={"inputs": TEXTS[:2]})
        short = http.post("/v1/embeddings", json={"input": TEXTS[2], "dimensions": 8})
        wider = http.post("/v1/embeddings", json={"input": "x", "dimensions": 32})
    served = np.array([row["embedding"] for row in openai.json()["data"]])
    assert served.shape == (len(TEXTS), 16)
    np.testing.assert_allclose(served, stored, atol=1e-5)
    np.testing.assert_allclose(np.array(tei.json()), stored[:2], atol=1e-5)
    expected = stored[2, :8] / np.linalg.norm(stored[2, :8])
    np.testing.assert_allclose(short.json()["data"][0]["embedding"], expected, atol=1e-5)
    assert wider.status_code == 400 and "from 1 to 16" in wider.json()["error"]["message"]


@pytest.mark.skipif(not Path("/usr/bin/chromium").exists(), reason="no Chromium (scripts/setup.sh installs it)")
def test_with_a_key_the_search_page_loads_asks_for_the_key_and_searches_with_it():
    from playwright.sync_api import expect, sync_playwright

    from test_serve import CHROMIUM, CHROMIUM_ARGS, serving

    with serving(FakeSearcher(), api_key=KEY) as (url, _, _), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            assert page.goto(url + "/").status == 401  # the page itself, which holds no data
            expect(page.locator("#about")).to_contain_text("word overlap")
            expect(page.locator("#key")).to_be_visible()
            page.fill("#query", "video player")
            page.click("#submit")
            expect(page.locator("#error")).to_contain_text("API key")
            page.fill("#key", KEY)
            page.click("#submit")
            expect(page.locator("#results li .title")).to_have_text(["vlc", "mpv"])
            expect(page.locator("#error")).to_be_hidden()
        finally:
            browser.close()


def test_after_a_reload_the_embedding_routes_use_the_new_index_model(models, tmp_path):
    from densepass.serve.reload import ReloadableSearcher
    from serve_fake import PASSAGES

    root, first = models
    second = dp.BiEncoder.from_pretrained(str(save_tiny_bert(tmp_path / "other", seed=7)))
    pipelines = iter(
        dp.SearchPipeline(dp.DenseIndex.build(m, [t for _, _, t in PASSAGES], kind="exact", show_progress=False))
        for m in (first, second)
    )
    searcher = ReloadableSearcher(lambda: next(pipelines), root / "idx")
    with TestClient(create_app(searcher), base_url="http://127.0.0.1") as http:
        before = http.post("/embed", json={"inputs": TEXTS[:2]}).json()
        searcher.reload()
        after = http.post("/embed", json={"inputs": TEXTS[:2]}).json()
    assert cosines(before, first.encode_passages(TEXTS[:2], show_progress=False)).min() >= 0.9999
    assert cosines(after, second.encode_passages(TEXTS[:2], show_progress=False)).min() >= 0.9999


def test_without_an_embedding_model_or_a_reranker_the_routes_say_so():
    app = create_app(FakeSearcher(), ServeSettings())
    with TestClient(app, base_url="http://127.0.0.1") as http:
        openai_error = http.post("/v1/embeddings", json={"input": "x"}).json()["error"]
        tei = http.post("/rerank", json={"query": "a", "texts": ["b"]}).json()
        limit = http.post("/embed", json={"inputs": ["x"] * 65}).json()
    assert "no embedding model" in openai_error["message"] and openai_error["type"] == "invalid_request_error"
    assert "--rerank MODEL" in tei["error"] and tei["error_type"] == "Validation"
    assert "no embedding model" in limit["error"]


def test_tei_bodies_take_booleans_only_as_json_booleans():
    app = create_app(FakeSearcher(), ServeSettings())
    with TestClient(app, base_url="http://127.0.0.1") as http:
        for route, body in [
            ("/embed", {"inputs": "a", "truncate": "yes"}),
            ("/embed", {"inputs": "a", "normalize": 1}),
            ("/rerank", {"query": "a", "texts": ["b"], "raw_scores": "true"}),
            ("/rerank", {"query": "a", "texts": ["b"], "return_text": "on"}),
        ]:
            assert http.post(route, json=body).status_code == 422, (route, body)


def test_openai_model_ids_holding_a_slash_are_found():
    searcher = FakeSearcher(embeddings=True)
    searcher.embedder.name, searcher.embedder.names = "BAAI/bge-small-en-v1.5", ("BAAI/bge-small-en-v1.5",)
    with TestClient(create_app(searcher, ServeSettings()), base_url="http://127.0.0.1") as http:
        found = http.get("/v1/models/BAAI/bge-small-en-v1.5")
        missing = http.get("/v1/models/BAAI/bge-large-en-v1.5")
        metrics = http.get("/metrics").text
    assert found.status_code == 200 and found.json()["id"] == "BAAI/bge-small-en-v1.5"
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert 'route="/v1/models/{model:path}"' in metrics  # counted under its route, not as "other"


def test_openai_models_lists_no_server_path_but_accepts_it():
    from densepass.serve.backends import Embedder
    from densepass.serve.compat import check_model

    path = "/srv/private/models/tiny-bi"
    embedder = Embedder(SimpleNamespace(eval=lambda: None, source=None), path, extra_names=["alias"])
    with TestClient(create_app(FakeSearcher(), embedder=embedder), base_url="http://127.0.0.1") as http:
        listed = [model["id"] for model in http.get("/v1/models").json()["data"]]
        missing = http.post("/v1/embeddings", json={"input": "x", "model": "other"}).json()["error"]
    assert listed == ["tiny-bi", "alias"]
    assert "'tiny-bi', 'alias'" in missing["message"] and "/srv" not in missing["message"]
    assert check_model(embedder, path) is embedder  # a client that sends the path still gets the model


def test_openai_embeddings_take_strict_types_and_a_null_encoding_format():
    app = create_app(FakeSearcher(embeddings=True), ServeSettings())
    with TestClient(app, base_url="http://127.0.0.1") as http:
        refused = [
            http.post("/v1/embeddings", json={"input": "abc", "dimensions": value}) for value in ["8", True, 8.0]
        ]
        unset = http.post("/v1/embeddings", json={"input": "abc", "encoding_format": None})
    for answer in refused:
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == "dimensions" and "integer" in error["message"], error
    assert unset.status_code == 200
    np.testing.assert_allclose(unset.json()["data"][0]["embedding"], FakeEmbedder.vector("abc"), rtol=1e-6)


def test_malformed_json_on_openai_routes_names_no_param():
    with TestClient(create_app(FakeSearcher(embeddings=True)), base_url="http://127.0.0.1") as http:
        malformed = http.post("/v1/embeddings", content=b'{"input": ', headers={"Content-Type": "application/json"})
    error = malformed.json()["error"]  # the character offset of the fault is in the message, not in param
    assert malformed.status_code == 400 and "malformed JSON at character" in error["message"], error
    assert error["param"] is None and error["type"] == "invalid_request_error"


def test_tei_rerank_orders_by_the_raw_scores_where_the_sigmoid_saturates():
    app = create_app(FakeSearcher(), ServeSettings(), reranker=FakeReranker())
    texts = ["40", "50", "45", "-3"]  # the sigmoid of 40, 45 and 50 is 1.0 in float64
    with TestClient(app, base_url="http://127.0.0.1") as http:
        squashed = http.post("/rerank", json={"query": "q", "texts": texts}).json()
        raw = http.post("/rerank", json={"query": "q", "texts": texts, "raw_scores": True}).json()
    assert [hit["index"] for hit in squashed] == [1, 2, 0, 3] == [hit["index"] for hit in raw]
    assert [hit["score"] for hit in squashed][:3] == [1.0, 1.0, 1.0] and squashed[3]["score"] < 0.05
    assert [hit["score"] for hit in raw] == [50.0, 45.0, 40.0, -3.0]


def test_sigterm_under_load_answers_every_accepted_request():
    port, n = free_port(), 12
    fake = [sys.executable, str(ROOT / "tests" / "serve_fake.py"), "--port", str(port), "--embeddings"]
    fake += ["--delay-ms", "300", "--max-batch-size", "1"]  # one item per call: the queue depth counts the rest
    process = subprocess.Popen(fake, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"

    def ask(http: httpx.AsyncClient, i: int):
        if i % 2:
            return http.post("/v1/embeddings", json={"input": f"video {i}", "model": "fake"})
        return http.post("/search", json={"query": f"video {i}"})

    async def load():
        limits = httpx.Limits(max_connections=n + 2)
        async with httpx.AsyncClient(base_url=url, timeout=60, trust_env=False, limits=limits) as http:
            asking = [asyncio.create_task(ask(http, i)) for i in range(n)]
            while (await http.get("/health")).json()["queue_depth"] < n - 1:  # every request taken, one at work
                await asyncio.sleep(0.02)
            process.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            try:  # a new connection is refused now
                async with httpx.AsyncClient(base_url=url, timeout=5, trust_env=False) as late_client:
                    late = await late_client.get("/health")
            except httpx.TransportError as err:
                late = err
            return await asyncio.gather(*asking), late

    try:
        wait_for_health(url, process)
        answers, late = asyncio.run(load())
    finally:
        stderr = stop(process)
    assert [r.status_code for r in answers] == [200] * n
    for i, answer in enumerate(answers):
        if i % 2:
            expected = FakeEmbedder.vector(f"video {i}")
            np.testing.assert_allclose(answer.json()["data"][0]["embedding"], expected, rtol=1e-6)
        else:
            assert answer.json()["results"][0][0]["id"] == "p0"
    assert isinstance(late, httpx.TransportError), late
    assert process.returncode in (0, -signal.SIGTERM) and "Traceback" not in stderr, stderr[-2000:]


def test_jobs_of_different_operations_are_batched_apart_and_keep_their_order():
    from densepass.serve.microbatch import MicroBatcher

    calls = []

    def operation(name):
        def run(items):
            calls.append((name, list(items)))
            return [f"{name}:{item}" for item in items]

        return run

    async def main():
        searcher = FakeSearcher()
        batcher = MicroBatcher(searcher, max_batch_size=3, max_wait_ms=0, max_queue=100)
        jobs = [
            batcher.run("embed:query", ["a", "b"], operation("q")),
            batcher.search(["video"], 1),
            batcher.run("embed:passage", ["c"], operation("p")),
            batcher.run("embed:query", ["d"], operation("q")),
            batcher.run("embed:query", ["e"], operation("q")),  # the batch of "a", "b", "d" is full
            batcher.run("embed:passage", ["f"], operation("p")),
        ]
        tasks = [asyncio.ensure_future(job) for job in jobs]
        await asyncio.sleep(0)
        batcher.start()
        outcomes = await asyncio.gather(*tasks)
        await batcher.close()
        return outcomes, searcher

    outcomes, searcher = asyncio.run(main())
    assert calls == [("q", ["a", "b", "d"]), ("p", ["c", "f"]), ("q", ["e"])]
    assert searcher.batches == [(["video"], 1)]
    assert outcomes[0] == ["q:a", "q:b"] and outcomes[2] == ["p:c"] and outcomes[4] == ["q:e"]


def test_the_load_test_drives_the_openai_route(tmp_path):
    queries = tmp_path / "queries.txt"
    queries.write_text("video player\nmail server\nimage photos\n")
    out = tmp_path / "bench.json"
    fake = f"{sys.executable} {ROOT / 'tests' / 'serve_fake.py'} --port {{port}} --embeddings --delay-ms 1"
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--queries", str(queries)]
    command += ["--start", f"fake={fake}", "--route", "v1/embeddings", "--texts-per-request", "4", "--model", "fake"]
    command += ["--concurrency", "1", "4", "--requests", "20", "--seconds", "20", "--warmup", "2", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["route"] == "v1/embeddings" and report["texts_per_request"] == 4
    assert all(r["requests"] == 20 and r["errors"] == 0 for r in report["results"])
    assert all(abs(r["texts_per_s"] - 4 * r["queries_per_s"]) < 1e-6 for r in report["results"])


def test_several_workers_serve_one_port_add_up_their_metrics_and_stop_on_sigterm():
    from prometheus_client.parser import text_string_to_metric_families

    port = free_port()
    fake = [sys.executable, str(ROOT / "tests" / "serve_fake.py"), "--port", str(port), "--workers", "2"]
    process = subprocess.Popen(fake, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        processes = set()
        for _ in range(20):  # a new connection each: the kernel spreads them over the workers
            with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
                processes.add(http.get("/health").json()["process"])
                assert http.post("/search", json={"query": "video"}).status_code == 200
        with httpx.Client(base_url=url, timeout=60, trust_env=False) as http:
            text = http.get("/metrics").text
    finally:
        stderr = stop(process)
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "densepass_requests_total" and s.labels["route"] == "/search"
    ]
    assert sum(s.value for s in samples) == 20, (processes, text[:2000])  # whichever worker answered /metrics
    assert process.pid not in processes and 1 <= len(processes) <= 2
    assert process.returncode in (0, -signal.SIGTERM) and "Traceback" not in stderr, stderr[-3000:]


def test_the_workers_end_when_their_parent_is_killed():
    port = free_port()
    fake = [sys.executable, str(ROOT / "tests" / "serve_fake.py"), "--port", str(port), "--workers", "2"]
    process = subprocess.Popen(fake, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process)
        workers = [int(pid) for pid in Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()]
        process.kill()
        process.communicate(timeout=30)
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() and "zombie" not in process_state(pid) for pid in workers):
            assert time.monotonic() < deadline, f"workers {workers} still run after their parent was killed"
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert len(workers) >= 2


def process_state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/status").read_text().split("State:")[1].split("\n")[0].lower()
    except (FileNotFoundError, IndexError):
        return "zombie"


def test_the_cli_worker_app_loads_the_index_from_the_serve_arguments(models, monkeypatch):
    from densepass.cli import serve_worker_app

    root, model = models
    argv = ["serve", str(root / "idx"), "--precision", "fp32", "--access-log", "off", "--workers", "2"]
    monkeypatch.setenv("DENSEPASS_SERVE_ARGV", json.dumps(argv))
    monkeypatch.setenv("DENSEPASS_API_KEY", KEY)
    with TestClient(serve_worker_app(), base_url="http://127.0.0.1") as http:
        assert http.post("/embed", json={"inputs": TEXTS[:2]}).status_code == 401
        vectors = http.post("/embed", headers=AUTH, json={"inputs": TEXTS[:2]}).json()
    assert cosines(vectors, model.encode_passages(TEXTS[:2], show_progress=False, precision="fp32")).min() >= 0.9999


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--api-key", "short"], "--api-key must be at least 16 printable characters without spaces, got 5"),
        (["--api-key", "sixteen chars with spaces"], "--api-key must be at least 16 printable characters"),
        (["--access-log", "{tmp}"], "--access-log {tmp}: not a regular file"),
        (["--access-log", "{tmp}/no/such/dir/log"], "--access-log {tmp}/no/such/dir/log: cannot write there"),
    ],
)
def test_cli_serve_refuses_a_bad_key_or_access_log_in_one_line_before_the_index_loads(tmp_path, capsys, flags, message):
    from densepass.cli import main

    flags = [flag.replace("{tmp}", str(tmp_path)) for flag in flags]
    assert main(["serve", str(tmp_path / "no-index"), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("densepass: error: " + message.replace("{tmp}", str(tmp_path))) and "\n" not in err, err


def test_cli_serve_with_a_key_on_a_public_host_is_not_warned_about_missing_authentication(tmp_path, capsys):
    from densepass.cli import main

    assert main(["serve", str(tmp_path / "no-index"), "--host", "192.0.2.7", "--port", "8123", "--api-key", KEY]) == 2
    err = capsys.readouterr().err.strip()
    assert "warning" not in err and len(err.splitlines()) == 1  # (cannot listen there, or then no index)


def test_serve_with_workers_whose_load_fails_stops_in_one_line_instead_of_restarting_them(tmp_path):
    """Each worker loads the index and models itself; one that cannot (here: a --rerank model that does not exist)
    stops the service with the reason in one line and exit status 2, where uvicorn's supervisor started it again
    and again, a traceback each time, and never exited."""
    dp.BM25Index.build(["tar archiver", "kernel driver"]).save(tmp_path / "idx")
    argv = [sys.executable, "-m", "densepass", "serve", str(tmp_path / "idx"), "--port", str(free_port())]
    argv += ["--workers", "2", "--rerank", str(tmp_path / "no-such-model")]
    done = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=240)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("densepass: error: model not found: ") and "no-such-model" in last, last


def test_a_worker_load_failure_outside_a_supervisor_is_the_callers_error(monkeypatch):
    from densepass.serve.app import WORKER_ERROR_ENV, worker_failed

    monkeypatch.delenv(WORKER_ERROR_ENV, raising=False)
    with pytest.raises(ConfigError, match="bad model"):
        worker_failed(ConfigError("bad model"))


def test_health_names_the_models_without_their_paths_on_the_server(models):
    """``/health`` answers without the API key: the index's model, the reranker and the embeddings route's names
    are shown as a client gives them (the folder's name), as ``/v1/models`` shows them, never as server paths."""
    from densepass.pipelines.search import SearchPipeline

    root, _ = models
    pipeline = SearchPipeline.load(root / "idx", root / "ce", device="cpu", precision="fp32", rerank_precision="fp32")
    app = create_app(pipeline, ServeSettings(), api_key=KEY)
    with TestClient(app, base_url="http://127.0.0.1") as http:
        health = http.get("/health")
    assert health.status_code == 200
    text = health.text
    assert str(root) not in text and str(root).replace("/", "\\/") not in text, text
    facts = health.json()
    assert facts["searcher"]["model"] == "tiny-bi" and facts["searcher"]["reranker"]["model"] == "ce"
    assert "tiny-bi" in facts["embeddings"]["names"]


def test_a_client_that_leaves_before_its_body_is_counted_499_not_a_server_error():
    """The app answers nothing to a client gone mid-body; the count said 500, so dashboards alerting on 5xx fired
    whenever a client timed out or cancelled an upload."""
    app = create_app(FakeSearcher(), ServeSettings())
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/search",
        "raw_path": b"/search",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"), (b"content-length", b"50")],
        "client": ("127.0.0.1", 5000),
        "server": ("127.0.0.1", 80),
    }
    with TestClient(app, base_url="http://127.0.0.1") as http:
        messages = [{"type": "http.request", "body": b"{", "more_body": True}]
        sent = []

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        asyncio.run(app(scope, receive, send))
        body = http.get("/metrics").text
    assert not [m for m in sent if m["type"] == "http.response.start"]
    counted = [line for line in body.splitlines() if line.startswith("densepass_requests_total{") and "/search" in line]
    assert counted and all('status="499"' in line for line in counted), counted


def test_health_says_a_reload_failed_without_the_paths_its_message_names():
    """/health is open without the key: a failed reload's message named the model's and the index's paths on the
    server there. It shows ``last_reload_failed``; the message stays in the log and the operator's 409."""

    class Failed(FakeSearcher):
        def describe(self):
            return {"kind": "fake", "last_reload_error": "/srv/idx/v000004: its model '/home/op/models/bi' is gone"}

    app = create_app(Failed(), ServeSettings(), api_key=KEY)
    with TestClient(app, base_url="http://127.0.0.1") as http:
        health = http.get("/health")
    assert health.status_code == 200
    assert health.json()["searcher"]["last_reload_failed"] is True and "/srv" not in health.text


def test_tei_routes_answer_a_full_queue_and_too_much_input_with_teis_statuses():
    """TEI's router answers an overloaded queue 429 and a batch or an input too large 413; densepass's TEI routes
    answered 503 and 400, which TEI's clients do not retry or report as TEI does. The other routes keep theirs."""
    from densepass.serve.compat import ApiError, batched, check_texts, styled_error
    from densepass.serve.microbatch import QueueFull, Unavailable

    def answer(path, status, reason=None, headers=None):
        response = styled_error(path, status, "refused", headers, reason=reason)
        return response.status_code, json.loads(response.body)

    full = answer("/embed", 503, "queue_full", {"Retry-After": "1"})
    assert full == (429, {"error": "refused", "error_type": "Overloaded"})
    assert styled_error("/rerank", 503, "x", {"Retry-After": "1"}, reason="queue_full").headers["retry-after"] == "1"
    assert answer("/rerank", 400, "too_large") == (413, {"error": "refused", "error_type": "Validation"})
    assert answer("/embed", 503) == (503, {"error": "refused", "error_type": "Unhealthy"})  # shutting down
    assert answer("/search", 503, "queue_full")[0] == 503 and answer("/v1/embeddings", 400, "too_large")[0] == 400

    class Refusing:
        def __init__(self, error):
            self.error = error

        async def run(self, *args):
            raise self.error

    for error, reason in [(QueueFull("the queue is full"), "queue_full"), (Unavailable("closing"), None)]:
        with pytest.raises(ApiError) as refused:
            asyncio.run(batched(Refusing(error), "embed", ["x"], None))
        assert (refused.value.status, refused.value.reason) == (503, reason)
    settings = ServeSettings(max_queries_per_request=2, max_query_chars=5)
    for texts in (["a", "b", "c"], ["abcdefg"]):
        with pytest.raises(ApiError) as refused:
            check_texts(texts, settings, "inputs")
        assert (refused.value.status, refused.value.reason) == (400, "too_large")
