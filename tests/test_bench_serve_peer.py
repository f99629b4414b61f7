"""The logic of ``benchmarks/bench_serve.py --peer`` that needs no server: the medians over rounds, the ratios, the
tables, the agreement check's cosine, the passage filter, and the refusals before anything starts (no test starts
infinity-emb: CI has no environment for it)."""

from __future__ import annotations

import gzip
import json
import os
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
