"""Mined pools kept by content (densepass.negatives.pool_cache): read back equal, keyed by everything they depend on,
never kept when mined with the model being trained, mined again when an entry is incomplete."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from conftest import save_tiny_bert, small_run_overrides, write_tiny_beir
from densepass.config import NegativesConfig, load_config
from densepass.data import load_dataset
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
    assert again.pool == plain.pool and list(again.pool) == list(plain.pool)  # the same candidates, scores, order
    assert again.removed == plain.removed and again.seconds == pytest.approx(first.seconds)
    assert again.read_from == entry and "from the cache" in again.summary()
    # how training draws from the pool is not part of it
    same = mine_negatives(
        dataset, qids, dataclasses.replace(config, per_query=5, refresh_every=3), context(entry.parent.parent)
    )
    assert same.read_from == entry


def test_the_key_changes_with_everything_the_pool_depends_on(tiny_beir, tiny_model_dir, tmp_path):
    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    config = mixed(tiny_model_dir)

    def key(data=dataset, queries=qids, negatives=config, ctx=None, sep="[SEP]", strategy="mixed"):
        ctx = ctx or context(tmp_path)
        return pool_key(
            data, queries, negatives, ctx, sep, strategy, mine_module.model_digests(negatives, ctx, strategy)
        )

    base = key()
    other_model = save_tiny_bert(tmp_path / "other-model", seed=1)
    changed_text = write_tiny_beir(tmp_path / "changed", seed=0)
    corpus = changed_text / "corpus.jsonl"
    lines = corpus.read_text().splitlines()
    record = json.loads(lines[3])
    record["text"] += " more"
    corpus.write_text("\n".join([*lines[:3], json.dumps(record), *lines[4:]]) + "\n")
    assert key(data=load_dataset(str(write_tiny_beir(tmp_path / "same", seed=0)))) == base  # content, not path
    variants = {
        "another model's weights": key(negatives=mixed(other_model)),
        "a passage's text": key(data=load_dataset(str(changed_text))),
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
    }
    assert None not in variants.values()
    assert len({base, *variants.values()}) == len(variants) + 1, variants
    assert key(negatives=dataclasses.replace(config, per_query=9, refresh_every=4)) == base


def test_a_pool_of_the_model_being_trained_is_never_kept(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.models.biencoder import BiEncoder

    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))
    ctx = context(tmp_path / "cache", model=BiEncoder.from_pretrained(str(tiny_model_dir)))
    assert mine_module.model_digests(mixed(tiny_model_dir), ctx, "model") is None
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
    assert resumed == pytest.approx(first)
    assert f"from the cache {entry}" in (tmp_path / "runs" / "a" / "report.md").read_text()
    second = run_experiment(config("b", "negatives.per_query=2"))  # another run drawing two from the same pool
    assert f"from the cache {entry}" in (tmp_path / "runs" / "b" / "report.md").read_text() and second
    assert (tmp_path / "runs" / "b" / "negatives.jsonl").read_text() == (entry / POOL_FILE).read_text()
