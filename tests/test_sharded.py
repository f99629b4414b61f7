"""Sharded encoding, search and mining (index.sharded): two gloo processes give exactly one process's
embeddings, search results and hard negatives; an interrupted sharded encode resumes; shards of another
model or corpus are refused; ties are broken by passage row whatever the chunking."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import assert_same_ranking_up_to_ties, run_densepass, save_tiny_bert, write_tiny_beir
from densepass.data import load_dataset, stream_passage_inputs
from densepass.data.dataset import LazyTexts
from densepass.errors import DataError
from densepass.fingerprints import fingerprint_corpus
from densepass.index.exact import exact_search
from densepass.index.sharded import ShardPlan, encode_sharded, shard_path
from densepass.models.biencoder import BiEncoder

CPU = torch.device("cpu")
BLOCK = 8  # 60 passages: 8 blocks, the last one short; two processes take 4 blocks each
K = 12


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _inputs(beir: Path, model: BiEncoder) -> tuple[LazyTexts, str, list[str]]:
    """The corpus's inputs streamed from its file, its fingerprint, and the queries."""
    dataset = load_dataset(str(beir))
    sep = model.tokenizer.sep_token
    texts = stream_passage_inputs(str(beir), None, "beir", sep, len(dataset.corpus))
    return texts, fingerprint_corpus(dataset.corpus), [dataset.queries[q] for q in sorted(dataset.queries)]


def _encode_and_search(model_dir: str, beir: str, directory: str) -> dict[str, np.ndarray]:
    model = BiEncoder.from_pretrained(model_dir)
    texts, fingerprint, queries = _inputs(Path(beir), model)
    shards = encode_sharded(model, texts, directory, fingerprint, block=BLOCK, device=CPU, show_progress=False)
    query_emb = model.encode_queries(queries, device=CPU, show_progress=False)
    scores, rows = shards.search(query_emb, K, device=CPU)
    return {"scores": scores, "rows": rows, "local": np.asarray(shards.local), "start": np.array(shards.start)}


def _worker(rank: int, world: int, port: int, model_dir: str, beir: str, directory: str, out: str, fail_rank: int):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    import densepass.index.embeddings as embeddings

    calls = []
    encode = embeddings.encode_texts

    def counted(*args, **kwargs):
        if rank == fail_rank and calls:
            raise RuntimeError("interrupted after one block")
        calls.append(len(args[1]))
        return encode(*args, **kwargs)

    embeddings.encode_texts = counted
    try:
        result = _encode_and_search(model_dir, beir, directory)
        np.savez(Path(out) / f"rank{rank}.npz", blocks=np.array(len(calls)), **result)
    finally:
        dist.destroy_process_group()


def _spawn(tiny_model_dir, beir, directory, out, fail_rank=-1):
    args = (2, _free_port(), str(tiny_model_dir), str(beir), str(directory), str(out), fail_rank)
    mp.spawn(_worker, args=args, nprocs=2)
    return [dict(np.load(Path(out) / f"rank{r}.npz")) for r in range(2)]


@pytest.fixture
def beir60(tmp_path) -> Path:
    return write_tiny_beir(tmp_path / "beir60", n_passages=60)


def test_two_processes_encode_and_search_exactly_like_one(tiny_model_dir, beir60, tmp_path):
    torch.set_num_threads(1)
    single = _encode_and_search(str(tiny_model_dir), str(beir60), str(tmp_path / "one"))
    ranks = _spawn(tiny_model_dir, beir60, tmp_path / "two", tmp_path)
    for got in ranks:  # every process holds the merged result: same ids, same scores, same order
        np.testing.assert_array_equal(got["rows"], single["rows"])
        np.testing.assert_array_equal(got["scores"], single["scores"])
    assert [int(r["start"]) for r in ranks] == [0, 32] and [len(r["local"]) for r in ranks] == [32, 28]
    np.testing.assert_array_equal(np.concatenate([r["local"] for r in ranks]), single["local"])
    # and the one-process result is plain exact search over the whole corpus (ids exact up to near-ties, scores to
    # rounding: a 32-row shard and the 60-row corpus are multiplied in different blockings)
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    _, _, queries = _inputs(beir60, model)
    query_emb = model.encode_queries(queries, device=CPU, show_progress=False)
    ref_scores, ref_rows = exact_search(query_emb, single["local"], K, device=CPU)
    assert_same_ranking_up_to_ties(single["rows"], single["scores"], ref_rows, ref_scores, atol=1e-6)


def test_an_interrupted_sharded_encode_resumes_where_it_stopped(tiny_model_dir, beir60, tmp_path):
    torch.set_num_threads(1)
    single = _encode_and_search(str(tiny_model_dir), str(beir60), str(tmp_path / "one"))
    directory = tmp_path / "two"
    with pytest.raises(Exception, match="interrupted after one block"):
        _spawn(tiny_model_dir, beir60, directory, tmp_path, fail_rank=1)
    plan = ShardPlan(60, 2, BLOCK)
    partial = shard_path(directory, plan, 1).with_name(shard_path(directory, plan, 1).name + ".partial")
    assert partial.is_file()  # rank 1 left a partial shard with one block done
    ranks = _spawn(tiny_model_dir, beir60, directory, tmp_path)
    assert int(ranks[1]["blocks"]) == 3  # of its 4 blocks, the one finished before the interruption is kept
    for got in ranks:
        np.testing.assert_array_equal(got["rows"], single["rows"])
        np.testing.assert_array_equal(got["scores"], single["scores"])
    np.testing.assert_array_equal(np.concatenate([r["local"] for r in ranks]), single["local"])


def test_shards_of_another_model_or_corpus_are_refused(tiny_model_dir, tiny_beir, tmp_path):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    texts, fingerprint, _ = _inputs(tiny_beir, model)
    options = dict(block=BLOCK, device=CPU, show_progress=False)
    encode_sharded(model, texts, tmp_path / "shards", fingerprint, **options)
    other = BiEncoder.from_pretrained(str(save_tiny_bert(tmp_path / "other-model", seed=1)))
    with pytest.raises(DataError, match=r"shards holds passages encoded with another model \(fingerprint"):
        encode_sharded(other, texts, tmp_path / "shards", fingerprint, **options)
    with pytest.raises(DataError, match="encoded with another corpus"):
        encode_sharded(model, texts, tmp_path / "shards", "0" * 32, **options)
    again = encode_sharded(model, texts, tmp_path / "shards", fingerprint, **options)  # the same content: reused
    assert len(again.local) == len(texts)


@pytest.mark.parametrize("rows, world, block", [(60, 2, 8), (60, 4, 8), (10, 4, 8), (0, 3, 5), (65, 3, 1)])
def test_a_shard_plan_splits_the_corpus_into_runs_of_whole_blocks(rows, world, block):
    plan = ShardPlan(rows, world, block)
    ranges = [plan.shard(r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert all(start % block == 0 and (end % block == 0 or end == rows) for start, end in ranges)


@pytest.mark.parametrize("passage_chunk", [1, 3, 4, 100])
@pytest.mark.parametrize("k", [1, 3, 5, 9])
def test_exact_search_breaks_ties_by_row_whatever_the_chunking(passage_chunk, k):
    rng = np.random.default_rng(0)
    passages = rng.integers(-2, 3, size=(23, 4)).astype(np.float32)  # small integers: many exact ties
    queries = rng.integers(-2, 3, size=(7, 4)).astype(np.float32)
    scores, rows = exact_search(queries, passages, k, device=CPU, passage_chunk=passage_chunk)
    for q, (got_scores, got_rows) in enumerate(zip(scores, rows)):
        expected = sorted(range(len(passages)), key=lambda r: (-float(passages[r] @ queries[q]), r))[:k]
        assert got_rows.tolist() == expected
        assert got_scores.tolist() == [float(passages[r] @ queries[q]) for r in expected]


def test_a_streamed_corpus_reads_the_same_inputs_as_the_loaded_one(tiny_beir):
    corpus = load_dataset(str(tiny_beir)).corpus
    streamed = stream_passage_inputs(str(tiny_beir), None, "beir", "[SEP]", len(corpus))
    shard = streamed.window(10, 30)
    assert shard[0:7] + shard[7:20] == corpus.passage_inputs("[SEP]", range(10, 30))
    assert shard[3:5] == corpus.passage_inputs("[SEP]", [13, 14])  # backwards: the file is read again
    assert list(streamed) == corpus.passage_inputs("[SEP]") and streamed[-1] == corpus.passage_inputs("[SEP]")[-1]


@pytest.mark.timeout(600)
def test_mining_and_indexing_under_torchrun_equal_one_process(tiny_model_dir, beir60, tmp_path, monkeypatch):
    from densepass.cli import main

    mine = ["mine", str(beir60), "--strategy", "model", "--model", str(tiny_model_dir), "--depth", "6"]
    mine += ["--set", f"negatives.shard_block={BLOCK}"]
    index = ["index", str(beir60), "--model", str(tiny_model_dir), "--shard-size", str(BLOCK)]
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    assert main([*mine, "--output", "mined1.jsonl"]) == 0 and main([*index, "--output", "index1"]) == 0
    mined = run_densepass(*mine, "--output", "mined2.jsonl", cwd=tmp_path, processes=2)
    assert mined.returncode == 0, mined.stderr
    indexed = run_densepass(*index, "--output", "index2", cwd=tmp_path, processes=2)
    assert indexed.returncode == 0, indexed.stderr
    assert indexed.stdout.count("indexed 60 passages") == 1  # rank 0 alone reports (and writes)
    assert (tmp_path / "mined1.jsonl").read_bytes() == (tmp_path / "mined2.jsonl").read_bytes()
    for name in ("embeddings.npy", "passages.jsonl"):
        assert (tmp_path / "index1" / name).read_bytes() == (tmp_path / "index2" / name).read_bytes()
    assert not list(tmp_path.glob(".index*.encoding"))


def test_every_encoding_path_reads_a_prompted_models_prompts(tiny_model_dir, tiny_beir):
    """Sharded encoding (index builds) and dense mining read passages and queries behind the model's prompts, as
    ``encode_passages`` / ``encode_queries`` and training do: the reference is the same weights without prompts,
    given the prompted texts."""
    from densepass.models.biencoder import BiEncoderConfig
    from densepass.negatives.dense import mine_dense_negatives

    prompts = BiEncoderConfig(query_prompt="query: ", passage_prompt="passage: ")
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=prompts)
    plain = BiEncoder.from_pretrained(str(tiny_model_dir))
    dataset = load_dataset(str(tiny_beir))
    sep = model.tokenizer.sep_token
    options = dict(device=CPU, precision="fp32", show_progress=False)
    texts = dataset.corpus.passage_inputs(sep)
    passages = plain.encode_passages(["passage: " + t for t in texts], **options)
    assert not np.allclose(passages, plain.encode_passages(texts, **options), atol=1e-3)  # the prompt matters
    np.testing.assert_allclose(model.encode_passages(texts, **options), passages, atol=1e-6)
    sharded = encode_sharded(model, dataset.corpus.lazy_inputs(sep), block=BLOCK, **options)
    np.testing.assert_allclose(sharded.local, passages, atol=1e-6)
    qids = sorted(dataset.queries)[:6]
    queries = plain.encode_queries(["query: " + dataset.queries[q] for q in qids], **options)
    _, rows = exact_search(queries, passages, 5)
    mined = mine_dense_negatives(model, dataset, qids, 5, **options)
    assert [[c.passage_id for c in mined[q]] for q in qids] == [[dataset.corpus.ids[r] for r in row] for row in rows]
