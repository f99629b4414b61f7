"""The on-disk IVF-PQ index (index.ondisk): filled part by part and merged on disk, it returns exactly the ids and
scores of the same trained index filled in memory in one go; built by two gloo processes under torchrun it equals
one process's build; its lists are memory-mapped read-only from wherever the index was moved; bad options, another
model and shards of another model or corpus are one-line errors before any work."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import run_densepass, save_tiny_bert, write_tiny_beir
from densepass.data import load_dataset
from densepass.errors import ConfigError, DataError
from densepass.index.base import as_corpus, load_index
from densepass.index.faiss_index import load_faiss_index, save_faiss_index
from densepass.index.ondisk import (
    LISTS_FILE,
    TRAINED_FILE,
    IVFPQOptions,
    OnDiskIVFPQIndex,
    build_ondisk_ivfpq,
    fill_part,
    merge_parts,
    open_ondisk,
    sample_rows,
    train_ivfpq,
)
from densepass.index.sharded import ShardedEmbeddings, encoder_fingerprint
from densepass.models.biencoder import BiEncoder

CPU = torch.device("cpu")
DIM = 32  # the tiny BERT's
ROWS = 3000
OPTIONS = IVFPQOptions(lists=16, pq_m=8, train_size=2000, nprobe=4)


@pytest.fixture(autouse=True)
def faiss_one_thread():
    """One FAISS thread: deterministic k-means and light on a shared machine."""
    import faiss

    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(1)
    yield
    faiss.omp_set_num_threads(before)


def unit_vectors(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, DIM))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir) -> BiEncoder:
    return BiEncoder.from_pretrained(str(tiny_model_dir))


def test_lists_filled_part_by_part_and_merged_on_disk_equal_one_in_memory_fill(tmp_path):
    import faiss

    passages, queries = unit_vectors(ROWS, 0), unit_vectors(40, 1)
    options = OPTIONS.resolve(ROWS, DIM)
    trained = tmp_path / "trained.index"
    save_faiss_index(train_ivfpq(passages[sample_rows(ROWS, options.train_size, options.seed)], options), trained)
    np.save(tmp_path / "passages.npy", passages)
    mapped = np.load(tmp_path / "passages.npy", mmap_mode="r")  # each part read from a memory map, block by block
    parts = []
    for i, (start, end) in enumerate([(0, 1000), (1000, 1100), (1100, ROWS)]):
        parts.append(tmp_path / f"part{i}.index")
        fill_part(trained, mapped[start:end], start, parts[-1], block=256)
    (tmp_path / "built").mkdir()
    merge_parts(trained, parts, tmp_path / "built")
    moved = (tmp_path / "built").rename(tmp_path / "moved")  # its lists are found beside it wherever it goes
    ondisk = open_ondisk(moved)

    lists = faiss.downcast_InvertedLists(faiss.extract_index_ivf(ondisk).invlists)
    assert isinstance(lists, faiss.OnDiskInvertedLists) and lists.read_only
    assert lists.filename == str(moved / LISTS_FILE) and ondisk.ntotal == ROWS
    reference = load_faiss_index(trained)
    reference.add(passages)  # in memory, in one go: ids are the rows
    for nprobe in (1, 4, 16):
        reference.nprobe = ondisk.nprobe = nprobe
        ref_scores, ref_rows = reference.search(queries, 10)
        scores, rows = ondisk.search(queries, 10)
        np.testing.assert_array_equal(rows, ref_rows)
        np.testing.assert_array_equal(scores, ref_scores)
    assert (rows >= 0).all() and len(np.unique(rows)) > 100  # real, varied hits


def _build(model, tmp_path, options=OPTIONS, content=None, **kwargs) -> OnDiskIVFPQIndex:
    """The index of ROWS random unit vectors standing for the model's embeddings of ROWS passages."""
    shards = ShardedEmbeddings.whole(unit_vectors(ROWS, 0), block=500)
    shards.content = content
    corpus = as_corpus([f"passage {i}" for i in range(ROWS)])
    return build_ondisk_ivfpq(model, shards, corpus, tmp_path / "work", options, device=CPU, **kwargs)


def test_a_saved_index_searches_like_its_trained_index_filled_in_memory(tiny_model, tmp_path):
    index = _build(tiny_model, tmp_path)
    queries = unit_vectors(30, 1)
    with pytest.raises(ConfigError, match="save the index first"):
        index.search(queries, k=5)
    reference = load_faiss_index(tmp_path / "work" / TRAINED_FILE)
    reference.add(unit_vectors(ROWS, 0))
    index.save(tmp_path / "index")
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["kind"] == "faiss-ivfpq-disk" and manifest["options"]["lists"] == 16
    assert manifest["model"]["path"] == tiny_model.source and set(manifest["files"]) >= {LISTS_FILE, "faiss.index"}

    for searched, nprobe in ((index, 4), (load_index(tmp_path / "index", model=tiny_model, nprobe=9), 9)):
        reference.nprobe = nprobe
        ref_scores, ref_rows = reference.search(queries, 7)
        results = searched.search(queries, k=7)
        np.testing.assert_array_equal(results.rows, ref_rows)
        np.testing.assert_array_equal(results.scores, ref_scores)
        assert results.ids(0) == [str(r) for r in ref_rows[0]]
    with pytest.raises(ConfigError, match="takes no more passages"):
        index.add(["one more"])


def test_an_index_loaded_with_another_model_is_refused(tiny_model, tmp_path):
    _build(tiny_model, tmp_path, IVFPQOptions(lists=4, pq_m=8, pq_bits=4, train_size=500)).save(tmp_path / "index")
    other = BiEncoder.from_pretrained(str(save_tiny_bert(tmp_path / "other-model", seed=1)))
    with pytest.raises(ConfigError, match="was built with another model") as err:
        load_index(tmp_path / "index", model=other)
    assert "\n" not in str(err.value)


def test_shards_of_another_model_or_corpus_are_refused(tiny_model, tmp_path):
    fingerprints = {"model": encoder_fingerprint(tiny_model, "fp32"), "corpus": "f" * 32}
    options = dict(corpus_fingerprint="f" * 32, precision="fp32")
    for what in ("model", "corpus"):
        with pytest.raises(DataError, match=f"encoded with another {what}"):
            _build(tiny_model, tmp_path, content={**fingerprints, what: "0" * 32}, **options)
        assert not (tmp_path / "work" / TRAINED_FILE).exists()  # refused before training
    assert _build(tiny_model, tmp_path, content=fingerprints, **options).encoder_fingerprint == fingerprints["model"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(nprobe=0), "nprobe must be a positive integer, got 0"),
        (dict(nprobe=-3), "nprobe must be a positive integer"),
        (dict(train_size=0), "train_size must be a positive integer, got 0"),
        (dict(lists=0), "lists must be a positive integer"),
        (dict(pq_bits=17), "pq_bits must be between 1 and 16"),
    ],
)
def test_bad_options_are_one_line_errors(options, message):
    with pytest.raises(ConfigError, match=message) as err:
        IVFPQOptions(**options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("options", "rows", "message"),
    [
        (dict(lists=100, train_size=50), ROWS, "100 inverted lists need at least as many training rows"),
        (dict(lists=100), 60, "100 inverted lists need at least as many training rows, but the sample has 60"),
        (dict(lists=2), 60, "8-bit product quantisation trains 256 centroids"),
        (dict(pq_m=7), ROWS, "pq_m=7 must divide the embedding dimension 32"),
    ],
)
def test_options_that_cannot_be_trained_are_one_line_errors(options, rows, message):
    with pytest.raises(ConfigError, match=message) as err:
        IVFPQOptions(**options).resolve(rows, DIM)
    assert "\n" not in str(err.value)


def test_default_options_follow_the_corpus_size():
    assert IVFPQOptions().resolve(1_000_000, 384) == IVFPQOptions(lists=4000, pq_m=96, train_size=256_000)
    assert IVFPQOptions().resolve(ROWS, DIM) == IVFPQOptions(lists=76, pq_m=8, train_size=ROWS)
    assert IVFPQOptions(train_size=390).resolve(ROWS, DIM).lists == 10  # 39 training rows per list at least


def test_bad_options_fail_before_the_corpus_is_encoded(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from densepass.cli import main

    beir = write_tiny_beir(tmp_path / "beir", n_passages=60)
    monkeypatch.chdir(tmp_path)
    args = ["index", str(beir), "--model", str(tiny_model_dir), "--kind", "faiss-ivfpq-disk", "--output", "idx"]
    assert main([*args, "--ivf-lists", "100"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (  # after the model's loading bar
        "densepass: error: 100 inverted lists need at least as many training rows, but the sample has 60 "
        "(60 passages): use fewer lists or a larger train_size"
    )
    assert not list(tmp_path.glob(".idx.encoding/rows-*")) and not (tmp_path / "idx").exists()


def test_a_loaded_index_refuses_a_bad_nprobe_before_loading_its_model(tiny_model, tmp_path, monkeypatch):
    _build(tiny_model, tmp_path, IVFPQOptions(lists=4, pq_m=8, pq_bits=4, train_size=500)).save(tmp_path / "index")
    monkeypatch.setattr(BiEncoder, "from_pretrained", lambda *a, **k: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match="nprobe must be a positive integer, got 0"):
        load_index(tmp_path / "index", nprobe=0)


@pytest.mark.timeout(600)
def test_an_index_built_under_torchrun_equals_one_process_build(tiny_model_dir, tmp_path, monkeypatch, capsys):
    from densepass.cli import main

    beir = write_tiny_beir(tmp_path / "beir60", n_passages=60)
    index = ["index", str(beir), "--model", str(tiny_model_dir), "--kind", "faiss-ivfpq-disk", "--shard-size", "8"]
    index += ["--ivf-lists", "2", "--pq-m", "8", "--pq-bits", "4", "--nprobe", "1"]  # 60 passages: 16 PQ centroids
    one = run_densepass(*index, "--output", "index1", cwd=tmp_path)
    assert one.returncode == 0, one.stderr
    two = run_densepass(*index, "--output", "index2", cwd=tmp_path, processes=2)  # 4 blocks of 8 rows each
    assert two.returncode == 0, two.stderr
    assert two.stdout.count("indexed 60 passages") == 1  # rank 0 alone reports (and writes)
    assert not list(tmp_path.glob(".index*.encoding"))
    for name in (LISTS_FILE, "passages.jsonl"):
        assert (tmp_path / "index1" / name).read_bytes() == (tmp_path / "index2" / name).read_bytes()

    dataset = load_dataset(str(beir))
    queries = [dataset.queries[q] for q in sorted(dataset.queries)]
    torch.set_num_threads(1)
    first, second = load_index(tmp_path / "index1", nprobe=2), load_index(tmp_path / "index2", nprobe=2)
    assert first.nprobe == 2 and len(first) == 60
    got, expected = second.search(queries, k=10), first.search(queries, k=10)
    np.testing.assert_array_equal(got.rows, expected.rows)
    np.testing.assert_array_equal(got.scores, expected.scores)
    assert (got.rows >= 0).all()  # 2 lists of 60 passages: both probed, every passage is a candidate

    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(["search", "index2", queries[0], "--nprobe", "2", "--k", "3"]) == 0
    assert expected.ids(0)[0] in capsys.readouterr().out
    assert main(["search", "index2", queries[0], "--search-precision", "int8"]) == 2
    assert "--search-precision is an option of exact indexes" in capsys.readouterr().err
    assert main(["index", str(beir), "--kind", "bm25", "--output", "bm25"]) == 0
    assert main(["search", "bm25", queries[0], "--nprobe", "2"]) == 2
    assert "--nprobe is an option of faiss-ivfpq-disk indexes; bm25 is a bm25 index" in capsys.readouterr().err


def test_an_upsert_whose_append_fails_keeps_the_passage_it_would_replace(tiny_model, tmp_path):
    """``upsert_encoded`` tombstoned the old row before the append ran: an append that failed ("save the index
    first", a NaN embedding) left the index without the old passage and without the new one."""
    from densepass.index.base import records_corpus

    index = _build(tiny_model, tmp_path)
    replace = records_corpus([{"id": "7", "text": "passage 7, again"}])
    with pytest.raises(ConfigError, match="save the index first"):
        index.upsert_encoded(replace, unit_vectors(1, 5))
    assert index.live_position("7") == 7 and not index.deleted.any() and len(index) == ROWS
    index.save(tmp_path / "index")
    bad = unit_vectors(1, 5)
    bad[0, 2] = np.nan
    with pytest.raises(DataError, match="the embedding of passage '7' holds NaN or infinity"):
        index.upsert_encoded(replace, bad)
    assert index.live_position("7") == 7 and not index.deleted.any() and len(index) == ROWS
    index.upsert_encoded(replace, unit_vectors(1, 5))
    assert index.live_position("7") == ROWS and index.deleted.sum() == 1 and len(index) == ROWS
