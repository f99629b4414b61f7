"""What the service refuses in a text before any model sees it (without importing torch, so that the service's
modules load fast): a lone surrogate, or nothing visible."""

from __future__ import annotations

import re
import unicodedata

INVISIBLE_CATEGORIES = {"Cc", "Cf", "Zs", "Zl", "Zp"}  # controls, format (zero-width) characters, separators
SURROGATE = re.compile("[\ud800-\udfff]")  # only lone ones reach a str: JSON pairs decode to one character
BLANK_LETTERS = {"\u115f", "\u1160", "\u3164", "\uffa0", "\u2800"}  # Hangul fillers and the blank Braille cell


def query_problem(query: str) -> str | None:
    """Why ``query`` cannot be searched (after "the query" / "query i"), or None: a lone surrogate (not
    Unicode, which tokenizers reject with a TypeError), or nothing visible (empty, whitespace, control or
    zero-width characters only)."""
    surrogate = SURROGATE.search(query)
    if surrogate:
        return f"has a lone surrogate U+{ord(surrogate[0]):04X} at character {surrogate.start()}, not valid Unicode"
    if not query.strip():
        return "is empty or whitespace only"
    if all(unicodedata.category(c) in INVISIBLE_CATEGORIES or c in BLANK_LETTERS or c.isspace() for c in query):
        shown = " ".join(dict.fromkeys(f"U+{ord(c):04X}" for c in query if not c.isspace()))
        return f"has no visible character, only whitespace, control or zero-width ones ({shown[:80]})"
    return None
