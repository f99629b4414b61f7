"""Checks of the texts densepass reads and is given: lone surrogates and blank texts.

A lone surrogate (U+D800 to U+DFFF) is not a Unicode character: a Python string holds one only from a JSON
``\\ud800``-style escape without its pair (or an argument decoded with ``surrogateescape``), it cannot be written
as UTF-8, and a tokenizer fails on it deep inside (``TypeError: TextEncodeInput must be ...``). The readers refuse
it with the file and line (``data.beir``, ``data.reader_helpers.read_json``), and texts given through the Python API are
checked where they enter (encoding, searching).

A blank text has no visible character: empty, whitespace, or only invisible characters such as the zero-width
space U+200B, the word joiner U+2060 and the byte-order mark U+FEFF (Unicode categories Cc, Cf, Zs, Zl, Zp), which
a tokenizer drops, leaving nothing to encode.

>>> lone_surrogate("caf\\u00e9 \\ud800"), lone_surrogate("caf\\u00e9")
(5, None)
>>> is_blank(" \\u200b\\u2060 "), is_blank("\\u200b a")
(True, False)
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from densepass.errors import DataError

_SURROGATE = re.compile(r"[\ud800-\udfff]")
_INVISIBLE = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})


def lone_surrogate(text: str) -> int | None:
    """The position of the first lone surrogate in ``text``; None when it has none."""
    if text.isascii():
        return None
    found = _SURROGATE.search(text)
    return None if found is None else found.start()


def surrogate_problem(text: str) -> str | None:
    """What is wrong with ``text`` when it holds a lone surrogate (for an error message); None when nothing is."""
    at = lone_surrogate(text)
    if at is None:
        return None
    return (
        f"a lone surrogate U+{ord(text[at]):04X} (character {at + 1}) is not a Unicode character "
        "(a \\ud800-style JSON escape without its pair?)"
    )


def is_blank(text: str) -> bool:
    """Whether ``text`` has no visible character (empty, whitespace or invisible characters only)."""
    if not text or text.isspace():
        return True
    return all(unicodedata.category(c) in _INVISIBLE for c in text)


def check_texts(texts: Iterable[str], what: str) -> None:
    """A one-line DataError naming the first of ``texts`` (``what`` 3, counted from 0) that holds a lone
    surrogate. Only a list or tuple is looked at: texts read on demand (``LazyTexts``) come from a file its reader
    checked, and are not read again for this."""
    if not isinstance(texts, (list, tuple)):
        return
    for i, text in enumerate(texts):
        if isinstance(text, str):
            problem = surrogate_problem(text)
            if problem is not None:
                raise DataError(f"{what} {i}: {problem}")


@contextmanager
def tokenizing(texts: Iterable[str], what: str = "text") -> Iterator[None]:
    """Around a tokenizer call on ``texts``: its TypeError on a lone surrogate becomes the one-line DataError of
    ``check_texts`` (what texts given through the Python API reach; nothing is checked unless it fails)."""
    try:
        yield
    except TypeError:
        check_texts(texts, what)
        raise


def might_hold_surrogates(raw: str | bytes) -> bool:
    """Whether raw JSON text has a surrogate escape (``\\udXXX``): only then can its decoded strings hold a lone
    surrogate (a quick test before looking at every decoded string)."""
    if isinstance(raw, bytes):
        return b"\\ud" in raw or b"\\uD" in raw
    return "\\ud" in raw or "\\uD" in raw


def surrogate_in(value: Any) -> tuple[str, str] | None:
    """``(where, problem)`` of the first string of a decoded JSON value (keys included) that holds a lone
    surrogate: ``where`` is ``field 'text'`` for a top-level field, else a JSON path such as
    ``[3].positive_ctxs[0].title`` or ``data[0].paragraphs[1].context``; None when no string holds one."""
    if isinstance(value, dict):  # a record: its own fields by name
        for key, item in value.items():
            if isinstance(item, str) and surrogate_problem(item) is not None:
                return f"field {key!r}", surrogate_problem(item)
    found = _surrogate_at(value, "")
    return None if found is None else (found[0] or "the value", found[1])


def _surrogate_at(value: Any, path: str) -> tuple[str, str] | None:
    if isinstance(value, str):
        problem = surrogate_problem(value)
        return None if problem is None else (path, problem)
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{path}.{key}" if path else str(key)
            problem = surrogate_problem(key)
            if problem is not None:
                return f"{inner} (the key)", problem
            found = _surrogate_at(item, inner)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


_ESCAPE = re.compile(r"\\u[dD]([89a-fA-F])[0-9a-fA-F]{2}")


def lone_escape_line(raw: str) -> int | None:
    """The line of ``raw`` JSON text with the first surrogate escape that is not half of a pair (a high one,
    ``\\ud800`` to ``\\udbff``, followed at once by a low one); None when every escape is paired."""
    escapes = list(_ESCAPE.finditer(raw))
    i = 0
    while i < len(escapes):
        high = escapes[i].group(1).lower() in "89ab"
        paired = (
            high
            and i + 1 < len(escapes)
            and escapes[i + 1].start() == escapes[i].end()
            and escapes[i + 1].group(1).lower() in "cdef"
        )
        if not paired:
            return raw.count("\n", 0, escapes[i].start()) + 1
        i += 2
    return None
