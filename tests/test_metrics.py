"""Ranking metrics (through ranx), TREC run files, ``make_run`` and DPR answer accuracy, checked
against values computed by hand."""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from densepass.errors import DataError, DataWarning, DensepassError
from densepass.evaluation.answers import has_answer, normalize_answer, top_k_accuracy
from densepass.evaluation.metrics import (
    answered_qrels,
    check_runs_cover,
    evaluate_run,
    make_run,
    paired_significance,
    passage_codes,
    randomization_p,
    read_trec_run,
    write_trec_run,
)


def log2(x: float) -> float:
    return math.log2(x)


# ---- metrics against hand-computed values -----------------------------------------------------

QRELS = {
    "q1": {"a": 2, "b": 1, "z": 0},  # graded; z is judged non-relevant
    "q2": {"c": 1},
    "q3": {"d": 1, "e": 1},
}
RUN = {
    "q1": {"x": 0.9, "a": 0.8, "y": 0.7, "b": 0.6},  # a at rank 2, b at rank 4
    "q2": {"c": 0.5, "w": 0.4},  # c at rank 1
    "q3": {"v": 0.9, "u": 0.8, "d": 0.3},  # d at rank 3, e not retrieved
}


def test_mrr_at_k_matches_hand_computation():
    got = evaluate_run(QRELS, RUN, ["mrr@10", "mrr@2"])
    assert got["mrr@10"] == pytest.approx((1 / 2 + 1 / 1 + 1 / 3) / 3)
    # at cutoff 2, q3's first relevant passage (rank 3) falls out
    assert got["mrr@2"] == pytest.approx((1 / 2 + 1 / 1 + 0) / 3)


def test_recall_at_k_matches_hand_computation():
    got = evaluate_run(QRELS, RUN, ["recall@2", "recall@4"])
    assert got["recall@2"] == pytest.approx((1 / 2 + 1 / 1 + 0 / 2) / 3)
    assert got["recall@4"] == pytest.approx((2 / 2 + 1 / 1 + 1 / 2) / 3)


def test_ndcg_at_k_uses_graded_relevance():
    got = evaluate_run(QRELS, RUN, ["ndcg@4", "ndcg@2"])
    # gain = grade, discount = log2(rank + 1); ideal ranking puts grade 2 first, then grade 1
    q1 = (2 / log2(3) + 1 / log2(5)) / (2 / log2(2) + 1 / log2(3))
    q2 = (1 / log2(2)) / (1 / log2(2))
    q3 = (1 / log2(4)) / (1 / log2(2) + 1 / log2(3))
    assert got["ndcg@4"] == pytest.approx((q1 + q2 + q3) / 3)
    q1_at2 = (2 / log2(3)) / (2 / log2(2) + 1 / log2(3))
    assert got["ndcg@2"] == pytest.approx((q1_at2 + 1 + 0) / 3)


def test_ndcg_distinguishes_grades():
    """Swapping the grade-2 and grade-1 passages must lower nDCG (grades are not binarised)."""
    qrels = {"q": {"a": 2, "b": 1}}
    best = evaluate_run(qrels, {"q": {"a": 2.0, "b": 1.0}}, ["ndcg@2"])["ndcg@2"]
    swapped = evaluate_run(qrels, {"q": {"b": 2.0, "a": 1.0}}, ["ndcg@2"])["ndcg@2"]
    assert best == pytest.approx(1.0)
    assert swapped == pytest.approx((1 / log2(2) + 2 / log2(3)) / (2 / log2(2) + 1 / log2(3)))


def test_query_missing_from_run_scores_zero():
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}}
    got = evaluate_run(qrels, {"q1": {"a": 1.0}}, ["mrr@10", "recall@10", "ndcg@10"])
    assert got == pytest.approx({"mrr@10": (1 + 0) / 2, "recall@10": (1 + 0) / 2, "ndcg@10": (1 + 0) / 2})
    # an empty ranking counts the same as a missing one
    got_empty = evaluate_run(qrels, {"q1": {"a": 1.0}, "q2": {}}, ["mrr@10"])
    assert got_empty["mrr@10"] == pytest.approx((1 + 0) / 2)


def test_run_files_are_evaluated_on_the_queries_they_answer_as_trec_eval_does():
    """A run over a sample of a split (q1 of q1-q3) is evaluated on that sample, with one warning; --all-queries
    (trec_eval -c) counts the rest as zero; a second run (a comparison) widens the sample to the queries of both."""
    qrels = {"q1": {"a": 1}, "q2": {"b": 1}, "q3": {"c": 1}}
    run = {"q1": {"x": 2.0, "a": 1.0}}
    with pytest.warns(DataWarning, match="answers 1 of the 3 queries"):
        kept = answered_qrels(qrels, [run])
    assert kept == {"q1": {"a": 1}} and evaluate_run(kept, run, ["mrr@10"])["mrr@10"] == pytest.approx(1 / 2)
    assert answered_qrels(qrels, [run], all_queries=True) == qrels
    assert evaluate_run(qrels, run, ["mrr@10"])["mrr@10"] == pytest.approx(1 / 2 / 3)
    with pytest.warns(DataWarning, match="answers 2 of the 3"):
        assert set(answered_qrels(qrels, [run, {"q2": {"b": 1.0}}])) == {"q1", "q2"}
    # a run of a sample against a run of the whole split: the comparison says it counts the others as zero
    whole = {q: {p: 1.0} for q, rels in qrels.items() for p in rels}
    with pytest.warns(DataWarning, match=r"answer different queries \(1 and 3 of the 3 evaluated\)"):
        assert answered_qrels(qrels, [run, whole]) == qrels
    with pytest.raises(DataError, match="answers none of the 3 queries"):
        answered_qrels(qrels, [{"q9": {"a": 1.0}}])
    with warnings.catch_warnings():  # two runs of the same queries, with every judged query (trec_eval -c): level
        warnings.simplefilter("error")
        assert answered_qrels(qrels, [run, dict(run)], all_queries=True) == qrels


def test_a_run_made_from_rows_keeps_the_best_score_of_a_passage_listed_twice():
    from densepass.evaluation.metrics import make_run

    run = make_run(["q"], ["a", "b"], np.array([[0.9, 0.8, 0.7]]), np.array([[0, 1, 0]]))
    assert run == {"q": {"a": 0.9, "b": 0.8}}


def test_queries_without_relevant_passages_are_not_averaged():
    qrels = {"q1": {"a": 1}, "q2": {"b": 0}}  # q2 has judgments but nothing relevant
    got = evaluate_run(qrels, {"q1": {"a": 1.0}, "q2": {"b": 1.0}}, ["mrr@10"])
    assert got["mrr@10"] == pytest.approx(1 / 1)


def test_run_queries_absent_from_the_qrels_are_left_out_with_one_warning():
    with pytest.warns(DataWarning, match="1 queries absent from the qrels .*'q9'.*not evaluated"):
        got = evaluate_run({"q1": {"a": 1}}, {"q1": {"b": 2.0, "a": 1.0}, "q9": {"a": 1.0}}, ["mrr@10"])
    assert got["mrr@10"] == pytest.approx(1 / 2)


def test_qrels_without_relevant_pair_raise():
    with pytest.raises(DataError, match="no query in the qrels has a relevant passage"):
        evaluate_run({"q1": {"a": 0}, "q2": {}}, {"q1": {"a": 1.0}}, ["mrr@10"])


def test_accuracy_metrics_without_answers_are_an_error_not_skipped():
    with pytest.raises(DataError, match="accuracy@5 needs answer strings"):
        evaluate_run(QRELS, RUN, ["accuracy@5", "mrr@10"])


def naive_mrr(qrels, run, k):
    """Mean over queries with a relevant passage of 1/rank of the first relevant one in the top k."""
    total, judged = 0.0, 0
    for qid, rels in qrels.items():
        relevant = {p for p, g in rels.items() if g > 0}
        if not relevant:
            continue
        judged += 1
        ranking = sorted(run.get(qid, {}).items(), key=lambda item: -item[1])[:k]
        total += next((1 / rank for rank, (pid, _) in enumerate(ranking, 1) if pid in relevant), 0.0)
    return total / judged


DOCS = [f"d{i}" for i in range(15)]


@st.composite
def qrels_and_run(draw):
    n_queries = draw(st.integers(1, 5))
    qrels, run = {}, {}
    for i in range(n_queries):
        qid = f"q{i}"
        judged = draw(st.lists(st.sampled_from(DOCS), min_size=1, max_size=5, unique=True))
        grades = draw(st.lists(st.integers(0, 2), min_size=len(judged), max_size=len(judged)))
        grades[0] = max(grades[0], 1)  # at least one relevant passage per query
        qrels[qid] = dict(zip(judged, grades))
        if draw(st.booleans()) or i == 0:
            ranked = draw(st.permutations(DOCS))[: draw(st.integers(0, len(DOCS)))]
            # distinct scores, best first: ties would make the expected ranking ambiguous
            run[qid] = {pid: float(len(ranked) - r) for r, pid in enumerate(ranked)}
    return qrels, run


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qrels_and_run())
def test_ranx_mrr_equals_naive_reference(case):
    qrels, run = case
    assert evaluate_run(qrels, run, ["mrr@10"])["mrr@10"] == pytest.approx(naive_mrr(qrels, run, 10))


NAMES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(qrels_and_run(), st.lists(NAMES | st.sampled_from(["-", "__none__"]), min_size=15, max_size=15, unique=True))
def test_passage_ids_of_any_length_or_name_score_as_the_ids_they_stand_for(case, names):
    """ranx is handed codes of one width (``passage_codes``), not the ids: ids renamed to strings of any length, the
    empty-ranking placeholder's name included, give the naive reference's MRR@10 and the original ids' metrics."""
    qrels, run = case
    rename = dict(zip(DOCS, names))
    renamed_qrels = {q: {rename[p]: g for p, g in rels.items()} for q, rels in qrels.items()}
    renamed_run = {q: {rename[p]: s for p, s in ranking.items()} for q, ranking in run.items()}
    metrics = ["mrr@10", "ndcg@10", "recall@5"]
    got = evaluate_run(renamed_qrels, renamed_run, metrics)
    assert got["mrr@10"] == pytest.approx(naive_mrr(qrels, run, 10))
    assert got == pytest.approx(evaluate_run(qrels, run, metrics))


def test_passage_codes_have_one_width_whatever_the_ids():
    codes = passage_codes(["a", "a" * 300], {"é": 1, "-": 2}, ["a"])
    assert list(codes) == ["a", "a" * 300, "é", "-"]  # each id once, in order of first appearance
    assert len(set(codes.values())) == 4 and {len(c) for c in codes.values()} == {8}


@pytest.mark.parametrize("name", ["-", "__none__"])
def test_a_query_missing_from_the_run_scores_zero_whatever_its_passage_is_called(name):
    qrels = {"q1": {name: 1}, "q2": {"b": 1}}
    assert evaluate_run(qrels, {"q2": {"b": 1.0}}, ["mrr@10"])["mrr@10"] == pytest.approx(0.5)


# ---- TREC run files ---------------------------------------------------------------------------


def _rank_runs(ranks_a, ranks_b):
    """Two runs over queries q0..q{n-1} with one relevant passage ``rel``, placed at the given ranks."""
    qrels = {f"q{i}": {"rel": 1} for i in range(len(ranks_a))}

    def run(ranks):
        return {f"q{i}": {("rel" if r == k else f"x{k}"): 1.0 / k for k in range(1, 11)} for i, r in enumerate(ranks)}

    return qrels, run(ranks_a), run(ranks_b)


def _exact_sign_flip_p(a: np.ndarray, b: np.ndarray) -> float:
    """Slow reference: Fisher's randomization test by enumerating every swap of the two systems' scores."""
    diffs, observed = a - b, abs((a - b).mean())
    hits = 0
    for signs in itertools.product([1.0, -1.0], repeat=len(diffs)):
        hits += abs((np.array(signs) * diffs).mean()) >= observed - 1e-12
    return hits / 2 ** len(diffs)


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 10), st.integers(1, 10)), min_size=4, max_size=10))
def test_paired_significance_matches_exact_randomization_test(pairs):
    ranks_a, ranks_b = [a for a, _ in pairs], [b for _, b in pairs]
    qrels, run_a, run_b = _rank_runs(ranks_a, ranks_b)
    result = paired_significance(qrels, {"a": run_a, "base": run_b}, "base", "mrr@10", n_permutations=20_000)["a"]
    rr_a, rr_b = 1.0 / np.array(ranks_a), 1.0 / np.array(ranks_b)
    assert result["delta"] == pytest.approx(rr_a.mean() - rr_b.mean())
    assert (result["wins"], result["ties"], result["losses"]) == (
        int((rr_a > rr_b).sum()),
        int((rr_a == rr_b).sum()),
        int((rr_a < rr_b).sum()),
    )
    assert result["p"] == pytest.approx(_exact_sign_flip_p(rr_a, rr_b), abs=0.02)


def test_paired_significance_separates_a_consistent_gain_from_noise():
    qrels, better, base = _rank_runs([1] * 30, [3] * 30)
    assert paired_significance(qrels, {"better": better, "base": base}, "base")["better"]["p"] < 0.001
    _, same, _ = _rank_runs([3] * 30, [3] * 30)
    assert paired_significance(qrels, {"same": same, "base": base}, "base")["same"] == {
        "delta": 0.0,
        "wins": 0,
        "ties": 30,
        "losses": 0,
        "p": 1.0,
    }


def test_paired_significance_unknown_baseline_is_a_clear_error():
    qrels, run_a, _ = _rank_runs([1, 2], [1, 2])
    with pytest.raises(DensepassError, match="baseline 'nope'"):
        paired_significance(qrels, {"a": run_a}, "nope")


def test_runs_made_for_other_queries_are_refused_before_a_paired_test():
    qrels = {"q1": {"p1": 1}, "q2": {"p2": 1}, "q3": {"p3": 1}}
    runs = {"a": {"q1": {"p1": 1.0}, "q2": {}}, "b": {"q1": {"p2": 1.0}, "q2": {"p2": 1.0}}}
    with pytest.raises(DataError, match="1 of the 3 evaluated queries are in none of the runs .*'q3'") as err:
        check_runs_cover(qrels, runs)
    assert "\n" not in str(err.value)
    check_runs_cover({q: qrels[q] for q in ("q1", "q2")}, runs)  # an empty ranking is a ranking: q2 is held
    check_runs_cover(qrels, {**runs, "c": {"q3": {}}})  # one run holding it is enough


def test_trec_run_round_trip(tmp_path):
    run = {"q1": {"p1": 0.25, "p2": 1.5, "p3": -0.125}, "q2": {"p9": 3.0}}
    path = tmp_path / "sub" / "run.trec"
    write_trec_run(run, path, tag="mytag")
    assert read_trec_run(path) == run
    lines = path.read_text().splitlines()
    # best first, ranks from 1, six columns with the tag
    assert lines[0].split() == ["q1", "Q0", "p2", "1", "1.5", "mytag"]
    assert [line.split()[2] for line in lines[:3]] == ["p2", "p1", "p3"]
    assert [line.split()[3] for line in lines[:3]] == ["1", "2", "3"]
    assert [p.name for p in path.parent.iterdir()] == ["run.trec"]  # no temporary file left


def test_read_trec_run_bad_column_count_names_file_and_line(tmp_path):
    path = tmp_path / "bad.trec"
    path.write_text("q1 Q0 p1 1 0.5 tag\n\nq1 Q0 p2 2 0.4\n")
    with pytest.raises(DataError, match=r"bad\.trec:3: expected 6 columns"):
        read_trec_run(path)


def test_read_trec_run_non_numeric_score_names_file_and_line(tmp_path):
    path = tmp_path / "bad.trec"
    path.write_text("q1 Q0 p1 1 high tag\n")
    with pytest.raises(DataError, match=r"bad\.trec:1: score 'high' is not a number"):
        read_trec_run(path)


def test_read_trec_run_missing_file(tmp_path):
    with pytest.raises(DataError, match="run file not found"):
        read_trec_run(tmp_path / "nope.trec")


# ---- make_run ---------------------------------------------------------------------------------


def test_make_run_maps_rows_to_ids_and_skips_padding():
    scores = np.array([[0.9, 0.5, 0.1], [0.7, 0.0, -1.0]], dtype=np.float32)
    rows = np.array([[2, 0, -1], [1, 2, 0]])  # -1 is FAISS padding for "no result"
    run = make_run(["qa", "qb"], ["p0", "p1", "p2"], scores, rows)
    assert run == {
        "qa": {"p2": pytest.approx(0.9), "p0": pytest.approx(0.5)},
        "qb": {"p1": pytest.approx(0.7), "p2": 0.0, "p0": -1.0},
    }


def test_make_run_drop_nonpositive():
    scores = np.array([[0.9, 0.0, -0.5], [0.0, -1.0, -2.0]], dtype=np.float32)
    rows = np.array([[0, 1, 2], [0, 1, 2]])
    run = make_run(["qa", "qb"], ["p0", "p1", "p2"], scores, rows, drop_nonpositive=True)
    assert run == {"qa": {"p0": pytest.approx(0.9)}, "qb": {}}


# ---- DPR answer accuracy ----------------------------------------------------------------------


def test_normalize_answer():
    assert normalize_answer("The  Quick, Brown-Fox!") == "quick brown fox"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theory") == "theory"  # articles only as whole words
    assert normalize_answer("  ") == ""


def test_normalize_answer_unicode_forms_agree():
    composed, decomposed = "caf\u00e9", "cafe\u0301"
    assert normalize_answer(composed) == normalize_answer(decomposed)


def test_has_answer_matches_on_token_boundaries():
    assert has_answer("Paris is the capital of France.", ["paris"])
    assert not has_answer("Parisian cafes are famous.", ["Paris"])
    assert not has_answer("The word is unparis.", ["paris"])
    assert has_answer("born in 1879 in Ulm", ["1879"])
    assert not has_answer("born in 18790", ["1879"])


def test_has_answer_finds_the_answers_tokens_in_order_as_dpr_does():
    """DPR's ``has_answer``: lower case, NFD, a token a run of letters/digits/marks or one other visible character;
    articles kept (stripping them made "The Who" the word "who" and "Vitamin A" the word "vitamin")."""
    assert has_answer("He visited the Eiffel Tower, in Paris.", ["eiffel tower"])
    assert has_answer("Mr. Smith's car was red", ["smith's CAR"])
    assert has_answer("nothing here", ["missing", "HERE"])  # any of several answers
    assert not has_answer("nothing here", ["missing"])
    assert not has_answer("songs by Beatles", ["The Beatles"])
    assert not has_answer("Who is the president of France?", ["The Who"])
    assert not has_answer("Take vitamin B12 daily", ["Vitamin A"])
    # Unicode punctuation is a token of its own, as ASCII punctuation is
    assert has_answer("born in \u201cParis\u201d in 1900", ["Paris"])
    assert has_answer("Paris\u2014the capital", ["Paris"]) and has_answer("the years 1900\u20131910", ["1900"])
    assert has_answer("l\u2019Or\u00e9al", ["Ore\u0301al"])  # composed and decomposed forms agree


def test_has_answer_agrees_with_a_token_window_reference():
    """Against a slow reference: the answer's token list equals some window of the passage's token list."""
    from densepass.evaluation.answers import answer_tokens

    def reference(passage: str, answer: str) -> bool:
        words, wanted = answer_tokens(passage).split(), answer_tokens(answer).split()
        n = len(wanted)
        return n > 0 and any(words[i : i + n] == wanted for i in range(len(words) - n + 1))

    rng = np.random.default_rng(3)
    vocabulary = ["the", "who", "a", "paris", "1900", "\u2013", ",", "b12", "caf\u00e9", "!", "x"]
    for _ in range(500):
        passage = " ".join(rng.choice(vocabulary, size=int(rng.integers(0, 12))))
        answer = " ".join(rng.choice(vocabulary, size=int(rng.integers(0, 4))))
        assert has_answer(passage, [answer]) == reference(passage, answer)


def test_has_answer_never_matches_an_empty_answer():
    assert not has_answer("the cat sat", ["", "  ", "\u200b"])


def test_top_k_accuracy_hand_case():
    passages = {"p1": "Rome is in Italy", "p2": "Paris is in France", "p3": "nothing relevant"}
    rankings = {
        "qa": ["p2", "p1", "p3"],  # answer "Rome": first hit at rank 2
        "qb": ["p2", "p3", "p1"],  # answer "France": first hit at rank 1
        "qc": ["p3", "p1", "p2"],  # answer "Berlin": never
        "qd": ["p1"],  # no answers: not counted
    }
    answers = {"qa": ["Rome"], "qb": ["france"], "qc": ["Berlin"], "qd": []}
    got = top_k_accuracy(rankings, passages, answers, [1, 2, 3])
    assert got == pytest.approx({"accuracy@1": 1 / 3, "accuracy@2": 2 / 3, "accuracy@3": 2 / 3})
    assert top_k_accuracy({"qd": ["p1"]}, passages, {"qd": []}, [1]) == {}


def test_randomization_p_counts_ties_lost_to_rounding():
    """Sign flips whose mean equals the observed one only up to floating-point rounding still count."""
    a, b = 1.0 / np.array([3, 1, 8, 2]), 1.0 / np.array([9, 3, 2, 8])
    diffs = a - b
    naive = sum(
        abs((np.array(signs) * diffs).sum()) >= abs(diffs.sum()) for signs in itertools.product([1.0, -1.0], repeat=4)
    )
    assert naive == 6  # in exact arithmetic 8 of the 16 assignments are as extreme as the observed one
    assert randomization_p(a, b) == 8 / 16 == _exact_sign_flip_p(a, b)


def test_randomization_p_is_seeded_and_close_to_exact_when_sampled():
    rng = np.random.default_rng(3)
    a, b = rng.random(18), rng.random(18)
    exact = randomization_p(a, b, n_permutations=2**18)
    sampled = randomization_p(a, b, n_permutations=20_000, seed=1)
    assert sampled == randomization_p(a, b, n_permutations=20_000, seed=1)
    assert sampled == pytest.approx(exact, abs=0.02)


@pytest.mark.parametrize("size", [10, 100, 2000])
@pytest.mark.parametrize("where", [0, 5, 9])
def test_tied_scores_rank_in_the_runs_order_at_any_length(size, where):
    """All scores tied: the relevant passage ranks where the run lists it (ranx's unstable sort kept short lists
    in order and scrambled long ones, so a metric depended on the ranking's length)."""
    ranking = {f"p{i}": 0.5 for i in range(size) if i != where}
    items = list(ranking.items())
    items.insert(where, ("rel", 0.5))
    got = evaluate_run({"q": {"rel": 1}}, {"q": dict(items)}, ["mrr@10"])
    assert got["mrr@10"] == pytest.approx(1 / (where + 1))


def test_a_run_written_and_read_back_scores_and_ranks_as_it_was(tmp_path):
    """Every digit of a score is written: scores six decimals would tie keep their order and value."""
    run = {"q": {"a": 0.8000000012, "b": 0.8000000011, "rel": 0.8000000013, "c": 0.1}}
    path = tmp_path / "run.trec"
    write_trec_run(run, path)
    back = read_trec_run(path)
    assert back == run and list(back["q"]) == ["rel", "a", "b", "c"]
    qrels = {"q": {"b": 1}}
    assert evaluate_run(qrels, back, ["mrr@10"]) == evaluate_run(qrels, run, ["mrr@10"]) == {"mrr@10": 1 / 3}


def test_a_passage_listed_twice_in_results_keeps_its_best_score_in_the_run():
    """A phrase index's hits are phrases, so a passage can come twice: its run keeps the first, best score (it kept
    the last, worst one, and ranked the passage below others)."""
    from densepass.data.dataset import Corpus
    from densepass.index.base import SearchResults

    ids = ["p0", "p1"]
    results = SearchResults(np.array([[5.0, 4.0, 3.0]]), np.array([[0, 1, 0]]), Corpus(ids, ["", ""], ids, ids))
    run = results.as_run(["q"])
    assert run == {"q": {"p0": 5.0, "p1": 4.0}} and list(run["q"]) == ["p0", "p1"]


def test_bpref_is_not_offered():
    """bpref needs judged non-relevant passages, which the evaluation leaves out: it was NaN for every run."""
    with pytest.raises(DensepassError, match="bpref"):
        evaluate_run({"q": {"a": 1, "b": 0}}, {"q": {"b": 2.0, "a": 1.0}}, ["bpref"])
