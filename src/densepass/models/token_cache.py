"""Token ids of the training texts, tokenised once per run instead of at every step.

What is cached: for each side (queries, passages), the token ids of every text training can draw (the
trainer passes the training queries and every passage that is a positive or in a negative pool, as the
model reads it: ``title [SEP] text``), exactly as the model's own ``tokenize`` asks its tokenizer for them:
with special tokens, truncated to the length that side is tokenised at, unpadded. They are stored once,
flat, in ``.npy`` files under the run directory (``input_ids.npy``: int32 ids of every text end to end;
``offsets.npy``: text i is ``input_ids[offsets[i]:offsets[i + 1]]``; ``token_type_ids.npy`` only when the
tokenizer gives non-zero type ids), read back memory-mapped and never unpickled, reused by every epoch and
every negative that points at a passage.

How it is keyed: a fingerprint of the tokenizer (the content of the files ``save_pretrained`` writes for it,
less the backend's truncation and padding settings, which every call overwrites, and its output for a probe
text, which shows settings changed after loading), the truncation length, the side, and the texts
themselves, in order. A directory whose key differs (another tokenizer, length or text) is rebuilt; one whose
manifest is malformed or whose files do not match it (sizes and digests) is rebuilt with a ``DataWarning``;
only the files its manifest lists are read. Under torchrun rank 0 builds or checks it and every process reads
it; processes that build or read one directory (ranks of a node without a shared disk) take turns, under a lock.

How it is used: ``CachedTokenizer`` stands in for the tokenizer inside the model's own ``tokenize`` (any
retriever kind, ColBERT's markers and [MASK] padding included). A call for texts it holds, at the length it
holds them, is answered from the cache and padded as the tokenizer pads (to the longest row or to
``max_length``, ``pad_to_multiple_of``, the padding side, the pad token and pad type ids); texts it does
not hold (a refreshed pool's new negatives, an empty pool's random fallback) are tokenised on the spot, and
any other kind of call goes to the tokenizer itself. The tensors equal the tokenizer's, token for token.
"""

from __future__ import annotations

import copy
import itertools
import json
import re
import tempfile
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from transformers import BatchEncoding, PreTrainedTokenizerBase

from densepass import distributed
from densepass.errors import DataError, DataWarning
from densepass.fingerprints import fingerprint_file, fingerprint_json, fingerprint_strings
from densepass.io import (
    MANIFEST,
    atomic_directory,
    disk_errors,
    exclusive_lock,
    hold_temporaries,
    manifest_problem,
    remove_stale_temporaries,
    write_manifest,
)
from densepass.models.biencoder import Side

FORMAT = 1
CHUNK = 4096  # texts tokenised per call while building
SERVED = {"truncation", "max_length", "padding", "return_tensors", "pad_to_multiple_of"}  # call arguments served


PROBE = "Héllo WORLD, naïve café 日本語 😀 supercalifragilistic x-ray 3.14 [SEP] [CLS] [MASK] <s> </s> <mask>"
"""A text tokenised into ``tokenizer_fingerprint``: its ids and output names show settings changed after
loading that ``save_pretrained`` does not write (``split_special_tokens``, ``model_input_names``)."""


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """Digest of what decides a tokenizer's output: its class, the files ``save_pretrained`` writes
    (vocabulary, normaliser, special tokens, padding and truncation sides...), with ``tokenizer.json``'s
    truncation and padding settings left out (the last call's, not the tokenizer's), and what it makes of
    ``PROBE`` (with its special tokens, as the cache asks)."""
    probe = tokenizer([PROBE, f"{tokenizer.sep_token} {tokenizer.cls_token}"], truncation=True, max_length=64)
    parts = [type(tokenizer).__name__, fingerprint_json({name: list(rows) for name, rows in probe.items()})]
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        for path in sorted(p for p in Path(tmp).rglob("*") if p.is_file()):
            if path.name == "tokenizer.json":
                data = json.loads(path.read_text())
                data.pop("truncation", None)
                data.pop("padding", None)
                digest = fingerprint_json(data)
            else:
                digest = fingerprint_file(path)
            parts += [str(path.relative_to(tmp)), digest]
    return fingerprint_strings(parts)


class TokenStore:
    """The cached token ids of one side's texts (memory-mapped), found by text."""

    def __init__(
        self,
        texts: Sequence[str],
        max_length: int,
        names: Sequence[str],
        input_ids: np.ndarray,
        offsets: np.ndarray,
        token_type_ids: np.ndarray | None,
    ) -> None:
        self.max_length = max_length
        self.names = tuple(names)  # what the tokenizer returns, in its order
        self.input_ids, self.offsets, self.token_type_ids = input_ids, offsets, token_type_ids
        self.index = {text: i for i, text in enumerate(texts)}
        self.reused = False  # set by ``cached_tokenizer``: found on disk (else built by this run)

    def row(self, text: str) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The ids and type ids (None: zeros) of ``text``; None when it is not cached."""
        i = self.index.get(text)
        if i is None:
            return None
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        types = None if self.token_type_ids is None else self.token_type_ids[start:end]
        return self.input_ids[start:end], types

    @classmethod
    def build(cls, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int) -> TokenStore:
        """Tokenise ``texts`` (truncated to ``max_length``, unpadded) in memory."""
        names = tuple(tokenizer([""], truncation=True, max_length=max_length).keys())  # even of no texts
        ids, types, lengths = [], [], []
        for start in range(0, len(texts), CHUNK):
            encoded = tokenizer(list(texts[start : start + CHUNK]), truncation=True, max_length=max_length)
            lengths += [len(row) for row in encoded["input_ids"]]
            ids.append(np.fromiter(itertools.chain.from_iterable(encoded["input_ids"]), dtype=np.int32))
            if "token_type_ids" in encoded:
                types.append(np.fromiter(itertools.chain.from_iterable(encoded["token_type_ids"]), dtype=np.int8))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat_types = np.concatenate(types) if types else None
        if flat_types is not None and not flat_types.any():
            flat_types = None  # all zeros: rebuilt at batch time
        flat_ids = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int32)
        return cls(texts, max_length, names, flat_ids, offsets, flat_types)

    def save(self, directory: Path, facts: dict) -> None:
        """Write the arrays and a manifest (``facts`` plus every file's size and digest) atomically; a full disk is a
        one-line error, and a killed save's temporary directory is removed first (``io``)."""
        remove_stale_temporaries(directory.parent, re.escape(directory.name))
        with disk_errors(directory), hold_temporaries() as hold, atomic_directory(directory) as tmp:
            hold(tmp)
            np.save(tmp / "input_ids.npy", self.input_ids)
            np.save(tmp / "offsets.npy", self.offsets)
            if self.token_type_ids is not None:
                np.save(tmp / "token_type_ids.npy", self.token_type_ids)
            write_manifest(tmp, **facts, names=list(self.names))

    @classmethod
    def load(cls, directory: Path, texts: Sequence[str], key: str, verify: bool = True) -> TokenStore:
        """The store saved in ``directory`` for ``key``, memory-mapped; a DataError when it is missing, was
        saved for another key, or (``verify``) does not match its manifest."""
        facts = _facts(directory)
        if facts is None or facts.get("key") != key:
            raise DataError(f"{directory} holds no token ids of these texts with this tokenizer")
        problem = _facts_problem(facts) or (manifest_problem(directory) if verify else None)
        if problem is not None:
            raise DataError(f"{directory} is damaged: {problem}")
        listed = facts["files"]  # only the files the manifest lists are read
        try:
            arrays = {
                name: np.load(directory / f"{name}.npy", mmap_mode="r", allow_pickle=False)
                for name in ("input_ids", "offsets", "token_type_ids")
                if f"{name}.npy" in listed
            }
        except (OSError, ValueError) as err:
            raise DataError(f"{directory} is damaged: {err}") from None
        ids, offsets, types = arrays["input_ids"], arrays["offsets"], arrays.get("token_type_ids")
        if (
            len(offsets) != len(texts) + 1
            or int(offsets[-1]) != len(ids)
            or (types is not None and len(types) != len(ids))
        ):
            raise DataError(f"{directory} is damaged: its arrays do not fit {len(texts)} texts")
        return cls(texts, int(facts["max_length"]), facts["names"], ids, offsets, types)


def store_key(tokenizer_digest: str, side: str, max_length: int, texts: Sequence[str]) -> str:
    """The content key of one side's cache."""
    return fingerprint_json(
        {
            "format": FORMAT,
            "tokenizer": tokenizer_digest,
            "side": side,
            "max_length": max_length,
            "texts": fingerprint_strings(texts),
        }
    )


NAMES = {"input_ids", "token_type_ids", "attention_mask"}  # what a cache may say its tokenizer returns


def _facts_problem(facts: dict) -> str | None:
    """What is wrong with the shape of a cache's manifest (None: nothing): its names, length and file list."""
    names, files, max_length = facts.get("names"), facts.get("files"), facts.get("max_length")
    if not isinstance(names, list) or "input_ids" not in names or not set(names) <= NAMES:
        return f"its manifest names {names!r}, not the tokenizer outputs it can hold ({', '.join(sorted(NAMES))})"
    if not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1:
        return f"its manifest's max_length is {max_length!r}"
    if not isinstance(files, dict) or not {"input_ids.npy", "offsets.npy"} <= set(files):
        return "its manifest does not list input_ids.npy and offsets.npy"
    return None


def _facts(directory: Path) -> dict | None:
    """The manifest of ``directory`` (None: none readable)."""
    try:
        facts = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return facts if isinstance(facts, dict) else None


def ensure_store(
    directory: Path, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], max_length: int, side: str, key: str
) -> bool:
    """Make ``directory`` hold the cache of ``texts``: kept when it has key ``key`` and its files are intact
    (returns True), else built and saved (False); a damaged one is rebuilt with a ``DataWarning``."""
    if (_facts(directory) or {}).get("key") == key:
        try:
            TokenStore.load(directory, texts, key)
            return True
        except DataError as err:
            warnings.warn(f"{err}; tokenising again", DataWarning, stacklevel=2)
    store = TokenStore.build(tokenizer, texts, max_length)
    store.save(directory, {"format": FORMAT, "key": key, "side": side, "max_length": max_length, "texts": len(texts)})
    return False


def pad_rows(
    rows: Sequence[tuple[np.ndarray, np.ndarray | None]],
    names: Sequence[str],
    tokenizer: PreTrainedTokenizerBase,
    width: int,
) -> BatchEncoding:
    """Rows of (ids, type ids or None for zeros) padded to ``width`` as ``tokenizer`` pads: its pad token
    and pad type id, on its padding side; the attention mask marks the tokens."""
    n = len(rows)
    ids = np.full((n, width), tokenizer.pad_token_id, dtype=np.int64)
    types = np.full((n, width), tokenizer.pad_token_type_id, dtype=np.int64)
    mask = np.zeros((n, width), dtype=np.int64)
    left = tokenizer.padding_side == "left"
    for i, (row, row_types) in enumerate(rows):
        place = slice(width - len(row), width) if left else slice(0, len(row))
        ids[i, place] = row
        types[i, place] = 0 if row_types is None else row_types
        mask[i, place] = 1
    arrays = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    return BatchEncoding({name: torch.from_numpy(arrays[name]) for name in names})


class CachedTokenizer:
    """A tokenizer that answers from token stores what it can and hands the rest to ``tokenizer`` (a private
    copy: give each thread its own); every other attribute is the tokenizer's."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stores: Sequence[TokenStore]) -> None:
        self._tokenizer = tokenizer
        self._stores = list(stores)

    def __getattr__(self, name: str):
        if name in ("_tokenizer", "_stores"):
            raise AttributeError(name)
        return getattr(self._tokenizer, name)

    @property
    def stores(self) -> list[TokenStore]:
        """The stores it answers from."""
        return self._stores

    def __call__(self, text=None, *args, **kwargs):
        """``tokenizer(text, ...)``: from the stores for a list of texts truncated to a stored length,
        padded (``padding`` True, "longest" or "max_length") into PyTorch tensors; otherwise the tokenizer's."""
        max_length, padding = kwargs.get("max_length"), kwargs.get("padding", False)
        multiple = kwargs.get("pad_to_multiple_of")
        stores = [s for s in self._stores if s.max_length == max_length]
        served = (
            not args
            and stores
            and isinstance(text, list)
            and len(text) > 0
            and all(isinstance(t, str) for t in text)
            and set(kwargs) <= SERVED
            and kwargs.get("truncation") is True
            and kwargs.get("return_tensors") == "pt"
            and padding in (True, "longest", "max_length")
            and not (multiple and max_length % multiple)  # the tokenizer refuses to pad past its truncation
        )
        if not served:
            return self._tokenizer(text, *args, **kwargs)
        rows = [next((r for s in stores if (r := s.row(t)) is not None), None) for t in text]
        missing = [t for t, r in zip(text, rows) if r is None]
        if missing:
            fresh = iter(self._fresh_rows(missing, max_length))
            rows = [r if r is not None else next(fresh) for r in rows]
        width = max_length if padding == "max_length" else max(len(ids) for ids, _ in rows)
        if multiple and width % multiple:
            width += multiple - width % multiple
        return pad_rows(rows, stores[0].names, self._tokenizer, width)

    def _fresh_rows(self, texts: list[str], max_length: int) -> list[tuple[np.ndarray, np.ndarray | None]]:
        """(ids, type ids) of texts no store holds, from the tokenizer."""
        encoded = self._tokenizer(texts, truncation=True, max_length=max_length)
        types = encoded.get("token_type_ids")
        return [
            (np.asarray(ids, dtype=np.int64), None if types is None else np.asarray(types[i], dtype=np.int64))
            for i, ids in enumerate(encoded["input_ids"])
        ]


class _Recorder:
    """A tokenizer that notes the keyword arguments of each call (``requested_length``)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer, self.calls = tokenizer, []

    def __getattr__(self, name: str):
        if name in ("tokenizer", "calls"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)

    def __call__(self, *args, **kwargs):
        self.calls.append(kwargs)
        return self.tokenizer(*args, **kwargs)


def requested_length(
    model, side: Side, tokenizer: PreTrainedTokenizerBase, max_length: int | None = None
) -> int | None:
    """The length ``model.tokenize`` (asked for ``max_length``, if given) truncates ``side``'s texts to (e.g.
    ColBERT's, one less for its marker), seen by tokenising one text through a recording tokenizer; None when
    its call is not one the cache serves."""
    recorder = _Recorder(tokenizer)
    model.tokenize(["a"], side, tokenizer=recorder, max_length=max_length)
    if len(recorder.calls) != 1:
        return None
    call = recorder.calls[0]
    servable = set(call) <= SERVED and call.get("truncation") is True and call.get("return_tensors") == "pt"
    return call.get("max_length") if servable and isinstance(call.get("max_length"), int) else None


def cached_tokenizer(
    model,
    texts: Mapping[Side, Sequence[str]],
    directory: Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_lengths: Mapping[Side, int | None] | None = None,
) -> CachedTokenizer:
    """A ``CachedTokenizer`` for ``model.tokenize`` over ``texts`` (per side), cached under ``directory/<side>``;
    ``tokenizer``: the private copy it wraps (default: a copy of the model's); ``max_lengths``: the
    ``max_length`` each side's calls will pass to ``model.tokenize`` (default: none, the model's own). Rank 0
    builds or checks the caches; every process then maps them (a process whose directory is not rank 0's builds
    its own)."""
    tokenizer = tokenizer if tokenizer is not None else copy.deepcopy(model.tokenizer)
    digest = tokenizer_fingerprint(tokenizer)
    plans = []
    prompted = getattr(model, "prompted", lambda texts, side: texts)
    for side, side_texts in texts.items():
        max_length = requested_length(model, side, tokenizer, (max_lengths or {}).get(side))
        if max_length is not None:
            # the texts as model.tokenize hands them to the tokenizer: behind the side's prompt (else no lookup hits)
            unique = list(dict.fromkeys(prompted(list(side_texts), side)))
            plans.append((directory / side, unique, max_length, side, store_key(digest, side, max_length, unique)))

    def ensure_all() -> list[bool]:
        with exclusive_lock(directory, "token cache", wait=True):
            return [ensure_store(path, tokenizer, *plan) for path, *plan in plans]

    reused = distributed.on_rank_zero(ensure_all)
    stores = []
    # processes that build or read the same directory (ranks of one node without a shared disk) take turns
    with exclusive_lock(directory, "token cache", wait=True):
        for (path, unique, max_length, side, key), was_reused in zip(plans, reused):
            if distributed.rank() != 0 and (_facts(path) or {}).get("key") != key:
                # this process's run directory is not rank 0's (not a shared one): it builds its own cache
                was_reused = ensure_store(path, tokenizer, unique, max_length, side, key)
            stores.append(TokenStore.load(path, unique, key, verify=False))  # checked (or just written) already
            stores[-1].reused = was_reused
    return CachedTokenizer(tokenizer, stores)
