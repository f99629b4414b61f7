"""A living index (issue 53): random sequences of add / delete / upsert / search / compact / save-load, per index
kind, against a brute-force reference over the live passages; deleted ids never come back; saved updates are
versions whose manifest is swapped last (index.living)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from densepass.errors import DensepassError
from densepass.index import BM25Index, ColbertIndex, DenseIndex, HybridIndex, SpladeIndex, load_index
from densepass.index.base import DELETED_ID
from densepass.index.binary import COMPACT_KINDS, CompactIndex
from densepass.index.living import index_version, save_version, update_index

CPU = torch.device("cpu")
WORDS = "audio video editor kernel driver printer music player browser database compiler shell backup".split()
FAST = settings(
    max_examples=6, stateful_step_count=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True
)


@pytest.fixture(scope="module")
def biencoder(tiny_model_dir):
    from densepass.models.biencoder import BiEncoder

    return BiEncoder.from_pretrained(str(tiny_model_dir))


@pytest.fixture(scope="module")
def splade(tiny_model_dir):
    from densepass.models.splade import SpladeEncoder

    return SpladeEncoder.from_pretrained(str(tiny_model_dir), head_bias=-0.35)


@pytest.fixture(scope="module")
def colbert(tiny_model_dir):
    from densepass.models.colbert import ColBERT

    torch.manual_seed(0)
    return ColBERT.from_pretrained(str(tiny_model_dir))


texts = st.lists(st.sampled_from(WORDS), min_size=1, max_size=4).map(" ".join)


# ---- vector kinds: ids + vectors, a brute-force inner product as the reference ----------------------------


def brute_force(vectors: dict[str, np.ndarray], order: list[str], queries: np.ndarray, k: int) -> list[list[str]]:
    """Top-k ids of each query by inner product over ``vectors`` (ties: earlier in ``order`` first)."""
    matrix = np.stack([vectors[pid] for pid in order])
    scores = queries @ matrix.T
    return [[order[j] for j in np.lexsort((np.arange(len(order)), -row))[:k]] for row in scores]


class VectorIndexMachine(RuleBasedStateMachine):
    """A DenseIndex of one kind fed vectors (``add_embeddings`` / ``upsert_embeddings``), and the live vectors."""

    def __init__(self, model, kind: str, directory: Path):
        super().__init__()
        self.model, self.kind, self.directory = model, kind, directory
        self.rng = np.random.default_rng(0)
        self.next_id = 0
        self.live: dict[str, np.ndarray] = {}
        self.order: list[str] = []  # live ids in row order (the index's tie-break)
        self.deleted: set[str] = set()
        self.saved = False

    def vectors(self, n: int) -> np.ndarray:
        x = self.rng.standard_normal((n, self.model.dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    def new_ids(self, n: int) -> list[str]:
        ids = [f"p{self.next_id + i}" for i in range(n)]
        self.next_id += n
        return ids

    @initialize(n=st.integers(20, 40))
    def build(self, n):
        n = 300 if self.kind == "faiss-ivfpq" else n  # its product quantiser trains 256 codes
        n = 80 if self.kind == "binary-ivf" else n  # two lists of at least 39 passages, both probed: exact
        ids, x = self.new_ids(n), self.vectors(n)
        options = {"pq_m": 8, "ivf_lists": 1} if self.kind == "faiss-ivfpq" else {}
        if self.kind in COMPACT_KINDS:  # every passage's code a candidate, re-scored in float: exact
            options = {"ivf_lists": 2} if self.kind == "binary-ivf" else {}
            self.index = CompactIndex(self.model, self.kind, "float", 1000, show_progress=False, device=CPU, **options)
        else:
            self.index = DenseIndex(self.model, self.kind, show_progress=False, device=CPU, **options)
        self.index.add_embeddings([{"id": i, "text": i} for i in ids], x)
        self.live.update(zip(ids, x))
        self.order += ids

    @rule(n=st.integers(1, 5))
    def add(self, n):
        ids, x = self.new_ids(n), self.vectors(n)
        self.index.add_embeddings([{"id": i, "text": i} for i in ids], x)
        self.live.update(zip(ids, x))
        self.order += ids

    @precondition(lambda self: len(self.live) > 3)
    @rule(data=st.data())
    def delete(self, data):
        ids = data.draw(st.lists(st.sampled_from(self.order), min_size=1, max_size=len(self.order) - 2, unique=True))
        self.index.delete(ids)
        for pid in ids:
            del self.live[pid]
            self.order.remove(pid)
        self.deleted |= set(ids)

    @rule(data=st.data(), new=st.integers(0, 3))
    def upsert(self, data, new):
        old = data.draw(st.lists(st.sampled_from(self.order), max_size=3, unique=True))
        ids = old + self.new_ids(new)
        if not ids:
            return
        x = self.vectors(len(ids))
        self.index.upsert_embeddings([{"id": i, "text": i} for i in ids], x)
        for pid, vector in zip(ids, x):
            if pid in self.live:
                self.order.remove(pid)
            self.live[pid] = vector
            self.order.append(pid)
            self.deleted.discard(pid)

    @rule()
    def compact(self):
        self.index.compact()
        assert not self.index.deleted.any() and len(self.index.passages) == len(self.live)

    @rule()
    def save_and_load(self):
        if self.saved:
            save_version(self.index, self.directory)
        else:
            self.index.save(self.directory)
            self.saved = True
        self.index = load_index(self.directory, model=self.model, device=CPU)

    @invariant()
    def searches_find_the_live_passages(self):
        if not hasattr(self, "index"):
            return
        assert len(self.index) == len(self.live)
        k = min(7, len(self.live) + 2)
        queries = np.stack([self.live[pid] for pid in self.order[-2:]] + [self.vectors(1)[0]])
        found = [self.index.search(queries, k=k).ids(i) for i in range(len(queries))]
        for ids in found:
            assert not set(ids) & self.deleted and set(ids) <= set(self.live)
        expected = brute_force(self.live, self.order, queries, k)
        if self.kind in ("exact", "faiss-flat", "binary-flat", "binary-ivf", "int8-flat"):
            assert found == expected
        else:  # approximate: the full count, and each of the last upserted passages finds itself
            assert [len(ids) for ids in found] == [min(k, len(self.live))] * len(queries)
            if self.kind == "faiss-hnsw":
                assert [ids[0] for ids in found[:2]] == self.order[-2:]


@pytest.mark.parametrize(
    "kind",
    ["exact", "faiss-flat", "faiss-hnsw", "faiss-ivfpq", "binary-flat", "binary-hnsw", "binary-ivf", "int8-flat"],
)
def test_random_updates_of_a_vector_index_match_brute_force(biencoder, tmp_path_factory, kind):
    run_state_machine_as_test(
        lambda: VectorIndexMachine(biencoder, kind, tmp_path_factory.mktemp(kind) / "index"), settings=FAST
    )


# ---- text kinds: ids + texts encoded by the index (or BM25), a fresh index of the live passages as reference ---


def fresh(kind: str, models: dict, records: list[dict]):
    """A new index of ``kind`` over ``records`` (the reference: what a rebuild from the live passages gives)."""
    if kind == "bm25":
        return BM25Index.build(records)
    if kind == "splade":
        return SpladeIndex.build(models["splade"], records, device=CPU)
    if kind == "colbert":
        return ColbertIndex.build(models["colbert"], records, device=CPU, centroids=4)
    if kind == "exact":
        return DenseIndex.build(models["biencoder"], records, show_progress=False, device=CPU)
    return HybridIndex(fresh("exact", models, records), fresh("bm25", models, records))


def ids_of(index, queries: list[str], k: int, **options) -> list[list[str]]:
    results = index.search(queries, k=k, **options)
    return [results.ids(i) for i in range(len(queries))]


def assert_top_k_up_to_near_ties(index, reference, queries: list[str], k: int, atol: float = 1e-5, **options):
    """``index``'s top k of each query is a top k of ``reference`` (a fresh index of the live passages): each hit
    has its reference score, and the scores are the reference's best k (near-ties, which another batch's float
    rounding may order either way, may trade places)."""
    found, full = index.search(queries, k=k, **options), reference.search(queries, k=len(reference), **options)
    for i in range(len(queries)):
        expected = dict(full.hits(i))
        got = found.hits(i)
        assert len(got) == min(k, len(expected))
        np.testing.assert_allclose([s for _, s in got], [expected[pid] for pid, _ in got], rtol=0, atol=atol)
        np.testing.assert_allclose([s for _, s in got], [s for _, s in full.hits(i)[: len(got)]], rtol=0, atol=atol)


class TextIndexMachine(RuleBasedStateMachine):
    """An index that encodes its passages (or BM25), fed records; the live records in row order."""

    def __init__(self, kind: str, models: dict, directory: Path):
        super().__init__()
        self.kind, self.models, self.directory = kind, models, directory
        self.next_id = 0
        self.live: dict[str, str] = {}
        self.deleted: set[str] = set()
        self.saved = False
        self.compacted = True  # no tombstone yet: BM25's statistics are those of a fresh index

    def records(self, ids: list[str], words: list[str]) -> list[dict]:
        return [{"id": pid, "text": text} for pid, text in zip(ids, words)]

    def new_ids(self, n: int) -> list[str]:
        ids = [f"p{self.next_id + i}" for i in range(n)]
        self.next_id += n
        return ids

    @initialize(words=st.lists(texts, min_size=6, max_size=12))
    def build(self, words):
        ids = self.new_ids(len(words))
        self.index = fresh(self.kind, self.models, self.records(ids, words))
        self.live.update(zip(ids, words))

    @rule(words=st.lists(texts, min_size=1, max_size=3))
    def add(self, words):
        ids = self.new_ids(len(words))
        self.index.add(self.records(ids, words))
        self.live.update(zip(ids, words))

    @precondition(lambda self: len(self.live) > 3)
    @rule(data=st.data())
    def delete(self, data):
        ids = data.draw(
            st.lists(st.sampled_from(list(self.live)), min_size=1, max_size=len(self.live) - 2, unique=True)
        )
        self.index.delete(ids)
        for pid in ids:
            del self.live[pid]
        self.deleted |= set(ids)
        self.compacted = False

    @rule(data=st.data(), words=st.lists(texts, min_size=1, max_size=3))
    def upsert(self, data, words):
        old = data.draw(st.lists(st.sampled_from(list(self.live)), max_size=len(words), unique=True))
        ids = old + self.new_ids(len(words) - len(old))
        self.index.upsert(self.records(ids, words))
        for pid, text in zip(ids, words):
            self.live.pop(pid, None)
            self.live[pid] = text  # appended: the row order of the index
            self.deleted.discard(pid)
        self.compacted = self.compacted and not old

    @rule()
    def compact(self):
        self.index.compact()
        self.compacted = True

    @rule()
    def save_and_load(self):
        if self.saved:
            save_version(self.index, self.directory)
        else:
            self.index.save(self.directory)
            self.saved = True
        model = {"bm25": None, "splade": "splade", "colbert": "colbert"}.get(self.kind, "biencoder")
        options = {} if model is None else {"device": CPU, "model": self.models[model]}
        self.index = load_index(self.directory, **options)

    @invariant()
    def searches_find_the_live_passages(self):
        if not hasattr(self, "index"):
            return
        assert len(self.index) == len(self.live)
        assert [p for p in self.index.passages.ids if not p.startswith(DELETED_ID)] == list(self.live)
        queries = [*list(self.live.values())[-2:], "kernel driver"]
        k = min(5, len(self.live) + 1)
        options = {"exhaustive": True} if self.kind == "colbert" else {}
        found = ids_of(self.index, queries, k, **options)
        for ids in found:
            assert not set(ids) & self.deleted and set(ids) <= set(self.live)
        if self.kind == "colbert":  # the pruned search too never returns a deleted passage
            assert not {p for ids in ids_of(self.index, queries, k) for p in ids} & self.deleted
        if self.kind in ("bm25", "hybrid") and not self.compacted:
            return  # deleted passages' terms still count in BM25's statistics until compact (as in Lucene)
        reference = fresh(self.kind, self.models, self.records(list(self.live), list(self.live.values())))
        if self.kind == "hybrid":  # fused ranks: equal when the parts' rankings are (no near-ties in BM25 here)
            assert found == ids_of(reference, queries, k)
        else:
            assert_top_k_up_to_near_ties(self.index, reference, queries, k, **options)


@pytest.mark.parametrize("kind", ["bm25", "exact", "splade", "colbert", "hybrid"])
def test_random_updates_of_a_text_index_match_a_fresh_index(biencoder, splade, colbert, tmp_path_factory, kind):
    models = {"biencoder": biencoder, "splade": splade, "colbert": colbert}
    run_state_machine_as_test(
        lambda: TextIndexMachine(kind, models, tmp_path_factory.mktemp(kind) / "index"), settings=FAST
    )


# ---- saved updates ----------------------------------------------------------------------------------------------


def bm25_folder(tmp_path: Path) -> Path:
    records = [{"id": str(i), "text": t} for i, t in enumerate(["tar archiver", "kernel driver", "audio editor"])]
    return BM25Index.build(records).save(tmp_path / "index")


def test_an_update_is_a_new_version_named_by_the_manifest_and_old_versions_go(tmp_path):
    folder = bm25_folder(tmp_path)
    assert index_version(folder) == 0
    update_index(folder, delete=["0"])
    update_index(folder, upsert=[{"id": "0", "text": "tar again"}])
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["version"] == 2 and manifest["current"] == "v000002" and manifest["kind"] == "bm25"
    assert list(manifest["files"]) == ["v000002/manifest.json"]
    assert not (folder / "passages.jsonl").exists()  # version 0's files: neither current nor previous
    assert (folder / "v000001").is_dir()  # the previous version stays (a service may still read it)
    update_index(folder, compact=True)
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("v")) == ["v000002", "v000003"]
    index = load_index(folder)
    assert index.version == 3 and index.passages.ids == ["1", "2", "0"]
    assert index.search(["tar"], k=3).ids(0) == ["0"]
    BM25Index.build(["a new corpus"]).save(folder)  # an updated index is still replaced by a new one
    assert load_index(folder).version == 0


def test_compacting_an_index_without_tombstones_writes_no_version(tmp_path, capsys, monkeypatch):
    from densepass import cli
    from densepass.index import living

    folder = bm25_folder(tmp_path)
    files = sorted(p.relative_to(folder) for p in folder.rglob("*"))
    (folder / ".v000001.k1lledab.tmp").mkdir()  # a killed update's half-written version: removed all the same
    (folder / ".v000001.k1lledab.tmp" / "manifest.json").write_text("{}")
    monkeypatch.setattr(living, "load_index", lambda *a, **k: pytest.fail("the index was loaded"))
    assert cli.main(["index-update", str(folder), "--compact"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("nothing to compact in ") and out.count("\n") == 1
    monkeypatch.undo()
    after = sorted(p.relative_to(folder) for p in folder.rglob("*") if p.name != ".lock")
    assert after == files and index_version(folder) == 0
    assert update_index(folder, compact=True).version == 0 and index_version(folder) == 0  # the Python API
    update_index(folder, delete=["0"])
    update_index(folder, upsert=[{"id": "3", "text": "music player"}])  # version 2, one tombstone
    assert update_index(folder, compact=True).version == 3  # tombstones: compacted into a new version
    assert cli.main(["index-update", str(folder), "--compact"]) == 0 and index_version(folder) == 3


def test_bad_updates_are_one_line_errors_and_change_nothing(tmp_path):
    folder = bm25_folder(tmp_path)
    before = (folder / "manifest.json").read_bytes()
    for bad, message in [
        ({"delete": ["7", "0", "8"]}, "2 of the 3 ids to delete are not in the index"),
        ({"delete": ["0", "0"]}, "1 ids to delete are repeated"),
        ({"delete": ["0"], "upsert": [{"id": "0", "text": "x"}]}, "both deleted and upserted"),
        ({"upsert": ["no ids"]}, "upsert takes {id, title, text} records"),
        ({"upsert": [{"id": "5", "text": "a"}, {"id": "5", "text": "b"}]}, "duplicate passage id '5'"),
        ({}, "nothing to update"),
    ]:
        with pytest.raises(DensepassError, match=message):
            update_index(folder, **bad)
    assert (folder / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".densepass-owned", ".lock", "bm25s", "manifest.json", "passages.jsonl"]
    )


def test_a_kind_whose_search_knows_no_tombstones_refuses_updates_before_loading(tmp_path, monkeypatch):
    from densepass.phrase.index import PhraseIndex

    assert not PhraseIndex.updatable  # its phrase search would return deleted passages
    folder = bm25_folder(tmp_path)
    monkeypatch.setattr(BM25Index, "updatable", False)
    monkeypatch.setattr(BM25Index, "load", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(DensepassError, match="a bm25 index cannot delete or upsert passages"):
        update_index(folder, delete=["0"])


def test_a_tampered_version_is_refused_by_the_manifest(tmp_path):
    folder = bm25_folder(tmp_path)
    update_index(folder, delete=["1"])
    with open(folder / "v000001" / "passages.jsonl", "a") as handle:
        handle.write("\n")
    with pytest.raises(DensepassError, match="not a usable densepass index: passages.jsonl has"):
        load_index(folder)


def test_the_cli_updates_an_index_and_refuses_bad_input_in_one_line(tmp_path):
    from densepass.cli import main

    folder = bm25_folder(tmp_path)
    (tmp_path / "ids.txt").write_text("1\n\n2\n")
    (tmp_path / "up.jsonl").write_text(json.dumps({"_id": "9", "text": "kernel nine"}) + "\n")
    assert (
        main(
            ["index-update", str(folder), "--delete", str(tmp_path / "ids.txt"), "--upsert", str(tmp_path / "up.jsonl")]
        )
        == 0
    )
    assert load_index(folder).search(["kernel"], k=5).ids(0) == ["9"]
    (tmp_path / "unknown.txt").write_text("0\n1\n")
    assert main(["index-update", str(folder), "--delete", str(tmp_path / "unknown.txt")]) == 2
    assert main(["index-update", str(folder), "--compact"]) == 0
    assert len(load_index(folder).passages) == 2


def test_an_ondisk_ivfpq_index_takes_deletes_upserts_and_compaction_like_a_fresh_fill(biencoder, tmp_path):
    from densepass.index.base import as_corpus, records_corpus
    from densepass.index.faiss_index import load_faiss_index
    from densepass.index.ondisk import TRAINED_FILE, IVFPQOptions, build_ondisk_ivfpq
    from densepass.index.sharded import ShardedEmbeddings

    rng = np.random.default_rng(0)

    def unit(n: int) -> np.ndarray:
        x = rng.standard_normal((n, biencoder.dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    vectors = unit(600)
    options = IVFPQOptions(lists=8, pq_m=8, train_size=600, nprobe=8)
    corpus = as_corpus([{"id": f"p{i}", "text": f"passage {i}"} for i in range(600)])
    shards = ShardedEmbeddings.whole(vectors, block=200)
    unsaved = build_ondisk_ivfpq(biencoder, shards, corpus, tmp_path / "work", options, device=CPU)
    unsaved.delete(["p1"])  # (p1 is upserted again below)
    with pytest.raises(DensepassError, match="save the index first"):  # (its first save dropped it in silence)
        unsaved.compact()
    unsaved.save(tmp_path / "index")
    index = load_index(tmp_path / "index", model=biencoder)
    gone = [f"p{i}" for i in range(0, 600, 5)]
    index.delete(gone)
    replaced = [f"p{i}" for i in range(1, 100, 10)]
    new = unit(len(replaced) + 5)
    index.upsert_encoded(records_corpus([{"id": p, "text": "new"} for p in [*replaced, *"abcde"]]), new)
    queries = np.concatenate([new[:3], unit(5)])
    for ids in (index.search(queries, k=10).ids(i) for i in range(len(queries))):
        assert len(ids) == 10 and not set(ids) & set(gone)
    assert [index.search(new[:3], k=1).ids(i)[0] for i in range(3)] == replaced[:3]
    index.compact()
    save_version(index, tmp_path / "index")
    loaded = load_index(tmp_path / "index", model=biencoder)
    live = [i for i in range(600) if f"p{i}" not in gone and f"p{i}" not in replaced]
    assert loaded.version == 1 and loaded.passages.ids == [f"p{i}" for i in live] + [*replaced, *"abcde"]
    reference = load_faiss_index(tmp_path / "work" / TRAINED_FILE)  # the same quantisers, filled in one go
    reference.add(np.concatenate([vectors[live], new]))
    reference.nprobe = 8
    ref_scores, ref_rows = reference.search(queries, 10)
    for searched in (loaded, index):  # the saved version, and the index that wrote it (now reading it)
        results = searched.search(queries, k=10)
        np.testing.assert_array_equal(results.rows, ref_rows)
        np.testing.assert_allclose(results.scores, ref_scores, rtol=0, atol=1e-6)


def test_an_ondisk_ivfpq_save_that_fails_midway_leaves_the_index_in_memory_answering_as_before(
    biencoder, tmp_path, monkeypatch
):
    """A compacting save that fails after the lists were written (a full disk at the manifest) leaves the index in
    memory with its passages and tombstones, matching the lists it searches; a later save then compacts."""
    import errno

    from densepass.index import base
    from densepass.index.base import as_corpus
    from densepass.index.ondisk import IVFPQOptions, build_ondisk_ivfpq
    from densepass.index.sharded import ShardedEmbeddings

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((300, biencoder.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    corpus = as_corpus([{"id": f"p{i}", "text": f"passage {i}"} for i in range(300)])
    options = IVFPQOptions(lists=2, pq_m=8, pq_bits=4, train_size=300, nprobe=2)
    shards = ShardedEmbeddings.whole(vectors, block=300)
    build_ondisk_ivfpq(biencoder, shards, corpus, tmp_path / "work", options, device=CPU).save(tmp_path / "index")
    index = load_index(tmp_path / "index", model=biencoder)
    index.delete([f"p{i}" for i in range(0, 300, 3)])
    index.compact()
    queries = vectors[1:6]
    before = [index.search(queries, k=5).ids(i) for i in range(len(queries))]
    ids, length = list(index.passages.ids), len(index)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(base, "write_manifest", full)
        with pytest.raises(DensepassError, match="no space left"):
            save_version(index, tmp_path / "index")
    assert list(index.passages.ids) == ids and len(index) == length and index.deleted.sum() == 100
    assert [index.search(queries, k=5).ids(i) for i in range(len(queries))] == before
    save_version(index, tmp_path / "index")  # with space again: the compaction is done
    assert len(index.passages) == 200 and not index.deleted.any()
    assert [index.search(queries, k=5).ids(i) for i in range(len(queries))] == before
    assert load_index(tmp_path / "index", model=biencoder).passages.ids == index.passages.ids


def test_an_ondisk_ivfpq_update_reserves_its_lists_file_before_writing_it(biencoder, tmp_path, monkeypatch):
    """An update's lists were written through FAISS's memory map as the file grew, without reserving its blocks: a
    full disk killed the process with SIGBUS halfway through. The file is now sized once, its blocks reserved first
    (a full disk is then one line and the saved version stays the one that loads)."""
    import errno

    from densepass.errors import DiskError
    from densepass.index import ondisk
    from densepass.index.base import as_corpus, records_corpus
    from densepass.index.ondisk import LISTS_FILE, IVFPQOptions, build_ondisk_ivfpq
    from densepass.index.sharded import ShardedEmbeddings

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((400, biencoder.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    corpus = as_corpus([{"id": f"p{i}", "text": f"passage {i}"} for i in range(400)])
    options = IVFPQOptions(lists=4, pq_m=8, train_size=400, nprobe=4)
    shards = ShardedEmbeddings.whole(vectors, block=400)
    build_ondisk_ivfpq(biencoder, shards, corpus, tmp_path / "work", options, device=CPU).save(tmp_path / "index")
    index = load_index(tmp_path / "index", model=biencoder)
    index.delete([f"p{i}" for i in range(0, 400, 7)])
    new = rng.standard_normal((30, biencoder.dim)).astype(np.float32)
    index.upsert_encoded(records_corpus([{"id": f"n{i}", "text": "new"} for i in range(30)]), new)
    index.compact()
    reserved = []
    real = ondisk.reserve_space

    def recorded(path, size=None):
        reserved.append((Path(path).name, size))
        real(path, size)

    def full(path, size=None):
        raise DiskError(f"no space left on device writing {path}", errno.ENOSPC, size)

    with monkeypatch.context() as patch:
        patch.setattr(ondisk, "reserve_space", full)
        with pytest.raises(DiskError, match="no space left"):
            save_version(index, tmp_path / "index")
    assert load_index(tmp_path / "index", model=biencoder).version == 0
    monkeypatch.setattr(ondisk, "reserve_space", recorded)
    save_version(index, tmp_path / "index")
    [(name, size)] = reserved
    written = tmp_path / "index" / "v000001" / LISTS_FILE
    assert name == LISTS_FILE and written.stat().st_size == size  # reserved once, grown no further
    loaded = load_index(tmp_path / "index", model=biencoder)
    assert len(loaded) == 400 - len(range(0, 400, 7)) + 30
    assert loaded.search(new[:3], k=1).ids(0) == index.search(new[:3], k=1).ids(0)


def test_search_with_hybrid_over_an_updated_dense_index_leaves_the_deleted_passages_out(biencoder, tmp_path):
    """``--hybrid`` builds BM25 over the dense index's rows at load time: the tombstoned ones too, which its BM25
    part must leave out as the dense part does (they came back, under their tombstone ids)."""
    from densepass.pipelines.search import SearchPipeline

    words = ["tar archiver", "kernel driver", "audio editor", "kernel module", "music player"]
    index = DenseIndex(biencoder, "exact", show_progress=False, device=CPU)
    index.add([{"id": str(i), "text": t} for i, t in enumerate(words)])
    folder = index.save(tmp_path / "index")
    update_index(folder, delete=["1", "3"])
    for method in ("rrf", "linear"):
        hits = SearchPipeline.load(folder, hybrid=method).search("kernel", k=5)
        assert sorted(hit.id for hit in hits) == ["0", "2", "4"], method


@pytest.mark.parametrize("listed", [np.int64(1), np.array([[1]]), np.array([1.0]), np.array([3]), np.array([-1])])
def test_damaged_tombstones_are_one_line(tmp_path, listed):
    """A ``deleted.npy`` that lists no rows of the index (under a manifest rewritten to match it): one line, also a
    0-d array (it has no length)."""
    from densepass.errors import DataError
    from densepass.index.base import read_tombstones

    np.save(tmp_path / "deleted.npy", listed)
    with pytest.raises(DataError, match="deleted.npy does not list rows of its 3 passages"):
        read_tombstones(tmp_path, 3)
    np.save(tmp_path / "deleted.npy", np.array([2, 0]))
    assert read_tombstones(tmp_path, 3).tolist() == [True, False, True]


def test_a_version_folder_is_refused_as_an_update_or_save_target_and_its_index_still_loads(tmp_path):
    """``DIR/v000002`` holds an index manifest of its own: updating or saving over it rewrote the manifest whose
    digest the parent's records (the parent no longer loaded), and a second update removed the parent's files."""
    from densepass.index.base import check_index_target
    from densepass.index.living import update_saved_index

    folder = bm25_folder(tmp_path)
    update_index(folder, delete=["1"])
    update_index(folder, delete=["2"])
    version = folder / "v000002"
    files = {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    for attempt in (
        lambda: update_index(version, delete=["0"]),
        lambda: update_index(folder / "v000002" / ".." / "v000002", delete=["0"]),
        lambda: update_saved_index(version, None, None, compact=True),
        lambda: save_version(load_index(folder), version),
        lambda: BM25Index.build(["a new corpus"]).save(version),
        lambda: check_index_target(version),
    ):
        with pytest.raises(DensepassError, match="is version v000002 of the updated index .*: update or replace"):
            attempt()
    assert {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} == files
    assert load_index(folder).version == 2 and len(load_index(folder)) == 1
    update_index(folder, delete=["0"], upsert=[{"id": "5", "text": "kernel five"}])  # the parent itself: as before
    assert load_index(folder).search(["kernel"], k=1).ids(0) == ["5"]


def test_a_part_of_a_hybrid_index_is_not_updated_or_replaced_on_its_own(biencoder, tmp_path):
    """``HY/first`` and ``HY/second`` (and ``HY/v000001/first`` once HY is updated) hold index manifests of their
    own: ``densepass index-update HY/first`` or ``index --output HY/second`` used to be accepted and break HY
    (its manifest holds the digests of its parts' files)."""
    from densepass.index.base import check_index_target

    records = [{"id": str(i), "text": t} for i, t in enumerate(["tar archiver", "kernel driver", "audio editor"])]
    folder = HybridIndex(
        DenseIndex.build(biencoder, records, show_progress=False, device=CPU), BM25Index.build(records)
    ).save(tmp_path / "hy")
    parts = [folder / "first", folder / "second"]
    update_index(folder, delete=["1"])
    parts += [folder / "v000001" / "first", folder / "v000001" / "second"]
    files = {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
    for part in parts:
        for attempt in (
            lambda part=part: update_index(part, delete=["0"]),
            lambda part=part: BM25Index.build(["a new corpus"]).save(part),
            lambda part=part: check_index_target(part),
        ):
            with pytest.raises(DensepassError, match=r"is part (v000001/)?(first|second) of the index .*: update or"):
                attempt()
    assert {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()} == files
    assert len(load_index(folder, model=biencoder)) == 2


def test_a_hybrid_add_that_fails_in_either_part_changes_neither(biencoder, monkeypatch):
    """Both parts encode the new passages before either takes them: a failure in the second part used to leave the
    first one a passage longer, and the fused rows of two different corpora."""
    from densepass.errors import DataError

    records = [{"id": str(i), "text": t} for i, t in enumerate(["tar archiver", "kernel driver", "audio editor"])]
    hybrid = HybridIndex(
        BM25Index.build(records), DenseIndex.build(biencoder, records, show_progress=False, device=CPU)
    )
    with pytest.raises(DataError, match="lone surrogate"):
        hybrid.add([{"id": "x", "text": "kernel bad \ud800 text"}])
    with pytest.raises(DataError, match="lone surrogate"):  # BM25 alone too (the save failed on it, not in one line)
        hybrid.first.add([{"id": "x", "text": "kernel bad \ud800 text"}])
    assert hybrid.first.passages.ids == hybrid.second.passages.ids == ["0", "1", "2"]

    def broken(*args, **kwargs):
        raise DataError("the encoder failed")

    monkeypatch.setattr(biencoder, "encode_passages", broken)
    with pytest.raises(DataError, match="the encoder failed"):
        hybrid.add([{"id": "x", "text": "kernel module"}])
    assert hybrid.first.passages.ids == hybrid.second.passages.ids == ["0", "1", "2"]
    monkeypatch.undo()
    hybrid.add([{"id": "x", "text": "kernel module"}])
    assert hybrid.first.passages.ids == hybrid.second.passages.ids == ["0", "1", "2", "x"]
    assert len(hybrid.second.embeddings) == 4 and set(hybrid.search(["kernel"], k=2).ids(0)) == {"1", "x"}


def test_a_compaction_bm25_refuses_leaves_the_index_and_a_hybrid_holding_it_as_they_were(biencoder):
    """BM25 refuses to index passages without a word; the refused compaction used to leave the live passages
    beside the old tombstones and retriever (len() then failed), and a hybrid's dense part already compacted."""
    from densepass.errors import DataError

    records = [{"id": "a", "text": "audio editor"}, {"id": "b", "text": "the"}, {"id": "c", "text": "kernel driver"}]
    bm25 = BM25Index.build(records)
    dense = DenseIndex.build(biencoder, records, show_progress=False, device=CPU)
    hybrid = HybridIndex(dense, BM25Index.build(records))
    bm25_first = HybridIndex(
        BM25Index.build(records), DenseIndex.build(biencoder, records, show_progress=False, device=CPU)
    )
    for index in (bm25, hybrid, bm25_first):
        before = index.search(["kernel driver"], k=3)
        index.delete(["a", "c"])
        with pytest.raises(DataError, match="BM25 has nothing to index"):
            index.compact()
        parts = [index] if index is bm25 else [index.first, index.second]
        for part in parts:
            assert part.passages.ids[1] == "b" and part.deleted.tolist() == [True, False, True]
        assert len(index) == 1 and set(index.search(["kernel driver"], k=3).ids(0)) <= {"b"}
        index.upsert(records[::2])  # the deleted ids come back, and the index searches as before
        assert index.search(["kernel driver"], k=3).ids(0)[0] == before.ids(0)[0]


def test_index_update_takes_the_model_of_an_index_whose_model_moved(tiny_model_dir, tmp_path, capsys):
    """The error said "pass the model", and index-update had no --model (search and serve have one)."""
    import shutil

    from densepass.cli import main

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    records = [{"id": f"p{i}", "text": text} for i, text in enumerate(["tar archiver", "kernel driver", "audio"])]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"_id": r["id"], **r}) + "\n" for r in records))
    assert (
        main(["index", str(tmp_path / "corpus.jsonl"), "--model", str(model), "--output", str(tmp_path / "idx")]) == 0
    )
    model.rename(tmp_path / "moved")
    (tmp_path / "delete.txt").write_text("p1\n")
    update = ["index-update", str(tmp_path / "idx"), "--delete", str(tmp_path / "delete.txt"), "--device", "cpu"]
    capsys.readouterr()
    assert main(update) == 2
    assert "is not there any more; pass the model (--model)" in capsys.readouterr().err
    assert main([*update, "--model", str(tmp_path / "moved")]) == 0
    from densepass.models.load import load_model

    assert len(load_index(tmp_path / "idx", model=load_model(str(tmp_path / "moved")))) == 2
    BM25Index.build(records).save(tmp_path / "bm25")
    assert main(["index-update", str(tmp_path / "bm25"), "--compact", "--model", str(tmp_path / "moved")]) == 2
    assert "--model is the model of a model index" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["bm25", "exact", "splade", "colbert", "hybrid"])
def test_texts_added_after_a_compaction_get_ids_no_passage_holds(biencoder, splade, colbert, kind):
    """Ids of added texts started at the index's length: after deleting "0" and compacting, "1" and "2" are left and
    the next text was named "2" (refused as a duplicate; a delete of the last id then reused it silently)."""
    models = {"biencoder": biencoder, "splade": splade, "colbert": colbert}
    index = fresh(kind, models, ["tar archiver", "kernel driver", "audio editor"])
    index.delete(["0"])
    index.compact()
    index.add(["video player", "music player"])
    assert index.passages.ids == ["1", "2", "3", "4"]
    assert ids_of(index, ["video player"], 1, **({"exhaustive": True} if kind == "colbert" else {})) == [["3"]]


@pytest.mark.parametrize("kind", ["bm25", "exact", "splade", "colbert", "hybrid"])
def test_an_array_of_query_texts_searches_as_a_list_does(biencoder, splade, colbert, kind):
    """``df["query"].values`` (a NumPy array of strings) was taken for query vectors by the dense, SPLADE and ColBERT
    kinds: "could not convert string to float"."""
    models = {"biencoder": biencoder, "splade": splade, "colbert": colbert}
    index = fresh(kind, models, ["tar archiver", "kernel driver", "audio editor"])
    queries = ["kernel", "audio editor"]
    for texts in (np.array(queries), np.array(queries, dtype=object)):
        assert ids_of(index, texts, 2) == ids_of(index, queries, 2)


@pytest.mark.parametrize("name", ["../victim.txt", "/ABSOLUTE", "sub/../../victim.txt", "./../victim.txt"])
def test_an_update_never_deletes_a_file_outside_the_index_its_ownership_list_names(tmp_path, name):
    """The ownership list is not covered by the manifest's digests: an index copied from someone else may name
    any path in it, and cleaning up version 0 after two updates must not delete what lies outside the index."""
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's own file")
    index = tmp_path / "index"
    BM25Index.build(["the tar archiver", "a kernel driver", "an audio editor", "kernel module"]).save(index)
    owned = json.loads((index / ".densepass-owned").read_text())
    (index / ".densepass-owned").write_text(json.dumps([*owned, name.replace("/ABSOLUTE", str(victim))]))
    update_index(index, delete=["1"])
    update_index(index, delete=["2"])  # version 0 is neither current nor previous now: its files go
    assert victim.read_text() == "the user's own file"
    assert load_index(index).search(["kernel"], k=2).ids(0) == ["3"]
    left = [".densepass-owned", ".lock", "manifest.json", "v000001", "v000002"]  # version 0's own files did go
    assert sorted(p.name for p in index.iterdir()) == left


def test_a_save_over_an_index_being_updated_is_refused_and_the_update_lands(tmp_path, monkeypatch):
    """A rebuild (``densepass index --output D``) while ``index-update D`` runs: before, the rebuild landed and the
    update then wrote its version (the old passages) over it, or the rebuild landed between the update's two last
    writes and the index no longer loaded. Both take the directory's lock now: the second is refused in one line."""
    import densepass.index.living as living

    index = tmp_path / "index"
    BM25Index.build(["old tar archiver", "old kernel driver", "old audio editor"]).save(index)
    save_version, refused = living.save_version, []

    def racing(updated, directory):
        with pytest.raises(DensepassError, match="in use") as err:
            BM25Index.build(["fresh one", "fresh two", "fresh three", "fresh four"]).save(directory)
        refused.append(str(err.value))
        return save_version(updated, directory)

    monkeypatch.setattr(living, "save_version", racing)
    update_index(index, delete=["1"])
    assert refused and "\n" not in refused[0]
    loaded = load_index(index)
    assert loaded.version == 1 and loaded.search(["old"], k=3).ids(0) == ["0", "2"]


def test_save_version_refuses_an_index_loaded_before_another_version_was_saved(tmp_path):
    index = tmp_path / "index"
    BM25Index.build(["the tar archiver", "a kernel driver", "an audio editor", "kernel module"]).save(index)
    stale = load_index(index)
    update_index(index, delete=["1"])  # another process's update, after ``stale`` was loaded
    stale.delete(["2"])
    with pytest.raises(DensepassError, match="saved again .* since this index was loaded at version 0"):
        save_version(stale, index)
    assert load_index(index).search(["kernel"], k=3).ids(0) == ["3"]  # the other update is kept
    fresh = load_index(index)
    fresh.delete(["2"])
    assert save_version(fresh, index) == 2 and save_version(fresh, index) == 3  # its own saves: in turn


def test_an_index_saved_as_a_version_folder_of_an_index_not_updated_yet_is_refused(tmp_path):
    """Its first update would have taken the folder for a killed update's version and removed it."""
    index = tmp_path / "index"
    BM25Index.build(["the tar archiver", "a kernel driver", "an audio editor"]).save(index)
    with pytest.raises(DensepassError, match="named as the versions of the index .* choose a path outside it"):
        BM25Index.build(["another index", "of its own"]).save(index / "v000001")
    assert not (index / "v000001").exists()
    update_index(index, delete=["1"])
    assert load_index(index).version == 1
