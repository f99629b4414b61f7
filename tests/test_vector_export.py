"""A dense index's embeddings for other stores: NumPy and Arrow from the Python API, and ``densepass export INDEX
--to qdrant`` into Qdrant's embedded mode, whose collection answers 100 queries with the index's top 10."""

from __future__ import annotations

import random

import numpy as np
import pytest

from conftest import WORDS, run_densepass
from densepass.config import BiEncoderConfig
from densepass.errors import ConfigError, DataError
from densepass.index.base import load_index
from densepass.index.bm25 import BM25Index
from densepass.index.dense import DenseIndex
from densepass.models.biencoder import BiEncoder
from densepass.pipelines.vector_export import export_to_qdrant, point_id

pytest.importorskip("qdrant_client")


def passages(n: int = 300, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [
        {"id": f"doc-{i}", "title": f"t{i}", "text": " ".join(rng.choice(WORDS) for _ in range(12))} for i in range(n)
    ]


def build(tiny_model_dir, root, normalize: bool):
    model = BiEncoder.from_pretrained(str(tiny_model_dir), BiEncoderConfig(normalize=normalize, passage_max_length=32))
    model.save(root / "model")
    model = BiEncoder.from_pretrained(str(root / "model"))
    index = DenseIndex.build(model, passages(), show_progress=False)
    index.save(root / "index")
    return root, model, index


@pytest.fixture(scope="module")
def saved_index(tiny_model_dir, tmp_path_factory):
    return build(tiny_model_dir, tmp_path_factory.mktemp("cosine"), normalize=True)


@pytest.fixture(scope="module", params=[True, False], ids=["cosine", "dot"])
def either_index(request, saved_index, tiny_model_dir, tmp_path_factory):
    return saved_index if request.param else build(tiny_model_dir, tmp_path_factory.mktemp("dot"), normalize=False)


def test_numpy_and_arrow_hold_the_index_vectors_ids_and_texts(saved_index):
    _, _, index = saved_index
    ids, vectors = index.to_numpy()
    assert ids == [f"doc-{i}" for i in range(300)] and vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors, index.embeddings)
    table = index.to_arrow()
    assert table.column_names == ["id", "title", "text", "embedding"] and table.num_rows == 300
    assert table.column("id").to_pylist() == ids and table.column("title")[5].as_py() == "t5"
    assert table.column("text").to_pylist() == list(index.passages.texts)
    np.testing.assert_array_equal(np.array(table.column("embedding").to_pylist(), dtype=np.float32), vectors)
    assert index.to_arrow(texts=False).column_names == ["id", "embedding"]


def test_embedded_qdrant_returns_the_index_top_10_for_100_queries(either_index, tmp_path):
    from qdrant_client import QdrantClient, models

    root, model, index = either_index
    done = export_to_qdrant(root / "index", str(tmp_path / "qdrant"), "passages", batch_size=64, show_progress=False)
    normalize = model.config.normalize
    assert (done.points, done.dim, done.distance) == (300, model.dim, "Cosine" if normalize else "Dot")
    rng = random.Random(1)
    queries = [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(100)]
    expected = load_index(root / "index").search(queries, k=10)
    vectors = model.encode_queries(queries, show_progress=False)
    client = QdrantClient(path=str(tmp_path / "qdrant"))
    try:
        requests = [models.QueryRequest(query=v.tolist(), limit=10, with_payload=True) for v in vectors]
        answers = client.query_batch_points("passages", requests)
        info = client.get_collection("passages")
    finally:
        client.close()
    assert info.points_count == 300
    for i, answer in enumerate(answers):
        got = [p.payload["passage_id"] for p in answer.points]
        assert got == expected.ids(i), i
        assert [p.id for p in answer.points] == [point_id(pid) for pid in got]
        np.testing.assert_allclose([p.score for p in answer.points], expected.scores[i], rtol=1e-4, atol=1e-5)
    payload = answers[0].points[0].payload
    row = index.passages.position(payload["passage_id"])
    assert payload["title"] == index.passages.titles[row] and payload["text"] == index.passages.texts[row]


def test_an_existing_collection_is_refused_without_force(saved_index, tmp_path):
    root, _, _ = saved_index
    target = str(tmp_path / "qdrant")
    export_to_qdrant(root / "index", target, "c", texts=False, show_progress=False)
    with pytest.raises(ConfigError, match="collection 'c' exists at .*--force replaces it"):
        export_to_qdrant(root / "index", target, "c", show_progress=False)
    default = export_to_qdrant(root / "index", target, force=True, show_progress=False)
    assert default.collection == "index" and default.points == 300  # the index folder's name


def test_bad_targets_and_indexes_are_one_line_before_anything_is_written(saved_index, tmp_path):
    root, _, _ = saved_index
    mine = tmp_path / "notes"
    mine.mkdir()
    (mine / "todo.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not a Qdrant storage folder"):
        export_to_qdrant(root / "index", str(mine), show_progress=False)
    assert [p.name for p in mine.iterdir()] == ["todo.txt"]
    for meta in ('{"user": "my own meta"}', "[]", "not json", '{"collections": {"c": 1}}'):  # a user's meta.json
        (mine / "meta.json").write_text(meta)
        with pytest.raises(ConfigError, match="holds a meta.json that is not Qdrant's"):
            export_to_qdrant(root / "index", str(mine), force=True, show_progress=False)
        assert sorted(p.name for p in mine.iterdir()) == ["meta.json", "todo.txt"]
        assert (mine / "meta.json").read_text() == meta
    (mine / "meta.json").unlink()
    with pytest.raises(ConfigError, match="inside the index"):
        export_to_qdrant(root / "index", str(root / "index" / "q"), show_progress=False)
    with pytest.raises(ConfigError, match="--api-key is for a Qdrant server"):
        export_to_qdrant(root / "index", str(tmp_path / "q"), api_key="k", show_progress=False)
    with pytest.raises(ConfigError, match="collection name"):
        export_to_qdrant(root / "index", str(tmp_path / "q"), "a/b", show_progress=False)
    BM25Index.build(["tar archives", "vlc plays"]).save(tmp_path / "bm25")
    with pytest.raises(DataError, match="is a bm25 index: --to qdrant exports dense indexes"):
        export_to_qdrant(tmp_path / "bm25", str(tmp_path / "q"), show_progress=False)
    assert not (tmp_path / "q").exists()
    with pytest.raises(ConfigError, match=r"Qdrant at http://127.0.0.1:9: .*refused"):
        export_to_qdrant(root / "index", "http://127.0.0.1:9", show_progress=False)


def test_the_command_replaces_a_collection_with_force(saved_index, tmp_path):
    root, _, _ = saved_index
    target = tmp_path / "qdrant"
    export_to_qdrant(root / "index", str(target), "p", texts=False, show_progress=False)
    args = ["export", str(root / "index"), "--to", "qdrant", str(target), "--collection", "p", "--force"]
    done = run_densepass(*args, "--batch-size", "100", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "exported 300 points (32-d, Cosine)" in done.stdout and "collection 'p'" in done.stdout


def test_deleted_passages_are_left_out(saved_index):
    _, model, _ = saved_index
    index = DenseIndex.build(model, passages(6), show_progress=False)
    full = index.embeddings.copy()
    index.delete(["doc-1", "doc-4"])
    ids, vectors = index.to_numpy()
    assert ids == ["doc-0", "doc-2", "doc-3", "doc-5"]
    np.testing.assert_array_equal(vectors, full[[0, 2, 3, 5]])
    table = index.to_arrow()
    assert table.column("id").to_pylist() == ids and table.column("title").to_pylist() == ["t0", "t2", "t3", "t5"]
