"""Training examples and batches for phrase retrieval (training-inference-gap §4).

An example is a question with its gold phrase: the first answer span, as (start, end) positions in the
window of its passage that holds the span with the most context. A step trains on ``passages_per_batch``
passage *groups*: one passage with up to ``questions_per_passage`` of its questions (so a passage is encoded
once for several questions). Each group may bring ``hard_negatives`` hard-negative passages, sampled from
its questions' mined lists (a random training passage without any of the group's answers when the lists
run out: the paper's footnote 6). Everything a step sees is a function of (seed, epoch, step), so a resumed
run trains on the same batches.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from densepass.data.dataset import Corpus
from densepass.data.squad import AnswerSpan
from densepass.errors import DataError, DataWarning
from densepass.evaluation.answers import has_answer
from densepass.phrase.windows import TokenizedPassage, char_span_to_tokens


@dataclass
class PhraseExample:
    """A question and its gold phrase: ``start`` / ``end`` are input positions in window ``window`` of corpus
    row ``passage``."""

    qid: str
    question: str
    passage: int
    window: int
    start: int
    end: int
    answers: list[str]


def training_examples(
    questions: dict[str, str],
    spans: dict[str, list[AnswerSpan]],
    passage_of: dict[str, str],
    corpus: Corpus,
    tokenized: dict[int, TokenizedPassage],
    qids: Sequence[str],
) -> list[PhraseExample]:
    """Examples of ``qids`` (their first answer span); a span no token or no window holds is skipped, counted
    in one warning."""
    out, skipped, first = [], 0, None
    for qid in qids:
        row = corpus.position(passage_of[qid])
        passage, span = tokenized[row], spans[qid][0]
        tokens = char_span_to_tokens(passage.offsets, span.start, span.end)
        window = None if tokens is None else passage.window_for_span(*tokens)
        if window is None:
            skipped += 1
            first = first or qid
            continue
        w = passage.windows[window]
        start, end = (w.first + t - w.start for t in tokens)
        answers = list(dict.fromkeys(s.text for s in spans[qid]))
        out.append(PhraseExample(qid, questions[qid], row, window, start, end, answers))
    if skipped:
        warnings.warn(
            f"{skipped} questions whose answer no window holds, skipped for training (first: {first})",
            DataWarning,
            stacklevel=2,
        )
    if not out:
        raise DataError("no training question has an answer span inside a passage window")
    return out


def plan_epoch(
    examples: Sequence[PhraseExample], passages_per_batch: int, questions_per_passage: int, seed: int, epoch: int
) -> list[list[list[int]]]:
    """The epoch's batches: lists of groups, a group being example indices on one passage."""
    rng = np.random.default_rng([seed, epoch])
    by_passage: dict[int, list[int]] = {}
    for i, example in enumerate(examples):
        by_passage.setdefault(example.passage, []).append(i)
    groups = []
    for members in by_passage.values():
        order = [members[j] for j in rng.permutation(len(members))]
        groups += [order[lo : lo + questions_per_passage] for lo in range(0, len(order), questions_per_passage)]
    groups = [groups[j] for j in rng.permutation(len(groups))]
    return [groups[lo : lo + passages_per_batch] for lo in range(0, len(groups), passages_per_batch)]


def sample_hard_negatives(
    groups: Sequence[Sequence[int]],
    examples: Sequence[PhraseExample],
    hard: dict[str, list[int]],
    h: int,
    train_rows: Sequence[int],
    corpus: Corpus,
    rng: np.random.Generator,
) -> list[int]:
    """``h`` hard-negative passage rows per group (not a passage of the batch, never repeated in the batch)."""
    taken = {examples[i].passage for group in groups for i in group}
    out = []
    for group in groups:
        pool = list(dict.fromkeys(row for i in group for row in hard.get(examples[i].qid, []) if row not in taken))
        answers = [a for i in group for a in examples[i].answers]
        for _ in range(h):
            pool = [row for row in pool if row not in taken]
            if pool:
                row = pool[int(rng.integers(len(pool)))]
            else:
                row = _random_negative(train_rows, taken, answers, corpus, rng)
                if row is None:
                    break
            taken.add(row)
            out.append(row)
    return out


def _random_negative(
    rows: Sequence[int], taken: set[int], answers: list[str], corpus: Corpus, rng: np.random.Generator
) -> int | None:
    """A random passage outside ``taken`` that contains none of ``answers`` (None: tried 50 and found none)."""
    for _ in range(50):
        row = int(rows[int(rng.integers(len(rows)))])
        if row not in taken and not has_answer(corpus.texts[row], answers):
            return row
    return None
