"""Phrase search: span scoring and the span constraint against a brute-force enumeration, character offsets
that map back to the exact answer text, the token filter threshold, and save -> load -> search."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import save_tiny_bert
from densepass.data.paths import default_data_dir
from densepass.data.squad import load_squad_spans
from densepass.errors import ConfigError, DataError
from densepass.index.base import load_index
from densepass.phrase.config import PhraseModelConfig
from densepass.phrase.model import PhraseEncoder, TokenFilter
from densepass.phrase.span_search import span_limits, top_passages, top_spans
from densepass.phrase.windows import char_span_to_tokens, token_span_to_chars, tokenize_passages
from densepass.pipelines.search import SearchPipeline
from densepass.serve.searcher import hit_to_json

SMALL = PhraseModelConfig(max_length=40, stride=8, title_max_tokens=6, max_answer_tokens=5)
PASSAGES = [
    {
        "id": "sb",
        "title": "Super Bowl 50",
        "text": "The Denver Broncos beat the Carolina Panthers 24-10 to win "
        "Super Bowl 50, played on February 7, 2016, at Levi's Stadium in Santa Clara, California. " * 2,
    },
    {
        "id": "tesla",
        "title": "Nikola Tesla",
        "text": "Nikola Tesla was a Serbian-American inventor, electrical "
        "engineer and futurist best known for the alternating current (AC) electricity supply system.",
    },
    {"id": "empty", "title": "Nothing", "text": ""},
    {"id": "short", "title": "", "text": "Café naïve résumé."},
]
QUESTIONS = ["Who won Super Bowl 50?", "What was Tesla known for?", "where was the game played"]


def brute_spans(a: np.ndarray, b: np.ndarray, bounds: list[int], max_len: int) -> list[tuple[float, int, int]]:
    """Every valid (score, start, end): same passage, start <= end < start + max_len, finite scores."""
    out = []
    for p in range(len(bounds) - 1):
        for i in range(bounds[p], bounds[p + 1]):
            for j in range(i, min(bounds[p + 1], i + max_len)):
                if np.isfinite(a[i]) and np.isfinite(b[j]):
                    out.append((float(a[i] + b[j]), i, j))
    return sorted(out, key=lambda t: -t[0])


@st.composite
def token_tables(draw):
    lengths = draw(st.lists(st.integers(0, 7), min_size=1, max_size=5))
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n, q = int(bounds[-1]), draw(st.integers(1, 3))
    rng = np.random.default_rng(draw(st.integers(0, 10_000)))
    a, b = rng.normal(size=(q, n)), rng.normal(size=(q, n))
    a[rng.random((q, n)) < 0.2] = -np.inf  # filtered start vectors
    b[rng.random((q, n)) < 0.2] = -np.inf
    return bounds, a, b, draw(st.integers(1, 6)), draw(st.integers(1, 12))


@settings(max_examples=150, deadline=None)
@given(token_tables())
def test_top_spans_are_the_best_valid_pairs_of_a_brute_force_enumeration(case):
    bounds, a, b, max_len, k = case
    limit = span_limits(torch.from_numpy(bounds), max_len)
    scores, starts, ends = top_spans(torch.from_numpy(a).float(), torch.from_numpy(b).float(), limit, k)
    for q in range(len(a)):
        want = brute_spans(a[q].astype(np.float32), b[q].astype(np.float32), bounds.tolist(), max_len)[:k]
        got = [(s, i, j) for s, i, j in zip(scores[q].tolist(), starts[q].tolist(), ends[q].tolist()) if i >= 0]
        assert [(i, j) for _, i, j in got] == [(i, j) for _, i, j in want]
        assert [s for s, _, _ in got] == pytest.approx([s for s, _, _ in want], rel=1e-6)
        assert all(not np.isfinite(s) for s in scores[q].tolist()[len(want) :])


@settings(max_examples=100, deadline=None)
@given(token_tables())
def test_passages_are_ranked_by_their_best_valid_phrase(case):
    bounds, a, b, max_len, k = case
    limit = span_limits(torch.from_numpy(bounds), max_len)
    passage_of_row = torch.from_numpy(np.repeat(np.arange(len(bounds) - 1), np.diff(bounds)))
    scores, rows = top_passages(
        torch.from_numpy(a).float(), torch.from_numpy(b).float(), limit, passage_of_row, len(bounds) - 1, k
    )
    for q in range(len(a)):
        best = {}
        for score, i, _ in brute_spans(a[q].astype(np.float32), b[q].astype(np.float32), bounds.tolist(), max_len):
            p = int(np.searchsorted(bounds, i, side="right") - 1)
            best.setdefault(p, score)
        want = sorted(best.items(), key=lambda t: -t[1])[:k]
        got = [(r, s) for r, s in zip(rows[q].tolist(), scores[q].tolist()) if r >= 0]
        assert [r for r, _ in got] == [p for p, _ in want]
        assert [s for _, s in got] == pytest.approx([s for _, s in want], rel=1e-6)


# ---- character offsets -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from densepass.models.biencoder import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.sampled_from("Denver Broncos won 24–10 in Santa Clara, Café naïve résumé $5 (AC) 2016.".split()),
        min_size=1,
        max_size=60,
    ),
    st.data(),
)
def test_an_answer_on_word_boundaries_maps_to_tokens_and_back_to_its_exact_text(tokenizer, words, data):
    text = " ".join(words)
    first = data.draw(st.integers(0, len(words) - 1))
    last = data.draw(st.integers(first, len(words) - 1))
    start = len(" ".join(words[:first])) + (1 if first else 0)
    answer = " ".join(words[first : last + 1])
    [passage] = tokenize_passages(tokenizer, ["A title"], [text], 24, 4, 3)
    span = char_span_to_tokens(passage.offsets, start, start + len(answer))
    assert span is not None
    c0, c1 = token_span_to_chars(passage.offsets, *span)
    assert text[c0:c1] == answer
    # every token is represented by a window that holds it, and the windows cover the text
    for row, w in enumerate(passage.owner.tolist()):
        window = passage.windows[w]
        assert window.start <= row < window.start + window.length
        position = window.first + row - window.start
        piece = tokenizer.convert_ids_to_tokens(window.input_ids[position]).removeprefix("##")
        a, b = passage.offsets[row]
        assert piece == "[UNK]" or piece == tokenizer.backend_tokenizer.normalizer.normalize_str(text[a:b])


def test_squad_answers_map_back_to_their_exact_text_unless_they_split_a_token(tokenizer):
    root = default_data_dir() / "squad-v1.1-dev-split"
    if not root.is_dir():
        pytest.skip("shared squad split not here")
    data = load_squad_spans(root)
    corpus = data.dataset.corpus
    passages = tokenize_passages(tokenizer, corpus.titles, corpus.texts, 256, 64, 24)
    exact = total = 0
    for qid, spans in data.spans.items():
        row = corpus.position(data.passage[qid])
        for span in spans:
            first, last = char_span_to_tokens(passages[row].offsets, span.start, span.end)
            assert passages[row].window_for_span(first, last) is not None
            c0, c1 = token_span_to_chars(passages[row].offsets, first, last)
            recovered = corpus.texts[row][c0:c1]
            total += 1
            exact += recovered == span.text
            assert span.text in recovered  # the tokens cover the answer; inexact only inside a word piece
    assert exact / total > 0.99


# ---- the index -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_bert(tmp_path_factory.mktemp("tiny-phrase-bert"), dropout=0.1)  # BertConfig's default
    encoder = PhraseEncoder.from_pretrained(str(path), SMALL)
    encoder.filter = TokenFilter(encoder.dim)
    encoder.eval()
    return encoder


def test_index_search_is_the_brute_force_best_span_of_its_token_vectors(model):
    from densepass.phrase.index import PhraseIndex

    index = PhraseIndex.build(model, PASSAGES, vector_dtype="float32")
    assert index.stats()["tokens"] == int(index.bounds[-1]) > 0
    assert index.bounds[3] == index.bounds[2]  # the empty passage has no tokens
    assert any(
        len(w) > 1 for w in [p.windows for p in model.tokenize_passages([PASSAGES[0]["title"]], [PASSAGES[0]["text"]])]
    )
    q_start, q_end = model.encode_questions(QUESTIONS)
    a, b = q_start @ index.stored["start"][1].T, q_end @ index.stored["end"][1].T
    results = index.search(QUESTIONS, k=7)
    for q in range(len(QUESTIONS)):
        want = brute_spans(a[q], b[q], index.bounds.tolist(), SMALL.max_answer_tokens)[:7]
        phrases = results.phrases(q)
        assert [round(p[4], 4) for p in phrases] == [round(s, 4) for s, _, _ in want]
        for (pid, answer, start, end, _), (_, i, j) in zip(phrases, want):
            text = index.passages.texts[index.passages.position(pid)]
            assert answer == text[start:end] == text[index.offsets[i, 0] : index.offsets[j, 1]]
            assert int(np.searchsorted(index.bounds, i, side="right") - 1) == index.passages.position(pid)
    with pytest.raises(ConfigError, match=r"^k must be a positive integer, got -1$"):  # (it failed inside torch)
        index.search_passages(QUESTIONS, k=-1)


def test_a_threshold_keeps_only_the_vectors_whose_filter_logit_is_above_it(model):
    from densepass.phrase.index import PhraseIndex

    index = PhraseIndex.build(model, PASSAGES, vector_dtype="float32")
    start_logits, end_logits = index.logits
    threshold = float(np.median(start_logits))
    small = index.filtered(threshold)
    assert small.start_rows.tolist() == np.flatnonzero(start_logits > threshold).tolist()
    assert small.end_rows.tolist() == np.flatnonzero(end_logits > threshold).tolist()
    assert small.stats()["vector_bytes"] < index.stats()["vector_bytes"]
    for phrases in (small.search(QUESTIONS, k=5).phrases(q) for q in range(len(QUESTIONS))):
        for pid, _, start, end, _ in phrases:
            row = index.passages.position(pid)
            rows = np.arange(index.bounds[row], index.bounds[row + 1])
            i = rows[index.offsets[rows, 0] == start][0]
            j = rows[index.offsets[rows, 1] == end][0]
            assert start_logits[i] > threshold and end_logits[j] > threshold
    # building at a threshold gives the same index as filtering afterwards
    built = PhraseIndex.build(model, PASSAGES, vector_dtype="float32", threshold=threshold)
    assert built.search(QUESTIONS, k=5).phrases(1) == small.search(QUESTIONS, k=5).phrases(1)


def test_save_load_search_round_trip_and_through_the_pipeline(model, tmp_path):
    from densepass.phrase.index import PhraseIndex

    model_dir = tmp_path / "model"
    model.save(model_dir)
    loaded_model = PhraseEncoder.from_pretrained(str(model_dir))
    index = PhraseIndex.build(loaded_model, PASSAGES, threshold=-10.0)
    before = index.search(QUESTIONS, k=6)
    index.save(tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["kind"] == "phrase" and manifest["stats"]["start_vectors"] == len(index.start_rows)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        again = load_index(tmp_path / "idx")
    after = again.search(QUESTIONS, k=6)
    assert [after.phrases(q) for q in range(3)] == [before.phrases(q) for q in range(3)]
    assert again.passages.ids == index.passages.ids
    # the search pipeline (densepass search / serve) returns the answer and its span
    hits = SearchPipeline.load(tmp_path / "idx").search(QUESTIONS[0], k=3)
    assert [(h.id, h.answer, h.start, h.end) for h in hits] == [p[:4] for p in before.phrases(0)[:3]]
    assert {"answer", "start", "end"} <= set(hit_to_json(hits[0]))
    run = before.as_run(["a", "b", "c"])
    assert all(len(ranked) == len({p[0] for p in before.phrases(i)}) for i, ranked in enumerate(run.values()))


def test_loading_with_another_phrase_encoder_or_a_damaged_file_is_refused(model, tmp_path):
    from densepass.phrase.index import PhraseIndex

    model_dir = tmp_path / "model"
    model.save(model_dir)
    PhraseIndex.build(PhraseEncoder.from_pretrained(str(model_dir)), PASSAGES).save(tmp_path / "idx")
    other = PhraseEncoder.from_pretrained(str(model_dir))
    with torch.no_grad():
        other.question_start.weight.mul_(2)  # a query-side change: still the same index
    load_index(tmp_path / "idx", model=other)
    with torch.no_grad():
        other.start.weight.mul_(2)
    with pytest.raises(ConfigError, match="another phrase encoder"):
        load_index(tmp_path / "idx", model=other)
    data = Path(tmp_path / "idx" / "start.npy")
    data.write_bytes(data.read_bytes()[:-16])
    with pytest.raises(DataError):
        load_index(tmp_path / "idx")
    with pytest.raises(ConfigError, match="rerank"):
        SearchPipeline(PhraseIndex.build(model, PASSAGES[:1]), reranker=object())


def test_a_threshold_without_a_filter_is_a_one_line_error(model, tmp_path):
    from densepass.phrase.index import PhraseIndex

    model.save(tmp_path / "m")
    plain = PhraseEncoder.from_pretrained(str(tmp_path / "m"))
    plain.filter = None
    with pytest.raises(ConfigError, match="token filter"):
        PhraseIndex.build(plain, PASSAGES, threshold=0.0)
    with pytest.raises(ConfigError, match="no filter logits"):
        PhraseIndex.build(plain, PASSAGES).filtered(0.0)


def test_the_search_service_returns_the_answer_and_its_span(model):
    from fastapi.testclient import TestClient

    from densepass.phrase.index import PhraseIndex
    from densepass.serve import create_app

    pipeline = SearchPipeline(PhraseIndex.build(model, PASSAGES))
    expected = pipeline.search(QUESTIONS[1], k=2)
    with TestClient(create_app(pipeline), base_url="http://localhost") as client:  # an allowed Host
        response = client.post("/search", json={"query": QUESTIONS[1], "k": 2})
        health = client.get("/health").json()
    assert response.status_code == 200
    hits = response.json()["results"][0]
    assert [(h["id"], h["answer"], h["start"], h["end"]) for h in hits] == [
        (h.id, h.answer, h.start, h.end) for h in expected
    ]
    assert hits[0]["text"][hits[0]["start"] : hits[0]["end"]] == hits[0]["answer"]
    assert "phrase" in json.dumps(health)
