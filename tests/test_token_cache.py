"""The training token cache: batches built from cached ids equal the model's own ``tokenize`` tensor for
tensor, the cache is rebuilt when the tokenizer, the length or a text changes (or a file is damaged), its
files load without pickle, and training with it ends with the same weights as training without it."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch

from densepass.config import TrainConfig
from densepass.data import load_dataset
from densepass.errors import DataWarning
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.colbert import ColBERT, ColbertArchitecture
from densepass.models.splade import SpladeArchitecture, SpladeEncoder
from densepass.models.token_cache import cached_tokenizer
from densepass.training.batches import TrainingData
from densepass.training.trainer import train

CPU = torch.device("cpu")
LONG = " ".join(["archiving utility with compression"] * 20)  # far past every max length below
TEXTS = {
    "query": ["audio editor", "Fast, Cross-Platform AUDIO editor", LONG, "", "ünïcödé naïve café", "kernel"],
    "passage": ["tar [SEP] GNU version of tar", LONG, "x", "Mail Server [SEP] " + LONG[:90], "", "a b c d e f g"],
}


def _bi_encoder(model_dir, query_length=8, passage_length=24) -> BiEncoder:
    config = BiEncoderConfig(query_max_length=query_length, passage_max_length=passage_length)
    return BiEncoder.from_pretrained(str(model_dir), config=config)


def _equal(got, expected) -> None:
    assert list(got.keys()) == list(expected.keys())
    for name in expected:
        assert got[name].dtype == expected[name].dtype, name
        assert torch.equal(got[name], expected[name]), name


def _batches(texts: list[str]) -> list[list[str]]:
    """Batches of the texts: one each, all, and with a text no cache holds."""
    return [[t] for t in texts] + [texts, list(reversed(texts)), [texts[0], "not cached AT ALL", texts[2]]]


MODELS = {
    "bi-encoder": _bi_encoder,
    "splade": lambda d: SpladeEncoder.from_pretrained(
        str(d), config=SpladeArchitecture(query_max_length=8, passage_max_length=13)
    ),
    "colbert": lambda d: ColBERT.from_pretrained(
        str(d), config=ColbertArchitecture(dim=8, query_max_length=9, passage_max_length=16)
    ),
}


@pytest.mark.parametrize("kind", MODELS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_cached_batches_equal_the_models_tokenize(tiny_model_dir, tmp_path, kind, padding_side):
    model = MODELS[kind](tiny_model_dir)
    model.tokenizer.padding_side = padding_side
    cached = cached_tokenizer(model, TEXTS, tmp_path / "cache")
    assert len(cached.stores) == 2  # both sides are served from the cache
    for side, texts in TEXTS.items():
        for batch in _batches(texts):
            _equal(model.tokenize(batch, side, tokenizer=cached), model.tokenize(batch, side))


def test_a_model_with_prompts_is_served_from_the_cache(tiny_model_dir, tmp_path, monkeypatch):
    """The cache holds the texts behind their side's prompt, as ``model.tokenize`` asks for them: every lookup of
    a text it was built for hits (it held the bare texts, so with prompts none did)."""
    model = _bi_encoder(tiny_model_dir)
    model.config = dataclasses.replace(model.config, query_prompt="query: ", passage_prompt="passage: ")
    cached = cached_tokenizer(model, TEXTS, tmp_path / "cache")

    def missed(texts, max_length):
        raise AssertionError(f"not served from the cache: {texts}")

    monkeypatch.setattr(cached, "_fresh_rows", missed)
    for side, texts in TEXTS.items():
        for batch in [[t] for t in texts] + [texts]:
            _equal(model.tokenize(batch, side, tokenizer=cached), model.tokenize(batch, side))


def test_only_the_calls_the_cache_holds_are_served_from_it(tiny_model_dir, tmp_path):
    model = _bi_encoder(tiny_model_dir)
    cached = cached_tokenizer(model, TEXTS, tmp_path / "cache")
    real = model.tokenizer
    # another length, no padding, a pair: the tokenizer's own answer
    _equal(
        cached(TEXTS["query"], truncation=True, max_length=5, padding=True, return_tensors="pt"),
        real(TEXTS["query"], truncation=True, max_length=5, padding=True, return_tensors="pt"),
    )
    assert cached(["audio editor"], truncation=True, max_length=7)["input_ids"] == real(["audio editor"])["input_ids"]
    _equal(
        cached(["a"], ["b"], truncation=True, max_length=7, padding=True, return_tensors="pt"),
        real(["a"], ["b"], truncation=True, max_length=7, padding=True, return_tensors="pt"),
    )
    assert cached.sep_token == real.sep_token and cached.pad_token_id == real.pad_token_id


def test_a_call_the_tokenizer_refuses_is_refused_the_same_way(tiny_model_dir, tmp_path):
    model = MODELS["splade"](tiny_model_dir)  # passages cut at 13 tokens, padded to the longest
    cached = cached_tokenizer(model, TEXTS, tmp_path / "cache")
    args = {"truncation": True, "max_length": 13, "padding": True, "return_tensors": "pt", "pad_to_multiple_of": 8}
    for tokenizer in (model.tokenizer, cached):
        with pytest.raises(ValueError, match="not a multiple of pad_to_multiple_of"):
            tokenizer(TEXTS["passage"], **args)


def _reuses(model, texts, directory, tokenizer=None) -> list[bool]:
    return [store.reused for store in cached_tokenizer(model, texts, directory, tokenizer).stores]


def test_the_cache_is_reused_only_for_the_same_tokenizer_length_and_texts(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    directory = tmp_path / "cache"
    model = _bi_encoder(tiny_model_dir)
    assert _reuses(model, TEXTS, directory) == [False, False]
    assert _reuses(model, TEXTS, directory) == [True, True]
    model.tokenize(TEXTS["passage"], "passage")  # a tokenizer's last call does not change its key
    assert _reuses(model, TEXTS, directory) == [True, True]

    cased = _bi_encoder(tiny_model_dir)
    cased.tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir), do_lower_case=False)
    assert _reuses(cased, TEXTS, directory) == [False, False]
    cached = cached_tokenizer(cased, TEXTS, directory)  # reused, and cased: the stale ids were replaced
    assert [s.reused for s in cached.stores] == [True, True]
    for side, texts in TEXTS.items():
        _equal(cased.tokenize(texts, side, tokenizer=cached), cased.tokenize(texts, side))
    assert not torch.equal(cased.tokenize(TEXTS["query"], "query")["input_ids"],
                           model.tokenize(TEXTS["query"], "query")["input_ids"])  # fmt: skip

    _reuses(model, TEXTS, directory)
    more_words = copy.deepcopy(model.tokenizer)
    assert more_words.add_tokens(["zzqxv"]) == 1  # a changed vocabulary
    assert _reuses(model, TEXTS, directory, more_words) == [False, False]

    _reuses(model, TEXTS, directory)
    split = copy.deepcopy(model.tokenizer)
    split.split_special_tokens = True  # set after loading: not in what save_pretrained writes
    assert _reuses(model, TEXTS, directory, split) == [False, False]
    cached = cached_tokenizer(model, TEXTS, directory, split)
    _equal(model.tokenize(TEXTS["passage"], "passage", tokenizer=cached),
           model.tokenize(TEXTS["passage"], "passage", tokenizer=split))  # fmt: skip

    _reuses(model, TEXTS, directory)
    assert _reuses(_bi_encoder(tiny_model_dir, passage_length=32), TEXTS, directory) == [True, False]
    edited = {"query": TEXTS["query"], "passage": [*TEXTS["passage"][:-1], "a b c d e f h"]}
    assert _reuses(model, edited, directory) == [True, False]
    cached = cached_tokenizer(model, edited, directory)
    _equal(model.tokenize(edited["passage"], "passage", tokenizer=cached), model.tokenize(edited["passage"], "passage"))


def test_the_cache_files_load_memory_mapped_without_pickle(tiny_model_dir, tmp_path):
    model = _bi_encoder(tiny_model_dir)
    cached = cached_tokenizer(model, TEXTS, tmp_path / "cache")
    for store in cached.stores:
        assert isinstance(store.input_ids, np.memmap) and store.input_ids.dtype == np.int32
        assert isinstance(store.offsets, np.memmap) and store.offsets.dtype == np.int64
        assert store.token_type_ids is None  # BERT gives a single text type ids of zero: not stored
    files = sorted((tmp_path / "cache").rglob("*.npy"))
    assert [f.relative_to(tmp_path / "cache").as_posix() for f in files] == [
        "passage/input_ids.npy",
        "passage/offsets.npy",
        "query/input_ids.npy",
        "query/offsets.npy",
    ]
    for path in files:
        np.load(path, allow_pickle=False)


MANIFEST_EDITS = {  # a hand-edited manifest: each is found damaged, and the cache rebuilt
    "unknown names": lambda m: m.update(names=["input_ids", "bogus"]),
    "no names": lambda m: m.pop("names"),
    "a bad max_length": lambda m: m.update(max_length="x"),
    "files as a list": lambda m: m.update(files=list(m["files"])),
    "a file entry not a dict": lambda m: m["files"].update({"offsets.npy": 3}),
    "the ids unlisted": lambda m: m["files"].pop("input_ids.npy"),
}


@pytest.mark.parametrize("damage", ["truncate", "flip a byte", "drop the manifest", "a stray file", *MANIFEST_EDITS])
def test_a_damaged_cache_is_rebuilt(tiny_model_dir, tmp_path, damage):
    directory = tmp_path / "cache"
    model = _bi_encoder(tiny_model_dir)
    cached_tokenizer(model, TEXTS, directory)
    ids = directory / "passage" / "input_ids.npy"
    manifest = directory / "passage" / "manifest.json"
    if damage == "truncate":
        ids.write_bytes(ids.read_bytes()[:-10])
    elif damage == "flip a byte":
        data = bytearray(ids.read_bytes())
        data[-3] ^= 0xFF
        ids.write_bytes(bytes(data))
    elif damage == "drop the manifest":
        manifest.unlink()
    elif damage == "a stray file":  # not in the manifest: never read
        np.save(directory / "passage" / "token_type_ids.npy", np.ones(len(np.load(ids)), dtype=np.int8))
    else:
        facts = json.loads(manifest.read_text())
        MANIFEST_EDITS[damage](facts)
        manifest.write_text(json.dumps(facts))
    if damage in ("drop the manifest", "a stray file"):  # built again silently, or reused as it was
        reused = _reuses(model, TEXTS, directory)
        assert reused == [True, damage == "a stray file"]
    else:
        with pytest.warns(DataWarning, match="is damaged.*tokenising again"):
            reused = _reuses(model, TEXTS, directory)
        assert reused == [True, False]
    cached = cached_tokenizer(model, TEXTS, directory)
    _equal(model.tokenize(TEXTS["passage"], "passage", tokenizer=cached), model.tokenize(TEXTS["passage"], "passage"))


def test_texts_in_use_are_the_queries_positives_and_pools(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]", {"q1": ["p5", "p7"], "q2": ["p7", "p2"]}, 1)
    texts = data.texts_in_use()
    assert texts["query"] == data.query_texts
    rows = sorted({r for positives in data.positive_rows for r in positives} | {5, 7})  # p2 is q2's positive
    assert texts["passage"] == [data.passage_inputs[r] for r in rows]
    assert data.passage_inputs[39] not in texts["passage"]
    data.replace_negatives({"q1": ["p39"]}, from_step=3)
    assert data.passage_inputs[39] in data.texts_in_use()["passage"]


def _count_step_tokenization(monkeypatch, tokenizer) -> list[int]:
    """Count the tokenizer calls that pad a batch of texts (the per-step ones: building the cache does not
    pad, and finding the length it is built at tokenises one text)."""
    calls, real = [], type(tokenizer).__call__

    def counting(self, *args, **kwargs):
        if kwargs.get("padding") and len(args[0]) > 1:
            calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", counting)
    return calls


def test_training_with_the_cache_ends_with_the_same_weights_bit_for_bit(
    tiny_model_dir, tiny_beir, tmp_path, monkeypatch
):
    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]", {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}, 1)
    results = {}
    for use_cache in (False, True):
        model = BiEncoder.from_pretrained(str(tiny_model_dir))
        calls = _count_step_tokenization(monkeypatch, model.tokenizer)
        config = TrainConfig(
            epochs=2, batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, log_every=1, seed=5, token_cache=use_cache
        )
        result = train(model, data, config, tmp_path / f"cache-{use_cache}", CPU)
        losses = [json.loads(line)["loss"] for line in result.log_path.read_text().splitlines()]
        results[use_cache] = (losses, {k: v.clone() for k, v in model.state_dict().items()}, len(calls))
        monkeypatch.undo()
    (plain_losses, plain_weights, plain_calls), (losses, weights, cached_calls) = results[False], results[True]
    assert plain_calls == 2 * 10 and cached_calls == 0  # every step tokenised its texts, or none did
    assert (tmp_path / "cache-True" / "token_cache" / "passage" / "manifest.json").is_file()
    assert losses == plain_losses
    for name, tensor in plain_weights.items():
        assert torch.equal(weights[name], tensor), name


def test_the_cache_is_built_and_read_under_a_lock_other_processes_wait_for(tiny_model_dir, tmp_path, monkeypatch):
    """Ranks of one node without a shared disk each build the same directory: while one builds or reads it,
    it holds ``<cache>/.lock``, which another process's ``flock`` cannot take (it waits its turn)."""
    import fcntl

    from densepass.models import token_cache

    directory = tmp_path / "cache"
    held = []

    def lock_is_held() -> bool:
        with open(directory / ".lock", "a+") as other:  # another open file: as another process sees it
            try:
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(other, fcntl.LOCK_UN)
            return False

    real_ensure, real_load = token_cache.ensure_store, token_cache.TokenStore.load

    def ensure(*args, **kwargs):
        held.append(lock_is_held())
        return real_ensure(*args, **kwargs)

    def load(*args, **kwargs):
        held.append(lock_is_held())
        return real_load(*args, **kwargs)

    monkeypatch.setattr(token_cache, "ensure_store", ensure)
    monkeypatch.setattr(token_cache.TokenStore, "load", load)  # called on the class: TokenStore.load(path, ...)
    cached_tokenizer(_bi_encoder(tiny_model_dir), TEXTS, directory)
    assert held and all(held)
    assert not lock_is_held()  # released afterwards
