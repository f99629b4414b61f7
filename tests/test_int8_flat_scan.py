"""int8-flat's first pass through FAISS's scalar quantiser (``index.binary``): its scores are the float query's dot
product with ``dequantize(codes)``, its rows the brute-force top k (equal scores by row, duplicated passages
included, ties reaching past the extra rows fetched), with deletes, after compaction and after save / load."""

from __future__ import annotations

import numpy as np
import pytest

from densepass.index import load_index
from densepass.index.binary import CompactIndex, dequantize
from densepass.models.biencoder import BiEncoder

N, DIM, K = 300, 32, 10


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    """The tiny 32-dimensional model, saved where an index can record it."""
    path = tmp_path_factory.mktemp("model") / "m"
    BiEncoder.from_pretrained(str(tiny_model_dir)).save(path)
    return BiEncoder.from_pretrained(str(path))


def data(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random passages, 24 of them copies of passage 7 (equal codes, equal scores), and queries: the first
    is passage 7 itself, so that its top k is a tie reaching far past k + the scan's few extra rows."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, DIM)).astype(np.float32)
    x[40:280:10] = x[7]
    q = np.concatenate([x[7:8], rng.standard_normal((5, DIM)).astype(np.float32)])
    return x, q


def brute_force(q: np.ndarray, vectors: np.ndarray, live: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k (scores, rows) of each query over the ``live`` rows, in float64, equal scores by row."""
    scores = q.astype(np.float64) @ vectors.astype(np.float64).T
    rows = [live[np.lexsort((live, -line[live]))[:k]] for line in scores]
    return np.take_along_axis(scores, np.array(rows), 1), np.array(rows)


def check(index: CompactIndex, q: np.ndarray, vectors: np.ndarray, live: np.ndarray) -> None:
    """``index``'s search (over-fetching past deleted rows) against the brute force over the live rows."""
    want_scores, want_rows = brute_force(q, vectors, live, K)
    scores, rows = index.live_rows(index.search_rows, q, K)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_allclose(scores, want_scores, rtol=0, atol=1e-4)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_faiss_scan_is_the_dot_product_with_the_dequantised_codes_and_its_brute_force_top_k(model, seed, tmp_path):
    x, q = data(seed)
    index = CompactIndex(model, "int8-flat", rescore_with="none", show_progress=False)
    index.add_embeddings([{"id": f"p{i}", "text": f"passage {i}"} for i in range(N)], x)
    codes = index.codes
    vectors = dequantize(codes, index.ranges)  # the reference: the codes' float values, scored in float64
    check(index, q, vectors, np.arange(N))
    scores, rows = index._int8_scan(q, K, margin=1)  # the tie group of passage 7 refetched twice as deep
    np.testing.assert_array_equal(rows[0], [7, 40, 50, 60, 70, 80, 90, 100, 110, 120])
    np.testing.assert_allclose(scores, brute_force(q, vectors, np.arange(N), K)[0], rtol=0, atol=1e-4)

    gone = sorted({7, 40, 50, *brute_force(q[1:], vectors, np.arange(N), 1)[1][:, 0].tolist()})
    index.delete([f"p{i}" for i in gone])
    live = np.setdiff1d(np.arange(N), gone)
    check(index, q, vectors, live)

    index.compact()
    np.testing.assert_array_equal(index.codes, codes[live])
    assert index.memory_bytes() == len(live) * DIM
    check(index, q, vectors[live], np.arange(len(live)))

    index.add_embeddings([{"id": "new", "text": "new"}], x[:1])  # after compaction: ranges kept, codes appended
    vectors = np.concatenate([vectors[live], dequantize(index.codes[-1:], index.ranges)])
    check(index, q, vectors, np.arange(len(vectors)))
    index.save(tmp_path / "int8")
    np.testing.assert_array_equal(np.load(tmp_path / "int8" / "int8.npy"), index.codes)
    loaded = load_index(tmp_path / "int8")
    check(loaded, q, vectors, np.arange(len(vectors)))
    assert loaded.memory_bytes() == index.memory_bytes() == len(vectors) * DIM
