"""Settings of the search service: request limits and micro-batching, with the command-line flags for them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field

from densepass.errors import ConfigError


@dataclass(frozen=True)
class ServeSettings:
    """Limits and micro-batching of the search service; every field has a documented default (its ``help``).

    ``max_batch_size=1`` turns micro-batching off: each request is its own searcher call.
    """

    max_queries_per_request: int = field(default=64, metadata={"help": "queries in one POST /search"})
    max_query_chars: int = field(default=1000, metadata={"help": "characters in one query"})
    max_k: int = field(default=100, metadata={"help": "largest k (hits per query) a request may ask for"})
    max_body_bytes: int = field(default=1_048_576, metadata={"help": "bytes in a request body"})
    max_batch_size: int = field(
        default=64,
        metadata={
            "help": "queries in one searcher call, gathered from concurrent requests (1: batching off, one call per "
            "request); a request is never split, and one larger than this is searched alone"
        },
    )
    max_wait_ms: float = field(
        default=2.0,
        metadata={"help": "how long a batch waits for more queries after its first one arrived, in milliseconds"},
    )
    max_queue: int = field(
        default=1024, metadata={"help": "queries waiting for the searcher; beyond it requests get 503 with Retry-After"}
    )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, real = getattr(self, f.name), isinstance(f.default, float)
            kinds = (int, float) if real else int
            if isinstance(value, bool) or not isinstance(value, kinds) or value < (0 if real else 1):
                raise ConfigError(
                    f"serve setting {f.name} must be {'a number >= 0' if real else 'an integer >= 1'}, got {value!r}"
                )
        if self.max_queries_per_request > self.max_queue:
            raise ConfigError(
                f"max_queries_per_request ({self.max_queries_per_request}) exceeds max_queue "
                f"({self.max_queue}): such a request could never be queued"
            )

    @property
    def batching(self) -> bool:
        """Whether concurrent requests are searched together (``max_batch_size > 1``)."""
        return self.max_batch_size > 1


def add_settings_arguments(parser: argparse.ArgumentParser) -> None:
    """Add one ``--max-...`` flag per :class:`ServeSettings` field (e.g. ``--max-batch-size``) to ``parser``."""
    for f in dataclasses.fields(ServeSettings):
        parser.add_argument(
            f"--{f.name.replace('_', '-')}",
            type=type(f.default),
            default=f.default,
            help=f"{f.metadata['help']} (default: {f.default})",
        )


def settings_from_args(args: argparse.Namespace) -> ServeSettings:
    """The :class:`ServeSettings` given by the flags of :func:`add_settings_arguments` (checked)."""
    return ServeSettings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings)})
