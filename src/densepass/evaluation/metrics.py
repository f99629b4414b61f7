"""Ranking metrics through ``ranx`` (MRR@k, nDCG@k, Recall@k, ...) and TREC run files.

Metric names follow ranx (``mrr@10``, ``ndcg@10``, ``recall@100``); ``accuracy@k`` is DPR's top-k
answer accuracy (see ``answers.py``) and needs answer strings. :func:`check_metrics` validates names before
any work.
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import numpy as np

from densepass.data.dataset import Qrels
from densepass.data.files import read_lines
from densepass.errors import ConfigError, DataError, DataWarning, DensepassError
from densepass.evaluation.answers import top_k_accuracy

Run = dict[str, dict[str, float]]  # query id -> passage id -> score

# The metrics of ranx (``ranx.metrics.metric_switch``), each with an optional cutoff ``@k``; not bpref, which needs
# the judged non-relevant passages that ``_ranx_inputs`` leaves out (it was NaN for every run).
RANX_METRICS = (
    "mrr",
    "ndcg",
    "ndcg_burges",
    "dcg",
    "dcg_burges",
    "recall",
    "precision",
    "r-precision",
    "f1",
    "map",
    "hits",
    "hit_rate",
)
ACCURACY = "accuracy"  # DPR top-k answer accuracy: always with a cutoff, accuracy@k
UNCUT_METRICS = ("r-precision",)  # ranx metrics whose cutoff is their own: an @k is refused, not ignored
_METRIC = re.compile(r"(?P<name>[a-z][a-z0-9_-]*)(?:@(?P<k>[0-9]+))?")  # f1 has a digit
MAX_CUTOFF = 10**9  # ranx overflows past 2**63, and Python parses no integer of more than 4300 digits


def _cutoff_ok(k: str | None) -> bool:
    """No cutoff, or one from 1 to MAX_CUTOFF."""
    if k is None:
        return True
    digits = k.lstrip("0")
    return 0 < len(digits) <= len(str(MAX_CUTOFF)) and int(digits) <= MAX_CUTOFF


def refuse_answer_metrics(names: Sequence[str], reader: str) -> None:
    """A one-line ConfigError where ``names`` hold ``accuracy@k``, which needs the answer strings that ``reader``
    (validation, the ensemble, a study) does not read: before any work, where it would fail at its first evaluation."""
    needing = next((name for name in names if name.startswith(f"{ACCURACY}@")), None)
    if needing is not None:
        raise ConfigError(f"{needing} needs answer strings, and {reader} has no answer strings: use a ranking metric")


@contextlib.contextmanager
def quiet_numba() -> Iterator[None]:
    """numba's warnings silenced for the block: ranx compiles its metrics with numba, whose type-safety warnings
    (``unsafe cast from uint64 to int64``, wrapped in terminal escapes) are about ranx's code on first compile, not
    about anything the user gave, and would print as a garbled line."""
    with warnings.catch_warnings():
        try:
            from numba.core.errors import NumbaWarning
        except ImportError:  # no numba: nothing to silence
            pass
        else:
            warnings.simplefilter("ignore", NumbaWarning)
        yield


def check_metrics(names: Sequence[str]) -> None:
    """A one-line ConfigError unless every name is a ranx metric (:data:`RANX_METRICS`) with an optional
    cutoff ``@k`` (1 <= k <= :data:`MAX_CUTOFF`), or ``accuracy@k``."""
    if isinstance(names, str) or not names:
        raise ConfigError(f"metrics should be a non-empty list of names, got {names!r}")
    for name in names:
        match = _METRIC.fullmatch(name) if isinstance(name, str) else None
        ok = (
            match is not None
            and _cutoff_ok(match["k"])
            and (match["name"] in RANX_METRICS or (match["name"] == ACCURACY and match["k"] is not None))
        )
        if ok and match["name"] in UNCUT_METRICS and match["k"] is not None:  # ranx would ignore the cutoff
            raise ConfigError(
                f"{name}: {match['name']} takes no cutoff (it cuts each ranking at its query's count of "
                "relevant passages)"
            )
        if not ok:
            raise ConfigError(
                f"unknown metric {name!r} (known: {', '.join(RANX_METRICS)}, each with an optional "
                f"cutoff @k but {', '.join(UNCUT_METRICS)}, 1 <= k <= {MAX_CUTOFF}; and {ACCURACY}@k)"
            )


def depth_for(names: Sequence[str], least: int = 100) -> int:
    """How many passages a query's ranking needs for ``names`` to mean what they say: their deepest cutoff, and at
    least ``least`` (a metric without one, mrr or map, reads the whole ranking: ``least`` is where it stops)."""
    return max([least, *(int(k) for name in names if (k := name.rpartition("@")[2]).isdigit())])


def warn_if_shallow(names: Sequence[str], depth: int, setting: str, listed: str = "metrics") -> None:
    """One warning where a metric of ``names`` cuts deeper than the ``depth`` passages a query retrieves (the
    ``setting`` that says so; ``listed``: the setting that lists them): a recall@1000 of a top 10 is reported under its
    name, but is a recall@10."""
    deepest = depth_for(names, least=0)
    if deepest > depth:
        warnings.warn(
            f"{listed} cut at {deepest} and {setting} retrieves {depth} passages a query: the metrics are of the top "
            f"{depth} (raise {setting} to {deepest} for what they name)",
            stacklevel=3,
        )


def split_metrics(names: Sequence[str]) -> tuple[list[str], list[int]]:
    """``(ranx metric names, cutoffs k of the accuracy@k metrics)`` of valid metric names."""
    accuracy = [int(n.split("@", 1)[1]) for n in names if n.startswith(f"{ACCURACY}@")]
    return [n for n in names if not n.startswith(f"{ACCURACY}@")], accuracy


def make_run(
    query_ids: Sequence[str],
    passage_ids: Sequence[str],
    scores: np.ndarray,
    rows: np.ndarray,
    drop_nonpositive: bool = False,
) -> Run:
    """A run from top-k (scores, rows) arrays, best first; ``rows`` index ``passage_ids``. A passage listed twice
    keeps its first (best) score, as ``SearchResults.as_run`` has it."""
    run: Run = {}
    for qid, row_scores, row_ids in zip(query_ids, scores, rows):
        ranking = {}
        for score, r in zip(row_scores.tolist(), row_ids.tolist()):
            if r < 0 or (drop_nonpositive and score <= 0):
                continue
            ranking.setdefault(passage_ids[r], score)
        run[qid] = ranking
    return run


# ranx keeps each query's passage ids in a NumPy array of fixed-width strings, as wide as the longest id it is given,
# and numba compiles its functions for that width: each new width compiles them again (a cost per process, larger
# on a machine's first run: docs/benchmarks.md's main-job table times runs with and without numba's cache). Passage
# ids reach ranx as codes of one width instead (hexadecimal, in order of first appearance: the metrics compare ids
# for equality only), so a process compiles once whatever the ids.
CODE_DIGITS = 8
NO_PASSAGE = "-"  # the placeholder ranking of a judged query the run leaves out: no code, so never relevant


def passage_codes(*id_lists: Iterable[str]) -> dict[str, str]:
    """Each distinct passage id of ``id_lists`` -> a code of ``CODE_DIGITS`` hexadecimal digits (more only past
    16^8 ids), in order of first appearance."""
    ids = dict.fromkeys(p for ids in id_lists for p in ids)
    digits = max(CODE_DIGITS, len(f"{len(ids):x}"))
    return {pid: f"{n:0{digits}x}" for n, pid in enumerate(ids)}


def _ranx_inputs(qrels: Qrels, run: Run):
    """ranx Qrels/Run of the judged queries, passage ids coded (``passage_codes``); a judged query missing from the
    run gets an empty ranking."""
    from ranx import Qrels as RanxQrels
    from ranx import Run as RanxRun

    judged = {q: {p: g for p, g in rels.items() if g > 0} for q, rels in qrels.items()}
    judged = {q: rels for q, rels in judged.items() if rels}
    if not judged:
        raise DataError("no query in the qrels has a relevant passage")
    unknown = set(run) - set(qrels)
    if unknown:  # as trec_eval does: a run over every query of a dataset evaluates on one split's
        warnings.warn(
            f"the run has {len(unknown)} queries absent from the qrels (e.g. {sorted(unknown)[0]!r}): not evaluated",
            DataWarning,
            stacklevel=3,
        )
    # ranx needs every judged query in the run; an empty ranking scores zero. Tied scores are ranked in the run's
    # order (its insertion order: an index's row order, a run file's rank column), made strict here: ranx orders a
    # ranking with an unstable sort, which kept ties in order for short lists and scrambled them for long ones.
    full_run = {q: strict_order(run[q]) for q in judged if run.get(q)}
    codes = passage_codes(*judged.values(), *full_run.values())
    coded_qrels = {q: {codes[p]: g for p, g in rels.items()} for q, rels in judged.items()}
    coded_run = {
        q: {codes[p]: s for p, s in full_run[q].items()} if q in full_run else {NO_PASSAGE: 0.0} for q in judged
    }
    ranx_qrels, ranx_run = RanxQrels(coded_qrels), RanxRun(coded_run)
    # The same queries on both sides, so ranx's make_comparable would add or drop nothing; what it does do, sort
    # the run again, is repeated here, and both are handed to ranx as the typed lists it evaluates. Its Qrels and
    # Run objects would be read key by key from Python, which numba compiles afresh in every process (seconds)
    # where these calls load ranx's cached compiled functions.
    ranx_run.sort()
    return ranx_qrels.to_typed_list(), ranx_run.to_typed_list()


def strict_order(ranking: dict[str, float]) -> dict[str, float]:
    """``ranking`` itself where its scores are distinct, else scores n, ..., 1 in the order (score desc, then its
    own order), for what depends on the order only (the metrics, rank fusion)."""
    if len(set(ranking.values())) == len(ranking):
        return ranking
    ordered = sorted(ranking.items(), key=lambda item: -item[1])  # stable: ties keep the ranking's order
    return {pid: float(len(ordered) - n) for n, (pid, _) in enumerate(ordered)}


def answered_qrels(qrels: Qrels, runs: Sequence[Run], all_queries: bool = False) -> Qrels:
    """The qrels that TREC run files are evaluated on: as trec_eval does, those of the queries the runs answer
    (a DataWarning says how many judged queries they leave out, e.g. a run over a sample of a split), or with
    ``all_queries`` (trec_eval's -c) every judged query, a missing one scoring zero. Runs that answer no query
    of the qrels are a DataError (a run of another split or dataset). Runs compared (several) are evaluated on the
    same queries, those any of them answers; where they answer different ones, a DataWarning says so: a query one of
    them leaves out scores zero for it (a system that found nothing, or a run of a sample against a whole split,
    whose comparison would then measure the sample)."""
    answered = set().union(*runs)
    kept = {q: rels for q, rels in qrels.items() if q in answered}
    if not kept:
        raise DataError(f"the run answers none of the {len(qrels):,} queries of the qrels (another split or dataset?)")
    if len(runs) > 1:
        scope = set(qrels) if all_queries else set(kept)
        judged = [scope & set(run) for run in runs]
        counts = [len(queries) for queries in judged]
        if any(queries != judged[0] for queries in judged):  # (not the queries none of them answers: --all-queries)
            warnings.warn(
                f"the runs compared answer different queries ({' and '.join(f'{c:,}' for c in counts)} of the "
                f"{len(scope):,} evaluated): a query a run leaves out scores zero for it",
                DataWarning,
                stacklevel=2,
            )
    if all_queries or len(kept) == len(qrels):
        return qrels
    warnings.warn(
        f"the run answers {len(kept):,} of the {len(qrels):,} queries of the qrels: evaluated on those "
        "(as trec_eval; --all-queries counts the others as zero, as trec_eval -c)",
        DataWarning,
        stacklevel=2,
    )
    return kept


def evaluate_run(
    qrels: Qrels,
    run: Run,
    metrics: Sequence[str],
    answers: Mapping[str, Sequence[str]] | None = None,
    passages: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Mean of each metric over the queries of ``qrels`` (a query missing from the run scores 0).

    ``accuracy@k`` (DPR top-k answer accuracy over the judged queries that have answers, a query missing
    from the run counting as unanswered) needs ``answers`` (query id -> answer strings) and ``passages``
    (passage id -> text); asking for it without them is a DataError, as is an unknown metric name."""
    from ranx import evaluate

    check_metrics(metrics)
    ranx_metrics, ks = split_metrics(metrics)
    results: dict[str, float] = {}
    if ks:
        results.update(_answer_accuracy(qrels, run, ks, answers, passages))
    if not ranx_metrics:
        return results
    ranx_qrels, ranx_run = _ranx_inputs(qrels, run)
    try:
        with quiet_numba():
            result = evaluate(ranx_qrels, ranx_run, ranx_metrics)
    except (ValueError, KeyError) as err:
        raise DensepassError(f"cannot compute metrics {ranx_metrics}: {err}") from None
    if isinstance(result, float):
        result = {ranx_metrics[0]: result}
    return {**{m: float(v) for m, v in result.items()}, **results}


def answered_queries(qrels: Qrels, answers: Mapping[str, Sequence[str]] | None, metrics: Sequence[str]) -> list[str]:
    """The judged queries of ``qrels`` that have answer strings, which ``accuracy@k`` averages over; a
    DataError when ``metrics`` ask for accuracy@k and there is none (checked before any work)."""
    ks = split_metrics(metrics)[1]
    judged = [q for q, rels in qrels.items() if any(g > 0 for g in rels.values()) and (answers or {}).get(q)]
    if ks and not judged:
        raise DataError(
            f"accuracy@{ks[0]} needs answer strings, and no judged query has any (use a DPR, SQuAD or "
            f"BEIR dataset whose queries carry 'answers')"
        )
    return judged


def _answer_accuracy(
    qrels: Qrels,
    run: Run,
    ks: list[int],
    answers: Mapping[str, Sequence[str]] | None,
    passages: Mapping[str, str] | None,
) -> dict[str, float]:
    """``accuracy@k`` for each k over the queries of ``qrels`` that have answer strings."""
    judged = answered_queries(qrels, answers, [f"{ACCURACY}@{k}" for k in ks])
    if passages is None:
        raise DensepassError("accuracy@k needs the passage texts (passages=)")
    rankings = {q: sorted(run.get(q, {}), key=run.get(q, {}).get, reverse=True) for q in judged}
    missing = next((p for ranking in rankings.values() for p in ranking if p not in passages), None)
    if missing is not None:
        raise DataError(f"the run names passage {missing!r}, which is not in the corpus")
    return top_k_accuracy(rankings, passages, answers, ks)


def randomization_p(a: np.ndarray, b: np.ndarray, n_permutations: int = 10_000, seed: int = 42) -> float:
    """Two-sided p-value of Fisher's paired randomization test (fisher-test): the share of the
    sign assignments of the per-query differences ``a - b`` whose mean is at least as far from zero as the
    observed one. Exact (all 2^n assignments) when 2^n <= ``n_permutations``; otherwise ``n_permutations``
    seeded random assignments plus the observed one, so p >= 1 / (n_permutations + 1) and the same inputs
    always give the same p. Means equal up to rounding count as "at least as far" (ties are not lost to
    floating-point noise)."""
    diffs = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    n = len(diffs)
    if n == 0:
        raise DensepassError("a paired test needs at least one query")
    observed = abs(diffs.sum())
    threshold = observed - 1e-9 * max(1.0, observed)
    if 2**n <= n_permutations:
        signs = ((np.arange(2**n)[:, None] >> np.arange(n)) & 1) * 2.0 - 1.0
        return float(np.mean(np.abs(signs @ diffs) >= threshold))
    rng = np.random.default_rng(seed)
    hits, chunk = 0, max(1, 2_000_000 // n)
    for start in range(0, n_permutations, chunk):
        signs = rng.integers(0, 2, size=(min(chunk, n_permutations - start), n)) * 2.0 - 1.0
        hits += int(np.count_nonzero(np.abs(signs @ diffs) >= threshold))
    return (hits + 1) / (n_permutations + 1)


def per_query_scores(qrels: Qrels, run: Run, metric: str) -> np.ndarray:
    """``metric`` of every judged query of ``qrels`` (in a fixed order), by ranx."""
    from ranx import evaluate

    check_metrics([metric])
    ranx_qrels, ranx_run = _ranx_inputs(qrels, run)
    try:
        with quiet_numba():
            # asked twice: for one metric of typed lists, ranx's evaluate looks its per-query scores up under the
            # metric's short name ("mrr" for "mrr@10") and fails; for a list it returns them all by full name
            scores = evaluate(ranx_qrels, ranx_run, [metric, metric], return_mean=False)[metric]
        return np.asarray(scores, dtype=np.float64)
    except (ValueError, KeyError) as err:
        raise DensepassError(f"cannot compute {metric}: {err}") from None


def check_runs_cover(qrels: Qrels, runs: Mapping[str, Run]) -> None:
    """A one-line DataError where a query of ``qrels`` is in none of ``runs``: the runs were made for other
    queries (another sample size or ``data.eval_part``), and scoring the missing ones 0 in every run would turn
    them into ties that dilute every difference and test."""
    missing = [q for q in qrels if not any(q in run for run in runs.values())]
    if missing:
        raise DataError(
            f"{len(missing)} of the {len(qrels)} evaluated queries are in none of the runs (the first: "
            f"{missing[0]!r}): they were made for other queries (another sample size or data.eval_part?)"
        )


def paired_significance(
    qrels: Qrels,
    runs: Mapping[str, Run],
    baseline: str,
    metric: str = "mrr@10",
    n_permutations: int = 10_000,
    seed: int = 42,
) -> dict[str, dict[str, float]]:
    """Every run against ``baseline`` on ``metric``, query by query.

    Returns, per other run: ``delta`` (its mean minus the baseline's), ``wins`` / ``ties`` / ``losses``
    (queries where it scores above / equal to / below the baseline) and ``p``, the two-sided p-value of
    Fisher's randomization test on the per-query scores (``randomization_p``: exact for up to
    log2(n_permutations) queries, seeded otherwise, so the same runs always give the same p).
    """
    if baseline not in runs:
        raise DensepassError(f"baseline {baseline!r} is not among the runs {sorted(runs)}")
    if len(runs) < 2:
        raise DensepassError("a paired test needs the baseline and at least one other run")
    base = per_query_scores(qrels, runs[baseline], metric)
    results = {}
    for name, run in runs.items():
        if name == baseline:
            continue
        scores = per_query_scores(qrels, run, metric)
        results[name] = {
            "delta": float(scores.mean() - base.mean()),
            "wins": int((scores > base).sum()),
            "ties": int((scores == base).sum()),
            "losses": int((scores < base).sum()),
            "p": randomization_p(scores, base, n_permutations, seed),
        }
    return results


def is_trec_line(line: str) -> bool:
    """Whether ``line`` reads as a TREC run line ``qid Q0 pid rank score tag`` (what ``write_trec_run`` writes)."""
    fields = line.split()
    return len(fields) == 6 and fields[1] == "Q0"


def check_run_file(path: str | Path, tag: str | None = None) -> None:
    """A one-line error when a run file to write is an existing directory, or a file that is not a TREC run
    (densepass overwrites only its own output, ``io.check_output_file``), or, with ``tag``, a run of another tag
    (a run another system wrote, such as an official BM25 run, is not replaced by this one's);
    ``write_trec_run`` checks it, and a command checks it before its work."""
    from densepass.io import check_output_file, every_line

    if tag is not None and (not tag or any(c.isspace() for c in tag)):
        raise ConfigError(f"--tag {tag!r}: a TREC run's tag is one word (no spaces), the sixth column of every line")
    if Path(path).is_dir():
        raise ConfigError(f"--output {path} is a directory; give a run file path")

    def ours(line: str) -> bool:
        return is_trec_line(line) and (tag is None or line.split()[5] == tag)

    check_output_file(path, f"TREC run{f' (tag {tag})' if tag is not None else ''}", every_line(ours))


def write_trec_run(run: Run, path: str | Path, tag: str = "densepass") -> None:
    """TREC run format: ``qid Q0 pid rank score tag``, best first; written atomically, over nothing but a TREC run
    (``check_run_file``); a run without hits is an empty file."""
    from densepass.io import atomic_write_text

    check_run_file(path, tag)
    lines = []
    for qid in run:
        ranked = sorted(run[qid].items(), key=lambda item: -item[1])
        # every digit of the score (repr: the shortest text that reads back as the same float): six decimals tied
        # scores that differ, and a run read back ranked those ties otherwise than the run written
        lines.extend(f"{qid} Q0 {pid} {rank} {float(score)!r} {tag}\n" for rank, (pid, score) in enumerate(ranked, 1))
    atomic_write_text(path, "".join(lines))


def read_trec_run(path: str | Path, corpus: Container[str] | None = None) -> Run:
    """A TREC run file ``qid Q0 pid rank score tag`` (optionally gzipped).

    One-line DataErrors name the file and line of: a line without 6 columns, a score that is not a finite
    number, a rank that is not an integer, a (query, passage) pair given twice, bad UTF-8; an empty file is
    an error too, and so are, with their count and an example, passages not in ``corpus`` (when given).
    Tied scores within a query are ordered by the rank column (then by the file's order): such a query's passages
    are kept in that order, their scores as the file gives them (a run's ties are ranked by that order:
    ``_ranx_inputs``; a fusion reads the scores), with one counted DataWarning for the file."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"run file not found: {path}")
    run: Run = {}
    ranks: dict[str, list[int]] = {}  # query id -> rank column, in the file's order
    for line_no, line in read_lines(path):
        parts = line.split()
        if not parts:
            continue
        if len(parts) != 6:
            raise DataError(f"{path}:{line_no}: expected 6 columns (qid Q0 pid rank score tag)")
        qid, _, pid, rank, score, _ = parts
        try:
            value = float(score)
        except ValueError:
            raise DataError(f"{path}:{line_no}: score {score!r} is not a number") from None
        if not math.isfinite(value):
            raise DataError(f"{path}:{line_no}: score {score!r} is not a finite number")
        try:
            position = int(rank)
        except ValueError:
            raise DataError(f"{path}:{line_no}: rank {rank!r} is not an integer") from None
        ranking = run.setdefault(qid, {})
        if pid in ranking:
            raise DataError(f"{path}:{line_no}: passage {pid!r} appears twice for query {qid!r}")
        ranking[pid] = value
        ranks.setdefault(qid, []).append(position)
    if not run:
        raise DataError(f"{path}: the run file is empty")
    if corpus is not None:
        unknown = list(dict.fromkeys(pid for ranking in run.values() for pid in ranking if pid not in corpus))
        if unknown:
            raise DataError(
                f"{path}: {len(unknown)} passage ids are not in the dataset's corpus (e.g. "
                f"{unknown[0]!r}); is the run for another dataset?"
            )
    _break_ties(path, run, ranks)
    return run


def _break_ties(path: Path, run: Run, ranks: dict[str, list[int]]) -> None:
    """Put, in place, the passages of the queries whose scores tie in the order (score desc, rank, file order),
    their scores unchanged (they were replaced by n, ..., 1, which a fusion then read as scores)."""
    tied = [qid for qid, ranking in run.items() if len(set(ranking.values())) < len(ranking)]
    for qid in tied:
        items, rank = list(run[qid].items()), ranks[qid]
        order = sorted(range(len(items)), key=lambda i: (-items[i][1], rank[i]))
        run[qid] = {items[i][0]: items[i][1] for i in order}
    if tied:
        warnings.warn(
            f"{path}: {len(tied)} of {len(run)} queries have tied scores (first: query {tied[0]!r}); "
            f"their ties are ordered by the rank column",
            DataWarning,
            stacklevel=3,
        )
