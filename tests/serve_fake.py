"""A small deterministic searcher for the search-service tests and the load-test smoke run.

Scores are word overlap (shared words / query words) with a handful of passages, ties broken by id; every
``search_batch`` call is logged. ``gate`` holds calls (queue-full and shutdown tests); the words "forbidden"
and "explode" make a query raise a ``DataError`` and a ``RuntimeError``. Run as a script, it serves itself:
``python3 tests/serve_fake.py --port 8000 [--max-batch-size 1] [--delay-ms 5] [--embeddings]``; with
``--embeddings`` (``FakeSearcher(embeddings=True)``) it also embeds (:class:`FakeEmbedder`, the embedding routes).
"""

from __future__ import annotations

import argparse
import re
import threading
import time
from dataclasses import dataclass

import numpy as np

from densepass.errors import DataError

PASSAGES = [
    ("p0", "vlc", "VLC media player: plays audio and video files, DVDs and network streams"),
    ("p1", "gimp", "GNU Image Manipulation Program: edit and retouch images and photos"),
    ("p2", "postfix", "High-performance mail server: a mail transport agent"),
    ("p3", "python3", "Interactive high-level object-oriented language: the Python interpreter"),
    ("p4", "htmldoc", "Converts <b>HTML</b> files to PDF <script>alert('markup')</script> for the web"),
    ("p5", "mpv", "Video player based on MPlayer: audio and video playback from the command line"),
]


@dataclass
class FakeHit:
    """A hit as the search pipeline gives it; ``answer`` is None here (dropped from the JSON)."""

    id: str
    score: float
    title: str
    text: str
    answer: str | None = None


def words(text: str) -> set[str]:
    return set(re.findall(r"\w+", text.lower()))


class FakeEmbedder:
    """Embeds a text as its normalised counts of the letters a-h (8 dimensions), one call logged per batch
    (``batches``: (texts, side)); each call takes ``delay_s``."""

    name, names, dim, prefix_dims = "fake", ("fake",), 8, []

    def __init__(self, delay_s: float = 0.0):
        self.delay_s = delay_s
        self.batches: list[tuple[list[str], str]] = []

    def embed(self, texts: list[str], side: str, truncate: bool = True) -> list[tuple[np.ndarray, int]]:
        self.batches.append((list(texts), side))
        time.sleep(self.delay_s)
        return [(self.vector(text), len(text.split())) for text in texts]

    @staticmethod
    def vector(text: str) -> np.ndarray:
        """The embedding of one text (the reference the service's answers are compared with)."""
        counts = np.array([text.lower().count(c) for c in "abcdefgh"], dtype=np.float32) + 1e-3
        return counts / np.linalg.norm(counts)

    def describe(self) -> dict:
        return {"model": self.name, "dim": self.dim}


class FakeSearcher:
    """Word-overlap searcher over :data:`PASSAGES` with a call log (``batches``: (queries, k) per call); with
    ``embeddings``, a :class:`FakeEmbedder` taking as long per call (``embedder``)."""

    nested_top_k = True  # its ranking (score, then id) for a larger k starts with a smaller k's: any k share a batch

    def __init__(self, delay_s: float = 0.0, embeddings: bool = False):
        self.delay_s = delay_s
        self.embedder = FakeEmbedder(delay_s) if embeddings else None
        self.batches: list[tuple[list[str], int]] = []
        self.gate: threading.Event | None = None  # when set, each call waits until the event is set
        self.entered = threading.Event()  # set when a call starts

    @property
    def calls(self) -> int:
        return len(self.batches)

    def search_batch(self, queries: list[str], k: int) -> list[list[FakeHit]]:
        self.batches.append((list(queries), k))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(30)
        time.sleep(self.delay_s)
        return [self.search_one(query, k) for query in queries]

    def search_one(self, query: str, k: int) -> list[FakeHit]:
        """The hits for one query (the reference the service's answers are compared with)."""
        query_words = words(query)
        if "forbidden" in query_words:
            raise DataError("the query contains the forbidden word")
        if "explode" in query_words:
            raise RuntimeError("the fake index exploded\nwith a second line")
        scored = [  # a query without words (say "?!") matches nothing
            (len(query_words & words(f"{title} {text}")) / max(1, len(query_words)), pid, title, text)
            for pid, title, text in PASSAGES
        ]
        ranked = sorted((s for s in scored if s[0] > 0), key=lambda s: (-s[0], s[1]))
        return [FakeHit(pid, score, title, text) for score, pid, title, text in ranked[:k]]

    def describe(self) -> dict:
        return {"kind": "fake word overlap", "passages": len(PASSAGES)}


class DepthSearcher(FakeSearcher):
    """Ranks as an index whose results depend on k (a binary index rescores k x its multiplier candidates): the
    fake's best 2k, re-ranked by the length of their text (shortest first, ties by id), cut to k; it declares
    nothing, and has no index kind, so each k is batched apart."""

    nested_top_k = None

    def search_one(self, query: str, k: int) -> list[FakeHit]:
        candidates = super().search_one(query, 2 * k)
        return sorted(candidates, key=lambda hit: (len(hit.text), hit.id))[:k]


class FakeReranker:
    """A reranker scoring each (query, text) pair as the number its text spells (``"40"``: 40.0)."""

    def score_pairs(self, queries: list[str], passages: list[str]) -> np.ndarray:
        return np.array([float(text) for text in passages], dtype=np.float64)

    def describe(self) -> dict:
        return {"kind": "fake: the text's number"}


def parser() -> argparse.ArgumentParser:
    """The fake service's command line."""
    parser = argparse.ArgumentParser(description="serve the fake searcher")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="time each searcher call takes")
    parser.add_argument("--embeddings", action="store_true", help="serve the embedding routes too (FakeEmbedder)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes behind the port")
    return parser


def worker_app():
    """The app of one worker process of ``--workers N``."""
    from densepass.serve import ServeSettings
    from densepass.serve.app import worker_app, worker_argv

    args = parser().parse_args(worker_argv())
    searcher = FakeSearcher(args.delay_ms / 1000, args.embeddings)
    return worker_app(searcher, ServeSettings(max_batch_size=args.max_batch_size), "127.0.0.1", None)


if __name__ == "__main__":
    import sys

    from densepass.serve import ServeSettings, run_server
    from densepass.serve.app import run_workers

    args = parser().parse_args()
    settings = ServeSettings(max_batch_size=args.max_batch_size)
    if args.workers > 1:
        run_workers("serve_fake:worker_app", sys.argv[1:], args.workers, "127.0.0.1", args.port, settings, "warning")
    else:
        run_server(
            FakeSearcher(args.delay_ms / 1000, args.embeddings), port=args.port, log_level="warning", settings=settings
        )
