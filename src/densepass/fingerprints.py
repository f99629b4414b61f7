"""Content fingerprints: what caches, indexes and checkpoints are keyed by (never a path).

A fingerprint is a short hex BLAKE2b digest of content: a model's weights (every tensor of its
state dict, by name), a corpus (ids, titles, texts, documents), a list of texts, or any JSON-able
configuration. Two things with the same fingerprint have the same content; anything saved under a
fingerprint is reused only when the fingerprint of what is asked for matches.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

DIGEST_BYTES = 16


def _hasher():
    return hashlib.blake2b(digest_size=DIGEST_BYTES)


def fingerprint_strings(items: Iterable[str]) -> str:
    """Digest of a sequence of strings (each length-prefixed, so ``["ab", "c"]`` differs from ``["a", "bc"]``)."""
    h = _hasher()
    for item in items:
        data = item.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def fingerprint_json(value: Any) -> str:
    """Digest of a JSON-able value (dataclasses are converted; keys sorted, so dict order does not matter)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return fingerprint_strings([json.dumps(value, sort_keys=True, default=str)])


def fingerprint_weights(module: nn.Module) -> str:
    """Digest of every tensor in ``module.state_dict()`` (names, dtypes, shapes and bytes), wherever it lives."""
    import torch  # here, not at the top: reading data and evaluating runs need this module, not torch

    h = _hasher()
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict().items()):
            t = tensor.detach().to("cpu").contiguous()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            if t.numel():
                h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def fingerprint_tokenizer(tokenizer) -> str:
    """Digest of what a tokenizer turns text into: a fast tokenizer's whole definition (vocabulary, normaliser,
    pre-tokeniser, post-processor; not its truncation and padding state, which each call sets), else its class and
    vocabulary."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        definition.pop("truncation", None), definition.pop("padding", None)
        return fingerprint_strings([type(tokenizer).__name__, json.dumps(definition, sort_keys=True)])
    vocab = sorted(tokenizer.get_vocab().items())
    return fingerprint_strings([type(tokenizer).__name__, *(f"{token}\t{row}" for token, row in vocab)])


def fingerprint_file(path, chunk: int = 1 << 22) -> str:
    """Digest of a file's bytes."""
    h = _hasher()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            h.update(block)
    return h.hexdigest()


_FILE_DIGESTS: dict[tuple, str] = {}


def fingerprint_file_cached(path) -> str:
    """``fingerprint_file``, computed once per process for a file whose path, size, modification time and inode
    stay the same (a dataset's files are fingerprinted at every check of a run's identity)."""
    import os

    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev)
    if key not in _FILE_DIGESTS:
        _FILE_DIGESTS[key] = fingerprint_file(path)
    return _FILE_DIGESTS[key]


def fingerprint_corpus(corpus) -> str:
    """Digest of a ``Corpus``: its passage ids, titles, texts and document ids, in order."""
    sep = ["\x00"]  # streamed, column by column: a corpus read from its file is never all in memory
    return fingerprint_strings(itertools.chain(corpus.ids, sep, corpus.titles, sep, corpus.texts, sep, corpus.doc_ids))


def fingerprint_directory(path) -> str:
    """Digest of every file under a directory (relative names and bytes), e.g. a saved model."""
    from pathlib import Path

    root = Path(path)
    h = _hasher()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith(".")):
        h.update(str(file.relative_to(root)).encode() + b"\x00")
        h.update(bytes.fromhex(fingerprint_file(file)))
    return h.hexdigest()


def library_versions() -> dict[str, str]:
    """The versions of the code a cached result comes out of: densepass's own, and the libraries that rank, encode
    or score (an upgrade of one may change a result, so a result of the old one is not read)."""
    from importlib.metadata import PackageNotFoundError, version

    from densepass.version import __version__

    versions = {"densepass": __version__}
    for package in ("bm25s", "PyStemmer", "numpy", "torch", "transformers", "tokenizers"):
        try:
            versions[package] = version(package)
        except PackageNotFoundError:
            versions[package] = "absent"
    return versions
