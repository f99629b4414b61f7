"""End to end through the search API: saved indexes answer like a brute-force reference, an index refuses
another model in one line, `densepass run` -> `index` -> `search` -> `evaluate` reproduces the run's own
metrics, and `densepass serve` answers like the in-process pipeline and shuts down cleanly."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import save_tiny_bert, write_tiny_beir
from densepass import cli
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.evaluation.metrics import read_trec_run
from densepass.index import BM25Index, DenseIndex, SearchResults, load_index
from densepass.models.biencoder import BiEncoder
from densepass.pipelines.search import SearchPipeline
from densepass.serve import hit_to_json

ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
QUERIES = ["audio video player", "kernel driver printer", "python compiler shell", "mail server backup"]
METRICS = ["mrr@10", "ndcg@10", "recall@20"]
DEPTH = 20  # the run's eval.depth and the k of `densepass search`


def densepass(*args, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python3 -m densepass ARGS`` in a fresh process that imports this checkout."""
    command = [sys.executable, "-m", "densepass", *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=timeout)


@pytest.fixture(scope="module")
def other_model_dir(tmp_path_factory) -> Path:
    """conftest's tiny BERT architecture and tokenizer with other random weights (another torch seed)."""
    return save_tiny_bert(tmp_path_factory.mktemp("other-bert"), seed=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return load_dataset(str(write_tiny_beir(tmp_path_factory.mktemp("data") / "tiny"))).corpus


@pytest.fixture(scope="module")
def model(tiny_model_dir) -> BiEncoder:
    return BiEncoder.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def saved(model, corpus, tmp_path_factory) -> dict[str, Path]:
    """Each kind's index of the tiny corpus, saved: {kind: directory}, and the in-memory BM25 index."""
    root = tmp_path_factory.mktemp("indexes")
    indexes = {kind: DenseIndex.build(model, corpus, kind, show_progress=False) for kind in ("exact", "faiss-flat")}
    indexes["bm25"] = BM25Index.build(corpus)
    return {kind: index.save(root / kind) for kind, index in indexes.items()} | {"bm25-in-memory": indexes["bm25"]}


def brute_force(model: BiEncoder, corpus, queries: list[str], k: int) -> tuple[list[list[str]], np.ndarray]:
    """The top-k passage ids and scores of each query by every dot product, sorted in numpy."""
    scores = model.encode_queries(queries, show_progress=False) @ model.encode_passages(corpus, show_progress=False).T
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[corpus.ids[r] for r in row] for row in order], np.take_along_axis(scores, order, axis=1)


def assert_same_ranking(results: SearchResults, ids: list[list[str]], scores: np.ndarray, atol: float) -> None:
    """``results`` rank exactly ``ids`` with ``scores`` (to ``atol``)."""
    assert [results.ids(i) for i in range(len(results))] == ids
    np.testing.assert_allclose(results.scores, scores, atol=atol)


@pytest.mark.parametrize("kind", ["exact", "faiss-flat"])
def test_a_saved_dense_index_searches_like_brute_force_dot_products(model, corpus, saved, kind):
    results = load_index(saved[kind], model=model).search(QUERIES, k=5)
    assert_same_ranking(results, *brute_force(model, corpus, QUERIES, 5), atol=1e-5)


def test_a_saved_bm25_index_searches_like_the_one_in_memory(saved):
    loaded, built = load_index(saved["bm25"]), saved["bm25-in-memory"]
    expected = list(built.search(QUERIES, k=5))
    assert any(expected) and list(loaded.search(QUERIES, k=5)) == expected


@pytest.mark.parametrize("kind", ["exact", "faiss-flat", "bm25"])
def test_adding_the_second_half_searches_like_building_over_everything(model, corpus, kind):
    half = len(corpus) // 2
    first, second = corpus.subset(list(range(half))), corpus.subset(list(range(half, len(corpus))))
    build = BM25Index.build if kind == "bm25" else lambda c: DenseIndex.build(model, c, kind, show_progress=False)
    grown = build(first)
    grown.add(second)
    whole = build(corpus)
    assert grown.passages.ids == corpus.ids
    expected = whole.search(QUERIES, k=5)
    ids = [expected.ids(i) for i in range(len(expected))]
    assert_same_ranking(grown.search(QUERIES, k=5), ids, expected.scores, atol=1e-6)


def test_loading_a_dense_index_with_another_model_is_a_one_line_error(saved, other_model_dir):
    built_with = json.loads((saved["exact"] / "manifest.json").read_text())["model"]["fingerprint"][:12]
    with pytest.raises(ConfigError, match=f"built with another model \\(weights {built_with}") as err:
        load_index(saved["exact"], model=BiEncoder.from_pretrained(str(other_model_dir)))
    assert "\n" not in str(err.value)
    done = densepass("search", saved["exact"], "audio player", "--model", other_model_dir, "--device", "cpu")
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("densepass: error: ")]
    assert errors == [f"densepass: error: {err.value}"], done.stderr
    assert done.stderr.strip().endswith(errors[0]) and "Traceback" not in done.stderr


def test_a_load_option_the_kind_does_not_take_is_a_one_line_error(saved):
    with pytest.raises(ConfigError, match=r"^a bm25 index takes no load option device \(it takes: none\)$"):
        load_index(saved["bm25"], device="cpu")
    with pytest.raises(ConfigError, match=r"^a faiss-flat index takes no load option nprobe \(it takes: model, "):
        load_index(saved["faiss-flat"], nprobe=3)
    assert load_index(saved["exact"], search_precision="bf16", rescore=2).rescore == 2


def test_an_index_records_its_models_absolute_path_and_refuses_a_model_of_another_kind(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    from densepass.models.splade import SpladeEncoder

    monkeypatch.chdir(tiny_model_dir.parent)  # the model given by a relative path
    out = tmp_path / "idx"
    args = ["index", str(tiny_beir), "--model", tiny_model_dir.name, "--output", str(out), "--device", "cpu"]
    assert cli.main(args) == 0
    assert json.loads((out / "manifest.json").read_text())["model"]["path"] == str(tiny_model_dir.resolve())
    monkeypatch.chdir(tmp_path)  # searched from elsewhere, it still finds its model
    assert cli.main(["search", str(out), "audio", "--device", "cpu"]) == 0
    SpladeEncoder.from_pretrained(str(tiny_model_dir)).save(tmp_path / "splade")
    assert cli.main(["search", str(out), "audio", "--model", str(tmp_path / "splade"), "--device", "cpu"]) == 2
    expected = f"densepass: error: {out} is a exact index; {tmp_path / 'splade'} is a splade model"
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected


def test_an_ivfpq_index_of_too_few_passages_is_refused_before_encoding(model, corpus, tiny_beir, tmp_path, capsys):
    message = f"needs at least 256 passages, got {len(corpus)}: index them exactly"
    with pytest.raises(ConfigError, match=message):
        DenseIndex.build(model, corpus, "faiss-ivfpq", show_progress=False)
    out = tmp_path / "ivfpq"
    args = ["index", str(tiny_beir), "--kind", "faiss-ivfpq", "--model", model.source, "--output", str(out)]
    assert cli.main([*args, "--device", "cpu"]) == 2
    assert message in capsys.readouterr().err and not list(tmp_path.glob(".ivfpq.encoding/*.npy"))


@pytest.fixture(scope="module")
def paths(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """Models the refusals below name: the tiny BERT, and a ColBERT model saved from it."""
    from densepass.models.colbert import ColBERT

    colbert = tmp_path_factory.mktemp("colbert") / "colbert"
    ColBERT.from_pretrained(str(tiny_model_dir)).save(colbert)
    return {"MODEL": str(tiny_model_dir), "COLBERT": str(colbert)}


NOT_GIVEN = "applies to the second stage of --rerank, which is not given"
REFUSED = [  # (index kind, SearchPipeline.load's keywords, the same as `densepass search` flags, the one line)
    (
        "bm25",
        {"precision": "bf16"},
        ["--precision", "bf16"],
        "--precision bf16 applies to model indexes; {} is a bm25 index",
    ),
    ("bm25", {"model": "MODEL"}, ["--model", "MODEL"], "--model is the model of a model index; {} is a bm25 index"),
    ("exact", {"rerank_depth": 5}, ["--rerank-depth", "5"], f"--rerank-depth {NOT_GIVEN}"),
    ("exact", {"rerank_batch_size": 5}, ["--rerank-batch-size", "5"], f"--rerank-batch-size {NOT_GIVEN}"),
    ("exact", {"rerank_precision": "int8"}, ["--rerank-precision", "int8"], f"--rerank-precision int8 {NOT_GIVEN}"),
    (
        "exact",
        {"rerank_depth": 5, "rerank_batch_size": 5},
        ["--rerank-depth", "5", "--rerank-batch-size", "5"],
        f"--rerank-depth, --rerank-batch-size {NOT_GIVEN}",
    ),
    (
        "bm25",
        {"reranker": "COLBERT", "rerank_precision": "int8"},
        ["--rerank", "COLBERT", "--rerank-precision", "int8"],
        "ColBERT models encode in fp32 or bf16 (or auto), not int8",
    ),
    (
        "exact",
        {"rescore": 8},
        ["--rescore", "8"],
        "--rescore sets how many candidates --search-precision bf16 / int8 re-scores in fp32",
    ),
    (
        "exact",
        {"fusion_weight": 0.3},
        ["--fusion-weight", "0.3"],
        "--fusion-weight weighs the dense scores of --hybrid linear",
    ),
    (
        "exact",
        {"hybrid": "rrf", "fusion_weight": 0.3},
        ["--hybrid", "rrf", "--fusion-weight", "0.3"],
        "--fusion-weight weighs the dense scores of --hybrid linear",
    ),
    (
        "faiss-flat",
        {"search_precision": "bf16"},
        ["--search-precision", "bf16"],
        "--search-precision is an option of exact indexes; {} is a faiss-flat index",
    ),
    (
        "exact",
        {"nprobe": 3},
        ["--nprobe", "3"],
        "--nprobe is an option of faiss-ivfpq-disk indexes; {} is a exact index",
    ),
    ("bm25", {"hybrid": "rrf"}, ["--hybrid", "rrf"], "--hybrid adds BM25 to a dense index; {} is a bm25 index"),
    ("bm25", {"rerank_fuse_weight": 0.5}, ["--rerank-fuse-weight", "0.5"], f"--rerank-fuse-weight {NOT_GIVEN}"),
]


@pytest.mark.parametrize("kind, keywords, flags, message", REFUSED, ids=lambda v: str(v) if isinstance(v, dict) else "")
def test_search_pipeline_load_refuses_what_the_command_line_refuses_before_loading_anything(
    saved, paths, kind, keywords, flags, message, monkeypatch, capsys
):
    # the rules are SearchPipeline.load's: a Python caller gets the CLI's one line, before a model or index loads
    from densepass.pipelines import search

    def loads(*args, **kwargs):
        raise AssertionError("loaded something before refusing")

    for name in ("load_index", "load_model", "load_reranker"):
        monkeypatch.setattr(search, name, loads)
    expected = message.format(saved[kind])
    with pytest.raises(ConfigError) as err:
        SearchPipeline.load(saved[kind], device="cpu", **{key: paths.get(v, v) for key, v in keywords.items()})
    assert str(err.value) == expected
    flags = [paths.get(flag, flag) for flag in flags]
    assert cli.main(["search", str(saved[kind]), "audio", *flags, "--device", "cpu"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"densepass: error: {expected}"


@pytest.mark.parametrize(
    "kind, keywords, message",
    [
        ("bm25", {"reranker": "COLBERT", "rerank_depth": 0}, "^rerank depth must be >= 1, got 0$"),
        ("bm25", {"reranker": "COLBERT", "rerank_batch_size": 0}, "^the reranker's batch size must be >= 1, got 0$"),
        ("exact", {"search_precision": "bf16", "rescore": 0}, "^rescore must be >= 1, got 0$"),
        ("exact", {"hybrid": "linear", "fusion_weight": 1.5}, r"^the fusion weight must be in \[0, 1\], got 1.5$"),
        (
            "bm25",
            {"reranker": "COLBERT", "rerank_fuse_weight": 1.5},
            r"^the fusion weight of the reranker lies in \[0, 1\], got 1.5$",
        ),
    ],
    ids=["rerank-depth", "rerank-batch-size", "rescore", "fusion-weight", "rerank-fuse-weight"],
)
def test_search_pipeline_load_refuses_values_out_of_range(saved, paths, kind, keywords, message):
    # what argparse's types refuse on the command line (positive integers, a weight in [0, 1]): refused here too
    with pytest.raises(ConfigError, match=message):
        SearchPipeline.load(saved[kind], device="cpu", **{key: paths.get(v, v) for key, v in keywords.items()})


def test_search_pipeline_load_takes_a_loaded_reranker_but_not_options_for_loading_one(saved):
    class Length:
        def score_pairs(self, queries, passages):
            return np.array([len(p) for p in passages], dtype=float)

        def describe(self):
            return {"kind": "length"}

    pipeline = SearchPipeline.load(saved["bm25"], Length(), device="cpu")
    assert pipeline.rerank_depth == len(pipeline.index) and len(pipeline.search("audio", k=3)) == 3
    with pytest.raises(
        ConfigError, match="^--rerank-batch-size applies to the second stage of --rerank, which is loaded already$"
    ):
        SearchPipeline.load(saved["bm25"], Length(), rerank_batch_size=4)


def test_run_then_index_search_and_evaluate_reproduce_the_runs_metrics(tiny_beir, tiny_model_dir, tmp_path, capsys):
    # The commands run in this process through the CLI's entry point (argument parsing and error handling
    # included) to keep the module fast; the other tests start fresh processes. The run evaluates every dev
    # query over the full corpus in dense mode with an exact index (no query sample, no subcorpus, no rerank
    # mode): the same search that `densepass index` + `densepass search --k eval.depth` do from the saved model.
    settings = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        "name=t",
        "device=cpu",
        "train.batch_size=8",
        "train.max_steps=2",
        "negatives.pool_depth=5",
        "model.passage_max_length=32",
        f"eval.metrics=[{', '.join(METRICS)}]",
        f"eval.depth={DEPTH}",
        "eval.mode=full",
        "eval.index=exact",
        "eval.baselines=[]",
    ]
    assert cli.main(["run", *[arg for setting in settings for arg in ("--set", setting)]]) == 0
    run_dir, index, run = tmp_path / "t", str(tmp_path / "index"), tmp_path / "search.trec"
    dev = set(load_dataset(str(tiny_beir)).split("dev"))
    queries = tiny_beir / "queries.jsonl"  # every query of the dataset: evaluate keeps the split's, with a warning
    device = ["--device", "cpu"]
    assert cli.main(["index", str(tiny_beir), "--model", str(run_dir / "model"), "--output", index, *device]) == 0
    assert cli.main(["search", index, "--queries", str(queries), "--output", str(run), "--k", str(DEPTH), *device]) == 0
    capsys.readouterr()
    assert cli.main(["evaluate", str(tiny_beir), str(run), "--split", "dev", "--metrics", *METRICS]) == 0
    out, err = capsys.readouterr()
    assert "absent from the qrels" in err and "not evaluated" in err
    metrics = json.loads(out)
    assert metrics == pytest.approx(
        json.loads((run_dir / "metrics.json").read_text())["results"]["fine-tuned"], abs=1e-6
    )
    ours, theirs = read_trec_run(run), read_trec_run(run_dir / "runs" / "fine-tuned.trec")
    ours = {q: ranked for q, ranked in ours.items() if q in dev}
    assert {q: list(ranked) for q, ranked in ours.items()} == {q: list(ranked) for q, ranked in theirs.items()}
    for q, ranked in theirs.items():  # the same scores up to the padding of other query batches
        np.testing.assert_allclose(list(ours[q].values()), list(ranked.values()), atol=1e-5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def without_scores(results: list[list[dict]]) -> list[list[dict]]:
    return [[{key: value for key, value in hit.items() if key != "score"} for hit in hits] for hits in results]


def scores(results: list[list[dict]]) -> list[list[float]]:
    return [[hit["score"] for hit in hits] for hits in results]


def test_the_service_answers_like_the_pipeline_and_shuts_down_cleanly_on_sigterm(model, saved):
    port, queries = free_port(), QUERIES[:2]
    command = [sys.executable, "-m", "densepass", "serve", str(saved["exact"]), "--port", str(port), "--device", "cpu"]
    server = subprocess.Popen(command, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, trust_env=False) as http:
            deadline = time.monotonic() + 60
            while True:
                assert server.poll() is None, server.communicate()[1]
                assert time.monotonic() < deadline, "the service did not start"
                with contextlib.suppress(httpx.TransportError):
                    health = http.get("/health")
                    break
                time.sleep(0.1)
            answer = http.post("/search", json={"queries": queries, "k": 3})
            wrong_type = http.post("/search", json={"queries": "audio player", "k": 3})
            malformed = http.post(
                "/search", content=b'{"queries": ["audio', headers={"Content-Type": "application/json"}
            )
        server.send_signal(signal.SIGTERM)
        _, log = server.communicate(timeout=30)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    pipeline = SearchPipeline.load(saved["exact"], model=model)
    from densepass.serve.app import public  # the models' folder names, not their paths on the server

    assert health.status_code == 200 and health.json()["searcher"] == public(pipeline.describe())
    assert health.json()["searcher"]["precision"] in ("fp32", "bf16")  # auto, as resolved on this machine
    assert health.json()["searcher"]["search_precision"] == "fp32"
    assert answer.status_code == 200, answer.text
    expected = [[hit_to_json(hit) for hit in hits] for hits in pipeline.search_batch(queries, 3)]
    served = answer.json()["results"]
    assert without_scores(served) == without_scores(expected)  # ids, titles and texts, in the same order
    np.testing.assert_allclose(scores(served), scores(expected), atol=1e-5)
    for response, status in ((wrong_type, 422), (malformed, 400)):
        assert response.status_code == status and set(response.json()) == {"error"}, response.text
    # uvicorn finishes its graceful shutdown, then re-raises the signal it caught: killed by SIGTERM (or 0)
    assert server.returncode in (0, -signal.SIGTERM), log
    assert "Application shutdown complete" in log and "Traceback" not in log
