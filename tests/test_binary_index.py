"""Binary and int8 indexes (``index.binary``): the Hamming first pass against a brute-force numpy reference, the
re-scored top k against exact float search when the multiplier covers the corpus, int8 codes against
sentence-transformers' quantisation, save / load with memory-mapped re-scoring embeddings, manifest checks, the
command line, and one-line errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from densepass.errors import ConfigError, DataError
from densepass.index import load_index
from densepass.index.binary import CompactIndex, compact_kind, dequantize
from densepass.models.biencoder import BiEncoder

N, DIM = 120, 32


@pytest.fixture(scope="module")
def model(tiny_model_dir, tmp_path_factory):
    """The tiny 32-dimensional model, saved where indexes can record it."""
    path = tmp_path_factory.mktemp("model") / "m"
    BiEncoder.from_pretrained(str(tiny_model_dir)).save(path)
    return BiEncoder.from_pretrained(str(path))


def vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, DIM)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def built(model, kind, embeddings, **options):
    index = CompactIndex(model, kind, show_progress=False, **options)
    index.add_embeddings([f"passage {i}" for i in range(len(embeddings))], embeddings)
    return index


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_hamming_pass_is_a_brute_force_count_of_differing_sign_bits(model, seed):
    x, q = vectors(N, seed), vectors(7, seed + 100)
    index = built(model, "binary-flat", x, rescore_with="none")
    k = 10
    scores, rows = index.search_rows(q, k)
    for i in range(len(q)):  # literally: the bits that differ, then dim - 2 x that (the ±1 vectors' dot product)
        hamming = np.array([sum((q[i, d] > 0) != (x[j, d] > 0) for d in range(DIM)) for j in range(N)])
        reference = DIM - 2 * hamming
        want = np.sort(reference)[::-1][:k]
        np.testing.assert_array_equal(scores[i], want)  # the top k scores, ties at the k-th in any order
        np.testing.assert_array_equal(reference[rows[i]], scores[i])  # each row has the score shown
        assert len(set(rows[i].tolist())) == k
        ties = scores[i][:-1] == scores[i][1:]
        assert (rows[i][:-1][ties] < rows[i][1:][ties]).all()  # equal scores by row


@pytest.mark.parametrize("kind", ["binary-flat", "binary-hnsw", "binary-ivf", "int8-flat"])
def test_float_rescoring_of_every_passage_is_exact_search(model, kind):
    x, q = vectors(N, 5), vectors(9, 6)
    options = {"ivf_lists": 2, "nprobe": 2} if kind == "binary-ivf" else {}
    index = built(model, kind, x, rescore_with="float", rescore_multiplier=N, **options)
    scores, rows = index.search_rows(q, 10)
    exact = q @ x.T
    np.testing.assert_array_equal(rows, np.argsort(-exact, axis=1, kind="stable")[:, :10])
    np.testing.assert_allclose(scores, np.take_along_axis(exact, rows, 1), atol=1e-5)
    candidates = np.tile(np.arange(N), (len(q), 1))
    np.testing.assert_array_equal(index._rescored(q, candidates, budget=100), index._rescored(q, candidates))  # blocks


def test_int8_codes_are_sentence_transformers_with_the_corpus_ranges_and_rescore_by_them(model):
    from sentence_transformers.util.quantization import quantize_embeddings

    x, q = vectors(N, 7), vectors(5, 8)
    index = built(model, "binary-flat", x, rescore_with="int8", rescore_multiplier=N)
    ranges = np.stack([x.min(0), x.max(0)])
    np.testing.assert_array_equal(index.ranges, ranges)
    np.testing.assert_array_equal(index.codes, quantize_embeddings(x, "int8", ranges=ranges))
    step = (ranges[1] - ranges[0]) / 255
    assert np.abs(dequantize(index.codes, index.ranges) - x).max() <= step.max() / 2 + 1e-6  # within half a bucket
    scores, rows = index.search_rows(q, 10)
    reference = q @ np.array([[ranges[0, d] + (c + 128.5) * step[d] for d, c in enumerate(r)] for r in index.codes]).T
    np.testing.assert_array_equal(rows, np.argsort(-reference, axis=1, kind="stable")[:, :10])
    flat = built(model, "int8-flat", x, rescore_with="none")  # the int8 scan scores the same dequantised codes
    np.testing.assert_array_equal(flat.search_rows(q, 10)[1], rows)
    np.testing.assert_allclose(flat.search_rows(q, 10)[0], scores, atol=1e-5)


def test_passages_added_later_outside_the_calibrated_range_are_clipped_not_wrapped(model):
    """Codes of vectors beyond the first passages' ranges are the nearest end bucket (-128 or 127), as the current
    sentence-transformers computes them; its releases before that wrapped them around int8."""
    from sentence_transformers.util.quantization import quantize_embeddings

    x = vectors(N, 7)
    index = built(model, "int8-flat", x, rescore_with="none")
    beyond = np.stack([x.max(0) * 3 + 1, x.min(0) * 3 - 1]).astype(np.float32)
    index.add_embeddings([{"id": "hi", "text": "h"}, {"id": "lo", "text": "l"}], beyond)
    assert (index.codes[-2] == 127).all() and (index.codes[-1] == -128).all()
    np.testing.assert_array_equal(index.codes[-2:], quantize_embeddings(beyond, "int8", ranges=index.ranges))


def test_save_and_load_keep_results_and_map_the_rescoring_embeddings_from_disk(model, tmp_path):
    x, q = vectors(N, 9), vectors(4, 10)
    for kind in ("binary-hnsw", "int8-flat"):
        index = built(model, kind, x, rescore_multiplier=3)
        before = index.search_rows(q, 5)
        index.save(tmp_path / kind)
        manifest = json.loads((tmp_path / kind / "manifest.json").read_text())
        assert manifest["kind"] == kind and manifest["dim"] == DIM
        assert manifest["options"]["rescore_with"] == "float" and manifest["options"]["rescore_multiplier"] == 3
        loaded = load_index(tmp_path / kind)
        assert isinstance(loaded, CompactIndex) and isinstance(loaded.embeddings, np.memmap)
        assert isinstance(loaded.codes, np.memmap) == (kind != "int8-flat")  # int8-flat scans its codes in RAM
        after = loaded.search_rows(q, 5)
        np.testing.assert_array_equal(after[1], before[1])
        np.testing.assert_allclose(after[0], before[0], atol=1e-6)
        assert loaded.memory_bytes() == index.memory_bytes() > 0
        assert load_index(tmp_path / kind, rescore_with="none", rescore_multiplier=1).rescore_with == "none"
    assert built(model, "binary-flat", x).memory_bytes() == N * DIM // 8  # 1 bit a dimension
    assert built(model, "int8-flat", x).memory_bytes() == N * DIM


def test_deleted_passages_never_come_back_before_or_after_compaction(model):
    x, q = vectors(N, 11), vectors(3, 12)
    index = built(model, "binary-flat", x, rescore_multiplier=N)
    top = index.search(q, k=5)
    gone = top.ids(0)[:2]
    index.delete(gone)
    assert not set(gone) & {pid for i in range(3) for pid in index.search(q, k=5).ids(i)}
    index.compact()
    assert len(index.passages) == N - 2 and index.bits.ntotal == N - 2 and len(index.codes) == N - 2
    assert not set(gone) & {pid for i in range(3) for pid in index.search(q, k=5).ids(i)}


def test_a_damaged_or_foreign_file_is_one_line(model, tmp_path):
    index = built(model, "binary-flat", vectors(N, 13))
    index.save(tmp_path / "idx")
    (tmp_path / "idx" / "int8.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="int8.npy"):
        load_index(tmp_path / "idx")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda m: CompactIndex(m, "binary-pq"), "unknown compact index kind"),
        (lambda m: CompactIndex(m, rescore_with="bf16"), "unknown re-scoring"),
        (lambda m: CompactIndex(m, rescore_multiplier=0), "integer >= 1"),
        (lambda m: CompactIndex(m, dim=12), "not a multiple of 8"),
        (lambda m: CompactIndex(m, efSearch=3), "takes no option efSearch"),
        (lambda m: compact_kind("int8", "faiss-hnsw"), "use --kind exact"),
        (lambda m: compact_kind("binary", "bm25"), "takes --kind exact, faiss-flat"),
        (lambda m: compact_kind("fp16", "exact"), "unknown embedding precision"),
    ],
)
@pytest.mark.filterwarnings("ignore:.*not trained at")
def test_bad_options_are_one_line_errors(model, make, match):
    with pytest.raises(ConfigError, match=match):
        make(model)


def test_densepass_index_and_search_binary_on_the_command_line(tiny_beir, tiny_model_dir, tmp_path):
    from conftest import densepass_here, run_densepass

    out = tmp_path / "bin"
    done = densepass_here(  # the command line's parsing and work in this process; the refusal as a program
        "index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(out), "--kind", "faiss-hnsw",
        "--embedding-precision", "binary", "--rescore-with", "int8", "--rescore-multiplier", "8", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "(binary-hnsw; " in done.stdout and "bytes per passage in RAM" in done.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kind"] == "binary-hnsw" and manifest["options"]["rescore_with"] == "int8"
    found = densepass_here("search", str(out), "audio editor", "--rescore-with", "float", cwd=tmp_path)
    assert found.returncode == 0 and "p" in found.stdout, found.stderr
    # a multiplier where nothing is re-scored had no effect: refused, at search and at indexing, before any work
    unused = densepass_here(
        "search", str(out), "audio", "--rescore-with", "none", "--rescore-multiplier", "8", cwd=tmp_path
    )
    assert (
        unused.returncode == 2
        and "--rescore-multiplier: this binary-hnsw index with --rescore-with none" in unused.stderr
    )
    int8 = ["--embedding-precision", "int8", "--rescore-with", "int8", "--rescore-multiplier", "8"]
    unused = densepass_here(
        "index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(tmp_path / "i8"), *int8, cwd=tmp_path
    )
    assert (
        unused.returncode == 2 and "the int8-flat index built with --rescore-with int8 re-scores none" in unused.stderr
    )
    assert not (tmp_path / "i8").exists()
    bad = run_densepass(
        "index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(tmp_path / "bad"),
        "--embedding-precision", "int8", "--kind", "faiss-hnsw", cwd=tmp_path,
    )  # fmt: skip
    last = bad.stderr.strip().splitlines()[-1]
    assert bad.returncode == 2 and last.startswith("densepass: error:") and "use --kind exact" in last, bad.stderr
    assert not (tmp_path / "bad").exists()


def test_index_settings_refuse_what_has_no_compact_index_before_any_work():
    from densepass.pipelines.indexing import IndexSettings

    for options, match in [
        ({"rescore_with": "int8"}, "re-score an int8 or binary index"),
        ({"kind": "bm25", "embedding_precision": "binary"}, "a bm25 index has none"),
        ({"embedding_precision": "binary", "rescore_multiplier": 0}, "integer >= 1"),
        ({"embedding_precision": "binary", "kind": "faiss-ivfpq-disk"}, "has none"),
    ]:
        with pytest.raises(ConfigError, match=match):
            IndexSettings(**options)


def test_the_compact_benchmark_runs_on_a_tiny_dataset(tiny_beir, tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    import densepass

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_compact.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(densepass.__file__).parents[1])}
    out = tmp_path / "compact.json"
    done = subprocess.run(
        [sys.executable, str(script), "--model", f"t={tiny_model_dir}", "--model", f"u={tiny_model_dir}",
         "--dataset", str(tiny_beir), "--dims", "32", "16", "--latency-queries", "2", "--principal-axes",
         "--out", str(out)],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    rows = {(r["model"], r["dim"], r["system"]): r for r in results["results"]}
    assert rows[("t", 32, "fp32 (exact)")]["bytes_per_passage"] == 128
    assert rows[("t", 16, "int8")]["bytes_per_passage"] == 16 and rows[("t", 16, "binary")]["bytes_per_passage"] == 2
    assert rows[("t", 32, "binary + float re-scoring")]["mrr@10"] >= 0
    assert ("u", 16, "sentence-transformers ubinary + rescore") in rows
    assert rows[("u", 32, "sentence-transformers int8 + rescore")]["mrr@10"] >= 0  # their usearch path (test extra)
    paired = {(p["b"], p["dim"]): p for p in results["paired"]}  # t against each other model, at each dimension
    assert sorted(paired) == [(b, d) for b in ("t+pca", "u", "u+pca") for d in (16, 32)]
    assert paired[("u", 32)]["p"] == 1.0 and paired[("u", 16)]["p"] == 1.0  # the same model
    assert abs(paired[("t+pca", 32)]["delta_mrr@10"]) < 1e-3  # a rotation keeps the full embedding's ranking
    assert rows[("t+pca", 16, "fp32 (exact)")]["bytes_per_passage"] == 64  # measured at every prefix


def test_the_search_pipeline_loads_a_compact_index_with_its_rescoring_options(model, tmp_path):
    from densepass.index.dense import DenseIndex
    from densepass.pipelines.search import SearchPipeline

    texts = [f"{w} tool for {v}" for w in ("audio", "kernel", "mail", "font") for v in ("desktops", "servers")]
    CompactIndex.build(model, texts, "binary-flat", show_progress=False).save(tmp_path / "bin")
    pipeline = SearchPipeline.load(tmp_path / "bin", rescore_with="int8", rescore_multiplier=2)  # as serve loads it
    assert pipeline.index.rescore_with == "int8" and pipeline.index.rescore_multiplier == 2
    ours = pipeline.search("mail servers", k=3)
    assert len(ours) == 3
    DenseIndex.build(model, texts, show_progress=False).save(tmp_path / "exact")
    with pytest.raises(ConfigError, match=r"^--rescore-with, --rescore-multiplier: options of an int8 or binary index"):
        SearchPipeline.load(tmp_path / "exact", rescore_with="int8", rescore_multiplier=2)


def test_a_binary_index_at_a_dimension_not_a_multiple_of_8_is_refused_before_any_passage_is_encoded(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    import densepass.pipelines.indexing as indexing
    from densepass.cli import main

    def encode(*args, **kwargs):
        raise AssertionError("the corpus was encoded before the refusal")

    monkeypatch.setattr(indexing, "encode_sharded", encode)
    argv = ["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(tmp_path / "bin")]
    assert main([*argv, "--embedding-precision", "binary", "--dim", "12"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == "densepass: error: binary codes pack 8 dimensions to a byte: 12 is not a multiple of 8 (--dim)"
    assert not (tmp_path / "bin").exists()


@pytest.mark.filterwarnings("ignore:.*not trained at")
def test_a_binary_ivf_index_of_a_small_corpus_is_built_on_the_command_line(tiny_beir, tiny_model_dir, tmp_path):
    """``--embedding-precision binary --kind faiss-ivfpq`` (binary-ivf) has no product quantiser: 40 passages were
    refused with the IVF-PQ's "needs at least 256 passages", which the Python API builds."""
    from densepass.cli import main

    out = tmp_path / "bin"
    argv = ["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(out)]
    assert main([*argv, "--embedding-precision", "binary", "--kind", "faiss-ivfpq"]) == 0
    assert json.loads((out / "manifest.json").read_text())["kind"] == "binary-ivf"
    assert main([*argv[:-1], str(tmp_path / "pq"), "--kind", "faiss-ivfpq"]) == 2  # float IVF-PQ: still refused


def test_a_binary_index_file_damaged_under_a_matching_manifest_is_one_line(model, tmp_path):
    from densepass.io import write_manifest

    index = built(model, "binary-flat", vectors(N, 13))
    index.save(tmp_path / "idx")
    bits = tmp_path / "idx" / "binary.index"
    original = bits.read_bytes()
    facts = {k: v for k, v in json.loads((tmp_path / "idx" / "manifest.json").read_text()).items() if k != "files"}
    variants = {
        "truncated": original[: len(original) // 2],
        "empty": b"",
        "header": original[:8] + (2**40).to_bytes(8, "little") + original[16:],
        "garbage": bytes(range(256)) * (len(original) // 256 + 1),
    }
    for data in variants.values():
        bits.write_bytes(data)
        write_manifest(tmp_path / "idx", **facts)  # the manifest rewritten to match: only reading the file can tell
        with pytest.raises(DataError, match=r"binary\.index does not load as a FAISS binary index \(damaged\?\)"):
            load_index(tmp_path / "idx")


@pytest.mark.parametrize("kind", ["binary-flat", "binary-hnsw", "int8-flat"])
def test_an_add_that_fails_leaves_a_compact_index_as_it_was(model, kind):
    """A repeated id or a NaN embedding is refused before the binary index, the codes or the passages change: the
    binary index used to take the new bits first, leaving its rows one past the passages for good."""
    x, more = vectors(20, 21), vectors(3, 22)
    index = built(model, kind, x, rescore_multiplier=100)  # float re-scoring of every passage: exact search
    bad = more.copy()
    bad[1, 3] = np.nan
    for records, embeddings, message in [
        ([{"id": "3", "text": "again"}, {"id": "new", "text": "new"}], more[:2], "duplicate passage id '3'"),
        ([{"id": f"n{i}", "text": "n"} for i in range(3)], bad, "the embedding of passage 'n1' holds NaN or infinity"),
    ]:
        with pytest.raises(DataError, match=message):
            index.add_embeddings(records, embeddings)
        assert len(index.passages) == len(index.embeddings) == len(index.codes) == 20
        assert index.bits is None or index.bits.ntotal == 20
    index.add_embeddings([{"id": f"n{i}", "text": "n"} for i in range(3)], more)
    assert len(index.codes) == 23 and (index.bits is None or index.bits.ntotal == 23)
    queries = np.concatenate([more, x[:2]])
    every = np.concatenate([x, more])
    want = np.argsort(-(queries @ every.T), axis=1, kind="stable")[:, :5]
    np.testing.assert_array_equal(index.search(queries, k=5).rows, want)
