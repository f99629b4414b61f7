"""Exact search in reduced precision (``index.exact.ReducedPassages``): a bf16 / int8 first pass, then fp32
re-scoring of the best ``rescore x k``, returns fp32's top k where the scores are well separated."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from densepass.errors import ConfigError
from densepass.index.dense import DenseIndex
from densepass.index.exact import ReducedPassages, exact_search

CPU = torch.device("cpu")


def separated_data(n_queries: int = 12, n_passages: int = 3000, dim: int = 64, k: int = 10, seed: int = 0):
    """Unit vectors where each query's best k passages score 0.95, 0.92, ... (planted, 0.03 apart) and the
    other passages (random directions) about N(0, 1/dim), far below."""
    rng = np.random.default_rng(seed)

    def unit(x):
        return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)

    queries = unit(rng.normal(size=(n_queries, dim)))
    passages = unit(rng.normal(size=(n_passages, dim)))
    rows = rng.choice(n_passages, size=(n_queries, k), replace=False)
    for q, planted in zip(queries, rows):
        for rank, row in enumerate(planted):
            target = 0.95 - 0.03 * rank
            noise = unit(rng.normal(size=dim))
            noise = unit(noise - (noise @ q) * q)  # orthogonal to the query
            passages[row] = target * q + np.sqrt(1 - target**2) * noise
    return queries, passages, rows


@pytest.mark.parametrize("precision", ["bf16", "int8"])
@pytest.mark.parametrize("passage_chunk", [262_144, 700])
def test_reduced_search_returns_the_fp32_top_k_and_scores(precision, passage_chunk):
    queries, passages, planted = separated_data()
    want_scores, want_ids = exact_search(queries, passages, 10, device=CPU)
    np.testing.assert_array_equal(want_ids, planted)  # the planted passages are fp32's top 10, in order
    reduced = ReducedPassages(passages, precision, CPU, chunk=passage_chunk)
    scores, ids = exact_search(queries, passages, 10, reduced=reduced, rescore=4)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(scores, want_scores, atol=1e-6)  # re-scored in fp32, not the reduced scores


def test_the_reduced_scores_approximate_the_fp32_ones():
    _, passages, _ = separated_data()
    queries = torch.from_numpy(passages[:5])
    exact = queries @ torch.from_numpy(passages).T
    for precision, tolerance in [("bf16", 1e-2), ("int8", 2e-2)]:
        reduced = ReducedPassages(passages, precision, CPU, chunk=1000)
        approx = torch.cat([f() for f in reduced.chunk_scores(queries)], 1)
        assert approx.shape == exact.shape
        assert float((approx - exact).abs().max()) < tolerance, precision


def test_a_dense_index_searches_in_reduced_precision_like_fp32(tiny_model_dir):
    from densepass.models.biencoder import BiEncoder

    queries, passages, _ = separated_data(dim=32)
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    texts = [f"passage {i}" for i in range(len(passages))]
    full = DenseIndex(model, device=CPU, show_progress=False)
    full.add_embeddings(texts, passages)
    want = full.search_rows(queries, 10)
    for precision in ("bf16", "int8"):
        index = DenseIndex(model, device=CPU, show_progress=False, search_precision=precision, rescore=3)
        index.add_embeddings(texts, passages)
        got = index.search_rows(queries, 10)
        assert index._resident is None  # only the reduced copy goes to the device: re-scoring reads the array
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[0], want[0], atol=1e-6)


def test_a_dense_index_keeps_its_passages_on_the_search_device_between_searches(tiny_model_dir, monkeypatch):
    """The fp32 passages go to the search device once, at the first search (on a GPU a copy per search cost more
    than the search), as a view of the array on the CPU; adding passages drops the copy."""
    import densepass.index.dense as dense_module
    from densepass.models.biencoder import BiEncoder

    queries, passages, _ = separated_data(dim=32)
    index = DenseIndex(BiEncoder.from_pretrained(str(tiny_model_dir)), device=CPU, show_progress=False)
    index.add_embeddings([f"passage {i}" for i in range(len(passages))], passages)
    seen = []
    real = dense_module.exact_search
    monkeypatch.setattr(dense_module, "exact_search", lambda q, p, *a, **kw: seen.append(p) or real(q, p, *a, **kw))
    first, second = index.search_rows(queries, 10), index.search_rows(queries, 10)
    np.testing.assert_array_equal(first[1], second[1])
    assert torch.is_tensor(seen[0]) and seen[0] is seen[1]  # one tensor for both searches
    assert seen[0].data_ptr() == index.embeddings.ctypes.data  # on the CPU: the array itself, not a copy
    index.add_embeddings(["one more"], passages[:1])
    index.search_rows(queries, 10)
    assert len(seen[2]) == len(passages) + 1


def test_bad_search_precision_options_are_one_line_errors(tiny_model_dir):
    from densepass.models.biencoder import BiEncoder

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    for options, message in [
        ({"search_precision": "fp16"}, "unknown search precision"),
        ({"search_precision": "int8", "kind": "faiss-hnsw"}, "option of the exact index"),
        ({"rescore": 0}, "rescore must be >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            DenseIndex(model, **options)
    with pytest.raises(ConfigError, match="bf16 or int8"):
        ReducedPassages(np.zeros((3, 4), dtype=np.float32), "fp16", CPU)


def test_densepass_search_takes_a_search_precision(tiny_beir, tiny_model_dir, tmp_path, capsys):
    from densepass import cli

    index, run = str(tmp_path / "idx"), tmp_path / "{}.trec"
    assert cli.main(["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", index]) == 0
    queries = str(tiny_beir / "queries.jsonl")
    for precision, rescore in (("fp32", []), ("int8", ["--rescore", "20"])):
        # 20 x 3 candidates cover the 40 passages: re-scored in fp32, the runs are the same
        args = ["search", index, "--queries", queries, "--k", "3", "--search-precision", precision, *rescore]
        assert cli.main([*args, "--output", str(run).format(precision)]) == 0
    fp32, int8 = (str(run).format(p) for p in ("fp32", "int8"))
    runs = [
        {tuple(f.split()[:3:2]): float(f.split()[4]) for f in open(path).read().splitlines()} for path in (fp32, int8)
    ]
    assert runs[0].keys() == runs[1].keys() and len(runs[0]) > 3
    assert list(runs[1].values()) == pytest.approx(list(runs[0].values()), abs=1e-5)
    hnsw = str(tmp_path / "hnsw")
    assert (
        cli.main(["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", hnsw, "--kind", "faiss-hnsw"])
        == 0
    )
    capsys.readouterr()
    assert cli.main(["search", hnsw, "audio", "--search-precision", "int8"]) == 2
    assert "option of exact indexes" in capsys.readouterr().err
