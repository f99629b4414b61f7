"""Passages as token windows with character offsets (DensePhrases; training-inference-gap §4.1).

A passage is encoded as ``title [SEP] text`` (the title cut to ``title_max_tokens``; text only without a
title). A text longer than the model's limit is split into windows of at most ``max_length`` tokens that
share ``stride`` tokens with the next one (the tokenizer's overflow). Every token of the text has one row
in the passage's token table (its character span in the text); a window covers a contiguous range of
those rows, and each row is represented by the window where it has the most context, i.e. the largest
min(tokens left, tokens right), as in BERT's SQuAD windows. A phrase is a (start, end) pair of rows, so
it maps back to exactly ``text[offsets[start, 0]:offsets[end, 1]]``.

>>> from transformers import AutoTokenizer
>>> from densepass.models.biencoder import resolve_model_path
>>> tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
>>> [passage] = tokenize_passages(tokenizer, ["Super Bowl"], ["Denver won Super Bowl 50."], 32, 8, 8)
>>> span = char_span_to_tokens(passage.offsets, 11, 24)  # "Super Bowl 50"
>>> span, token_span_to_chars(passage.offsets, *span)
((2, 4), (11, 24))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from densepass.errors import ConfigError, DataError


@dataclass
class Window:
    """One encoder input: token ids and types, and the passage token rows ``[start, start + length)`` it
    holds at input positions ``[first, first + length)``."""

    input_ids: list[int]
    token_type_ids: list[int]
    first: int
    start: int
    length: int

    def context(self, row: int) -> int:
        """Tokens of context the window gives passage row ``row`` (min of left and right)."""
        return min(row - self.start, self.start + self.length - 1 - row)


@dataclass
class TokenizedPassage:
    """A passage's token table (``offsets`` [T, 2]: character span of each text token), its windows, and the
    window that represents each row (``owner`` [T])."""

    offsets: np.ndarray
    windows: list[Window]
    owner: np.ndarray

    def __len__(self) -> int:
        return len(self.offsets)

    def window_for_span(self, start: int, end: int) -> int | None:
        """The window holding rows ``start..end`` with the most context around them (None: no window holds both)."""
        best, best_context = None, -1
        for w, window in enumerate(self.windows):
            if window.start <= start and end < window.start + window.length:
                context = min(window.context(start), window.context(end))
                if context > best_context:
                    best, best_context = w, context
        return best


def check_window_settings(max_length: int, stride: int, title_max_tokens: int) -> None:
    """A one-line error unless a window keeps room for text beyond the stride."""
    room = max_length - title_max_tokens - 3  # [CLS] title [SEP] text [SEP]
    if room < 8 or stride >= room // 2:
        raise ConfigError(
            f"windows of {max_length} tokens with a {title_max_tokens}-token title leave {room} text tokens: "
            f"the stride ({stride}) must be below half of that and at least 8 text tokens must fit"
        )


def _cut_titles(tokenizer: PreTrainedTokenizerBase, titles: Sequence[str], max_tokens: int) -> list[str]:
    """Each title cut at the end of its ``max_tokens``-th token ('' when max_tokens is 0)."""
    if max_tokens == 0:
        return ["" for _ in titles]
    encoded = tokenizer(list(titles), add_special_tokens=False, return_offsets_mapping=True)
    return [
        title if len(offsets) <= max_tokens else title[: offsets[max_tokens - 1][1]]
        for title, offsets in zip(titles, encoded["offset_mapping"])
    ]


def tokenize_passages(
    tokenizer: PreTrainedTokenizerBase,
    titles: Sequence[str],
    texts: Sequence[str],
    max_length: int,
    stride: int,
    title_max_tokens: int,
    chunk: int = 256,
) -> list[TokenizedPassage]:
    """Windows and token tables of passages (``titles[i]``, ``texts[i]``); an empty text has no rows."""
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError("phrase retrieval needs a fast tokenizer (character offsets)")
    check_window_settings(max_length, stride, title_max_tokens)
    titles = _cut_titles(tokenizer, titles, title_max_tokens)
    out: list[TokenizedPassage] = []
    for lo in range(0, len(texts), chunk):
        out += _tokenize_chunk(tokenizer, titles[lo : lo + chunk], list(texts[lo : lo + chunk]), max_length, stride)
    return out


def _tokenize_chunk(
    tokenizer: PreTrainedTokenizerBase, titles: list[str], texts: list[str], max_length: int, stride: int
) -> list[TokenizedPassage]:
    with_title = [i for i, t in enumerate(titles) if t]
    without = [i for i, t in enumerate(titles) if not t]
    windows: list[list[tuple[list[int], list[int], list[tuple[int, int]], list[int | None]]]] = [[] for _ in texts]
    for rows, pair in ((with_title, True), (without, False)):
        if not rows:
            continue
        args = ([titles[i] for i in rows], [texts[i] for i in rows]) if pair else ([texts[i] for i in rows],)
        enc = tokenizer(
            *args,
            truncation="only_second" if pair else True,
            max_length=max_length,
            stride=stride,
            return_overflowing_tokens=True,
            return_offsets_mapping=True,
            return_token_type_ids=True,
        )
        for w, sample in enumerate(enc["overflow_to_sample_mapping"]):
            windows[rows[sample]].append(
                (enc["input_ids"][w], enc["token_type_ids"][w], enc["offset_mapping"][w], enc.sequence_ids(w))
            )
    return [_passage(parts, 1 if titles[i] else 0) for i, parts in enumerate(windows)]


def _passage(parts, text_sequence: int) -> TokenizedPassage:
    """The token table of one passage from its tokenizer windows (their text tokens, deduplicated by span)."""
    rows: dict[tuple[int, int], int] = {}
    spans: list[list[tuple[int, int]]] = []
    firsts: list[int] = []
    for _, _, offsets, sequence in parts:
        text_positions = [p for p, s in enumerate(sequence) if s == text_sequence]
        spans.append([tuple(offsets[p]) for p in text_positions])
        firsts.append(text_positions[0] if text_positions else 0)
        for span in spans[-1]:
            rows.setdefault(span, len(rows))
    ordered = sorted(rows)
    index = {span: r for r, span in enumerate(ordered)}
    windows = []
    for (input_ids, types, _, _), window_spans, first in zip(parts, spans, firsts):
        start = index[window_spans[0]] if window_spans else 0
        if [index[s] for s in window_spans] != list(range(start, start + len(window_spans))):
            raise DataError("a window's text tokens are not contiguous in the passage (tokenizer offsets overlap)")
        windows.append(Window(list(input_ids), list(types), first, start, len(window_spans)))
    owner = np.zeros(len(ordered), dtype=np.int32)
    best = np.full(len(ordered), -1)
    for w, window in enumerate(windows):
        for row in range(window.start, window.start + window.length):
            if window.context(row) > best[row]:
                best[row], owner[row] = window.context(row), w
    offsets = np.asarray(ordered, dtype=np.int64).reshape(-1, 2)
    return TokenizedPassage(offsets, windows, owner)


def char_span_to_tokens(offsets: np.ndarray, start: int, end: int) -> tuple[int, int] | None:
    """Rows ``(first, last)`` of the tokens that cover characters ``[start, end)`` (None: no token does)."""
    if end <= start or len(offsets) == 0:
        return None
    first = int(np.searchsorted(offsets[:, 1], start, side="right"))  # first token ending after `start`
    last = int(np.searchsorted(offsets[:, 0], end, side="left")) - 1  # last token starting before `end`
    if first >= len(offsets) or last < first:
        return None
    return first, last


def token_span_to_chars(offsets: np.ndarray, first: int, last: int) -> tuple[int, int]:
    """The character span ``[start, end)`` of rows ``first..last``."""
    return int(offsets[first, 0]), int(offsets[last, 1])
