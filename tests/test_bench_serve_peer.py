"""The logic of ``benchmarks/bench_serve.py --peer`` that needs no server: the medians over rounds, the ratios, the
tables, the agreement check's cosine, the passage filter, and the refusals before anything starts (no test starts
infinity-emb: CI has no environment for it)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import densepass

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def peer(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import serve_peer

    return serve_peer


def cell(service, tpr, c, texts_per_s, p50, p99, errors=0, cpu=0.1):
    return {
        "service": service,
        "texts_per_request": tpr,
        "concurrency": c,
        "texts_per_s": texts_per_s,
        "p50_ms": p50,
        "p99_ms": p99,
        "errors": errors,
        "client_cpu": cpu,
    }


def test_each_cell_is_the_median_over_rounds_and_densepass_is_divided_by_the_peer(peer):
    results = [
        cell("densepass-fp32", 1, 64, 300.0, 10.0, 40.0, errors=1),
        cell("infinity-torch", 1, 64, 100.0, 20.0, 50.0),
        cell("densepass-fp32", 1, 64, 900.0, 30.0, 20.0),
        cell("infinity-torch", 1, 64, 300.0, 40.0, 80.0, errors=2),
        cell("densepass-fp32", 1, 64, 600.0, 20.0, 30.0),
        cell("infinity-torch", 1, 64, 200.0, 10.0, 60.0),
    ]
    summary = peer.summarise(results)
    assert [(r["service"], r["rounds"], r["errors"]) for r in summary] == [
        ("densepass-fp32", 3, 1),
        ("infinity-torch", 3, 2),
    ]
    ours = summary[0]
    assert (ours["texts_per_s"], ours["p50_ms"], ours["p99_ms"]) == (600.0, 20.0, 30.0)
    assert ours["texts_per_s_rounds"] == [300.0, 900.0, 600.0]
    (ratio,) = peer.ratios(summary)
    assert (ratio["service"], ratio["versus"]) == ("densepass-fp32", "infinity-torch")
    assert ratio["texts_per_s_ratio"] == pytest.approx(3.0)
    assert ratio["p50_ratio"] == pytest.approx(1.0) and ratio["p99_ratio"] == pytest.approx(0.5)
    text = peer.peer_tables(summary, peer.ratios(summary))
    assert "| 1 | 64 | densepass-fp32 ÷ infinity-torch | 3.00x | 1.00x | 0.50x |" in text
    assert "| 1 | 64 | infinity-torch | 200 | 20.0 | 60.0 | 2 | 10% |" in text


def test_a_cell_that_one_server_lacks_has_no_ratio(peer):
    summary = peer.summarise([cell("densepass-bf16", 32, 1, 50.0, 1.0, 2.0), cell("infinity-torch", 32, 8, 5.0, 1, 2)])
    assert peer.ratios(summary) == []


def test_the_agreement_cosine_matches_a_slow_reference(peer):
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(5, 7)), rng.normal(size=(5, 7))
    slow = [
        sum(x * y for x, y in zip(u, v)) / (sum(x * x for x in u) * sum(y * y for y in v)) ** 0.5 for u, v in zip(a, b)
    ]
    np.testing.assert_allclose(peer.cosines(a, b), slow, rtol=1e-12)


def test_only_passages_no_server_cuts_are_sent(peer, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.jsonl.gz"
    texts = ["short", "a b c d e f g h i j k l m n o p", "", "two words"]
    with gzip.open(corpus, "wt") as handle:
        for i, text in enumerate(texts):
            handle.write(json.dumps({"_id": f"p{i}", "title": "", "text": text}) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    limit = len(tokenizer("two words")["input_ids"])
    kept = peer.read_passages(corpus, str(tiny_model_dir), limit, 10)
    assert kept == [t for t in texts if t and len(tokenizer(t)["input_ids"]) <= limit] and "two words" in kept
    assert peer.read_passages(corpus, str(tiny_model_dir), 1000, 1) == ["short"]


def test_peer_arguments_are_refused_in_one_line_before_anything_starts(tmp_path):
    env = {
        **os.environ,
        "PYTHONPATH": str(Path(densepass.__file__).parents[1]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    script = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--peer", "infinity"]
    done = subprocess.run(
        [*script, "--index", str(tmp_path / "missing"), "--passages", str(tmp_path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].endswith("not a densepass index folder")
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_rerank_agreement_reports_the_largest_difference_and_the_orders_kept(peer):
    reference = [np.array([3.0, 1.0, 2.0]), np.array([0.5, 0.4])]
    same_order = [np.array([3.01, 0.99, 2.0]), np.array([0.5, 0.4])]
    found = peer.score_agreement(reference, same_order)
    assert found == {
        "queries": 2,
        "pairs": 5,
        "max_abs_diff": pytest.approx(0.01),
        "spread": pytest.approx(2.6),  # 3.0 - 0.4
        "relative_diff": pytest.approx(0.01 / 2.6),
        "same_order": 1.0,
    }
    swapped = peer.score_agreement(reference, [np.array([3.0, 1.0, 2.0]), np.array([0.4, 0.5])])
    assert swapped["same_order"] == 0.5 and swapped["max_abs_diff"] == pytest.approx(0.1)


@pytest.fixture(scope="module")
def rerank_setup(tiny_model_dir, tmp_path_factory):
    """A tiny BEIR corpus (with queries), an exact index of a tiny bi-encoder over it, and a tiny cross-encoder
    (head scaled up: scores far apart) that densepass serve and the stand-in peer both load."""
    import torch

    from conftest import write_tiny_beir
    from densepass.models.cross_encoder import CrossEncoder

    root = tmp_path_factory.mktemp("rerank-peer")
    data = write_tiny_beir(root / "data")
    model = densepass.BiEncoder.from_pretrained(str(tiny_model_dir))
    passages = [json.loads(line) for line in (data / "corpus.jsonl").read_text().splitlines()]
    passages = [{"id": p["_id"], "title": p["title"], "text": p["text"]} for p in passages]
    densepass.DenseIndex.build(model, passages, kind="exact", show_progress=False).save(root / "idx")
    cross = CrossEncoder.new(str(tiny_model_dir), seed=3, max_length=96, device="cpu", precision="fp32")
    with torch.no_grad():
        cross.model.classifier.weight.mul_(300.0)
    cross.save(root / "ce")
    return root, data


def bench_rerank(root: Path, data: Path, *extra: str, peer_env: dict | None = None) -> subprocess.CompletedProcess:
    """``bench_serve.py --peer infinity --route rerank`` with the stand-in peer, briefly (one round, short cells)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(densepass.__file__).parents[1]), str(ROOT / "tests")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        **(peer_env or {}),
    }
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--peer", "infinity", "--route", "rerank"]
    command += ["--peer-command", f"{sys.executable} {ROOT / 'tests' / 'peer_fake.py'}", "--reranker", str(root / "ce")]
    command += ["--index", str(root / "idx"), "--passages", str(data / "corpus.jsonl"), "--cores", "", "--threads", "1"]
    command += ["--precisions", "fp32", "--rounds", "1", "--seconds", "0.3", "--requests", "30", "--warmup", "2"]
    command += ["--concurrency", "1", "4", "--texts-per-request", "1", "3", "--max-tokens", "40", "--check-texts", "16"]
    process = subprocess.Popen([*command, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:  # Ctrl-C: the script stops the servers it started
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=120)
        raise AssertionError(f"bench_serve.py did not finish: {err[-3000:]}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def test_the_rerank_peer_runs_end_to_end_against_a_stand_in(rerank_setup, tmp_path):
    """Both servers up, their raw scores compared on 16 pairs, every cell measured on each (documents/s, no
    errors), the tables and JSON written; the queries are read from beside the corpus."""
    root, data = rerank_setup
    done = bench_rerank(root, data, "--out", str(tmp_path / "rerank.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "rerank.json").read_text())
    assert result["route"] == "rerank" and result["queries_file"] == str(data / "queries.jsonl")
    (agreement,) = result["agreement"].values()
    assert agreement["versus"] == "densepass-fp32" and agreement["pairs"] == 16 and agreement["same_order"] == 1.0
    assert agreement["max_abs_diff"] < 1e-3 and agreement["relative_diff"] < 1e-3
    cells = {(r["texts_per_request"], r["concurrency"], r["service"]): r for r in result["summary"]}
    assert set(cells) == {(n, c, s) for n in (1, 3) for c in (1, 4) for s in ("densepass-fp32", "infinity-torch-fp32")}
    assert all(r["errors"] == 0 and r["texts_per_s"] > 0 for r in cells.values())
    assert "| documents/request | clients | server | documents/s |" in (tmp_path / "rerank.md").read_text()
    assert "raw scores differ by at most" in done.stdout


def test_the_rerank_peer_stops_when_the_scores_disagree(rerank_setup, tmp_path):
    """A peer answering sigmoid-ed scores when asked for raw ones stops the run before any cell is measured."""
    root, data = rerank_setup
    done = bench_rerank(root, data, "--out", str(tmp_path / "rerank.json"), peer_env={"FAKE_PEER_SCORES": "sigmoid"})
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith("bench_serve: infinity-torch-fp32's raw scores differ")
    assert "round 0" not in done.stdout and not (tmp_path / "rerank.json").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--peer-engines", "optimum"], "needs --peer-onnx DIR, an ONNX export of the same model"),
        (["--peer-engines", "optimum", "--peer-onnx", "."], "--peer-onnx .: no .onnx file in that folder"),
        (["--route", "rerank"], "--peer --route rerank needs --reranker, a saved cross-encoder folder (got None)"),
        (["--reranker", "."], "--reranker is for --route rerank"),
    ],
)
def test_optimum_and_rerank_arguments_are_refused_in_one_line(tmp_path, extra, message):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("")
    env = {**os.environ, "PYTHONPATH": str(Path(densepass.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    script = [sys.executable, str(ROOT / "benchmarks" / "bench_serve.py"), "--peer", "infinity"]
    done = subprocess.run(
        [*script, "--index", str(tmp_path), "--passages", str(corpus), *extra],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and message in done.stderr.strip().splitlines()[-1], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
