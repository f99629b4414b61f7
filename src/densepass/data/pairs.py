"""Reader for sentence-transformers-style training rows: (anchor, positive[, negative_1, ..., negative_n]).

The rows come from a JSONL file (optionally gzipped), a CSV file (optionally gzipped), a Parquet file, a folder a
``datasets.Dataset`` was saved to with ``save_to_disk``, or a ``datasets.Dataset`` passed from Python. Parquet and
CSV are read with ``pyarrow`` and saved datasets with ``datasets``, batch by batch: a file larger than memory is
streamed once, and what is kept is the distinct texts (the corpus), the anchors (the queries) and their ids.

Columns (``data.columns``; each may be named explicitly, or is found by its name):

- the anchor: ``anchor``, else ``query``;
- the positive: ``positive``, else ``pos`` (a string, or a list of strings: several positives);
- the negatives: every column named ``negative``, ``negatives`` or ``neg``, optionally followed by a number
  (``negative_1``, ``neg2``), in the order the row gives them (each a string, a list of strings, or null: none);
- optional teacher scores: ``scores``, a list of numbers, the teacher's score of each positive then of each
  negative in the row's order (Margin-MSE / KL distillation; in a CSV file, that list written as JSON).

In a CSV file every column is text and an empty cell is no value (a row with fewer negatives than others leaves
the rest empty); a cell of spaces is an empty text.

What it makes is a :class:`PairsDataset`, a ``RetrievalDataset`` whose corpus is the distinct passage texts
(positives and negatives), each with an id derived from its text (``p`` + 20 hex digits of its BLAKE2b hash: the
same text has the same id in every file and format); whose queries are the distinct anchors (``q`` + the hash of
the anchor); whose one split, ``train``, holds each anchor's positives (grade 1); and whose ``negatives`` are each
anchor's given negatives, in the order first given: the hard-negative pool (``negatives.source: given``), so no
mining is needed. Rows repeating an anchor add to its positives and negatives. Training draws each query's first
positive (as for every dataset); its other positives are never drawn as its negatives.

Every row is checked, and bad input is a one-line :class:`DataError` naming the file and the line (JSONL) or row
(the others): a column named in the mapping that the data does not have, a row without an anchor or a positive,
an empty (or whitespace-only) text, a text that is not a string, a negative equal to one of the row's positives
(up to whitespace: "a b" and " a  b" are one text to a tokenizer), scores of the wrong length or not finite, two
rows giving the same (anchor, passage) pair different scores.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from densepass.data.dataset import Corpus, RetrievalDataset
from densepass.data.texts import is_blank
from densepass.errors import DataError

ANCHOR_NAMES = ("anchor", "query")
POSITIVE_NAMES = ("positive", "pos")
NEGATIVE_NAME = re.compile(r"^(negatives?|neg)(_?\d+)?$")
SCORES_NAME = "scores"
SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")  # with .gz for JSONL and CSV
BATCH_ROWS = 1024  # rows converted to Python objects at a time from Parquet, CSV and saved datasets
COLUMN_KEYS = ("anchor", "positive", "negatives", "scores")


def text_id(prefix: str, text: str) -> str:
    """A stable id derived from ``text``: ``prefix`` + 20 hex digits of its BLAKE2b hash (80 bits: no collision is
    expected below about 10^11 texts, and one is detected)."""
    return prefix + hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=10).hexdigest()


@dataclass
class PairsDataset(RetrievalDataset):
    """A ``RetrievalDataset`` read from training rows: ``negatives`` (query id -> the passage ids given as its
    negatives, in order) and, when the rows carry them, ``teacher_scores`` (query id -> passage id -> score).
    ``digest`` fingerprints the rows as read (the same rows give the same digest in every format): the data part
    of a run's identity."""

    negatives: dict[str, list[str]] = field(default_factory=dict)
    teacher_scores: dict[str, dict[str, float]] | None = None
    digest: str = ""

    def file_fingerprints(self) -> dict[str, str]:
        """{``<name>/rows``: the digest of the rows}: a run is never resumed on rows that changed."""
        return {f"{self.name}/rows": self.digest}


def is_pairs_source(source: Any) -> bool:
    """Whether ``source`` is training rows this module reads: a ``datasets`` dataset, a file whose name ends in one
    of :data:`SUFFIXES` (or ``.jsonl.gz`` / ``.csv.gz``), or a folder written by ``Dataset.save_to_disk``."""
    if _is_hf_dataset(source):
        return True
    if not isinstance(source, (str, Path)):
        return False
    path = Path(source)
    if path.is_dir():
        return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()
    name = path.name.lower().removesuffix(".gz")
    return name.endswith(SUFFIXES)


def _is_hf_dataset(source: Any) -> bool:
    module = type(source).__module__ or ""
    return module.startswith("datasets.") and hasattr(source, "column_names")


def load_pairs(
    source: str | Path | Any, columns: Mapping[str, Any] | None = None, name: str | None = None, split: str = "train"
) -> PairsDataset:
    """The :class:`PairsDataset` of ``source`` (a file path, a ``save_to_disk`` folder, or a ``datasets``
    dataset), its columns mapped by ``columns`` ({"anchor", "positive", "negatives", "scores"}: a column name
    each, a list of names for ``negatives``; a missing or null key: found by name as the module says). ``split``
    names the split of a ``DatasetDict`` (saved or in memory) to read, and the split the rows become."""
    mapping = _check_mapping(columns or {})
    files: dict[str, Path] = {}
    if _is_hf_dataset(source) and isinstance(source.column_names, dict):  # a DatasetDict: its ``split``
        if split not in source:
            available = ", ".join(sorted(source)) or "none"
            raise DataError(f"the DatasetDict has no split {split!r} (available: {available})")
        source = source[split]
    if _is_hf_dataset(source):
        label = name or getattr(source, "info", None) and source.info.dataset_name or "dataset"
        columns = source.column_names  # None: an IterableDataset without declared features (each row has its own)
        rows, known = _dataset_rows(source, str(label)), None if columns is None else list(columns)
    else:
        path = Path(source)
        label = name or path.name
        if path.is_dir():
            rows, known = _saved_dataset_rows(path, split)
            files = {p.name: p for p in sorted(path.glob("*.arrow"))}
        elif not path.is_file():
            raise DataError(f"training rows not found: {path}")
        else:
            files = {path.name: path}
            rows, known = _file_rows(path)
    return _build(rows, known, mapping, str(label), split, files)


def _check_mapping(columns: Mapping[str, Any]) -> dict[str, Any]:
    unknown = [k for k in columns if k not in COLUMN_KEYS]
    if unknown:
        raise DataError(f"data.columns: unknown key {unknown[0]!r} (known: {', '.join(COLUMN_KEYS)})")
    mapping = {k: columns.get(k) for k in COLUMN_KEYS}
    negatives = mapping["negatives"]
    if isinstance(negatives, str):
        mapping["negatives"] = [negatives]
    return mapping


# ---- sources: (where, row) pairs, where = "file:line" or "source: row N" ----------------------------------


def _file_rows(path: Path) -> tuple[Iterator[tuple[str, dict]], list[str] | None]:
    """The rows of a JSONL, CSV or Parquet file, and its columns (None for JSONL: each record has its own)."""
    name = path.name.lower().removesuffix(".gz")
    if name.endswith((".jsonl", ".json")):
        from densepass.data.beir import read_jsonl

        if name.endswith(".json"):
            _refuse_json_array(path)
        return ((f"{path}:{line_no}", record) for line_no, record in read_jsonl(path, unique_keys=True)), None
    import pyarrow as pa

    try:
        if name.endswith(".parquet"):
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            known = list(parquet.schema_arrow.names)
            batches = parquet.iter_batches(batch_size=BATCH_ROWS)
        else:
            import pyarrow.csv as pacsv

            # a quoted cell may hold line breaks (csv.writer writes a multi-line text so): without
            # newlines_in_values, a file of more than one block (1 MB) is cut inside such a cell
            parse = pacsv.ParseOptions(newlines_in_values=True)
            with pacsv.open_csv(path, parse_options=parse) as reader:  # the header: every column is read as text
                known = list(reader.schema.names)
            convert = pacsv.ConvertOptions(
                column_types={c: pa.string() for c in known}, null_values=[""], strings_can_be_null=True
            )
            batches = pacsv.open_csv(path, parse_options=parse, convert_options=convert)
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{path}: not a readable {name.rsplit('.', 1)[-1].upper()} file ({_one_line(err)})") from None
    repeated = next((column for column in known if known.count(column) > 1), None)
    if repeated is not None:  # a row (a dict) would keep one of them
        raise DataError(f"{path}: column {repeated!r} appears twice; give each column its own name (negative_1, ...)")
    return _arrow_rows(batches, str(path)), known


def _refuse_json_array(path: Path) -> None:
    """A one-line DataError for a ``.json`` file holding a JSON array (of rows): a ``.json`` file is read as JSON
    lines, where the array's first line would be "not valid JSON" (though it is valid JSON)."""
    from densepass.data.files import open_text, reading

    with reading(path), open_text(path) as handle:
        while (chunk := handle.read(1 << 16)) and not chunk.strip():
            pass
    if chunk.lstrip().startswith("["):
        raise DataError(
            f"{path}: a JSON array; training rows are read as JSON lines: one JSON object per line, no enclosing "
            "[...] (a .jsonl file)"
        )


def _arrow_rows(batches: Iterable, label: str) -> Iterator[tuple[str, dict]]:
    """The rows of an iterator of pyarrow record batches (or of ``datasets`` batches: dicts of columns)."""
    import pyarrow as pa

    row = 0
    try:
        for batch in batches:
            records = batch.to_pylist() if hasattr(batch, "to_pylist") else _dict_rows(batch)
            for record in records:
                row += 1
                yield f"{label}: row {row}", record
    except pa.ArrowException as err:
        raise DataError(f"{label}: after row {row}: not readable ({_one_line(err)})") from None


def _dict_rows(batch: Mapping[str, list]) -> list[dict]:
    keys = list(batch)
    return [dict(zip(keys, values)) for values in zip(*(batch[k] for k in keys))]


def _dataset_rows(dataset: Any, label: str) -> Iterator[tuple[str, dict]]:
    """The rows of a ``datasets.Dataset`` (read in batches from its Arrow table) or ``IterableDataset``."""
    if hasattr(dataset, "iter") and hasattr(dataset, "num_rows"):
        return _arrow_rows(dataset.iter(batch_size=BATCH_ROWS), label)
    return ((f"{label}: row {i}", dict(record)) for i, record in enumerate(dataset, 1))


def _saved_dataset_rows(path: Path, split: str) -> tuple[Iterator[tuple[str, dict]], list[str]]:
    """The rows of a folder written by ``Dataset.save_to_disk`` (of ``DatasetDict``: its ``split``)."""
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(f"{path}: not a dataset saved by datasets' save_to_disk ({_one_line(err)})") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"{path}: no split {split!r} (available: {', '.join(sorted(loaded)) or 'none'})")
        loaded = loaded[split]
    return _dataset_rows(loaded, str(path)), list(loaded.column_names)


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]


# ---- columns and rows -------------------------------------------------------------------------------------


def _resolve(known: Iterable[str], mapping: dict[str, Any], where: str) -> dict[str, Any]:
    """The column of each role among ``known`` columns: the mapping's (checked to exist), or found by name."""
    known = list(known)
    listed = ", ".join(map(repr, known)) or "none"
    for key in ("anchor", "positive", "scores"):
        if mapping[key] is not None and mapping[key] not in known:
            raise DataError(
                f"{where}: data.columns.{key} names column {mapping[key]!r}, which it does not have "
                f"(its columns: {listed})"
            )
    for column in mapping["negatives"] or ():
        if column not in known:
            raise DataError(
                f"{where}: data.columns.negatives names column {column!r}, which it does not have "
                f"(its columns: {listed})"
            )
    out = dict(mapping)
    for key, names in (("anchor", ANCHOR_NAMES), ("positive", POSITIVE_NAMES)):
        if out[key] is None:
            out[key] = next((n for n in names if n in known), None)
            if out[key] is None:
                raise DataError(
                    f"{where}: no {key} column (looked for {' or '.join(names)}; its columns: {listed}); "
                    f"name it in data.columns.{key}"
                )
    if out["negatives"] is None:
        out["negatives"] = [c for c in known if NEGATIVE_NAME.match(c) and c not in (out["anchor"], out["positive"])]
    if out["scores"] is None and SCORES_NAME in known:
        out["scores"] = SCORES_NAME
    return out


def _text(value: Any, what: str, where: str) -> str:
    if value.__class__ is not str:
        raise DataError(f"{where}: the {what} should be a string, got {type(value).__name__}")
    if is_blank(value):
        raise DataError(f"{where}: the {what} is empty")
    return value


def _texts(value: Any, what: str, where: str) -> list[str]:
    """A column's texts: a string, a list of strings, or None (no text)."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [_text(v, f"{what}[{i}]", where) for i, v in enumerate(value)]
    return [_text(value, what, where)]


def _scores(value: Any, count: int, column: str, where: str) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, str):  # a CSV cell: the list written as JSON
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):  # not JSON, or beyond json's limits (5000 digits, [[[[...]]]])
            raise DataError(f"{where}: column {column!r} should hold a list of numbers, got {value[:40]!r}") from None
    if not isinstance(value, (list, tuple)) or any(
        isinstance(v, bool) or not isinstance(v, (int, float)) for v in value
    ):
        raise DataError(f"{where}: column {column!r} should hold a list of numbers")
    if len(value) != count:
        raise DataError(
            f"{where}: column {column!r} holds {len(value)} scores for {count} passages (one per positive, then one "
            "per negative)"
        )
    try:
        scores = [float(v) for v in value]
    except OverflowError:  # an integer beyond a float's range (10**400 written out): no finite score
        scores = [math.inf]
    if not all(math.isfinite(v) for v in scores):
        raise DataError(f"{where}: column {column!r} holds a score that is not a finite number")
    return scores


class _Builder:
    """Accumulates the rows' corpus, queries, qrels, negatives and scores (each text stored once)."""

    def __init__(self) -> None:
        self.rows: dict[str, int] = {}  # passage id -> row of the corpus
        self.texts: list[str] = []
        self.queries: dict[str, str] = {}
        self.positives: dict[str, dict[str, int]] = {}
        self.negatives: dict[str, dict[str, None]] = {}
        self.scores: dict[str, dict[str, float]] = {}
        self.hasher = hashlib.blake2b(digest_size=16)
        self.count = 0

    def passage(self, text: str, where: str) -> str:
        pid = text_id("p", text)
        row = self.rows.get(pid)
        if row is None:
            self.rows[pid] = len(self.texts)
            self.texts.append(text)
        elif self.texts[row] != text:
            raise DataError(f"{where}: two different texts have the same id {pid!r} (a hash collision)")
        return pid

    def query(self, text: str, where: str) -> str:
        qid = text_id("q", text)
        known = self.queries.setdefault(qid, text)
        if known != text:
            raise DataError(f"{where}: two different anchors have the same id {qid!r} (a hash collision)")
        return qid

    def pool(self, qid: str) -> list[str]:
        """An anchor's negatives less any that another of its rows gives as a positive (up to whitespace)."""
        spaced = {" ".join(self.texts[self.rows[p]].split()) for p in self.positives[qid]}
        return [p for p in self.negatives[qid] if " ".join(self.texts[self.rows[p]].split()) not in spaced]

    def digest(self, *parts: Any) -> None:
        data = json.dumps(parts, ensure_ascii=False).encode("utf-8", "surrogatepass")
        self.hasher.update(len(data).to_bytes(8, "little"))
        self.hasher.update(data)

    def add(self, anchor: str, positives: list[str], negatives: list[str], scores: list[float] | None, where: str):
        self.count += 1
        self.digest(anchor, positives, negatives, scores)
        qid = self.query(anchor, where)
        pos_ids = [self.passage(t, where) for t in positives]
        neg_ids = [self.passage(t, where) for t in negatives]
        given = self.positives.setdefault(qid, {})
        for pid in pos_ids:
            given.setdefault(pid, 1)
        pool = self.negatives.setdefault(qid, {})
        for pid in neg_ids:
            pool.setdefault(pid, None)
        if scores is not None:
            scored = self.scores.setdefault(qid, {})
            for pid, value in zip([*pos_ids, *neg_ids], scores):
                if scored.setdefault(pid, value) != value:
                    raise DataError(
                        f"{where}: the score {value:g} of a passage differs from the {scored[pid]:g} an earlier row "
                        "gave the same anchor and passage"
                    )


def _build(
    rows: Iterator[tuple[str, dict]],
    known: list[str] | None,
    mapping: dict[str, Any],
    name: str,
    split: str,
    files: dict[str, Path],
) -> PairsDataset:
    builder = _Builder()
    resolved = _resolve(known, mapping, name) if known is not None else None
    by_keys: dict[tuple[str, ...], dict[str, Any]] = {}  # JSONL: the columns of each set of record keys
    scored_rows = 0
    for where, record in rows:
        if known is None:  # a JSONL record: its own keys (the mapping checked against the first record)
            keys = tuple(record)
            columns = by_keys.get(keys)
            if columns is None:
                columns = by_keys[keys] = (
                    _resolve(keys, mapping, where)
                    if not by_keys
                    else _resolve_row(keys, mapping, next(iter(by_keys.values())), where)
                )
        else:
            columns = resolved
        anchor_value = record.get(columns["anchor"])
        if anchor_value is None:
            raise DataError(f"{where}: no anchor (column {columns['anchor']!r})")
        anchor = _text(anchor_value, f"anchor (column {columns['anchor']!r})", where)
        positives = _texts(record.get(columns["positive"]), f"positive (column {columns['positive']!r})", where)
        if not positives:
            raise DataError(f"{where}: no positive (column {columns['positive']!r})")
        negatives = [t for c in columns["negatives"] for t in _texts(record.get(c), f"negative (column {c!r})", where)]
        spaced = {" ".join(t.split()) for t in positives}
        same = next((t for t in negatives if " ".join(t.split()) in spaced), None)
        if same is not None:
            raise DataError(f"{where}: a negative is the row's positive ({same[:40]!r})")
        scores = None
        if columns["scores"] is not None:
            scores = _scores(record.get(columns["scores"]), len(positives) + len(negatives), columns["scores"], where)
            scored_rows += scores is not None
        builder.add(anchor, positives, negatives, scores, where)
    if not builder.count:
        raise DataError(f"{name}: no rows")
    if scored_rows and scored_rows != builder.count:
        raise DataError(f"{name}: {scored_rows} of its {builder.count} rows have teacher scores: give all or none")
    corpus = Corpus(list(builder.rows), [""] * len(builder.texts), builder.texts, list(builder.rows))
    dataset = PairsDataset(
        name=name,
        corpus=corpus,
        queries=builder.queries,
        qrels={split: builder.positives},
        files=files,
        negatives={q: builder.pool(q) for q in builder.negatives},
        teacher_scores=builder.scores if scored_rows else None,
        digest=builder.hasher.hexdigest(),
    )
    return dataset


def _resolve_row(keys: tuple[str, ...], mapping: dict[str, Any], first: dict[str, Any], where: str) -> dict[str, Any]:
    """The columns of a JSONL record after the first: the first record's anchor, positive and scores columns
    (a record without one gives the row's own error; a ``scores`` key the first record lacked is read, so rows
    that give scores after a first that gives none are refused, as in any other order), its negatives found by
    name unless the mapping names them."""
    columns = dict(first)
    if columns["scores"] is None and mapping["scores"] is None and SCORES_NAME in keys:
        columns["scores"] = SCORES_NAME  # scores only from a later record on: counted, so "give all or none" says so
    if mapping["negatives"] is None:
        columns["negatives"] = [
            c for c in keys if NEGATIVE_NAME.match(c) and c not in (columns["anchor"], columns["positive"])
        ]
    return columns
