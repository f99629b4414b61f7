"""The content-keyed cache of corpus encodings (``cache_dir``, ``index.sharded.encode_cached``): an encoding is made
once and read back by every later run of the same model, tokenizer, settings and corpus; any change to them is
another entry; results equal the uncached run's."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import small_run_overrides
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.fingerprints import fingerprint_corpus
from densepass.index import embeddings as embeddings_module
from densepass.index.sharded import CACHE_FOLDER, cache_key, encode_cached, encode_sharded
from densepass.io import exclusive_lock
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.pipelines.experiment import run_experiment

CPU = torch.device("cpu")


def entries(cache: Path) -> list[str]:
    """The encodings held in ``cache``."""
    folder = cache / CACHE_FOLDER
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def no_encoding(monkeypatch) -> None:
    """Make any passage encoding by block (the cache's writer) fail: what follows must read the cache."""

    def refuse(*args, **kwargs):
        raise AssertionError("encoded the corpus again instead of reading the cache")

    monkeypatch.setattr(embeddings_module, "encode_texts", refuse)


def test_an_encoding_is_made_once_and_keyed_by_everything_that_shapes_it(
    tiny_model_dir, tiny_beir, tmp_path, monkeypatch
):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    corpus = load_dataset(str(tiny_beir)).corpus
    options = dict(device=CPU, precision="fp32", show_progress=False, batch_size=16)
    first = np.array(encode_cached(model, corpus, tmp_path, **options).local)
    reference = encode_sharded(model, corpus.lazy_inputs(model.tokenizer.sep_token), **options).local
    np.testing.assert_array_equal(first, reference)
    assert len(entries(tmp_path)) == 1
    with monkeypatch.context() as patch:
        no_encoding(patch)
        np.testing.assert_array_equal(encode_cached(model, corpus, tmp_path, **options).local, first)
    # another batch size, precision, prompt, weights or corpus: another entry, never the stale one
    encode_cached(model, corpus, tmp_path, **{**options, "batch_size": 8})
    encode_cached(model, corpus, tmp_path, **{**options, "precision": "bf16"})
    prompted = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(passage_prompt="passage: "))
    encode_cached(prompted, corpus, tmp_path, **options)
    with torch.no_grad():
        next(model.parameters()).add_(1e-3)
    changed = encode_cached(model, corpus, tmp_path, **options).local
    assert not np.array_equal(changed, first)
    encode_cached(model, corpus.subset(list(range(len(corpus) - 1))), tmp_path, **options)
    assert len(entries(tmp_path)) == 6


def test_a_run_reads_the_encodings_of_earlier_runs_and_scores_the_same(
    tiny_model_dir, tiny_beir, tmp_path, monkeypatch
):
    """A run that trains (mining with a fixed model, evaluating the zero-shot and the fine-tuned model) fills the
    cache; an evaluation of its saved model, and another run's mining with the same model, read it; every metric
    equals the uncached run's."""
    cache = tmp_path / "cache"

    def run(name: str, *changes: str, cached: bool = True) -> dict:
        settings = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "runs", name)
        extra = [f"cache_dir={cache}"] if cached else []
        run_experiment(load_config(None, [*settings, *changes, *extra]))
        return json.loads((tmp_path / "runs" / name / "metrics.json").read_text())

    mining = [
        "negatives.source=model",
        f"negatives.model={tiny_model_dir}",
        "negatives.per_query=1",
        "train.max_steps=2",
        "train.batch_size=8",
        "eval.baselines=[zero-shot]",
    ]
    trained = run("trained", *mining)
    # the miner's encoding (negatives.model at its own lengths), the zero-shot and the fine-tuned model's
    assert len(entries(cache)) == 3
    uncached = run("uncached", *mining, cached=False)
    for system in ("zero-shot", "fine-tuned"):
        assert trained["results"][system] == uncached["results"][system], system
    saved = tmp_path / "runs" / "trained" / "model"
    with monkeypatch.context() as patch:
        no_encoding(patch)
        again = run("again", f"model.name_or_path={saved}", "train.enabled=false", "eval.baselines=[zero-shot]")
        assert again["results"]["zero-shot"] == trained["results"]["fine-tuned"]
    remined = run("remined", *mining, "train.max_steps=1")
    assert remined["results"]["zero-shot"] == trained["results"]["zero-shot"]
    assert len(entries(cache)) == 4  # mined and evaluated from the cache: the one-step model's is the only new entry


def test_a_run_without_a_cache_writes_none(tiny_model_dir, tiny_beir, tmp_path):
    settings = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "runs", "plain")
    run_experiment(load_config(None, [*settings, "train.enabled=false", "eval.baselines=[zero-shot]"]))
    assert not list(tmp_path.rglob(CACHE_FOLDER))


def test_runs_asking_for_the_same_encoding_take_turns(tiny_model_dir, tiny_beir, tmp_path):
    """While one process holds an entry (encoding it), another waits for it, then reads what it finished."""
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    corpus = load_dataset(str(tiny_beir)).corpus
    options = dict(device=CPU, precision="fp32", show_progress=False, batch_size=16)
    key = cache_key(model, fingerprint_corpus(corpus), "fp32", 16, 65_536, CPU)
    result = {}
    with exclusive_lock(tmp_path / CACHE_FOLDER / key, "encoding"):
        waiting = threading.Thread(target=lambda: result.update(out=encode_cached(model, corpus, tmp_path, **options)))
        waiting.start()
        time.sleep(1.0)
        assert waiting.is_alive() and not list((tmp_path / CACHE_FOLDER / key).glob("rows-*"))
    waiting.join(60)
    assert not waiting.is_alive() and result["out"].local.shape == (len(corpus), model.dim)


def test_the_key_names_the_cpu_code_path_that_encodes(tiny_model_dir, monkeypatch):
    """bf16 on a CPU with densepass's kernels and without them are other code paths (other embeddings): other
    keys. fp32 runs no kernels: one key either way."""
    from densepass.models import cpu_kernels

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    keys = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(cpu_kernels.ENV, switch)
        keys[switch] = {p: cache_key(model, "corpus", p, 16, 64, CPU) for p in ("fp32", "bf16")}
    assert keys["1"]["fp32"] == keys["0"]["fp32"]
    assert (keys["1"]["bf16"] != keys["0"]["bf16"]) == (cpu_kernels.layer_kind() is not None)


def test_a_cache_dir_that_is_a_file_is_one_line_before_any_work(tiny_model_dir, tiny_beir, tmp_path):
    from densepass.errors import ConfigError

    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    settings = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "runs", "c")
    with pytest.raises(ConfigError, match="exists and is not a folder"):
        run_experiment(load_config(None, [*settings, f"cache_dir={notes}"]))
    with pytest.raises(ConfigError, match="File name too long"):  # what the file system refuses: one line too
        run_experiment(load_config(None, [*settings, f"cache_dir={tmp_path / ('x' * 5000)}"]))
    assert notes.read_text() == "mine\n" and not (tmp_path / "runs").exists()
