"""Mined pools kept by content (densepass.negatives.pool_cache): read back equal, keyed by everything they depend on,
never kept when mined with the model being trained, mined again when an entry is incomplete."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest

from conftest import save_tiny_bert, small_run_overrides, write_tiny_beir
from densepass.config import NegativesConfig, load_config
from densepass.data import load_dataset
from densepass.data.dataset import RetrievalDataset
from densepass.negatives import mine as mine_module
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.negatives.pool_cache import CACHE_FOLDER, POOL_FILE, RESULT_FILE, pool_key


def mixed(model: Path, **changes) -> NegativesConfig:
    settings = dict(source="mixed", mix=["bm25", "context", "model"], model=str(model), pool_depth=6)
    return NegativesConfig(**{**settings, **changes})


def context(cache: Path | None, **changes) -> MiningContext:
    return MiningContext(**{"show_progress": False, "cache_dir": cache, "precision": "fp32", **changes})


def entries(cache: Path) -> list[Path]:
    return sorted(p for p in (cache / CACHE_FOLDER).glob("*") if p.is_dir()) if (cache / CACHE_FOLDER).exists() else []


def test_a_kept_pool_reads_back_equal_to_mining_it_without_mining(tiny_beir, tiny_model_dir, tmp_path, monkeypatch):
    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    random.Random(3).shuffle(qids)  # the pool keeps the order asked for, not a sorted one
    config = mixed(tiny_model_dir, filters=["qrels", "duplicates"])
    plain = mine_negatives(dataset, qids, config, context(None))
    assert entries(tmp_path / "cache") == [] and plain.read_from is None
    first = mine_negatives(dataset, qids, config, context(tmp_path / "cache"))
    assert first.pool == plain.pool and first.removed == plain.removed and first.read_from is None
    [entry] = entries(tmp_path / "cache")

    def no_mining(*args, **kwargs):
        raise AssertionError("a kept pool is read, not mined")

    monkeypatch.setattr(mine_module, "raw_pool", no_mining)
    again = mine_negatives(dataset, qids, config, context(tmp_path / "cache"))
    assert list(plain.pool) == qids
    assert again.pool == plain.pool and list(again.pool) == qids  # the same candidates, scores, order
    assert again.removed == plain.removed and again.seconds == pytest.approx(first.seconds)
    assert again.read_from == entry and "from the cache" in again.summary()
    # how training draws from the pool is not part of it
    same = mine_negatives(
        dataset, qids, dataclasses.replace(config, per_query=5, refresh_every=3), context(entry.parent.parent)
    )
    assert same.read_from == entry


def test_the_key_changes_with_everything_the_pool_depends_on(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.index.bm25 import BM25Index

    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    config = mixed(tiny_model_dir)

    def key(data=dataset, queries=qids, negatives=config, ctx=None, sep="[SEP]", strategy="mixed"):
        ctx = ctx or context(tmp_path)
        return pool_key(
            data, queries, negatives, sep, strategy, mine_module.mining_inputs(data, negatives, ctx, strategy)
        )

    def edited(name: str, edit=None) -> RetrievalDataset:  # the same dataset in another folder, then changed
        changed = load_dataset(str(write_tiny_beir(tmp_path / name, seed=0)))
        if edit is not None:
            edit(changed)
        return changed

    def positives_in_order(*order: str):  # two positives of equal grade, in the order given
        return lambda data: data.qrels["train"].update(q0=dict.fromkeys(order, 1))

    bm25_texts = mine_module.bm25_corpus(dataset)
    base = key()
    assert key(data=edited("same")) == base  # content, not path
    other_model = save_tiny_bert(tmp_path / "other-model", seed=1)
    changed_text = write_tiny_beir(tmp_path / "changed", seed=0)
    corpus = changed_text / "corpus.jsonl"
    lines = corpus.read_text().splitlines()
    record = json.loads(lines[3])
    record["text"] += " more"
    corpus.write_text("\n".join([*lines[:3], json.dumps(record), *lines[4:]]) + "\n")
    negatives_file = tmp_path / "given.jsonl"
    file_config = NegativesConfig(source="file", file=str(negatives_file))
    negatives_file.write_text(json.dumps({"query_id": "q0", "negatives": [["p3", "bm25", 1.0]]}) + "\n")
    file_before = key(negatives=file_config, strategy="file")
    negatives_file.write_text(json.dumps({"query_id": "q0", "negatives": [["p4", "bm25", 1.0]]}) + "\n")
    cross = NegativesConfig(source="bm25", filters=["qrels", "cross-encoder"], cross_encoder=str(tiny_model_dir))
    variants = {
        "another model's weights": key(negatives=mixed(other_model)),
        "a passage's text": key(data=load_dataset(str(changed_text))),
        "a query's text": key(data=edited("query", lambda d: d.queries.update(q0="another text"))),
        "a qrel": key(data=edited("qrel", lambda d: d.qrels["train"].update(q1={"p2": 1}))),
        "positives p0, p1": key(data=edited("p0-p1", positives_in_order("p0", "p1"))),
        "positives p1, p0": key(data=edited("p1-p0", positives_in_order("p1", "p0"))),
        "an answer": key(data=edited("answer", lambda d: d.answers.update(q0=["audio"]))),
        "fewer queries": key(queries=qids[:-1]),
        "the pool depth": key(negatives=mixed(tiny_model_dir, pool_depth=7)),
        "the mix": key(negatives=mixed(tiny_model_dir, mix=["bm25", "model"])),
        "the filters": key(negatives=mixed(tiny_model_dir, filters=["qrels", "duplicates"])),
        "skip_top": key(negatives=mixed(tiny_model_dir, skip_top=1)),
        "the separator": key(sep=" "),
        "the strategy": key(strategy="bm25"),
        "the seed": key(ctx=context(tmp_path, seed=14)),
        "the split": key(ctx=context(tmp_path, split="dev")),
        "the precision": key(ctx=context(tmp_path, precision="bf16")),
        "BM25's parameters": key(ctx=context(tmp_path, bm25_index=BM25Index.build(bm25_texts, k1=1.2))),
        "BM25's passages": key(ctx=context(tmp_path, bm25_index=BM25Index.build(bm25_texts[:-1]))),
        "a negatives file, before": file_before,
        "a negatives file, after": key(negatives=file_config, strategy="file"),
        "the cross-encoder filter's model": key(negatives=cross, strategy="bm25"),
        "another cross-encoder": key(
            negatives=dataclasses.replace(cross, cross_encoder=str(other_model)), strategy="bm25"
        ),
    }
    assert len({base, *variants.values()}) == len(variants) + 1, variants
    assert key(negatives=dataclasses.replace(config, per_query=9, refresh_every=4)) == base
    # BM25 reads neither the precision nor the seed, and an index built with the defaults is the default
    bm25 = NegativesConfig(source="bm25")
    index = BM25Index.build(mine_module.bm25_corpus(dataset))  # what mining builds without one
    alike = context(tmp_path, precision="bf16", seed=5, bm25_index=index)
    assert key(negatives=bm25, strategy="bm25") == key(negatives=bm25, strategy="bm25", ctx=alike)
    # the relative-margin filter's bar is the positive of the split mined for: dev's pool is not train's
    margin = NegativesConfig(source="bm25", filters=["qrels", "relative-margin"], model=str(tiny_model_dir))
    assert key(negatives=margin, strategy="bm25") != key(negatives=margin, strategy="bm25", ctx=context(tmp_path,
               split="dev"))  # fmt: skip
    assert key(negatives=bm25, strategy="bm25") == key(negatives=bm25, strategy="bm25", ctx=context(tmp_path,
               split="dev"))  # fmt: skip


def test_a_pool_of_the_model_being_trained_is_never_kept(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.models.biencoder import BiEncoder

    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    ctx = context(tmp_path / "cache", model=BiEncoder.from_pretrained(str(tiny_model_dir)))
    assert mine_module.mining_inputs(dataset, mixed(tiny_model_dir), ctx, "model") is None
    result = mine_negatives(dataset, qids, mixed(tiny_model_dir), ctx, strategy="model")
    assert result.read_from is None and entries(tmp_path / "cache") == []


@pytest.mark.parametrize("damage", ["no result file", "a damaged pool line", "a pool of other queries"])
def test_an_incomplete_or_damaged_entry_is_mined_again(tiny_beir, tiny_model_dir, tmp_path, damage):
    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    config = NegativesConfig(source="bm25", pool_depth=4)
    first = mine_negatives(dataset, qids, config, context(tmp_path))
    [entry] = entries(tmp_path)
    if damage == "no result file":
        (entry / RESULT_FILE).unlink()
    elif damage == "a damaged pool line":
        with open(entry / POOL_FILE, "ab") as handle:
            handle.write(b'{"query_id": "q0", "negat\n')
    else:
        lines = (entry / POOL_FILE).read_text().splitlines()
        (entry / POOL_FILE).write_text("\n".join(lines[1:]) + "\n")
    again = mine_negatives(dataset, qids, config, context(tmp_path))
    assert again.read_from is None and again.pool == first.pool  # mined, not read
    assert mine_negatives(dataset, qids, config, context(tmp_path)).read_from == entry  # and kept again, whole


def test_a_resumed_run_and_a_second_run_read_the_pool_the_first_mined(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.pipelines.experiment import run_experiment

    def config(name: str, *extra: str):
        overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "runs", name)
        return load_config(
            None,
            [
                *overrides,
                f"cache_dir={tmp_path / 'cache'}",
                "negatives.source=mixed",
                "negatives.mix=[bm25, context]",
                "negatives.per_query=1",
                "train.batch_size=8",
                "train.max_steps=2",
                *extra,
            ],
        )

    first = run_experiment(config("a"))["fine-tuned"]
    report = (tmp_path / "runs" / "a" / "report.md").read_text()
    assert "from the cache" not in report
    [entry] = entries(tmp_path / "cache")
    shutil.rmtree(tmp_path / "runs" / "a" / "model")  # interrupted at the end: it resumes
    resumed = run_experiment(config("a"))["fine-tuned"]
    assert resumed == first
    assert (tmp_path / "runs" / "a" / "negatives.jsonl").read_text() == (entry / POOL_FILE).read_text()
    assert f"from the cache {entry}" in (tmp_path / "runs" / "a" / "report.md").read_text()
    second = run_experiment(config("b", "negatives.per_query=2"))  # another run drawing two from the same pool
    assert f"from the cache {entry}" in (tmp_path / "runs" / "b" / "report.md").read_text() and second
    assert (tmp_path / "runs" / "b" / "negatives.jsonl").read_text() == (entry / POOL_FILE).read_text()


def test_processes_mining_together_keep_nothing(tiny_beir, tmp_path, monkeypatch):
    from densepass import distributed

    dataset = load_dataset(str(tiny_beir))
    monkeypatch.setattr(distributed, "world_size", lambda: 2)  # under torchrun each process mines a shard
    qids = sorted(dataset.positives("train"))
    result = mine_negatives(dataset, qids, NegativesConfig(source="bm25"), context(tmp_path))
    assert result.read_from is None and entries(tmp_path) == []


def test_without_a_cache_dir_a_run_keeps_its_pool_in_its_own_folder_until_restart(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.pipelines.experiment import run_experiment

    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "runs", "own")
    extra = ["negatives.source=bm25", "negatives.per_query=1", "train.batch_size=8", "train.max_steps=2"]
    config = load_config(None, [*overrides, *extra])
    run = tmp_path / "runs" / "own"
    first = run_experiment(config)["fine-tuned"]
    [entry] = entries(run / "negatives")
    assert "from the cache" not in (run / "report.md").read_text()
    shutil.rmtree(run / "model")  # interrupted at the end: it resumes, reading the pool back
    assert run_experiment(config)["fine-tuned"] == first
    assert f"from the cache {entry}" in (run / "report.md").read_text()
    (entry / POOL_FILE).write_text((entry / POOL_FILE).read_text().replace('"bm25"', '"planted"'))
    run_experiment(config, restart=True)  # starting over removes the run's pools with its other files
    assert "from the cache" not in (run / "report.md").read_text()
    assert "planted" not in (entries(run / "negatives")[0] / POOL_FILE).read_text()
    notes = entries(run / "negatives")[0] / "my-notes.txt"  # a user's file in the way: kept, and the folder with it
    notes.write_text("mine")
    run_experiment(config, restart=True)
    assert notes.read_text() == "mine"
