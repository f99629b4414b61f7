"""Exact and FAISS dense search, BM25, and (resumable) encoding, against brute-force references."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.errors import DensepassError
from densepass.index import embeddings as embeddings_module
from densepass.index.bm25 import BM25Index, top_k
from densepass.index.embeddings import encode_to_memmap
from densepass.index.exact import exact_search
from densepass.index.faiss_index import build_faiss_index, faiss_search, load_faiss_index, save_faiss_index
from densepass.models import encode as encode_module
from densepass.models.encode import encode_texts

CPU = torch.device("cpu")


def brute_force(queries: np.ndarray, passages: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    scores = queries.astype(np.float64) @ passages.astype(np.float64).T
    ids = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(scores, ids, axis=1), ids


def random_data(n_queries: int, n_passages: int, dim: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(n_queries, dim)).astype(np.float32), rng.normal(size=(n_passages, dim)).astype(np.float32))


def clustered_unit_vectors(n: int, dim: int, n_clusters: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(n_clusters, dim))
    x = centers[rng.integers(0, n_clusters, n)] + 0.3 * rng.normal(size=(n, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture
def faiss_one_thread():
    """FAISS's OpenMP threads fight torch's on a small machine; one thread is faster and deterministic."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


# ---- exact search -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("query_chunk", "passage_chunk", "k"),
    [
        (4096, 262_144, 10),  # one chunk each
        (7, 50, 10),  # several query and passage chunks, chunk larger than k
        (7, 3, 10),  # passage chunks smaller than k: the merge must still keep k results
        (1, 64, 5),  # uneven last passage chunk
        (16, 30, 1),
    ],
)
def test_exact_search_matches_brute_force(query_chunk, passage_chunk, k):
    queries, passages = random_data(20, 203, 16)
    scores, ids = exact_search(queries, passages, k, device=CPU, query_chunk=query_chunk, passage_chunk=passage_chunk)
    ref_scores, ref_ids = brute_force(queries, passages, k)
    assert scores.shape == ids.shape == (20, k)
    assert scores.dtype == np.float32 and ids.dtype == np.int64
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)


def test_exact_search_k_larger_than_corpus_returns_whole_corpus_sorted():
    queries, passages = random_data(5, 8, 4, seed=1)
    scores, ids = exact_search(queries, passages, 50, device=CPU, passage_chunk=3)
    ref_scores, ref_ids = brute_force(queries, passages, 8)
    assert ids.shape == (5, 8)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_allclose(scores, ref_scores, rtol=1e-5, atol=1e-5)
    assert all(sorted(row) == list(range(8)) for row in ids.tolist())


def test_exact_search_accepts_tensors():
    queries, passages = random_data(3, 40, 8, seed=2)
    scores, ids = exact_search(torch.from_numpy(queries), torch.from_numpy(passages), 4, device=CPU)
    np.testing.assert_array_equal(ids, brute_force(queries, passages, 4)[1])


def test_exact_search_errors():
    queries, passages = random_data(2, 5, 4)
    with pytest.raises(DensepassError, match="empty corpus"):
        exact_search(queries, passages[:0], 3, device=CPU)
    with pytest.raises(DensepassError, match="dim"):
        exact_search(queries, passages[:, :3], 3, device=CPU)


# ---- FAISS ------------------------------------------------------------------------------------


def test_faiss_flat_equals_exact_search(faiss_one_thread):
    queries, passages = random_data(30, 500, 16, seed=3)
    index = build_faiss_index(passages, "faiss-flat")
    scores, ids = faiss_search(index, queries, 10)
    ex_scores, ex_ids = exact_search(queries, passages, 10, device=CPU)
    np.testing.assert_array_equal(ids, ex_ids)
    np.testing.assert_allclose(scores, ex_scores, rtol=1e-5, atol=1e-5)
    # k beyond the corpus is clamped, like exact search
    assert faiss_search(build_faiss_index(passages[:6], "faiss-flat"), queries, 10)[1].shape == (30, 6)


@pytest.mark.parametrize(("kind", "options"), [("faiss-hnsw", {}), ("faiss-ivfpq", {"pq_m": 16})])
def test_approximate_faiss_indexes_find_most_true_neighbours(faiss_one_thread, kind, options):
    passages = clustered_unit_vectors(2000, 32, n_clusters=20, seed=0)
    rng = np.random.default_rng(1)
    queries = passages[rng.choice(len(passages), 100, replace=False)] + 0.05 * rng.normal(size=(100, 32))
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    _, exact_ids = exact_search(queries, passages, 10, device=CPU)
    _, ids = faiss_search(build_faiss_index(passages, kind, **options), queries, 10)
    assert ids.shape == (100, 10)
    recall = np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids.tolist(), exact_ids.tolist())])
    assert recall >= 0.8, f"{kind} recall@10 vs exact = {recall:.3f}"


def test_faiss_unknown_kind_and_empty_input():
    from densepass.errors import ConfigError

    _, passages = random_data(1, 10, 8)
    with pytest.raises(ConfigError, match="unknown index kind"):
        build_faiss_index(passages, "faiss-nope")
    with pytest.raises(DensepassError, match="empty"):
        build_faiss_index(passages[:0], "faiss-flat")


def test_faiss_save_load_round_trip_is_atomic(tmp_path, faiss_one_thread):
    queries, passages = random_data(5, 100, 8, seed=4)
    index = build_faiss_index(passages, "faiss-hnsw")
    path = tmp_path / "nested" / "hnsw.index"
    save_faiss_index(index, path)
    assert sorted(p.name for p in path.parent.iterdir()) == ["hnsw.index"]  # no temporary file left
    loaded = load_faiss_index(path)
    assert loaded.ntotal == 100
    before, after = faiss_search(index, queries, 5), faiss_search(loaded, queries, 5)
    np.testing.assert_array_equal(before[1], after[1])
    np.testing.assert_allclose(before[0], after[0])
    save_faiss_index(build_faiss_index(passages[:10], "faiss-flat"), path)  # overwrite in place
    assert load_faiss_index(path).ntotal == 10
    assert sorted(p.name for p in path.parent.iterdir()) == ["hnsw.index"]


def test_faiss_load_missing_file(tmp_path):
    with pytest.raises(DensepassError, match="index file not found"):
        load_faiss_index(tmp_path / "missing.index")


# ---- BM25 -------------------------------------------------------------------------------------

BM25_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a kernel driver for the network printer",
    "python compiler and interpreter for scripting",
    "music player with playlist and equalizer support",
    "database server with replication and backup",
    "image viewer for photographs and thumbnails",
]


def test_bm25_top_hit_is_the_passage_with_the_query_words():
    index = BM25Index.build(BM25_TEXTS)
    queries = ["playlist equalizer", "replication backup", "thumbnails photographs", "printer kernel"]
    scores, rows = index.search_rows(queries, k=3)
    assert rows.shape == scores.shape == (4, 3)
    assert rows[:, 0].tolist() == [3, 4, 5, 1]
    assert (np.diff(scores, axis=1) <= 0).all()  # best first
    assert (scores[:, 0] > 0).all()


def test_bm25_stems_query_words():
    index = BM25Index.build(BM25_TEXTS)
    _, rows = index.search_rows(["jumping foxes"], k=1)
    assert rows[0, 0] == 0


def test_bm25_k_is_clamped_to_corpus_size():
    index = BM25Index.build(BM25_TEXTS)
    scores, rows = index.search_rows(["python"], k=100)
    assert rows.shape == (1, len(BM25_TEXTS))
    assert sorted(rows[0].tolist()) == list(range(len(BM25_TEXTS)))


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=60),  # few distinct values: ties everywhere
    st.integers(0, 70),
)
def test_top_k_is_the_best_k_with_ties_in_row_order(levels, k):
    scores = np.asarray(levels, dtype=np.float32) * np.float32(0.37)
    reference = sorted(range(len(scores)), key=lambda r: (-float(scores[r]), r))[:k]
    values, rows = top_k(scores, k)
    assert rows.tolist() == reference
    assert values.tolist() == scores[reference].tolist()


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 3), min_size=1, max_size=40),  # a passage is one of four vectors: ties everywhere
    st.integers(1, 45),
)
def test_faiss_flat_returns_the_best_k_with_ties_in_row_order_as_exact_search_does(levels, k):
    """FAISS keeps an arbitrary few of the passages tied at the k-th score, in its heap's order: which duplicates
    came back changed with k (and with a tombstone's deeper search)."""
    basis = np.eye(4, dtype=np.float32)
    passages = basis[levels] * np.float32(0.5)
    queries = np.asarray([[1.0, 0.6, 0.3, 0.0], [0.0, 0.0, 0.0, 1.0]], dtype=np.float32)
    scores, rows = faiss_search(build_faiss_index(passages, "faiss-flat"), queries, k)
    every = queries @ passages.T
    for line in range(len(queries)):
        reference = sorted(range(len(levels)), key=lambda r: (-float(every[line, r]), r))[:k]
        assert rows[line].tolist() == reference
        assert scores[line].tolist() == pytest.approx(every[line, reference].tolist())


def test_bm25_ranks_tied_passages_in_row_order():
    # copies of one passage score alike wherever they are: which of them enter the top k must not depend on the CPU
    # (NumPy's SIMD argpartition / argsort kernels, which bm25s ranks with, break such ties differently per CPU)
    texts = ["audio player"] * 40 + ["audio editor"] * 40 + BM25_TEXTS
    rng = np.random.default_rng(0)
    texts = [texts[i] for i in rng.permutation(len(texts))]
    index = BM25Index.build(texts)
    for query, k in (("audio", 50), ("audio player", 45), ("printer", 10)):
        scores, rows = index.search_rows([query], k=k)
        every = index.score_all(query)
        assert rows[0].tolist() == sorted(range(len(texts)), key=lambda r: (-float(every[r]), r))[:k], query
        assert scores[0].tolist() == every[rows[0]].tolist()


def test_bm25_save_load_round_trip(tmp_path):
    index = BM25Index.build(BM25_TEXTS)
    queries = ["python scripting", "lazy dog", "network driver"]
    expected = index.search_rows(queries, k=4)
    path = tmp_path / "bm25"
    index.save(path)
    index.save(path)  # saving over an existing index replaces it
    assert [p.name for p in tmp_path.iterdir()] == ["bm25"]  # no temporary or old directory left
    loaded = BM25Index.load(path)
    assert loaded.size == len(BM25_TEXTS)
    got = loaded.search_rows(queries, k=4)
    np.testing.assert_array_equal(got[1], expected[1])
    np.testing.assert_allclose(got[0], expected[0], rtol=1e-6)


def test_a_loaded_index_reads_its_passages_from_its_file(tmp_path):
    records = [{"id": f"p{i}", "title": f"T{i}" if i % 2 else "", "text": text} for i, text in enumerate(BM25_TEXTS)]
    BM25Index.build(records).save(tmp_path / "bm25")
    loaded = BM25Index.load(tmp_path / "bm25")
    assert not isinstance(loaded.passages.texts, list) and list(loaded.passages.texts) == BM25_TEXTS
    assert list(loaded.passages.titles) == [r["title"] for r in records]
    hits = loaded.search(["lazy dog"], k=2)
    assert [loaded.passages.texts[loaded.passages.position(pid)] for pid in hits.ids(0)][0] == BM25_TEXTS[0]
    BM25Index.build(["another corpus"]).save(tmp_path / "bm25")  # saved over it: the loaded one still reads its own
    assert list(loaded.passages.texts) == BM25_TEXTS
    loaded.add([{"id": "new", "text": "a new passage about audio"}])  # adding brings the passages into memory
    assert loaded.passages.texts[-1] == "a new passage about audio" and loaded.passages.texts[:-1] == BM25_TEXTS


def test_bm25_errors(tmp_path):
    with pytest.raises(DensepassError, match="no passages to index"):
        BM25Index.build([])
    with pytest.raises(DensepassError, match="no queries"):
        BM25Index.build(BM25_TEXTS).search([], k=1)
    with pytest.raises(DensepassError, match="densepass index not found"):
        BM25Index.load(tmp_path / "missing")


# ---- encoding ---------------------------------------------------------------------------------

TEXTS = [
    "short",
    "a somewhat longer passage about audio and video editing software",
    "mid length text here",
    "one",
    "the longest text of them all, describing a terminal emulator, a font viewer and a mail server in detail",
    "two words",
    "network kernel driver",
]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from densepass.models.biencoder import BiEncoder

    return BiEncoder.from_pretrained(str(tiny_model_dir))


def test_encode_texts_keeps_input_order(tiny_model):
    batched = encode_texts(
        tiny_model, TEXTS, "passage", batch_size=3, device=CPU, precision="fp32", show_progress=False
    )
    one_by_one = np.stack(
        [
            encode_texts(tiny_model, [t], "passage", batch_size=1, device=CPU, precision="fp32", show_progress=False)[0]
            for t in TEXTS
        ]
    )
    assert batched.shape == (len(TEXTS), tiny_model.dim) and batched.dtype == np.float32
    np.testing.assert_allclose(batched, one_by_one, atol=1e-5)
    # the texts really differ, so a permuted result could not pass the comparison above
    assert np.linalg.norm(batched[:, None] - batched[None], axis=-1)[~np.eye(len(TEXTS), dtype=bool)].min() > 1e-3


def test_encode_texts_max_tokens_gives_same_embeddings(tiny_model):
    plain = encode_texts(tiny_model, TEXTS, "query", batch_size=2, device=CPU, precision="fp32", show_progress=False)
    capped = encode_texts(
        tiny_model, TEXTS, "query", batch_size=1, device=CPU, precision="fp32", show_progress=False, max_tokens=40
    )
    np.testing.assert_allclose(plain, capped, atol=1e-5)


def naive_encoding(model, texts, side):
    """One text at a time, straight through the tokenizer and the model: no sorting, no padding."""
    rows = []
    with torch.no_grad():
        for text in texts:
            tokens = model.tokenizer([text], truncation=True, max_length=model.max_length(side), return_tensors="pt")
            rows.append(model(tokens["input_ids"], tokens["attention_mask"], side=side)[0].numpy())
    return np.stack(rows)


@pytest.mark.parametrize("chunk, batch_size, max_tokens", [(3, 2, None), (4, 1, 30), (1000, 5, None)])
def test_encode_texts_equals_naive_per_text_encoding(tiny_model, monkeypatch, chunk, batch_size, max_tokens):
    """Chunked background tokenisation, numpy padding and reordering change nothing: every row equals
    the text encoded on its own. Includes an empty text and texts cut at the passage length."""
    monkeypatch.setattr(encode_module, "TOKENIZE_CHUNK", chunk)
    long_text = " ".join(TEXTS * 12)  # far beyond passage_max_length tokens
    texts = TEXTS + ["", long_text, long_text[::-1], TEXTS[1]]
    got = encode_texts(
        tiny_model,
        texts,
        "passage",
        batch_size=batch_size,
        device=CPU,
        precision="fp32",
        show_progress=False,
        max_tokens=max_tokens,
    )
    assert got.shape == (len(texts), tiny_model.dim) and got.dtype == np.float32
    np.testing.assert_allclose(got, naive_encoding(tiny_model, texts, "passage"), atol=1e-5)
    queries = encode_texts(
        tiny_model, texts, "query", batch_size=batch_size, device=CPU, precision="fp32", show_progress=False
    )
    np.testing.assert_allclose(queries, naive_encoding(tiny_model, texts, "query"), atol=1e-5)


def test_inference_copy_is_low_precision_and_leaves_the_model_alone(tiny_model):
    before = {n: p.detach().clone() for n, p in tiny_model.named_parameters()}
    half = encode_module.inference_copy(tiny_model)
    assert {p.dtype for p in half.query_encoder.parameters()} == {torch.bfloat16}
    assert half.query_encoder is half.passage_encoder  # a shared tower stays shared
    for name, param in tiny_model.named_parameters():
        assert param.dtype == torch.float32 and torch.equal(param, before[name]), name
    with torch.no_grad():
        tokens = tiny_model.tokenize(TEXTS, "passage")
        full = tiny_model(tokens["input_ids"], tokens["attention_mask"], side="passage")
        low = half(tokens["input_ids"], tokens["attention_mask"], side="passage")
    assert low.dtype == torch.float32
    torch.testing.assert_close(low, full, atol=3e-2, rtol=0)
    assert not torch.equal(low, full)  # it really ran in bfloat16


def test_encode_texts_empty_list(tiny_model):
    with pytest.raises(DensepassError, match="nothing to encode"):
        encode_texts(tiny_model, [], "query", device=CPU, show_progress=False)


def test_encode_to_memmap_resumes_after_interruption(tiny_model, tmp_path, monkeypatch):
    texts = [f"{word} passage number {i}" for i, word in enumerate(TEXTS * 2)]  # 14 texts
    path = tmp_path / "emb" / "passages.npy"
    kwargs = dict(device=CPU, show_progress=False, batch_size=4)
    real = encode_module.encode_texts
    calls: list[int] = []

    def failing_on_second_shard(model, shard_texts, side, **kw):
        calls.append(len(shard_texts))
        if len(calls) == 2:
            raise KeyboardInterrupt("simulated interruption")
        return real(model, shard_texts, side, **kw)

    monkeypatch.setattr(embeddings_module, "encode_texts", failing_on_second_shard)
    with pytest.raises(KeyboardInterrupt):
        encode_to_memmap(tiny_model, texts, "passage", path, shard_size=5, **kwargs)
    assert not path.exists()
    assert (path.parent / "passages.npy.partial").is_file()
    assert (path.parent / "passages.npy.done").read_text().split() == ["0"]

    calls.clear()
    monkeypatch.setattr(
        embeddings_module, "encode_texts", lambda *a, **kw: (calls.append(len(a[1])), real(*a, **kw))[1]
    )
    out = encode_to_memmap(tiny_model, texts, "passage", path, shard_size=5, **kwargs)
    assert calls == [5, 4]  # shard 0 was not encoded again; shards 1 and 2 were
    direct = real(tiny_model, texts, "passage", **kwargs)
    assert out.shape == (14, tiny_model.dim)
    np.testing.assert_allclose(np.asarray(out), direct, atol=1e-5)
    assert sorted(p.name for p in path.parent.iterdir()) == ["passages.npy"]  # no .partial or .done left

    # a finished file is returned as is, without encoding anything
    calls.clear()
    again = encode_to_memmap(tiny_model, texts, "passage", path, shard_size=5, **kwargs)
    assert calls == []
    np.testing.assert_array_equal(np.asarray(again), np.asarray(out))


@pytest.mark.parametrize("damage", ["wrong shape", "truncated", "bad done list", "truncated final"])
def test_encode_to_memmap_encodes_damaged_files_again(tiny_model, tmp_path, damage):
    path = tmp_path / "emb.npy"
    kwargs = dict(device=CPU, show_progress=False, shard_size=2)
    expected = np.asarray(encode_to_memmap(tiny_model, TEXTS, "passage", tmp_path / "ref.npy", **kwargs))
    partial, done = path.with_name("emb.npy.partial"), path.with_name("emb.npy.done")
    if damage == "wrong shape":
        np.lib.format.open_memmap(partial, mode="w+", dtype=np.float32, shape=(3, 5))
    elif damage == "truncated":
        with open(partial, "wb") as handle:
            np.save(handle, expected)
        partial.write_bytes(partial.read_bytes()[:100])
        done.write_text("0\n1\n")
    elif damage == "bad done list":
        with open(partial, "wb") as handle:
            np.save(handle, np.zeros_like(expected))
        done.write_text("0\nnot-a-shard")
    else:
        np.save(path, expected)
        path.write_bytes(path.read_bytes()[:150])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = encode_to_memmap(tiny_model, TEXTS, "passage", path, **kwargs)
    np.testing.assert_array_equal(np.asarray(out), expected)
    if damage != "bad done list":  # an unreadable list of shards just means: encode every shard
        assert any("is damaged" in str(w.message) for w in caught)


def test_an_installed_jax_neither_takes_the_gpu_nor_ranks_bm25(tmp_path):
    """bm25s imports JAX where it is installed (on a GPU machine JAX preallocates 75% of the GPU at that
    import): densepass lets it allocate on demand and ranks with NumPy. A stand-in JAX prints the setting it
    was imported under and answers every top-k wrongly, so ranking through it would show."""
    fake = tmp_path / "jax"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "import os\nprint('PREALLOCATE=' + str(os.environ.get('XLA_PYTHON_CLIENT_PREALLOCATE')))\n"
    )
    (fake / "lax.py").write_text("import numpy as np\n\n\ndef top_k(x, k):\n    return np.zeros(k), np.arange(k)\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_PREALLOCATE"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), *filter(None, [env.get("PYTHONPATH")])])
    script = (
        "from densepass.index.bm25 import BM25Index\n"
        "index = BM25Index.build(['kernel driver', 'fast audio editor', 'audio player'])\n"
        "print('TOP=' + ','.join(index.search(['audio editor'], k=2).ids(0)))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    assert "PREALLOCATE=false" in out
    assert "TOP=1,2" in out


# ---- dense indexes: bad input refused before any change ------------------------------------------------


def dense_records(n: int, start: int = 0) -> list[dict]:
    return [{"id": f"p{i}", "text": f"{TEXTS[i % len(TEXTS)]} {i}"} for i in range(start, start + n)]


def unit_rows(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_dense_index_options_are_checked_against_the_kind_before_any_passage_is_encoded(tiny_model, monkeypatch):
    """An option the kind does not take (a typo, or one of another kind) and a value FAISS cannot use are one line
    at construction: they were written into the manifest unused, or failed with a raw TypeError after encoding."""
    from densepass.errors import ConfigError
    from densepass.index.dense import DenseIndex

    monkeypatch.setattr(tiny_model, "encode_passages", lambda *a, **k: pytest.fail("encoded before the refusal"))
    for kind, options, message in [
        ("exact", {"hnsw_m": 8, "rescor": 2}, "an exact index takes no option hnsw_m, rescor (it takes: none)"),
        ("faiss-flat", {"ivf_lists": 4}, "a faiss-flat index takes no option ivf_lists (it takes: none)"),
        ("faiss-hnsw", {"hnswm": 8}, "a faiss-hnsw index takes no option hnswm (it takes: hnsw_m)"),
        ("faiss-hnsw", {"hnsw_m": 1}, "hnsw_m must be an integer >= 2, got 1"),
        ("faiss-ivfpq", {"ivf_lists": 0}, "ivf_lists must be a positive integer, got 0"),
        ("faiss-ivfpq", {"ivf_lists": -3}, "ivf_lists must be a positive integer, got -3"),
        ("faiss-ivfpq", {"pq_m": 0}, "pq_m must be a positive integer, got 0"),
        ("faiss-ivfpq", {"pq_m": True}, "pq_m must be a positive integer, got True"),
        ("faiss-ivfpq", {"pq_m": 5}, "pq_m=5 must divide the embedding dimension 32"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            DenseIndex.build(tiny_model, dense_records(300), kind, show_progress=False, **options)
    assert DenseIndex(tiny_model, "faiss-ivfpq", ivf_lists=None, pq_m=8).faiss_options == {"ivf_lists": None, "pq_m": 8}


@pytest.mark.parametrize("kind", ["exact", "faiss-flat"])
def test_a_dense_index_refuses_nan_or_inf_embeddings_and_queries_and_changes_nothing(tiny_model, kind):
    from densepass.errors import DataError
    from densepass.index.dense import DenseIndex

    dim = tiny_model.dim
    index = DenseIndex(tiny_model, kind, show_progress=False, device=CPU)
    x = unit_rows(10, dim, 0)
    index.add_embeddings(dense_records(10), x)
    before = index.search(x[:3], k=4)
    bad = unit_rows(3, dim, 1)
    bad[1, 4] = np.nan
    with pytest.raises(DataError, match="the embedding of passage 'p11' holds NaN or infinity"):
        index.add_embeddings(dense_records(3, start=10), bad)
    assert len(index.passages) == len(index.embeddings) == 10
    bad[1, 4] = np.inf
    with pytest.raises(DataError, match="the embedding of passage 'p1' holds NaN or infinity"):
        index.upsert_embeddings(dense_records(3), bad)
    assert index.live_position("p1") == 1 and not index.deleted.any() and len(index.passages) == 10
    queries = x[:3].copy()
    queries[2, 0] = np.nan
    with pytest.raises(DataError, match="the embedding of query 2 holds NaN or infinity"):
        index.search(queries, k=4)
    after = index.search(x[:3], k=4)
    np.testing.assert_array_equal(after.rows, before.rows)
    if kind == "faiss-flat":
        assert index.faiss.ntotal == 10


def test_a_dense_add_refuses_a_repeated_id_before_encoding_and_a_failed_add_changes_nothing(tiny_model, monkeypatch):
    from densepass.errors import ConfigError, DataError
    from densepass.index.dense import DenseIndex

    index = DenseIndex.build(tiny_model, dense_records(5), show_progress=False, device=CPU)
    calls = []
    encode = tiny_model.encode_passages
    monkeypatch.setattr(tiny_model, "encode_passages", lambda *a, **k: calls.append(1) or encode(*a, **k))
    with pytest.raises(DataError, match="duplicate passage id 'p3'"):
        index.add([{"id": "p3", "text": "again"}, {"id": "new", "text": "new"}])
    assert not calls and len(index.passages) == len(index.embeddings) == 5
    ivfpq = DenseIndex(tiny_model, "faiss-ivfpq", show_progress=False, device=CPU)
    with pytest.raises(ConfigError, match="needs at least 256 passages, got 100"):
        ivfpq.add_embeddings(dense_records(100), unit_rows(100, tiny_model.dim, 2))
    assert len(ivfpq.passages) == len(ivfpq.embeddings) == 0 and ivfpq.faiss is None


def test_a_manifest_lacking_a_fact_its_kind_reads_is_one_line(tiny_model, tmp_path):
    """A manifest whose file digests match but that lacks the options, dimension, model or size (written by hand,
    or by another tool): a one-line DataError, not a KeyError."""
    import json

    from densepass.errors import DataError
    from densepass.index import load_index
    from densepass.index.dense import DenseIndex

    BM25Index.build(BM25_TEXTS).save(tmp_path / "bm25")
    DenseIndex.build(tiny_model, dense_records(5), show_progress=False, device=CPU).save(tmp_path / "dense")
    for name, missing in [("bm25", "options"), ("bm25", "size"), ("dense", "options"), ("dense", "dim"),
                          ("dense", "model")]:  # fmt: skip
        path = tmp_path / name / "manifest.json"
        original = path.read_text()
        path.write_text(json.dumps({k: v for k, v in json.loads(original).items() if k != missing}))
        with pytest.raises(DataError, match=f"{name} is not a usable densepass index: its manifest has no '{missing}'"):
            load_index(tmp_path / name)
        path.write_text(original)
        assert len(load_index(tmp_path / name)) == (5 if name == "dense" else len(BM25_TEXTS))


def test_an_index_refuses_its_weights_loaded_with_other_settings(tiny_model_dir, tmp_path):
    """The same weights pooled, normalised or prompted otherwise embed queries apart from the indexed passages: a
    model given to a saved index must match its recorded settings as well as its weights' fingerprint."""
    from densepass.config import BiEncoderConfig
    from densepass.errors import ConfigError
    from densepass.index import load_index
    from densepass.index.dense import DenseIndex
    from densepass.models.biencoder import BiEncoder

    model = BiEncoder.from_pretrained(str(tiny_model_dir), BiEncoderConfig(pooling="cls", query_prompt="q: "))
    model.save(tmp_path / "model")
    saved = BiEncoder.from_pretrained(str(tmp_path / "model"))
    DenseIndex.build(saved, dense_records(5), show_progress=False, device=CPU).save(tmp_path / "index")
    assert len(load_index(tmp_path / "index", model=saved)) == 5
    other = BiEncoder.from_pretrained(str(tmp_path / "model"), BiEncoderConfig(pooling="mean", query_prompt="q: "))
    with pytest.raises(ConfigError, match=r"same weights but other settings: pooling 'mean' \(the index's: 'cls'\)"):
        load_index(tmp_path / "index", model=other)


@pytest.mark.parametrize("bad", ["release notes", "tab\there", "line\u2028separator", ""])
def test_a_passage_id_no_saved_index_could_hold_is_refused_before_anything_is_written(tmp_path, bad):
    """The readers of a saved index's passages (and TREC runs) refuse an empty id or one with whitespace: an index
    built or updated with one through the API would save, then never load again."""
    from densepass.data.dataset import Corpus
    from densepass.index import load_index
    from densepass.index.living import update_index

    records = [{"id": "p0", "text": "audio editor"}, {"id": bad, "text": "kernel driver"}]
    corpus = Corpus(["p0", bad], ["", ""], ["audio editor", "kernel driver"], ["p0", "d1"])
    for passages in (records, corpus):
        with pytest.raises(DensepassError, match=r"^passage 1: (its 'id' is empty|id .* holds whitespace)"):
            BM25Index.build(passages)
    BM25Index.build(records[:1] + [{"id": "p1", "text": "tar archiver"}]).save(tmp_path / "index")
    with pytest.raises(DensepassError, match=r"^passage 0: "):
        update_index(tmp_path / "index", upsert=[{"id": bad, "text": "video player"}])
    index = load_index(tmp_path / "index")  # untouched, and still loads
    assert index.version == 0 and index.passages.ids == ["p0", "p1"]


def test_an_empty_index_is_not_saved_and_leaves_a_saved_one_in_place(tiny_model, tmp_path):
    """``BM25Index().save`` was an AttributeError traceback, and an empty dense index was saved (over a good one
    too) as a folder no load accepted ("the corpus is empty")."""
    from densepass.errors import ConfigError
    from densepass.index import load_index
    from densepass.index.dense import DenseIndex

    with pytest.raises(ConfigError, match="^the index is empty: add passages before saving$"):
        BM25Index().save(tmp_path / "bm25")
    assert not (tmp_path / "bm25").exists()
    DenseIndex.build(tiny_model, dense_records(5), show_progress=False, device=CPU).save(tmp_path / "dense")
    files = {p: p.read_bytes() for p in (tmp_path / "dense").rglob("*") if p.is_file()}
    with pytest.raises(ConfigError, match="^the index is empty"):
        DenseIndex(tiny_model, show_progress=False, device=CPU).save(tmp_path / "dense")
    assert {p: p.read_bytes() for p in (tmp_path / "dense").rglob("*") if p.is_file()} == files
    assert len(load_index(tmp_path / "dense", model=tiny_model)) == 5
