"""coCondenser span pairs (abs-condenser-openqa §3.3): two random spans from each document.

Passages are grouped into documents by ``doc_id``; a document's token sequence is its passages' tokens
in corpus order, joined by [SEP]. Each span has a length drawn uniformly from [min_tokens, max_tokens]
and capped at the document's length, and a uniformly random start, so a document with one short
passage gives two (possibly identical) spans of it; the two spans are then masked independently.
"""

from __future__ import annotations

import random

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError

Span = tuple[int, int]  # [start, end) token offsets in the document


def group_documents(corpus: Corpus) -> list[list[int]]:
    """Passage positions of each document, documents in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for position, doc_id in enumerate(corpus.doc_ids):
        groups.setdefault(doc_id, []).append(position)
    return list(groups.values())


def sample_span(length: int, min_tokens: int, max_tokens: int, rng: random.Random) -> Span:
    """A random span of a ``length``-token document."""
    if not 1 <= min_tokens <= max_tokens:
        raise ConfigError(f"span lengths need 1 <= min <= max, got min={min_tokens}, max={max_tokens}")
    if length < 1:
        raise ConfigError("cannot sample a span from an empty document")
    size = min(rng.randint(min_tokens, max_tokens), length)
    start = rng.randint(0, length - size)
    return start, start + size


def span_pair(length: int, min_tokens: int, max_tokens: int, rng: random.Random) -> tuple[Span, Span]:
    """Two independent random spans of one document (h_i1, h_i2 of eq. 10)."""
    return sample_span(length, min_tokens, max_tokens, rng), sample_span(length, min_tokens, max_tokens, rng)
