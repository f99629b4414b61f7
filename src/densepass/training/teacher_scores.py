"""Teacher scores for distillation (neural-retrieval-lecture: Margin-MSE; training-inference-gap §2): a
cross-encoder's score of every training query with each of its positives and pool candidates, computed
once into a file that any number of student runs then read.

The file is JSONL: a header line, then one line per query::

    {"format": "densepass-teacher-scores", "version": 2, "teacher": {"path": ..., "weights": ..., "max_length": 256},
     "scoring": {"config": ..., "tokenizer": ..., "sides": [...], "precision": "fp32", "device": "cpu"},
     "pairs": "<fingerprint of the (query, passages) lists>", "queries": 2048, "pair_count": 63488}
    {"query_id": "q7", "scores": {"p12": 7.31, "p9": -2.04, ...}, "texts": "<fingerprint of what was scored>"}

``teacher`` is the teacher's identity: its path and the fingerprint of its weights (``fingerprints``)
and its truncation length; ``scoring`` what else a score depends on (``models.score_cache.scorer_identity`` but
the library versions), of which the configuration, tokenizer and sides must match (the precision and device are
recorded, not compared: a file a GPU scored in bf16 serves a student on a CPU, its targets a rounding away from
fp32's); each line's ``texts`` fingerprints the query's text and its passages' inputs, in the
line's order (a file is keyed by what was scored, not by ids alone: a passage rewritten under its id is refused,
and scored again in a new file). Computing is resumable: lines go to ``<file>.partial`` (flushed every ``chunk``
queries) and a re-run continues after the last complete line; the finished file replaces ``<file>``
atomically. Reading checks the header and that every pair asked for has a score: a file from another teacher,
other scoring settings or texts, other queries or another pool is a one-line ``DataError`` naming what differs.
A version-1 file (written before ``scoring`` and ``texts`` were recorded) is read with a warning that they could
not be checked.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

from tqdm.auto import tqdm

from densepass import distributed
from densepass.data.dataset import RetrievalDataset
from densepass.data.keys import parse_half_id, passage_input
from densepass.device import resolve_precision
from densepass.errors import DataError, DataWarning
from densepass.fingerprints import fingerprint_strings, fingerprint_weights
from densepass.models.cross_encoder import PASSAGE_SEP, CrossEncoder
from densepass.models.score_cache import CachedPairScores, scorer_identity
from densepass.negatives.pool import NegativePool

FORMAT = "densepass-teacher-scores"
VERSION = 2
READABLE = (1, 2)  # version 1: no texts or scoring settings recorded (read with a warning)
MATCHED_SETTINGS = ("config", "tokenizer", "sides")  # of ``scoring``: those a file must share to be read
Pairs = dict[str, list[str]]  # query id -> passage ids to score
Scores = dict[str, dict[str, float]]  # query id -> passage id -> teacher score


SCORE_LIMIT = 3.4028234663852886e38 / 2  # half the largest float32: two scores' margin stays finite in training


def teacher_identity(teacher: CrossEncoder) -> dict:
    """What a teacher is: its path, the fingerprint of its weights and its truncation length."""
    return {"path": teacher.source, "weights": fingerprint_weights(teacher.model), "max_length": teacher.max_length}


def distillation_pairs(dataset: RetrievalDataset, split: str, query_ids: Sequence[str], pool: NegativePool) -> Pairs:
    """Per training query: its positives of ``split``, then its pool candidates (each passage once)."""
    positives = dataset.positives(split)
    return {
        q: list(dict.fromkeys([*positives.get(q, ()), *(c.passage_id for c in pool.get(q, ()))])) for q in query_ids
    }


def is_teacher_scores_file(path: Path) -> bool:
    """Whether ``path`` begins with a teacher-scores header (densepass wrote it: it may remove it)."""
    try:
        with open(path, "rb") as handle:
            return json.loads(handle.readline()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def pairs_fingerprint(pairs: Pairs) -> str:
    """Fingerprint of the (query, passages) lists, in query order."""
    return fingerprint_strings(f"{q}\t" + "\t".join(pids) for q, pids in pairs.items())


def holds(corpus, pid: str) -> bool:
    """Whether ``pid`` names a passage of ``corpus``, or a half of one (``data.keys``)."""
    if pid in corpus:
        return True
    base, _ = parse_half_id(pid) or (None, None)
    return base is not None and base in corpus


def texts_fingerprint(dataset: RetrievalDataset, query_id: str, passage_ids: Sequence[str]) -> str:
    """Fingerprint of what the teacher scores for one query: its text, then its passages' inputs in order."""
    return fingerprint_strings(
        [dataset.queries[query_id], *(passage_input(dataset.corpus, p, PASSAGE_SEP) for p in passage_ids)]
    )


def _scored_as_now(dataset: RetrievalDataset, query_id: str, passage_ids: Sequence[str], digest: str | None) -> bool:
    """Whether a line's ``texts`` fingerprint ``digest`` is that of the data now (its query and passages still
    there, their texts unchanged)."""
    if query_id not in dataset.queries or not all(holds(dataset.corpus, p) for p in passage_ids):
        return False
    return digest == texts_fingerprint(dataset, query_id, passage_ids)


def scoring_settings(teacher: CrossEncoder, precision: str | None) -> dict:
    """What a teacher's score depends on besides its weights and the texts (``scorer_identity``: its config,
    tokenizer, the sides it truncates and pads, the precision and kind of device it scores in); the library versions
    are left out, so that a shared file outlives an upgrade."""
    resolved = teacher.precision if precision is None else resolve_precision(precision, teacher.device)
    settings = scorer_identity(teacher, resolved)
    return {k: settings[k] for k in ("config", "tokenizer", "sides", "precision", "device")}


def _header(pairs: Pairs, teacher: dict, scoring: dict | None = None) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "teacher": teacher,
        "scoring": scoring,
        "pairs": pairs_fingerprint(pairs),
        "queries": len(pairs),
        "pair_count": sum(map(len, pairs.values())),
    }


def _read(path: Path, complete: bool, digests: dict[str, str] | None = None) -> tuple[dict, Scores, int]:
    """(header, scores, bytes of complete lines) of a scores file, each line's ``texts`` fingerprint put in
    ``digests`` (when given); ``complete=False`` tolerates a last line cut short by an interruption (a partial
    file)."""
    with open(path, "rb") as handle:
        data = handle.read()
    lines = data.split(b"\n")
    try:
        header = json.loads(lines[0])
    except (json.JSONDecodeError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise DataError(f"{path}: not a teacher-scores file (no {FORMAT!r} header line)")
    if header.get("version") not in READABLE:
        raise DataError(f"{path}: teacher-scores format version {header.get('version')!r}, expected {VERSION}")
    scores: Scores = {}
    good = len(lines[0]) + 1
    for line_no, line in enumerate(lines[1:], 2):
        if not complete and line_no == len(lines) and line:
            break  # no newline after it: the line being written when the run stopped, even where it parses
        if not line.strip():
            good += len(line) + 1
            continue
        try:
            record = json.loads(line)
            qid, values = record["query_id"], record["scores"]
            if not isinstance(qid, str) or not isinstance(values, dict):
                raise TypeError
            scores[qid] = {str(p): float(v) for p, v in values.items()}
            if digests is not None and isinstance(record.get("texts"), str):
                digests[qid] = record["texts"]
            if not all(math.isfinite(v) for v in scores[qid].values()):
                raise DataError(f"{path}:{line_no}: a teacher score that is not a finite number (NaN or infinity)")
            if not all(abs(v) <= SCORE_LIMIT for v in scores[qid].values()):  # float32 margins: infinite
                raise DataError(
                    f"{path}:{line_no}: a teacher score beyond +-1.7e38, whose margins are infinite in float32"
                )
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError):
            if not complete and line_no == len(lines):
                break  # the line being written when the run stopped
            raise DataError(f'{path}:{line_no}: expected {{"query_id": str, "scores": {{passage: score}}}}') from None
        good += len(line) + 1
    return header, scores, min(good, len(data))


def _check_teacher(path: Path, header: dict, teacher: Mapping | None) -> None:
    saved = header.get("teacher") or {}
    if (
        teacher is None
        or saved.get("weights") == teacher["weights"]
        and saved.get("max_length") == teacher["max_length"]
    ):
        return
    raise DataError(
        f"{path} was scored by teacher {saved.get('path')!r} (weights {str(saved.get('weights'))[:12]}, max_length "
        f"{saved.get('max_length')}), not by {teacher['path']!r} (weights {teacher['weights'][:12]}, max_length "
        f"{teacher['max_length']}); delete it or point reranker.distill.scores_file elsewhere"
    )


def _check_scored(
    path: Path,
    header: dict,
    scores: Scores,
    digests: Mapping[str, str],
    pairs: Pairs,
    dataset: RetrievalDataset | None,
    scoring: dict | None,
) -> None:
    """A DataError where the file scored, for a query of ``pairs``, other texts than the ``dataset``'s (when given),
    or scored in other settings than ``scoring`` (when given); a version-1 file, which recorded neither, with a
    warning."""
    if dataset is None and scoring is None:
        return
    if header.get("version") == 1:
        warnings.warn(
            f"{path} was written before teacher-score files recorded the texts and settings they scored: read "
            "without checking them (delete it to score them again)",
            DataWarning,
            stacklevel=3,
        )
        return
    saved = header.get("scoring") or {}
    differ = sorted(k for k in MATCHED_SETTINGS if scoring is not None and saved.get(k) != scoring.get(k))
    if differ:
        raise DataError(
            f"{path} was scored in other settings ({', '.join(differ)} differ): delete it or point "
            "reranker.distill.scores_file elsewhere"
        )
    if dataset is None:
        return
    corpus = dataset.corpus
    for qid in pairs:
        if qid not in scores:
            continue
        gone = next((p for p in scores[qid] if not holds(corpus, p)), None) if qid in dataset.queries else qid
        if gone is not None:  # (its passages are the file's own: one may have left the corpus since)
            raise DataError(f"{path} scored {gone!r} for query {qid!r}, which the data no longer holds")
        if digests.get(qid) != texts_fingerprint(dataset, qid, list(scores[qid])):
            raise DataError(
                f"{path} scored other texts for query {qid!r} than the data's now (the query or a passage changed "
                "under its id): delete it or point reranker.distill.scores_file elsewhere"
            )


def load_teacher_scores(
    path: str | Path,
    pairs: Pairs,
    teacher: Mapping | None = None,
    dataset: RetrievalDataset | None = None,
    scoring: dict | None = None,
) -> Scores:
    """The scores of ``pairs`` read from a finished file; a file of another teacher (when ``teacher`` is
    given), of scoring settings other than ``scoring`` or texts other than the ``dataset``'s (when given), or one
    missing a query or a pair of ``pairs`` (other queries, another pool), is a DataError."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"teacher-scores file not found: {path}")
    digests: dict[str, str] = {}
    header, scores, _ = _read(path, complete=True, digests=digests)
    _check_teacher(path, header, teacher)
    if header.get("pairs") == pairs_fingerprint(pairs) and len(scores) == len(pairs):
        _check_scored(path, header, scores, digests, pairs, dataset, scoring)
        return scores
    for qid, pids in pairs.items():
        if qid not in scores:
            raise DataError(
                f"{path} has no teacher scores for query {qid!r} ({header.get('queries')} queries scored): it was "
                "computed for other training queries"
            )
        missing = next((p for p in pids if p not in scores[qid]), None)
        if missing is not None:
            raise DataError(
                f"{path} has no teacher score for query {qid!r} and passage {missing!r}: it was computed for "
                "another hard-negative pool"
            )
    _check_scored(path, header, scores, digests, pairs, dataset, scoring)
    return {q: scores[q] for q in pairs}


def compute_teacher_scores(
    teacher: CrossEncoder,
    dataset: RetrievalDataset,
    pairs: Pairs,
    path: str | Path,
    chunk: int = 256,
    show_progress: bool = True,
    precision: str | None = None,
    cache_dir: str | Path | None = None,
) -> Scores:
    """Score every (query, passage) pair of ``pairs`` with ``teacher`` (in ``precision``; None: the teacher's
    own) into ``path`` (resuming a partial file of the same teacher and pairs); an existing finished file is
    checked and read, not recomputed. With ``cache_dir``, pairs the same teacher scored before in that precision
    (for another run) are read from its content-keyed cache (``models.score_cache``), the others kept there."""
    path = Path(path)
    identity = teacher_identity(teacher)
    if path.is_symlink() or path.exists() and not path.is_file():
        raise DataError(f"{path} exists and is not a teacher-scores file (a folder, a pipe or a link): choose another")
    scoring = scoring_settings(teacher, precision)
    if path.is_file():
        return load_teacher_scores(path, pairs, identity, dataset, scoring)
    header = _header(pairs, identity, scoring)
    partial = path.with_name(path.name + ".partial")
    done: Scores = {}
    if partial.is_symlink() or partial.exists() and not partial.is_file():
        raise DataError(f"{partial}, where teacher scores are written as they are computed, is not a plain file")
    if partial.is_file():
        try:
            digests: dict[str, str] = {}
            old, done, good = _read(partial, complete=False, digests=digests)
        except DataError:  # not densepass's: a user's file bearing the name is never written over
            raise DataError(
                f"{partial} is not a teacher-scores file densepass began (no {FORMAT!r} header): move it away"
            ) from None
        stale = any(not _scored_as_now(dataset, q, list(done[q]), digests.get(q)) for q in done if q in pairs)
        if old != header or stale:
            what = "other texts" if old == header else "another teacher, scoring settings or pool"
            warnings.warn(f"{partial} was scored for {what}; starting it over", DataWarning, stacklevel=2)
            done = {}
        else:
            os.truncate(partial, good)
    if not done:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(header) + "\n")
    todo = [q for q in pairs if q not in done]
    scorer = CachedPairScores(teacher, cache_dir) if cache_dir is not None else teacher
    progress = tqdm(total=len(pairs), initial=len(pairs) - len(todo), desc="teacher scores", disable=not show_progress)
    with open(partial, "a", encoding="utf-8") as handle:
        for start in range(0, len(todo), chunk):
            queries = todo[start : start + chunk]
            flat = [(q, p) for q in queries for p in pairs[q]]
            values = scorer.score_pairs(
                [dataset.queries[q] for q, _ in flat],
                [passage_input(dataset.corpus, p, PASSAGE_SEP) for _, p in flat],
                precision,
            )
            for (q, p), value in zip(flat, values.tolist()):
                if not math.isfinite(value) or abs(value) > SCORE_LIMIT:  # a file every later read would refuse
                    raise DataError(
                        f"the teacher {teacher.source} scores query {q!r} and passage {p!r} {value}: not a finite "
                        "number a student could learn from (a diverged teacher?)"
                    )
                done.setdefault(q, {})[p] = value
            records = [
                {"query_id": q, "scores": done.get(q, {}), "texts": texts_fingerprint(dataset, q, pairs[q])}
                for q in queries
            ]
            handle.write("".join(json.dumps(record) + "\n" for record in records))
            handle.flush()
            os.fsync(handle.fileno())
            progress.update(len(queries))
    progress.close()
    os.replace(partial, path)
    return {q: done.get(q, {}) for q in pairs}


@dataclasses.dataclass
class PairScorer:
    """A teacher scoring the new candidates of a refreshed pool (``training.refresh``) into files of their own:
    ``score`` computes them on rank 0 (resumably, as ``compute_teacher_scores``) while the other processes wait,
    then every process reads them; ``read`` reads a finished file again (a resumed run), checked against the
    teacher."""

    teacher: CrossEncoder
    dataset: RetrievalDataset
    precision: str | None = None
    show_progress: bool = True
    cache_dir: str | Path | None = None

    def score(self, pairs: Pairs, path: Path) -> Scores:
        """The teacher's scores of ``pairs``, computed into ``path`` by rank 0 (or read from it when finished) and
        given to every process (whose run directory may be its own); an error there stops every process."""
        options = dict(show_progress=self.show_progress, precision=self.precision, cache_dir=self.cache_dir)
        return distributed.on_rank_zero(
            lambda: compute_teacher_scores(self.teacher, self.dataset, pairs, path, **options)
        )

    def read(self, path: Path) -> Scores:
        """Every score of a finished file this teacher wrote (as many pairs as its header says)."""
        header, scores, _ = _read(path, complete=True)  # read once: header and scores
        _check_teacher(path, header, teacher_identity(self.teacher))
        if sum(map(len, scores.values())) != header.get("pair_count"):
            raise DataError(f"{path} holds {sum(map(len, scores.values()))} teacher scores, its header says "
                            f"{header.get('pair_count')}: score the refresh again (delete the file)")  # fmt: skip
        return scores
