"""Passage identities shared by every layer: content keys and the synthetic half passages.

A passage's *content key* is a stable hash of its encoder input, so that two passages with the same
text count as one (for false-negative masks and duplicate filters). A *half passage* ``<pid>#half0`` /
``<pid>#half1`` is one half of a corpus passage, split at the middle word: the context negative of a
query whose positive's document has no other passage (negative-contrast §4.1).
"""

from __future__ import annotations

import hashlib

from densepass.data.dataset import Corpus


def content_key(text: str) -> int:
    """A stable 63-bit key of a passage's content (equal texts = the same passage for masking)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


HALF_MARK = "#half"


def half_id(passage_id: str, half: int) -> str:
    """The id of half ``half`` (0 or 1) of passage ``passage_id``."""
    return f"{passage_id}{HALF_MARK}{half}"


def parse_half_id(pid: str) -> tuple[str, int] | None:
    """``(base passage id, half)`` for a half id, else None."""
    base, mark, half = pid.rpartition(HALF_MARK)
    return (base, int(half)) if mark and half in ("0", "1") else None


def split_in_half(text: str) -> tuple[str, str]:
    """``text`` cut at its middle word (the first half is the shorter one for an odd word count)."""
    words = text.split()
    middle = len(words) // 2
    return " ".join(words[:middle]), " ".join(words[middle:])


def is_known_passage(corpus: Corpus, pid: str) -> bool:
    """Whether ``pid`` is a passage of ``corpus`` or a half of one."""
    if pid in corpus:
        return True
    parsed = parse_half_id(pid)
    return parsed is not None and parsed[0] in corpus


def passage_input(corpus: Corpus, pid: str, sep_token: str) -> str:
    """Encoder input of a corpus passage or of a half passage."""
    if pid in corpus:
        return corpus.passage_inputs(sep_token, [corpus.position(pid)])[0]
    base, half = parse_half_id(pid)
    row = corpus.position(base)
    text = split_in_half(corpus.texts[row])[half]
    return f"{corpus.titles[row]} {sep_token} {text}" if corpus.titles[row] else text


def passage_text(corpus: Corpus, pid: str) -> str:
    """The text of a corpus passage or of a half passage (no title)."""
    if pid in corpus:
        return corpus.texts[corpus.position(pid)]
    base, half = parse_half_id(pid)
    return split_in_half(corpus.texts[corpus.position(base)])[half]
