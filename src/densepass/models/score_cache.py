"""A cross-encoder's scores kept by content (``cache_dir``), so that every run scoring the same (query, passage)
pairs with the same model in the same precision scores each pair once: the distillation targets of several
students of one teacher, that teacher's denoising filter over the same pool, a run started again.

An entry is ``<cache_dir>/pair-scores/<key>/``, ``key`` the digest of what a score depends on besides the pair
(``scorer_identity``): the model's weights and configuration, its tokenizer (and the side it truncates and pads),
its truncation length, the precision and the kind of device it scores in, and the versions of densepass and of the
libraries that compute it (``scorer.json`` holds them in words). Its ``scores.sqlite`` has a row per pair: a
16-byte digest of the query's and the passage's texts (``pair_key``) and the model's float32 logit (exact in
SQLite's REAL). The identity follows the weights (``models.quantize.weights_key``), so a model trained between two
calls scores into another entry. A kept score is the one the model gave in the batch it was first scored in: equal
to a fresh one up to float rounding (fp32 and bf16 sum a pair's products in an order that depends on its batch's
padded width); int8 scores, whose activation scale is set per batch, are never kept. Rows are added one call per
transaction (an interruption loses that call's pairs only); processes share an entry through SQLite's locking (a
local disk: network filesystems' locks are not reliable). Nothing in an entry is code, or pickled. An entry that
cannot be used (damaged, a link, locked past ``LOCK_TIMEOUT_S``) is passed over with a warning, never written, and
the cache is off for the rest of that scorer's calls: the pairs are scored.

Usage::

    teacher = CrossEncoder.from_pretrained("outputs/teacher/reranker/model", precision="bf16")
    scores = CachedPairScores(teacher, "outputs/cache").score_pairs(queries, passages)  # float32 logits
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import warnings
from collections.abc import Sequence
from contextlib import closing
from pathlib import Path
from typing import Any

import numpy as np

from densepass.device import resolve_precision
from densepass.errors import ConfigError, DataWarning
from densepass.fingerprints import fingerprint_json, fingerprint_tokenizer, fingerprint_weights, library_versions
from densepass.io import atomic_write_text
from densepass.models.quantize import weights_key

CACHE_FOLDER = "pair-scores"
DATABASE = "scores.sqlite"
IDENTITY_FILE = "scorer.json"
SCORES_VERSION = 3  # how a score is computed and kept, and how a scorer is keyed; a change to either bumps it
# configuration keys that name or describe a model without changing its scores: saving a model sets them
# (``save_pretrained`` its architectures, ``CrossEncoder.save`` sentence-transformers' activation), so a model
# scored before it was saved and the same one loaded from disk key alike
NAMING_KEYS = ("architectures", "sentence_transformers", "_name_or_path", "transformers_version")
LOOKUP_BATCH = 500  # keys per SELECT: under the 999 parameters of SQLite builds before 3.32
LOCK_TIMEOUT_S = 60.0  # how long a call waits for another process's transaction on the same entry (its
# transactions only read or add rows: seconds)


def pair_key(query: str, passage: str) -> bytes:
    """The 16-byte digest a pair is kept under (each text length-prefixed: no two pairs share one by concatenation)."""
    digest = hashlib.blake2b(digest_size=16)
    for text in (query, passage):
        data = text.encode("utf-8", "surrogatepass")
        digest.update(len(data).to_bytes(8, "little"))
        digest.update(data)
    return digest.digest()


def scorer_identity(model: Any, precision: str) -> dict:
    """What a cross-encoder's score of a pair depends on besides the pair: its weights and configuration (heads,
    activation, epsilon, ...), its tokenizer, the sides it truncates and pads, its truncation length, the precision
    and the kind of device it scores in, and the code's versions."""
    tokenizer = model.tokenizer
    return {
        "version": SCORES_VERSION,
        "weights": fingerprint_weights(model.model),
        "config": fingerprint_json({k: v for k, v in model.model.config.to_dict().items() if k not in NAMING_KEYS}),
        "tokenizer": fingerprint_tokenizer(tokenizer),
        "sides": [getattr(tokenizer, "truncation_side", None), getattr(tokenizer, "padding_side", None)],
        "max_length": model.max_length,
        "precision": precision,
        "device": model.device.type,
        "libraries": library_versions(),
    }


class CachedPairScores:
    """``model.score_pairs`` (a ``models.cross_encoder.CrossEncoder``'s) through the cache in ``cache_dir``: the pairs
    found there are read, the others scored in one call and added. ``scored`` counts the pairs the model was asked
    for, ``found`` those read from the cache."""

    def __init__(self, model: Any, cache_dir: str | Path) -> None:
        if not str(cache_dir).strip():
            raise ConfigError("the score cache needs a folder (cache_dir), got an empty path")
        self.model, self.cache_dir = model, Path(cache_dir)
        self.scored = self.found = 0
        self._off = False  # set when an entry could not be used: the rest of the calls score without the cache
        self._entries: dict[tuple, Path] = {}  # (weights_key, precision) -> the entry's database

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str], precision: str | None = None) -> np.ndarray:
        """One float32 logit per pair ``(queries[i], passages[i])``, as ``model.score_pairs`` gives it in
        ``precision`` (None: the model's own)."""
        if len(queries) != len(passages):
            raise ConfigError(f"{len(queries)} queries but {len(passages)} passages")
        precision = self.model.precision if precision is None else resolve_precision(precision, self.model.device)
        if not queries or precision == "int8":  # nothing to score; int8: a score depends on its batch, never kept
            return self.model.score_pairs(queries, passages, precision)
        keys = [pair_key(q, p) for q, p in zip(queries, passages)]
        database = self._database(precision)
        known = self._read(database, keys) if database is not None else None
        if known is None:  # no entry, or one that could not be read: not written either
            database, known = None, {}
        todo, seen = [], set(known)  # the first place of each pair not found, in the order given
        for i, key in enumerate(keys):
            if key not in seen:
                seen.add(key)
                todo.append(i)
        if todo:
            values = self.model.score_pairs([queries[i] for i in todo], [passages[i] for i in todo], precision)
            new = dict(zip((keys[i] for i in todo), np.asarray(values, dtype=np.float32).tolist()))
            if database is not None:
                self._write(database, new)
            known.update(new)
        self.scored += len(todo)
        self.found += len(set(keys)) - len(todo)
        return np.asarray([known[key] for key in keys], dtype=np.float32)

    def _database(self, precision: str) -> Path | None:
        """The entry's database for the model as it is now (made when new), or None when the cache is off (warned)."""
        if self._off:
            return None
        tokenizer = self.model.tokenizer  # besides the weights, what a score depends on that may change in place
        current = (
            weights_key(self.model.model),
            precision,
            self.model.max_length,
            self.model.device.type,
            id(tokenizer),
            getattr(tokenizer, "truncation_side", None),
            getattr(tokenizer, "padding_side", None),
            fingerprint_json(self.model.model.config.to_dict()),
        )
        if current in self._entries:
            return self._entries[current]
        identity = scorer_identity(self.model, precision)
        directory = self.cache_dir / CACHE_FOLDER / fingerprint_json(identity)
        database = directory / DATABASE
        try:
            directory.mkdir(parents=True, exist_ok=True)
            if not (directory / IDENTITY_FILE).is_file():
                atomic_write_text(directory / IDENTITY_FILE, json.dumps({"source": str(self.model.source), **identity}))
            if database.is_symlink() or database.exists() and not database.is_file():
                raise OSError(f"{database} is not a plain file")
            with closing(sqlite3.connect(database, timeout=LOCK_TIMEOUT_S)) as connection, connection:
                connection.execute("CREATE TABLE IF NOT EXISTS scores (pair BLOB PRIMARY KEY, score REAL NOT NULL)")
        except (OSError, sqlite3.Error) as err:
            return self._pass_over(database, err)
        self._entries[current] = database
        return database

    def _read(self, database: Path, keys: list[bytes]) -> dict[bytes, float] | None:
        wanted, found = list(dict.fromkeys(keys)), {}
        try:
            with closing(sqlite3.connect(database, timeout=LOCK_TIMEOUT_S)) as connection:
                for start in range(0, len(wanted), LOOKUP_BATCH):
                    batch = wanted[start : start + LOOKUP_BATCH]
                    marks = ",".join("?" * len(batch))
                    rows = connection.execute(f"SELECT pair, score FROM scores WHERE pair IN ({marks})", batch)
                    found.update((bytes(pair), float(score)) for pair, score in rows)
        except sqlite3.Error as err:
            return self._pass_over(database, err)
        return found

    def _write(self, database: Path, scores: dict[bytes, float]) -> None:
        try:
            with closing(sqlite3.connect(database, timeout=LOCK_TIMEOUT_S)) as connection, connection:
                connection.executemany("INSERT OR IGNORE INTO scores VALUES (?, ?)", scores.items())
        except sqlite3.Error as err:
            self._pass_over(database, err)

    def _pass_over(self, database: Path, err: Exception) -> None:
        """Warn once and turn the cache off for this scorer (a locked or damaged entry stays so: no call waits on it
        again)."""
        if not self._off:
            warnings.warn(
                f"the pair-score cache {database} cannot be used ({err}): scoring without it", DataWarning, stacklevel=3
            )
        self._off = True
        return None
