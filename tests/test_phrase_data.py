"""SQuAD answer spans for phrase retrieval: checked offsets, counted skips, the passage-level dataset unchanged."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from densepass.data.paths import default_data_dir
from densepass.data.squad import AnswerSpan, load_squad, load_squad_spans
from densepass.errors import DataWarning


def squad_json(paragraphs: list[tuple[str, list[tuple[str, list[tuple[str, object]]]]]]) -> str:
    """One article ``T`` from ``[(context, [(qid, [(answer text, answer_start)])])]``."""
    return json.dumps(
        {
            "data": [
                {
                    "title": "T",
                    "paragraphs": [
                        {
                            "context": context,
                            "qas": [
                                {
                                    "id": qid,
                                    "question": f"question {qid}?",
                                    "answers": [{"text": t, "answer_start": s} for t, s in answers],
                                }
                                for qid, answers in qas
                            ],
                        }
                        for context, qas in paragraphs
                    ],
                }
            ]
        }
    )


def write(root: Path, train: str, dev: str | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "train-v1.1.json").write_text(train)
    if dev is not None:
        (root / "dev-v1.1.json").write_text(dev)
    return root


def test_answer_spans_point_at_their_text_and_repeats_are_merged(tmp_path):
    root = write(
        tmp_path / "s",
        squad_json(
            [("Denver won Super Bowl 50 in Santa Clara.", [("a", [("Denver", 0), ("Denver", 0), ("Santa Clara", 28)])])]
        ),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = load_squad_spans(root)
    assert data.spans == {"a": [AnswerSpan("Denver", 0), AnswerSpan("Santa Clara", 28)]}
    assert data.passage == {"a": "train-0-0"}
    text = data.dataset.corpus.texts[0]
    assert [text[s.start : s.end] for s in data.spans["a"]] == ["Denver", "Santa Clara"]
    assert data.skipped == {"empty passage": 0, "offset mismatch": 0, "no answer": 0}


def test_bad_offsets_unanswered_questions_and_empty_passages_are_skipped_and_counted(tmp_path):
    root = write(
        tmp_path / "s",
        squad_json(
            [
                ("Tesla was an inventor.", [("ok", [("inventor", 13), ("Tesla", 3)]), ("bad", [("inventor", 0)])]),
                ("Edison too.", [("none", []), ("neg", [("Edison", -1)]), ("str", [("Edison", "0")])]),
                ("   ", [("empty", [("x", 0)])]),
            ]
        ),
    )
    with pytest.warns(DataWarning) as caught:
        data = load_squad_spans(root)
    assert data.spans == {"ok": [AnswerSpan("inventor", 13)]}
    assert data.skipped == {"empty passage": 1, "offset mismatch": 4, "no answer": 4}
    messages = [str(w.message) for w in caught]
    assert any("4 answers whose answer_start does not point at their text" in m and "answers[1]" in m for m in messages)
    assert any("1 questions on an empty paragraph" in m for m in messages)
    # the passage-level dataset keeps every question, as before
    assert set(load_squad(root).queries) == {"ok", "bad", "none", "neg", "str", "empty"}


def test_the_shared_squad_split_has_no_skips():
    root = default_data_dir() / "squad-v1.1-dev-split"
    if not root.is_dir():
        pytest.skip("shared squad split not here")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = load_squad_spans(root)
    assert len(data.spans) == 4201 + 760
    assert sum(data.skipped.values()) == 0
