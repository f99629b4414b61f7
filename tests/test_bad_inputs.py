"""Bad data inputs: each is a one-line DataError naming the file (and line), or, where reading on is right,
one counted DataWarning per file and kind; plus metric names, run files and unknown model names."""

from __future__ import annotations

import gzip
import json
import re
import shutil
import socket
import tempfile
import time
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from densepass.cli import main
from densepass.config import load_config
from densepass.data import default_data_dir, load_dataset
from densepass.data.beir import load_beir
from densepass.data.dpr import load_dpr
from densepass.data.msmarco import load_msmarco
from densepass.data.squad import load_squad
from densepass.device import resolve_device
from densepass.errors import ConfigError, DataError, DataWarning, DensepassError
from densepass.evaluation.metrics import check_metrics, evaluate_run, read_trec_run
from test_data_readers import (
    BEIR_CORPUS,
    BEIR_QUERIES,
    DPR_TRAIN,
    ctx,
    jsonl,
    squad_file,
    write,
    write_beir,
    write_dpr,
    write_msmarco,
    write_squad,
)


def data_warnings(record) -> list[str]:
    """The messages of the DataWarnings recorded by ``pytest.warns`` / ``warnings.catch_warnings``."""
    return [str(w.message) for w in record if issubclass(w.category, DataWarning)]


def no_data_warnings(load):
    """Call ``load`` and fail on any DataWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DataWarning)
        return load()


# ---------------------------------------------------------------- 1. bytes that are not UTF-8


def corrupt_line(path: Path, line_no: int) -> None:
    """Put a latin-1 ``é`` (0xe9, not UTF-8 on its own) after the first byte of line ``line_no`` (1-based) of
    a (possibly gzipped) text file."""
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    lines = raw.split(b"\n")
    lines[line_no - 1] = lines[line_no - 1][:1] + "\xe9".encode("latin-1") + lines[line_no - 1][1:]
    raw = b"\n".join(lines)
    path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)


@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize("name", ["corpus.jsonl", "queries.jsonl", "qrels/train.tsv"])
def test_non_utf8_bytes_in_beir_files_name_the_file_and_line(tmp_path, name, gz):
    root = write_beir(tmp_path / "beir", gz)
    path = root / (name + (".gz" if gz else ""))
    corrupt_line(path, 2)
    with pytest.raises(DataError, match=rf"{path.name}:2: not valid UTF-8 \(byte 0xe9"):
        load_beir(root)


@pytest.mark.parametrize("name", ["collection.tsv", "queries.train.tsv", "qrels.train.tsv"])
def test_non_utf8_bytes_in_msmarco_files_name_the_file_and_line(tmp_path, name):
    root = write_msmarco(tmp_path / "marco")
    write(root / name, "10\tplain\n11\tfirst passage\n" if name != "qrels.train.tsv" else "10 0 0 1\n11 0 1 1\n")
    corrupt_line(root / name, 2)
    with pytest.raises(DataError, match=rf"{name}:2: not valid UTF-8"):
        load_msmarco(root)


def test_non_utf8_bytes_in_dpr_and_squad_json_name_the_file_and_line(tmp_path):
    root = write_dpr(tmp_path / "dpr", gz=True)
    corrupt_line(root / "dev.json.gz", 1)
    with pytest.raises(DataError, match=r"dev\.json\.gz:1: not valid UTF-8"):
        load_dpr(root)
    root = write_squad(tmp_path / "squad")
    corrupt_line(root / "train-v1.1.json", 1)
    with pytest.raises(DataError, match=r"train-v1\.1\.json:1: not valid UTF-8"):
        load_squad(root)


def test_non_utf8_bytes_in_a_run_file_name_the_file_and_line(tmp_path):
    path = tmp_path / "run.trec"
    path.write_bytes(b"q1 Q0 p1 1 0.5 t\nq1 Q0 p\xe92 2 0.4 t\n")
    with pytest.raises(DataError, match=r"run\.trec:2: not valid UTF-8"):
        read_trec_run(path)


# ---------------------------------------------------------------- 2. broken gzip files


def test_a_truncated_gzip_is_a_one_line_error(tmp_path):
    root = write_beir(tmp_path / "beir", gz=True)
    path = root / "corpus.jsonl.gz"
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(DataError, match=r"corpus\.jsonl\.gz: truncated gzip file"):
        load_beir(root)


@pytest.mark.parametrize("damage", ["not gzip", "bad deflate block", "bad checksum"])
def test_a_corrupt_gzip_is_a_one_line_error(tmp_path, damage):
    root = write_beir(tmp_path / "beir", gz=True)
    path = root / "queries.jsonl.gz"
    data = bytearray(gzip.compress(jsonl(BEIR_QUERIES).encode()))  # no file name in the header: 10 bytes
    if damage == "not gzip":
        data = bytearray(jsonl(BEIR_QUERIES).encode())
    elif damage == "bad deflate block":
        data[10] = 0xFF  # first byte of the deflate stream: block type 3 does not exist
    else:
        data[-6] ^= 0xFF  # the CRC32 of the uncompressed data
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"queries\.jsonl\.gz: corrupt gzip file"):
        load_beir(root)


# ---------------------------------------------------------------- 3. / 10. field types


@pytest.mark.parametrize(
    "record, message",
    [
        ({"_id": "q1", "text": None}, "null field 'text'"),
        ({"_id": "q1", "text": 42}, "field 'text' should be a str, got int"),
        ({"_id": None, "text": "what"}, "null field '_id'"),
        ({"_id": ["q1"], "text": "what"}, "field '_id' should be a str or int, got list"),
        ({"_id": True, "text": "what"}, "field '_id' should be a str or int, got bool"),
        ({"_id": "", "text": "what"}, "empty field '_id'"),
        ({"_id": "q9", "text": "what", "answers": "one string"}, "field 'answers' should be a list"),
    ],
)
def test_a_bad_query_field_is_a_data_error_naming_file_and_line(tmp_path, record, message):
    root = write_beir(tmp_path / "beir")
    write(root / "queries.jsonl", jsonl([BEIR_QUERIES[0], record, *BEIR_QUERIES[1:]]))
    with pytest.raises(DataError, match=rf"queries\.jsonl:2: {message}"):
        load_beir(root)


@pytest.mark.parametrize(
    "record, message",
    [
        ({"_id": "p9", "text": 3.5}, "field 'text' should be a str, got float"),
        ({"_id": "p9", "text": "fine", "title": ["a", "list"]}, "field 'title' should be a str, got list"),
        ({"_id": "p9", "text": None}, "null field 'text'"),
        ({"_id": {"id": 1}, "text": "fine"}, "field '_id' should be a str or int, got dict"),
        ({"_id": "p9", "text": "fine", "doc_id": 1.5}, "field 'doc_id' should be a str or int, got float"),
    ],
)
def test_a_bad_passage_field_is_a_data_error_naming_file_and_line(tmp_path, record, message):
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", jsonl([*BEIR_CORPUS, record]))
    with pytest.raises(DataError, match=rf"corpus\.jsonl:4: {message}"):
        load_beir(root)


def test_integer_ids_and_null_titles_are_accepted(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "7\t5\t1\n"})
    write(root / "corpus.jsonl", jsonl([{"_id": 5, "title": None, "text": "five", "doc_id": 50}]))
    write(root / "queries.jsonl", jsonl([{"_id": 7, "text": "seven"}]))
    ds = no_data_warnings(lambda: load_beir(root))
    assert (ds.corpus.ids, ds.corpus.titles, ds.corpus.doc_ids) == (["5"], [""], ["50"])
    assert ds.positives("dev") == {"7": ["5"]}


def test_a_repeated_passage_id_in_a_beir_corpus_names_the_line(tmp_path):
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", jsonl([*BEIR_CORPUS, {"_id": "p2", "text": "again"}]))
    with pytest.raises(DataError, match=r"corpus\.jsonl:4: duplicate passage id 'p2'"):
        load_beir(root)


def test_a_null_question_in_dpr_and_a_boolean_squad_id_are_errors(tmp_path):
    write(tmp_path / "dpr" / "train.json", json.dumps([{"question": None, "positive_ctxs": []}]))
    with pytest.raises(DataError, match=r"record 0: null field 'question'"):
        load_dpr(tmp_path / "dpr")
    write(tmp_path / "dpr" / "train.json", json.dumps([{"question": "q", "answers": [["nested"]]}]))
    with pytest.raises(DataError, match=r"record 0: answers\[0\] should be a str, got list"):
        load_dpr(tmp_path / "dpr")
    write(tmp_path / "squad" / "dev-v1.1.json", squad_file([("T", [("c", [(True, "q", ["a"])])])]))
    with pytest.raises(DataError, match=r"field 'id' should be a str or int, got bool"):
        load_squad(tmp_path / "squad")


# ---------------------------------------------------------------- 5. repeated query ids


def test_a_query_id_repeated_with_another_text_is_an_error(tmp_path):
    root = write_beir(tmp_path / "beir")
    write(root / "queries.jsonl", jsonl([*BEIR_QUERIES, {"_id": "q1", "text": "something else"}]))
    with pytest.raises(DataError, match=r"queries\.jsonl:4: query id 'q1' repeated with a different text"):
        load_beir(root)


def test_a_query_id_repeated_with_the_same_text_is_one_counted_warning(tmp_path):
    root = write_beir(tmp_path / "beir")
    write(root / "queries.jsonl", jsonl([*BEIR_QUERIES, BEIR_QUERIES[2], BEIR_QUERIES[0]]))
    with pytest.warns(DataWarning) as record:
        ds = load_beir(root)
    assert data_warnings(record) == [
        f"{root / 'queries.jsonl'}: 2 repeated query ids with the same text, ignored (first: line 4)"
    ]
    assert ds.queries["q1"] == "what is alpha"


def test_msmarco_query_ids_with_two_texts_are_an_error_within_and_across_files(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    write(root / "queries.train.tsv", "10\twhat is first\n10\twhat is first, really\n")
    with pytest.raises(DataError, match=r"queries\.train\.tsv:2: query id '10' given again with a different text"):
        load_msmarco(root)
    root = write_msmarco(tmp_path / "marco2")
    write(root / "queries.dev.tsv", "20\twhat is third\n10\tnot what is first\n")
    with pytest.raises(DataError, match=r"queries\.(dev|train)\.tsv:\d: query id '10' given again"):
        load_msmarco(root)


def test_msmarco_repeated_queries_warn_within_a_file_but_not_across_split_files(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    write(root / "queries.dev.small.tsv", "20\twhat is third\n")  # a subset of queries.dev.tsv: normal
    no_data_warnings(lambda: load_msmarco(root))
    write(root / "queries.train.tsv", "10\twhat is first\n11\twhat is second\n10\twhat is first\n")
    with pytest.warns(DataWarning, match=r"queries\.train\.tsv: 1 repeated query ids with the same text"):
        load_msmarco(root)


# ---------------------------------------------------------------- 6. / 8. qrels rows


def test_a_qrels_pair_judged_twice_with_different_grades_is_an_error(tmp_path):
    # before: the later grade-0 row silently removed q1's positive
    root = write_beir(tmp_path / "beir", qrels={"train": "q1\tp1\t1\nq1\tp2\t1\nq1\tp1\t0\n"})
    with pytest.raises(
        DataError,
        match=r"train\.tsv:3: query 'q1' and passage 'p1' judged again with grade 0 "
        r"\(before: 1\)",
    ):
        load_beir(root)


def test_a_repeated_identical_qrels_row_is_one_counted_warning(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"train": "q1\tp1\t1\nq1\tp1\t1\nq2\tp3\t1\nq1\tp1\t1\n"})
    with pytest.warns(DataWarning) as record:
        ds = load_beir(root)
    expected = f"{root / 'qrels' / 'train.tsv'}: 2 repeated (query, passage) rows with the same grade, ignored"
    assert data_warnings(record) == [f"{expected} (first: line 2)"]
    assert ds.qrels["train"] == {"q1": {"p1": 1}, "q2": {"p3": 1}}


def test_a_headerless_qrels_file_keeps_a_first_row_graded_1_point_0(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "q2\tp3\t1.0\nq1\tp1\t2.0\n", "train": "q1 0 p2 1.0\n"})
    ds = no_data_warnings(lambda: load_beir(root))
    assert ds.qrels["dev"] == {"q2": {"p3": 1}, "q1": {"p1": 2}}
    assert ds.qrels["train"] == {"q1": {"p2": 1}}


@pytest.mark.parametrize("grade", ["0.5", "nan", "inf", "high"])
def test_a_non_integral_grade_is_an_error(tmp_path, grade):
    root = write_beir(tmp_path / "beir", qrels={"dev": f"query-id\tcorpus-id\tscore\nq2\tp3\t{grade}\n"})
    with pytest.raises(DataError, match=rf"dev\.tsv:2: relevance '{grade}' is not an integer"):
        load_beir(root)


# ---------------------------------------------------------------- 7. DPR passage ids


def test_a_dpr_passage_id_with_two_different_texts_is_an_error(tmp_path):
    root = write_dpr(tmp_path / "dpr")
    clash = [{"question": "q", "positive_ctxs": [ctx("Beta", "Beta is NOT a letter.", passage_id="200")]}]
    write(root / "dev.json", json.dumps(clash))
    with pytest.raises(
        DataError,
        match=r"dev\.json: record 0\.positive_ctxs\[0\]: passage id '200' given again "
        r"with a different text",
    ):
        load_dpr(root)
    write(
        root / "dev.json",
        json.dumps([{"question": "q", "positive_ctxs": [ctx("Gamma", "Beta is a letter.", passage_id="200")]}]),
    )
    with pytest.raises(DataError, match="passage id '200' given again with a different title"):
        load_dpr(root)


def test_a_dpr_passage_id_repeated_with_the_same_text_is_fine(tmp_path):
    root = tmp_path / "dpr"
    write(root / "train.json", json.dumps(DPR_TRAIN))  # passage 200 appears in two records, identical
    assert no_data_warnings(lambda: load_dpr(root)).corpus.ids.count("200") == 1


# ---------------------------------------------------------------- 9. MS MARCO header line


@pytest.mark.parametrize("header", ["id\ttext", "pid\tpassage"])
def test_a_header_line_in_collection_tsv_is_skipped_with_a_warning(tmp_path, header):
    root = write_msmarco(tmp_path / "marco")
    write(root / "collection.tsv", f"{header}\n0\tfirst passage\n1\tsecond\n2\tthird\n")
    with pytest.warns(DataWarning, match=r"collection\.tsv: 1 header lines skipped \(first: line 1\)"):
        ds = load_msmarco(root)
    assert ds.corpus.ids == ["0", "1", "2"]


# ---------------------------------------------------------------- 11. empty queries


def test_a_split_whose_queries_are_all_empty_is_an_error(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "q1\tp1\t1\nq2\tp3\t1\n", "train": "q3\tp2\t1\n"})
    write(
        root / "queries.jsonl",
        jsonl([{"_id": "q1", "text": ""}, {"_id": "q2", "text": "  \t"}, {"_id": "q3", "text": "fine"}]),
    )
    with pytest.raises(DataError, match=r"every query of qrels/dev has an empty text \(e\.g\. query 'q1'\)"):
        load_beir(root)


def test_some_empty_queries_are_one_counted_warning_per_split(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "q1\tp1\t1\nq2\tp3\t1\nq3\tp2\t1\n"})
    write(
        root / "queries.jsonl",
        jsonl([{"_id": "q1", "text": "fine"}, {"_id": "q2", "text": " "}, {"_id": "q3", "text": ""}]),
    )
    with pytest.warns(DataWarning) as record:
        load_beir(root)
    assert data_warnings(record) == ["beir: qrels/dev: 2 of its 3 queries have an empty text (first: query 'q2')"]


# ---------------------------------------------------------------- 12. run files and metrics


def write_run(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_a_run_naming_passages_outside_the_corpus_is_an_error(tmp_path):
    path = write_run(tmp_path / "run.trec", ["q1 Q0 p1 1 0.9 t", "q1 Q0 zz 2 0.8 t", "q2 Q0 yy 1 0.7 t"])
    assert set(read_trec_run(path)["q1"]) == {"p1", "zz"}  # without a corpus nothing is checked
    with pytest.raises(DataError, match=r"run\.trec: 2 passage ids are not in the dataset's corpus \(e\.g\. 'zz'\)"):
        read_trec_run(path, {"p1", "p2"})


def test_a_run_giving_one_passage_twice_for_a_query_is_an_error(tmp_path):
    path = write_run(tmp_path / "run.trec", ["q1 Q0 p1 1 0.9 t", "q2 Q0 p1 1 0.9 t", "q1 Q0 p1 2 0.1 t"])
    with pytest.raises(DataError, match=r"run\.trec:3: passage 'p1' appears twice for query 'q1'"):
        read_trec_run(path)


@pytest.mark.parametrize("score", ["nan", "inf", "-inf", "NaN"])
def test_a_run_score_that_is_not_finite_is_an_error(tmp_path, score):
    path = write_run(tmp_path / "run.trec", ["q1 Q0 p1 1 0.9 t", f"q1 Q0 p2 2 {score} t"])
    with pytest.raises(DataError, match=rf"run\.trec:2: score '{score}' is not a finite number"):
        read_trec_run(path)


def test_an_empty_run_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match=r"run\.trec: the run file is empty"):
        read_trec_run(write_run(tmp_path / "run.trec", ["", "  "]))


def test_tied_scores_are_ordered_by_the_rank_column_with_one_warning(tmp_path):
    # constant scores; the file lists the relevant passage last but ranks it first
    lines = [f"q1 Q0 x{i} {i + 2} 0.0 t" for i in range(19)] + ["q1 Q0 rel 1 0.0 t"]
    lines += ["q2 Q0 a 1 0.5 t", "q2 Q0 rel 3 0.5 t", "q2 Q0 b 2 0.5 t", "q2 Q0 top 9 0.9 t"]
    path = write_run(tmp_path / "run.trec", lines)
    with pytest.warns(DataWarning) as record:
        run = read_trec_run(path)
    expected = f"{path}: 2 of 2 queries have tied scores (first: query 'q1'); their ties are ordered by the rank column"
    assert data_warnings(record) == [expected]
    assert sorted(run["q2"], key=run["q2"].get, reverse=True) == ["top", "a", "b", "rel"]
    assert list(run["q2"].items()) == [("top", 0.9), ("a", 0.5), ("b", 0.5), ("rel", 0.5)]  # its scores, in order
    got = evaluate_run({"q1": {"rel": 1}, "q2": {"rel": 1}}, run, ["mrr@10"])
    assert got["mrr@10"] == pytest.approx((1 / 1 + 1 / 4) / 2)


def test_a_run_without_ties_keeps_its_scores_and_warns_nothing(tmp_path):
    path = write_run(tmp_path / "run.trec", ["q1 Q0 p1 1 0.9 t", "q1 Q0 p2 2 0.25 t", "q2 Q0 p1 1 0.9 t"])
    assert no_data_warnings(lambda: read_trec_run(path)) == {"q1": {"p1": 0.9, "p2": 0.25}, "q2": {"p1": 0.9}}


@pytest.mark.parametrize(
    "name", ["mrr@x", "foo@10", "mrr@0", "accuracy", "accuracy@0", "MRR@10", "ndcg@-1", "", "recall@10@2", "mrr@ 10"]
)
def test_an_unknown_metric_name_is_a_one_line_config_error(name):
    with pytest.raises(ConfigError, match="unknown metric"):
        check_metrics(["mrr@10", name])


def test_known_metric_names_pass_the_check():
    check_metrics(
        [
            "mrr",
            "mrr@10",
            "ndcg@10",
            "recall@100",
            "precision@5",
            "map@1000",
            "hits@3",
            "hit_rate@5",
            "r-precision",
            "accuracy@5",
            "accuracy@20",
            "f1",
            "f1@5",
        ]
    )
    with pytest.raises(ConfigError, match="non-empty list"):
        check_metrics([])


def test_every_metric_the_error_message_lists_is_accepted_and_computed():
    from densepass.evaluation.metrics import RANX_METRICS

    with pytest.raises(ConfigError) as refused:
        check_metrics(["nope"])
    listed = re.search(r"known: (.*?), each with", str(refused.value)).group(1).split(", ")
    assert listed == list(RANX_METRICS)
    names = [*listed, *(f"{name}@5" for name in listed if name != "r-precision")]  # its cutoff is its own
    check_metrics(names)
    got = evaluate_run({"q1": {"p1": 1}}, {"q1": {"p2": 0.9, "p1": 0.8}}, ["f1", "f1@5"])  # the one with a digit
    assert got == {"f1": pytest.approx(2 / 3), "f1@5": pytest.approx(1 / 3)}  # precision@5 is 1/5


def test_ranx_compile_warnings_are_not_printed_as_garbled_lines(capsys):
    # numba warns "unsafe cast from uint64 to int64" in terminal escapes when it compiles ranx's map on first use
    # (a fresh NUMBA_CACHE_DIR shows it; compiling takes minutes, so the warning is raised here by hand)
    import warnings

    from numba.core.errors import NumbaTypeSafetyWarning

    import densepass.evaluation.metrics as metrics
    from densepass.cli import run_guarded

    real = metrics.quiet_numba

    def compile_now(*args, **kwargs):
        with real():  # inside: silenced
            warnings.warn("\x1b[1munsafe cast from uint64 to int64\x1b[0m", NumbaTypeSafetyWarning, stacklevel=1)
        warnings.warn("\x1b[1mcoloured\x1b[0m warning", DataWarning, stacklevel=1)  # outside: escapes dropped

    assert run_guarded(compile_now) == 0
    assert capsys.readouterr().err == "densepass: warning: coloured warning\n"


def test_evaluate_run_computes_answer_accuracy_or_refuses_without_answers():
    qrels = {"qa": {"p1": 1}, "qb": {"p2": 1}}
    run = {"qa": {"p2": 0.9, "p1": 0.8}, "qb": {"p2": 0.7}}
    passages = {"p1": "Rome is in Italy", "p2": "Paris is in France"}
    got = evaluate_run(qrels, run, ["accuracy@1", "accuracy@2", "mrr@10"], {"qa": ["Rome"], "qb": ["France"]}, passages)
    assert got == pytest.approx({"accuracy@1": 1 / 2, "accuracy@2": 2 / 2, "mrr@10": (1 / 2 + 1) / 2})
    with pytest.raises(DataError, match="accuracy@1 needs answer strings"):
        evaluate_run(qrels, run, ["accuracy@1"])
    with pytest.raises(ConfigError, match="unknown metric 'mrr@x'"):
        evaluate_run(qrels, run, ["mrr@x"])


# ---------------------------------------------------------------- the evaluate command


def stderr_lines(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()


def test_cli_evaluate_rejects_an_unknown_metric_before_any_work(tmp_path, capsys):
    # the dataset does not exist either: the metric name is checked first
    assert (
        main(
            [
                "evaluate",
                "nosuch",
                str(tmp_path / "run.trec"),
                "--data-dir",
                str(tmp_path),
                "--metrics",
                "mrr@10",
                "foo@10",
            ]
        )
        == 2
    )
    [line] = stderr_lines(capsys)
    assert line == (
        "densepass: error: unknown metric 'foo@10' (known: mrr, ndcg, ndcg_burges, dcg, dcg_burges, "
        "recall, precision, r-precision, f1, map, hits, hit_rate, each with an optional cutoff @k but "
        "r-precision, 1 <= k <= 1000000000; and accuracy@k)"
    )


def test_cli_evaluate_reports_answer_accuracy_on_a_dataset_with_answers(tmp_path, capsys):
    root = write_squad(tmp_path / "squad")
    run = write_run(tmp_path / "run.trec", ["d1 Q0 train-0-0 1 0.9 t", "d1 Q0 dev-0-0 2 0.8 t"])
    assert (
        main(["evaluate", str(root), str(run), "--format", "squad", "--metrics", "accuracy@1", "accuracy@2", "mrr@10"])
        == 0
    )
    assert json.loads(capsys.readouterr().out) == {"mrr@10": 0.5, "accuracy@1": 0.0, "accuracy@2": 1.0}


def test_cli_evaluate_accuracy_without_answers_is_a_one_line_error(tiny_beir, tmp_path, capsys):
    run = write_run(tmp_path / "run.trec", ["q30 Q0 p30 1 0.9 t"])
    assert main(["evaluate", str(tiny_beir), str(run), "--metrics", "accuracy@5"]) == 2
    [line] = stderr_lines(capsys)
    assert line.startswith("densepass: error: accuracy@5 needs answer strings, and no judged query has any")


def test_cli_evaluate_rejects_a_run_for_another_corpus(tiny_beir, tmp_path, capsys):
    run = write_run(tmp_path / "run.trec", ["q30 Q0 p30 1 0.9 t", "q30 Q0 other-7 2 0.8 t"])
    assert main(["evaluate", str(tiny_beir), str(run)]) == 2
    [line] = stderr_lines(capsys)
    assert "1 passage ids are not in the dataset's corpus (e.g. 'other-7')" in line


def test_cli_prints_each_warning_as_one_line(tiny_beir, tmp_path, capsys):
    with open(tiny_beir / "qrels" / "dev.tsv", "a") as handle:
        handle.write("q30\tp30\t1\nq31\tp31\t1\n")  # two repeated rows
    run = write_run(tmp_path / "run.trec", ["q30 Q0 p30 1 0.5 t", "q30 Q0 p1 2 0.5 t"])  # tied scores
    assert main(["evaluate", str(tiny_beir), str(run), "--metrics", "mrr@10"]) == 0
    qrels = tiny_beir / "qrels" / "dev.tsv"
    assert stderr_lines(capsys) == [
        f"densepass: warning: {qrels}: 2 repeated (query, passage) rows with the same grade, ignored (first: line 12)",
        (
            f"densepass: warning: {run}: 1 of 1 queries have tied scores (first: query 'q30'); "
            "their ties are ordered by the rank column"
        ),
        "densepass: warning: the run answers 1 of the 10 queries of the qrels: evaluated on those (as trec_eval; "
        "--all-queries counts the others as zero, as trec_eval -c)",
    ]
    assert warnings.showwarning is not None and warnings.showwarning.__module__ == "warnings"  # restored


# ---------------------------------------------------------------- 4. model names


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection or resolve a host name fails the test at once."""

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """An empty Hugging Face hub cache used for this test."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    return cache


@pytest.mark.timeout(60)
def test_an_unknown_hub_model_is_a_one_line_config_error_without_network(no_network, hub_cache):
    from densepass.models.biencoder import BiEncoder

    start = time.monotonic()
    with pytest.raises(
        ConfigError, match="model no-such-org/no-such-model is not in the Hugging Face cache and the Hub is offline"
    ):
        BiEncoder.from_pretrained("no-such-org/no-such-model")
    assert time.monotonic() - start < 10


def test_a_hub_model_in_the_local_cache_is_still_accepted(no_network, hub_cache, tiny_model_dir):
    from densepass.models.biencoder import resolve_model_path

    snapshot = hub_cache / "models--some-org--tiny" / "snapshots" / "0123abcd"
    shutil.copytree(tiny_model_dir, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abcd")
    assert resolve_model_path("some-org/tiny") == str(snapshot)  # read from the cache, no network
    with pytest.raises(ConfigError, match="some-org/other is not in the Hugging Face cache and the Hub is offline"):
        resolve_model_path("some-org/other")


# ---------------------------------------------------------------- the real datasets stay clean


@pytest.mark.parametrize("name, fmt", [("debian-packages", "beir"), ("squad-v1.1-dev-split", "squad")])
def test_the_shared_datasets_load_without_warnings(name, fmt):
    data_dir = default_data_dir()
    if not (data_dir / name).is_dir():
        pytest.skip(f"shared data not found at {data_dir}")
    no_data_warnings(lambda: load_dataset(name, data_dir=data_dir, format=fmt))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("cuda", "asked for, but this machine has no CUDA GPU"),
        ("mps", "is not supported"),
        ("gpu0", "is not a torch device"),
    ],
)
def test_a_device_this_machine_lacks_is_a_one_line_error_before_any_work(tmp_path, name, message):
    from densepass.pipelines.experiment import check

    with pytest.raises(ConfigError, match=message):
        resolve_device(name)
    with pytest.raises(ConfigError, match=message):
        check(load_config(None, [f"device={name}", f"output_dir={tmp_path}"]))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (["train.batch_size=32"], "3", "train.batch_size 32 does not split over the 3 processes"),
        (["loss.memory=moco", "train.lora_rank=4"], "1", "loss.memory=moco does not combine with train.lora_rank"),
    ],
)
def test_training_settings_that_fail_only_at_a_step_are_refused_before_any_work(
    tmp_path, monkeypatch, overrides, world, message
):
    """Under torchrun a batch that does not split over the processes, and a MoCo queue with LoRA, stopped a run at
    its first batch or step, after mining and scoring."""
    from densepass.pipelines.experiment import check

    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ConfigError, match=message):
        check(load_config(None, [*overrides, f"output_dir={tmp_path}"]))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "mix, message",
    [
        ("[bm25, contxt]", "unknown negatives strategy 'contxt'"),
        ("['dense:abc']", "the dimension after 'dense:' must be a number"),
        ("[]", "negatives.mix must list the strategies to mix"),
        ("[bm25, mixed]", "negatives.mix must list the strategies to mix"),
    ],
)
def test_a_mix_of_strategies_that_cannot_mine_is_refused_before_any_work(tmp_path, mix, message):
    """They failed only after --restart had removed the earlier outputs, the BM25 index was built and a dense
    miner trained."""
    from densepass.pipelines.experiment import check

    with pytest.raises(ConfigError, match=re.escape(message)):
        check(load_config(None, ["negatives.source=mixed", f"negatives.mix={mix}", f"output_dir={tmp_path}"]))
    assert list(tmp_path.iterdir()) == []


RERANKER_ONLY = [  # no bi-encoder training: the pool is mined for the cross-encoder alone
    "train.enabled=false",
    "reranker.enabled=true",
    "reranker.first_stages=[]",
    "reranker.max_length=64",
    "reranker.train.negatives_per_query=4",
    "reranker.train.max_steps=1",
]


def _earlier_run(run_dir: Path) -> Path:
    """A run directory as an earlier run left it: what --restart removes once the run claims it."""
    from densepass.io import claim_run_directory
    from densepass.pipelines.experiment import RUN_ENTRIES

    claim_run_directory(run_dir, "run", RUN_ENTRIES, False)
    (run_dir / "metrics.json").write_text("earlier")
    return run_dir / "metrics.json"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["negatives.source=model"], "negatives.source=model needs negatives.model"),
        (["negatives.source=model", "negatives.model={missing}"], "model not found"),
        (["negatives.source=mixed", "negatives.mix=[bm25, model]"], "negatives.mix's 'model' needs negatives.model"),
        (["negatives.source=file"], "negatives.source=file needs negatives.file"),
        (["negatives.source=file", "negatives.file={missing}.jsonl"], "hard-negatives file not found"),
        (["negatives.source=mixed", "negatives.mix=['file:{missing}.jsonl']"], "hard-negatives file not found"),
        (["negatives.source=mixed", "negatives.mix=[bm25, given]"], "'given' takes the negatives of training rows"),
        (["validation.enabled=true", "validation.retriever={missing}"], "validation.retriever .* model not found"),
        ([*RERANKER_ONLY, "negatives.source=mixed", "negatives.mix=[bm25, bogus]"], "unknown negatives strategy"),
        ([*RERANKER_ONLY, "negatives.filters=[qrels, cross-encoder]"], "the cross-encoder filter needs a"),
        ([*RERANKER_ONLY, "negatives.source=model"], "negatives.source=model needs negatives.model"),
    ],
)
def test_what_mining_and_validation_read_is_checked_before_restart_removes_the_earlier_run(
    tiny_beir, tiny_model_dir, tmp_path, overrides, message
):
    """A model or pool file the negatives or validation read, `given` on data that are no training rows, and the
    strategies and filters of a pool mined for the cross-encoder alone failed only after --restart had removed the
    earlier run's outputs (the validation retriever: after mining, once training had started)."""
    from conftest import small_run_overrides
    from densepass.pipelines.experiment import run_experiment

    runs, missing = tmp_path / "runs", tmp_path / "no" / "such"
    earlier = _earlier_run(runs / "r")
    settings = [*small_run_overrides(tiny_beir, tiny_model_dir, runs, "r"), "train.max_steps=1", "train.batch_size=4"]
    settings += [f"reranker.name_or_path={tiny_model_dir}"] + [o.format(missing=missing) for o in overrides]
    with pytest.raises(DensepassError, match=message):
        run_experiment(load_config(None, settings), restart=True)
    assert earlier.read_text() == "earlier"


def _pairs_rows(path: Path, negatives: bool) -> Path:
    rows = [
        {"anchor": f"query {i} audio", "positive": f"passage {i} audio editor"}
        | ({"negative": f"other {i} kernel"} if negatives else {})
        for i in range(8)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_given_negatives_are_checked_before_the_claim_and_never_refreshed(tiny_beir, tiny_model_dir, tmp_path):
    """`negatives.source: given` with `refresh_every` crashed at the first refresh (a TypeError: the given pool has
    no mining context); rows that give no negatives were refused only after --restart removed the earlier run."""
    from conftest import small_run_overrides
    from densepass.pipelines.experiment import check, run_experiment

    runs = tmp_path / "runs"
    pairs = ["data.format=pairs", f"data.eval_name={tiny_beir}", "train.batch_size=4", "train.max_steps=1"]
    settings = [*small_run_overrides(_pairs_rows(tmp_path / "r.jsonl", True), tiny_model_dir, runs, "r"), *pairs]
    with pytest.raises(ConfigError, match=r"^negatives\.refresh_every re-mines .*\.source: given mines nothing"):
        check(load_config(None, [*settings, "negatives.source=given", "negatives.refresh_every=1"]))
    earlier = _earlier_run(runs / "r")
    _pairs_rows(tmp_path / "r.jsonl", False)
    for source in (["negatives.source=given"], ["negatives.source=mixed", "negatives.mix=[bm25, given]"]):
        with pytest.raises(ConfigError, match="give no negatives"):
            run_experiment(load_config(None, [*settings, *source]), restart=True)
        assert earlier.read_text() == "earlier"


def test_an_eval_index_that_cannot_be_built_or_would_be_ignored_is_refused_before_any_work(
    tiny_beir, tiny_model_dir, tmp_path
):
    """faiss-ivfpq over a corpus too small to train it failed after training (and after --restart's removal);
    eval.index was silently ignored for SPLADE, ColBERT and rerank mode."""
    from conftest import small_run_overrides
    from densepass.pipelines.experiment import check, run_experiment

    for overrides in (["model.kind=splade"], ["model.kind=colbert"], ["eval.mode=rerank"]):
        with pytest.raises(ConfigError, match=r"^eval\.index=faiss-hnsw.*leave eval\.index at exact$"):
            check(load_config(None, ["eval.index=faiss-hnsw", "device=cpu", *overrides]))
    runs = tmp_path / "runs"
    earlier = _earlier_run(runs / "r")
    settings = [*small_run_overrides(tiny_beir, tiny_model_dir, runs, "r"), "train.max_steps=1", "train.batch_size=4"]
    with pytest.raises(ConfigError, match="faiss-ivfpq index .* needs at least 256 passages, got 40"):
        run_experiment(load_config(None, [*settings, "eval.index=faiss-ivfpq"]), restart=True)
    assert earlier.read_text() == "earlier"


def test_mining_into_the_pool_it_reads_is_refused(tmp_path):
    from densepass.config import ExperimentConfig
    from densepass.pipelines.mine_command import mine_training_negatives

    pool = tmp_path / "pool.jsonl"
    pool.write_text('{"query_id": "q1", "negatives": ["p1"]}\n')
    config = load_config(None, ["negatives.source=file", f"negatives.file={pool}"], ExperimentConfig)
    with pytest.raises(ConfigError, match="is the pool this mining reads"):
        mine_training_negatives(config, pool)
    assert pool.read_text() == '{"query_id": "q1", "negatives": ["p1"]}\n'


@pytest.mark.parametrize("name", ["cpu:7", "cpu:1"])
def test_a_cpu_device_index_is_a_one_line_error(tmp_path, name):
    from densepass.pipelines.experiment import check

    with pytest.raises(ConfigError, match=rf"device '{name}': the CPU has no device index \(use cpu\)"):
        resolve_device(name)
    with pytest.raises(ConfigError, match="the CPU has no device index"):
        check(load_config(None, [f"device={name}", f"output_dir={tmp_path}"]))
    assert list(tmp_path.iterdir()) == []
    assert resolve_device("cpu:0") == resolve_device("cpu") == torch.device("cpu")


def test_a_cuda_index_beyond_the_gpus_is_a_one_line_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda:1") == torch.device("cuda:1")
    with pytest.raises(ConfigError, match=r"device 'cuda:2': this machine has 2 CUDA GPU\(s\)"):
        resolve_device("cuda:2")


# ---------------------------------------------------------------- seeds


@pytest.mark.parametrize("seed, message", [("-1", "must be >= 0, got -1"), ("4294967296", "must be <= 4294967295")])
@pytest.mark.parametrize(
    "config, key",
    [
        (None, "train.seed"),
        (None, "data.seed"),
        (None, "validation.seed"),
        (None, "reranker.train.seed"),
        ("pretraining", "train.seed"),
        ("pretraining", "data.seed"),
        ("phrase", "train.seed"),
        ("phrase", "data.seed"),
        ("phrase", "query_tuning.seed"),
    ],
)
def test_a_seed_numpy_refuses_is_a_one_line_config_error(config, key, seed, message):
    from densepass.phrase.config import PhraseConfig
    from densepass.pretraining.config import PretrainConfig

    cls = {"pretraining": [PretrainConfig], "phrase": [PhraseConfig], None: []}[config]
    with pytest.raises(ConfigError, match=rf"{key}: {message}"):
        load_config(None, [f"{key}={seed}"], *cls)
    load_config(None, [f"{key}=4294967295"], *cls)  # the largest seed numpy takes


# ---------------------------------------------------------------- damaged weights without a manifest


def truncated_copy(model_dir: Path, to: Path, keep: float = 0.5) -> Path:
    """A copy of ``model_dir`` whose ``model.safetensors`` is cut to ``keep`` of its bytes (no manifest)."""
    shutil.copytree(model_dir, to)
    weights = to / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: int(weights.stat().st_size * keep)])
    return to


@pytest.mark.parametrize("keep", [0.5, 0.0001])
@pytest.mark.parametrize(
    "loader",
    [
        "densepass.models.biencoder:BiEncoder",
        "densepass.models.splade:SpladeEncoder",
        "densepass.models.colbert:ColBERT",
        "densepass.models.cross_encoder:CrossEncoder",
        "densepass.pretraining.condenser:Condenser",
        "densepass.phrase.model:PhraseEncoder",
    ],
)
def test_a_truncated_model_safetensors_without_a_manifest_is_one_line(tiny_model_dir, tmp_path, loader, keep):
    import importlib

    module, name = loader.split(":")
    cls = getattr(importlib.import_module(module), name)
    damaged = truncated_copy(tiny_model_dir, tmp_path / "damaged", keep)
    expected = rf"^{re.escape(str(damaged / 'model.safetensors'))} does not load \(truncated or damaged\?\): [^\n]+$"
    with pytest.raises(DataError, match=expected):
        cls.from_pretrained(str(damaged))


def test_cli_index_with_a_truncated_model_is_a_one_line_error(tiny_beir, tiny_model_dir, tmp_path, capsys):
    damaged = truncated_copy(tiny_model_dir, tmp_path / "damaged")
    args = ["index", str(tiny_beir), "--model", str(damaged), "--output", str(tmp_path / "idx"), "--device", "cpu"]
    assert main(args) == 2
    [line] = stderr_lines(capsys)
    assert line.startswith(f"densepass: error: {damaged / 'model.safetensors'} does not load (truncated or damaged?)")


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"vocab_size": 0}, "config.json describes no model transformers can build: index 0 is out of bounds"),
        ({"num_attention_heads": 3}, "config.json describes no model transformers can build: The hidden size \\(32\\)"),
        (
            {"hidden_size": 64},
            "model.safetensors does not fit .*config.json: .* is \\[32\\], the config makes it \\[64\\]",
        ),
        ({"model_type": "t5"}, "config.json is not a config transformers can load: Validation error for field"),
    ],
)
def test_a_model_config_that_does_not_fit_its_weights_is_one_line_before_any_work(
    tiny_beir, tiny_model_dir, tmp_path, capsys, change, says
):
    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **change}))
    output = tmp_path / "idx"
    args = ["index", str(tiny_beir), "--model", str(model), "--output", str(output), "--device", "cpu"]
    assert main(args) == 2
    [line] = stderr_lines(capsys)
    assert re.match(rf"densepass: error: {re.escape(str(model))}/{says}", line), line
    assert not output.exists() and not (tmp_path / ".idx.encoding").exists()


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("model.safetensors", "holds no weights to load"),  # never opened: a FIFO would wait for a writer
        ("tokenizer.json", r"tokenizer\.json is not a regular file \(a named pipe\)"),
    ],
)
def test_a_named_pipe_in_a_model_folder_is_one_line_not_a_wait(tiny_model_dir, tmp_path, name, says):
    import os
    import signal

    from densepass.models.biencoder import BiEncoder

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / name).unlink()
    os.mkfifo(model / name)
    signal.alarm(60)  # a wait on the pipe fails the test instead of hanging it
    try:
        with pytest.raises((ConfigError, DataError), match=says):
            BiEncoder.from_pretrained(str(model))
    finally:
        signal.alarm(0)


def test_a_saved_query_tower_whose_config_does_not_fit_its_weights_is_one_line(tiny_model_dir, tmp_path):
    from densepass.models.biencoder import BiEncoder, BiEncoderConfig

    saved = tmp_path / "two-towers"
    BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(shared=False)).save(saved)
    (saved / "manifest.json").unlink()  # edited by hand: no manifest to catch it
    config = json.loads((saved / "query" / "config.json").read_text())
    (saved / "query" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(DataError, match=rf"^{re.escape(str(saved / 'query' / 'model.safetensors'))} does not fit"):
        BiEncoder.from_pretrained(str(saved))


# ---------------------------------------------------------------- token limits beyond the model's positions

LONG_PASSAGE = " ".join(["archive"] * 400)


@pytest.mark.parametrize("key", ["query_max_length", "passage_max_length"])
@pytest.mark.parametrize("kind", ["bi-encoder", "splade", "colbert"])
def test_a_max_length_beyond_the_models_positions_is_refused_at_load(tiny_model_dir, key, kind):
    from densepass.models.biencoder import BiEncoder, BiEncoderConfig
    from densepass.models.colbert import ColBERT, ColbertArchitecture
    from densepass.models.splade import SpladeArchitecture, SpladeEncoder

    cls, arch = {
        "bi-encoder": (BiEncoder, BiEncoderConfig),
        "splade": (SpladeEncoder, SpladeArchitecture),
        "colbert": (ColBERT, ColbertArchitecture),
    }[kind]
    with pytest.raises(
        ConfigError, match=rf"^model\.{key} 129 exceeds {re.escape(str(tiny_model_dir))}'s 128 positions: set it to 128"
    ):
        cls.from_pretrained(str(tiny_model_dir), config=arch(**{key: 129}))
    model = cls.from_pretrained(str(tiny_model_dir), config=arch(**{key: 128}))  # the limit itself reads a long text
    model.encode_passages([LONG_PASSAGE], show_progress=False)
    model.encode_queries([LONG_PASSAGE], show_progress=False)


def test_a_roberta_models_limit_is_its_positions_less_the_padding_offset(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer, RobertaConfig, RobertaModel

    from densepass.models.biencoder import BiEncoder, BiEncoderConfig

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = RobertaConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=34,  # 32 positions: RoBERTa's start after the padding index 1
        pad_token_id=1,
    )
    RobertaModel(config).save_pretrained(tmp_path / "roberta")
    tokenizer.save_pretrained(tmp_path / "roberta")
    with pytest.raises(
        ConfigError,
        match=r"model\.passage_max_length 33 exceeds .*'s 32 positions \(max_position_embeddings 34 less RoBERTa's "
        r"padding offset 2\): set it to 32 or less",
    ):
        BiEncoder.from_pretrained(str(tmp_path / "roberta"), config=BiEncoderConfig(passage_max_length=33))
    model = BiEncoder.from_pretrained(str(tmp_path / "roberta"), config=BiEncoderConfig(passage_max_length=32))
    assert model.encode_passages([LONG_PASSAGE], show_progress=False).shape == (1, 32)


def test_phrase_max_lengths_beyond_the_models_positions_are_refused_at_load(tiny_model_dir):
    from densepass.phrase.config import PhraseModelConfig
    from densepass.phrase.model import PhraseEncoder

    with pytest.raises(ConfigError, match=r"^model\.max_length 256 exceeds .*'s 128 positions"):
        PhraseEncoder.from_pretrained(str(tiny_model_dir), PhraseModelConfig())  # the default windows: 256 tokens
    with pytest.raises(ConfigError, match=r"^model\.question_max_length 129 exceeds .*'s 128 positions"):
        PhraseEncoder.from_pretrained(str(tiny_model_dir), PhraseModelConfig(max_length=128, question_max_length=129))


def test_a_run_with_a_max_length_beyond_the_positions_stops_before_any_work(tiny_beir, tiny_model_dir, tmp_path):
    from conftest import small_run_overrides
    from densepass.pipelines.experiment import run_experiment

    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "long")
    config = load_config(None, [*overrides, "model.passage_max_length=512"])
    with pytest.raises(ConfigError, match=r"model\.passage_max_length 512 exceeds .*'s 128 positions"):
        run_experiment(config)
    assert not (tmp_path / "long" / "negatives.jsonl").exists() and not (tmp_path / "long" / "model").exists()


# ---------------------------------------------------------------- a corpus of empty passages


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_beir_corpus_whose_passages_are_all_empty_is_one_data_error(tmp_path, on_disk):
    root = write_beir(tmp_path / "beir")
    empty = [{"_id": "p1", "title": "", "text": ""}, {"_id": "p2", "text": " \t"}, {"_id": "p3", "title": None}]
    write(root / "corpus.jsonl", jsonl([{**r, "text": r.get("text", "")} for r in empty]))
    with pytest.raises(
        DataError,
        match=r"corpus\.jsonl: every passage of the corpus \(3\) has an empty title and text: there is nothing",
    ):
        load_beir(root, passages_on_disk=on_disk)
    write(root / "corpus.jsonl", jsonl([*empty[:2], {"_id": "p3", "title": "a title alone", "text": ""}]))
    with pytest.warns(DataWarning, match=r"2 passages with an empty title and text, kept"):
        assert len(load_beir(root, passages_on_disk=on_disk).corpus) == 3  # one passage reads


def test_an_msmarco_collection_of_empty_passages_is_one_data_error(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    write(root / "collection.tsv", "0\t\n1\t  \n2\t\n")
    with pytest.raises(DataError, match=r"collection\.tsv: every passage of the corpus \(3\) has an empty title"):
        load_msmarco(root)


def test_bm25_over_passages_without_a_word_is_one_data_error(tiny_beir, tmp_path, capsys):
    from densepass.index.bm25 import BM25Index

    with pytest.raises(DataError, match=r"BM25 has nothing to index: none of the 2 passages has a word"):
        BM25Index.build(["", "the of a"])  # what the Python API lets through: empty and stopwords only
    records = [json.loads(line) for line in (tiny_beir / "corpus.jsonl").read_text().splitlines()]
    write(tiny_beir / "corpus.jsonl", jsonl([{**r, "title": "", "text": ""} for r in records]))
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", str(tmp_path / "bm25")]) == 2
    [line] = stderr_lines(capsys)
    assert line == (
        f"densepass: error: {tiny_beir / 'corpus.jsonl'}: every passage of the corpus (40) has an empty title and "
        "text: there is nothing to index"
    )


# ---------------------------------------------------------------- lone surrogates

LONE = '"\\ud800"'  # how a lone surrogate reaches a JSON file: an escape without its pair


def with_lone_surrogate(record: dict, field: str) -> str:
    """``record`` as one JSON line whose ``field`` is ``'bad ' + '\\ud800'`` (written as a JSON escape)."""
    return json.dumps({**record, field: "bad @"}).replace("@", "\\ud800")


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize("gz", [False, True])
@pytest.mark.parametrize(
    "name, field", [("corpus.jsonl", "text"), ("corpus.jsonl", "title"), ("queries.jsonl", "text")]
)
def test_a_lone_surrogate_in_a_beir_file_names_the_file_line_and_field(tmp_path, name, field, gz, on_disk):
    root = write_beir(tmp_path / "beir", gz)
    records = BEIR_CORPUS if name == "corpus.jsonl" else BEIR_QUERIES
    lines = [json.dumps(r) for r in records]
    lines[1] = with_lone_surrogate(records[1], field)
    path = write(root / name, "\n".join(lines) + "\n", gz)
    with pytest.raises(
        DataError,
        match=rf"^{re.escape(str(path))}:2: field '{field}': a lone surrogate U\+D800 \(character 5\) is not a Unicode "
        r"character \(a \\ud800-style JSON escape without its pair\?\)$",
    ):
        load_beir(root, passages_on_disk=on_disk)


def test_a_surrogate_pair_escape_is_a_character_and_reads(tmp_path):
    root = write_beir(tmp_path / "beir")
    write(root / "queries.jsonl", jsonl(BEIR_QUERIES).replace("what is alpha", "what is \\ud83d\\ude00 alpha"))
    assert no_data_warnings(lambda: load_beir(root)).queries["q1"] == "what is \U0001f600 alpha"


def test_a_lone_surrogate_in_dpr_and_squad_json_names_the_file_line_and_path(tmp_path):
    root = write_dpr(tmp_path / "dpr")
    text = json.dumps(DPR_TRAIN, indent=1).replace('"Alpha was written by Ann."', '"Alpha \\udfff"', 1)
    assert "\\udfff" in text
    write(root / "biencoder-nq-train.json", text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "\\udfff" in row)
    with pytest.raises(
        DataError, match=rf"train\.json:{line}: \[0\]\.positive_ctxs\[0\]\.text: a lone surrogate U\+DFFF"
    ):
        load_dpr(root)
    root = write_squad(tmp_path / "squad")
    path = root / "train-v1.1.json"
    path.write_text(path.read_text().replace('"context": "', '"context": "\\ud800', 1))
    with pytest.raises(DataError, match=r"train-v1\.1\.json:1: data\[0\]\.paragraphs\[0\]\.context: a lone surrogate"):
        load_squad(root)


def test_a_surrogate_in_a_tsv_file_is_bytes_that_are_not_utf8(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    (root / "queries.train.tsv").write_bytes(b"10\twhat is first\n11\tbad \xed\xa0\x80\n")
    with pytest.raises(DataError, match=r"queries\.train\.tsv:2: not valid UTF-8"):
        load_msmarco(root)


@pytest.mark.parametrize("kind", ["bi-encoder", "splade", "colbert"])
def test_a_lone_surrogate_given_to_encode_is_a_one_line_error(tiny_model_dir, kind):
    from densepass.models.load import CLASSES

    model = CLASSES[kind].from_pretrained(str(tiny_model_dir))
    with pytest.raises(DataError, match=r"^query text 1: a lone surrogate U\+D800 \(character 5\) is not a Unicode"):
        model.encode_queries(["fine", "bad \ud800"], show_progress=False)
    with pytest.raises(DataError, match=r"^passage text 0: a lone surrogate U\+DC80"):
        model.encode_passages(["\udc80"], show_progress=False)


def test_a_lone_surrogate_reaching_a_tokenizer_is_a_one_line_error(tiny_model_dir):
    from densepass.models.biencoder import BiEncoder
    from densepass.models.encode import encode_texts

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    with pytest.raises(DataError, match=r"^text 0: a lone surrogate"):  # below the API's check: the tokenizer's net
        encode_texts(model, ["bad \ud800"], "query", show_progress=False)
    with pytest.raises(DataError, match=r"^text 1: a lone surrogate"):
        model.tokenize(["fine", "bad \ud800"], "query")


def test_a_lone_surrogate_in_a_search_query_is_a_one_line_error(tiny_model_dir):
    from densepass.index.bm25 import BM25Index
    from densepass.pipelines.search import SearchPipeline

    pipeline = SearchPipeline(BM25Index.build(["tar archiving utility", "X11 window manager"]))
    with pytest.raises(DataError, match=r"^the query: a lone surrogate U\+D800 \(character 8\)"):
        pipeline.search("window \ud800")
    with pytest.raises(DataError, match=r"^query 1: a lone surrogate"):
        pipeline.search_batch(["window", "\ud800"])


# ---------------------------------------------------------------- ids a TREC run cannot hold


@pytest.mark.parametrize("bad", ["p 1", "p\t1", "p\u00a01", "p\u20281"])
def test_a_passage_id_with_whitespace_names_the_id_and_line(tmp_path, bad):
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", jsonl([*BEIR_CORPUS, {"_id": bad, "text": "fine"}]))
    with pytest.raises(
        DataError,
        match=rf"corpus\.jsonl:4: field '_id' {re.escape(repr(bad))} holds whitespace \({re.escape(repr(bad[1]))}\), "
        r"which TREC run and qrels files cannot represent \(their columns are separated by whitespace\)$",
    ):
        load_beir(root)


def test_query_ids_with_whitespace_are_refused_by_every_reader(tmp_path):
    root = write_beir(tmp_path / "beir")
    write(root / "queries.jsonl", jsonl([*BEIR_QUERIES, {"_id": "q 9", "text": "what"}]))
    with pytest.raises(DataError, match=r"queries\.jsonl:4: field '_id' 'q 9' holds whitespace"):
        load_beir(root)
    root = write_beir(tmp_path / "beir2", qrels={"dev": "q1\tp 1\t1\n"})
    with pytest.raises(DataError, match=r"dev\.tsv:1: passage id 'p 1' holds whitespace"):
        load_beir(root)
    root = write_msmarco(tmp_path / "marco")
    write(root / "queries.train.tsv", "10\twhat is first\n1 1\twhat is second\n")
    with pytest.raises(DataError, match=r"queries\.train\.tsv:2: id '1 1' holds whitespace"):
        load_msmarco(root)
    write(tmp_path / "squad" / "dev-v1.1.json", squad_file([("T", [("c", [("d 1", "q", ["a"])])])]))
    with pytest.raises(DataError, match=r"field 'id' 'd 1' holds whitespace"):
        load_squad(tmp_path / "squad")
    root = write_dpr(tmp_path / "dpr")
    write(root / "dev.json", json.dumps([{"question": "q", "positive_ctxs": [ctx("T", "t", passage_id="1 2")]}]))
    with pytest.raises(DataError, match=r"dev\.json: record 0\.positive_ctxs\[0\]: field 'passage_id' '1 2' holds"):
        load_dpr(root)


DELETED_LOOKALIKE = "\x00deleted:7"


@pytest.mark.parametrize("on_disk", [False, True])
def test_an_id_starting_as_a_deleted_rows_does_is_refused_by_every_reader(tmp_path, on_disk):
    """``\\x00deleted:`` starts the id an index gives a deleted row (``index.base.DELETED_ID``): a passage so named
    was read, then taken for a deleted one by the index."""
    from densepass.data.beir import read_corpus
    from densepass.data.reader_helpers import RESERVED_ID_PREFIX
    from densepass.index.base import DELETED_ID

    assert RESERVED_ID_PREFIX == DELETED_ID
    bad = re.escape(repr(DELETED_LOOKALIKE))
    says = r" starts with '\\x00deleted:', which densepass keeps for the deleted rows of an index$"
    root = write_beir(tmp_path / "beir")
    for record in ({"_id": DELETED_LOOKALIKE, "text": "fine"}, {"_id": DELETED_LOOKALIKE, "title": None, "text": "x"}):
        write(root / "corpus.jsonl", jsonl([*BEIR_CORPUS, record]))
        with pytest.raises(DataError, match=rf"corpus\.jsonl:4: field '_id' {bad}{says}"):
            load_beir(root, passages_on_disk=on_disk)
    root = write_beir(tmp_path / "beir2")
    write(root / "queries.jsonl", jsonl([*BEIR_QUERIES, {"_id": DELETED_LOOKALIKE, "text": "what"}]))
    with pytest.raises(DataError, match=rf"queries\.jsonl:4: field '_id' {bad}{says}"):
        load_beir(root, passages_on_disk=on_disk)
    root = write_beir(tmp_path / "beir3", qrels={"dev": f"q1\t{DELETED_LOOKALIKE}\t1\n"})
    with pytest.raises(DataError, match=rf"dev\.tsv:1: passage id {bad}{says}"):
        load_beir(root, passages_on_disk=on_disk)
    root = write_msmarco(tmp_path / "marco")
    write(root / "collection.tsv", f"0\tfirst\n{DELETED_LOOKALIKE}\tsecond\n")
    with pytest.raises(DataError, match=rf"collection\.tsv:2: id {bad}{says}"):
        load_msmarco(root)
    root = write_dpr(tmp_path / "dpr")
    write(
        root / "dev.json",
        json.dumps([{"question": "q", "positive_ctxs": [ctx("T", "t", passage_id=DELETED_LOOKALIKE)]}]),
    )
    with pytest.raises(DataError, match=rf"field 'passage_id' {bad}{says}"):
        load_dpr(root)
    write(root / "corpus.jsonl", jsonl([{"_id": "\x00", "text": "a NUL alone is an id"}]))
    assert read_corpus(root / "corpus.jsonl", on_disk).ids == ["\x00"]


def test_a_carriage_return_alone_ends_no_line_and_is_one_line_naming_its_line(tmp_path):
    """Text mode read a lone \\r as a line end: a TSV text holding one became a passage that does not exist (or an
    error naming the next line), and a corpus.jsonl whose lines end in \\r loaded in memory but not from the file."""
    says = r"a carriage return \(\\r\) inside a line: only \\n \(or \\r\\n\) ends a line"
    root = write_msmarco(tmp_path / "marco")
    for raw, line in (
        (b"0\tfirst\n1\thello\r7\tinjected\n2\tx\n", 2),
        (b"0\ta\n1\thello\rworld\n", 2),
        (b"0\ta\r1\tb\r", 1),
    ):
        (root / "collection.tsv").write_bytes(raw)
        with pytest.raises(DataError, match=rf"collection\.tsv:{line}: {says}"):
            load_msmarco(root)
    root = write_beir(tmp_path / "beir")
    (root / "corpus.jsonl").write_bytes(jsonl(BEIR_CORPUS).replace("\n", "\r").encode())
    for on_disk in (False, True):  # the same error from either reader of the file
        with pytest.raises(DataError, match=rf"corpus\.jsonl:1: not valid JSON \(Extra data\): {says}"):
            load_beir(root, passages_on_disk=on_disk)
    root = write_beir(tmp_path / "beir2", qrels={"dev": "q1\tp1\t1\rq2\tp3\t1\r"})
    with pytest.raises(DataError, match=rf"dev\.tsv:1: {says}"):
        load_beir(root)


def test_a_qrels_id_with_a_quote_is_read_as_written(tmp_path):
    # a tab-separated qrels file was read as CSV: a field starting with '"' swallowed the lines after it
    root = write_beir(tmp_path / "beir", qrels={"dev": '"q1\tp1\t1\nq2\tp3\t1\n'})
    write(root / "queries.jsonl", jsonl([*BEIR_QUERIES, {"_id": '"q1', "text": "quoted"}]))
    assert no_data_warnings(lambda: load_beir(root)).qrels["dev"] == {'"q1': {"p1": 1}, "q2": {"p3": 1}}


ANY_ID = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(qid=ANY_ID, pid=ANY_ID)
def test_any_id_the_readers_accept_round_trips_through_trec_run_and_qrels_files(qid, pid):
    from densepass.evaluation.metrics import write_trec_run

    assume(qid not in ("q1", "q2", "q3") and pid not in ("p1", "p2", "p3"))
    with tempfile.TemporaryDirectory() as tmp:
        root = write_beir(Path(tmp) / "beir")
        write(root / "corpus.jsonl", jsonl([*BEIR_CORPUS, {"_id": pid, "text": "words"}]))
        write(root / "queries.jsonl", jsonl([*BEIR_QUERIES, {"_id": qid, "text": "a query"}]))
        try:
            dataset = load_beir(root)
        except DataError as err:  # refused: exactly the ids a TREC line cannot hold
            assert "holds whitespace" in str(err) and any(c.isspace() for c in qid + pid)
            return
        assert not any(c.isspace() for c in qid + pid)
        run = {qid: {pid: 0.5, "p1": 0.25}}
        write_trec_run(run, Path(tmp) / "run.trec")
        assert read_trec_run(Path(tmp) / "run.trec", dataset.corpus) == run
        write(root / "qrels" / "dev.tsv", f"query-id\tcorpus-id\tscore\n{qid}\t{pid}\t1\nq2\tp3\t1\n")
        assert load_beir(root).qrels["dev"] == {qid: {pid: 1}, "q2": {"p3": 1}}


# ---------------------------------------------------------------- blank and repeated search queries


@pytest.fixture(scope="module")
def bm25_index(tmp_path_factory) -> Path:
    """A saved BM25 index of the tiny dataset."""
    from conftest import write_tiny_beir

    root = tmp_path_factory.mktemp("search")
    assert main(["index", str(write_tiny_beir(root / "tiny")), "--kind", "bm25", "--output", str(root / "bm25")]) == 0
    return root / "bm25"


def run_queries(path: Path) -> list[str]:
    """The query ids of a TREC run file (BM25 on the tiny dataset ties: no warning about it)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DataWarning)
        return list(read_trec_run(path))


@pytest.mark.parametrize("query", ["", "   ", "\t\n", "\u200b\u2060", "\ufeff \u200b"])
def test_a_blank_query_is_a_one_line_error(bm25_index, tmp_path, capsys, query):
    from densepass.index.bm25 import BM25Index
    from densepass.pipelines.search import SearchPipeline

    capsys.readouterr()
    assert main(["search", str(bm25_index), query]) == 2
    [line] = stderr_lines(capsys)
    assert line.startswith("densepass: error: the query is empty") and "nothing to search for" in line
    pipeline = SearchPipeline(BM25Index.build(["tar archiving utility", "X11 window manager"]))
    with pytest.raises(DataError, match=r"^the query is empty"):
        pipeline.search(query)
    with pytest.raises(DataError, match=r"^query 1 is empty"):
        pipeline.search_batch(["window", query])


@pytest.mark.parametrize("fmt", ["tsv", "jsonl"])
def test_blank_queries_in_a_queries_file_are_skipped_with_one_counted_warning(bm25_index, tmp_path, capsys, fmt):
    rows = [("q1", "audio editor"), ("q2", ""), ("q3", "\u200b\u2060"), ("q4", "kernel driver"), ("q5", " ")]
    path = tmp_path / f"queries.{fmt}"
    if fmt == "tsv":
        path.write_text("".join(f"{qid}\t{text}\n" for qid, text in rows))
    else:
        path.write_text(jsonl([{"_id": qid, "text": text} for qid, text in rows]))
    capsys.readouterr()
    assert main(["search", str(bm25_index), "--queries", str(path), "--output", str(tmp_path / "run.trec")]) == 0
    assert stderr_lines(capsys) == [
        f"densepass: warning: {path}: 3 blank queries (empty, whitespace or zero-width characters only) skipped: "
        "nothing to search (first: line 2)"
    ]
    assert set(run_queries(tmp_path / "run.trec")) == {"q1", "q4"}
    blank = [("q2", ""), ("q3", "\u200b")]
    path.write_text(
        "".join(f"{q}\t{t}\n" for q, t in blank) if fmt == "tsv" else jsonl([{"_id": q, "text": t} for q, t in blank])
    )
    assert main(["search", str(bm25_index), "--queries", str(path), "--output", str(tmp_path / "run2.trec")]) == 2
    [line] = stderr_lines(capsys)
    assert line == f"densepass: error: {path}: every query is blank (empty, whitespace or zero-width characters only)"
    assert not (tmp_path / "run2.trec").exists()


def test_blank_dataset_queries_count_zero_width_characters_as_empty(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "q1\tp1\t1\nq2\tp3\t1\n"})
    write(root / "queries.jsonl", jsonl([{"_id": "q1", "text": "fine"}, {"_id": "q2", "text": "\u200b\u2060"}]))
    with pytest.warns(DataWarning) as record:
        load_beir(root)
    assert data_warnings(record) == ["beir: qrels/dev: 1 of its 2 queries have an empty text (first: query 'q2')"]


@pytest.mark.parametrize("fmt", ["tsv", "jsonl"])
def test_a_query_id_repeated_in_a_queries_file_is_an_error_or_one_counted_warning(bm25_index, tmp_path, capsys, fmt):
    def write_queries(rows):
        path = tmp_path / f"queries.{fmt}"
        if fmt == "tsv":
            path.write_text("".join(f"{qid}\t{text}\n" for qid, text in rows))
        else:
            path.write_text(jsonl([{"_id": qid, "text": text} for qid, text in rows]))
        return path

    path = write_queries([("q1", "audio editor"), ("q2", "kernel"), ("q1", "a different text")])
    run = tmp_path / "run.trec"
    capsys.readouterr()
    assert main(["search", str(bm25_index), "--queries", str(path), "--output", str(run)]) == 2
    [line] = stderr_lines(capsys)
    assert line == (
        f"densepass: error: {path}:3: query id 'q1' given again with a different text ('a different text'; "
        "line 1: 'audio editor')"
    )
    assert not run.exists()
    path = write_queries([("q1", "audio editor"), ("q2", "kernel"), ("q1", "audio editor"), ("q2", "kernel")])
    assert main(["search", str(bm25_index), "--queries", str(path), "--output", str(run)]) == 0
    assert stderr_lines(capsys) == [
        f"densepass: warning: {path}: 2 repeated query ids with the same text, ignored (first: line 3)"
    ]
    assert set(run_queries(run)) == {"q1", "q2"}


# ---------------------------------------------------------------- more negatives per query than a pool holds


def test_more_negatives_per_query_than_the_pool_depth_is_refused_before_any_work(tiny_model_dir, tmp_path):
    from densepass.pipelines.experiment import check

    with pytest.raises(
        ConfigError,
        match=r"^negatives\.per_query 6 is more than negatives\.pool_depth 5: a pool holds at most pool_depth "
        r"distinct negatives, so every draw would repeat some$",
    ):
        check(load_config(None, ["negatives.per_query=6", "negatives.pool_depth=5", f"output_dir={tmp_path}"]))
    reranker = [
        "reranker.enabled=true",
        f"reranker.name_or_path={tiny_model_dir}",
        "reranker.max_length=64",
        "reranker.train.negatives_per_query=9",
        "negatives.pool_depth=8",
        f"output_dir={tmp_path}",
    ]
    with pytest.raises(
        ConfigError, match=r"^reranker\.train\.negatives_per_query 9 is more than negatives\.pool_depth 8"
    ):
        check(load_config(None, reranker))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b'{"query_id": "q0", "negatives": []}\n\xff\n', r":2: not UTF-8 \(byte 0xff at column 1\)"),
        (b"", r" holds no negatives \(no line\)"),
        (b"\n  \n", r" holds no negatives \(no line\)"),
        (b'{"query_id": "q0", "negatives": []}\n', r" holds no negatives \(1 queries, every one without a negative\)"),
    ],
)
def test_a_negatives_file_not_utf8_or_without_negatives_is_one_line_before_any_work(
    tiny_beir, tiny_model_dir, tmp_path, capsys, content, says
):
    from conftest import small_run_overrides

    negatives = tmp_path / "neg.jsonl"
    negatives.write_bytes(content)
    runs = tmp_path / "runs"
    overrides = small_run_overrides(tiny_beir, tiny_model_dir, runs, "r")
    overrides += ["device=cpu", "negatives.source=file", f"negatives.file={negatives}"]
    assert main(["run", *(arg for value in overrides for arg in ("--set", value))]) == 2
    [line] = stderr_lines(capsys)
    assert re.match(rf"densepass: error: (hard-negatives file )?{re.escape(str(negatives))}{says}", line), line
    assert not runs.exists()  # refused before the run directory was made


def test_pools_shorter_than_the_negatives_drawn_are_one_counted_warning(tiny_beir):
    from densepass.training.batches import TrainingData

    dataset = load_beir(tiny_beir)
    qids = ["q0", "q1", "q2", "q3"]
    pools = {"q0": ["p10", "p11", "p12"], "q1": ["p10", "p11"], "q2": ["p13", "p2", "p10"], "q3": []}
    with pytest.warns(DataWarning) as record:  # q2 loses its positive p2: q1 and q2 keep 2 distinct negatives
        data = TrainingData(dataset, "train", "[SEP]", pools, 3, query_ids=qids)
    assert data_warnings(record) == [
        "2 of 4 training queries have fewer distinct hard negatives in their pool than the 3 drawn per query "
        "(the smallest pool holds 2): their draws repeat negatives"
    ]
    assert data.pool_sizes.summary() == (
        "3 hard negative(s) drawn per query and step; 2 of the 4 queries have fewer distinct ones in their pool "
        "(the smallest 2), so their draws repeat negatives; 1 of the 4 have an empty pool (random passages instead)."
    )
    no_data_warnings(lambda: TrainingData(dataset, "train", "[SEP]", pools, 2, query_ids=qids))


def test_a_run_reports_the_negatives_its_pools_really_hold(tiny_beir, tiny_model_dir, tmp_path):
    from conftest import small_run_overrides
    from densepass.pipelines.experiment import run_experiment

    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "short")
    settings = ["negatives.source=context", "negatives.per_query=2", "train.max_steps=1", "train.batch_size=4"]
    config = load_config(None, [*overrides, *settings])  # a passage's document holds one other passage
    with pytest.warns(DataWarning, match=r"training queries have fewer distinct hard negatives in their pool"):
        run_experiment(config)
    report = (tmp_path / "short" / "report.md").read_text()
    assert re.search(
        r"Training negatives: 2 hard negative\(s\) drawn per query and step; \d+ of the \d+ queries", report
    )


# ---------------------------------------------------------------- damaged files under a manifest that matches them


def error_lines(capsys) -> list[str]:
    """The ``densepass: error:`` lines of what the command printed (warnings aside); never a traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("densepass: error:")]


def as_object_array(path: Path) -> None:
    """Rewrite the ``.npy`` at ``path`` with the same numbers as an object array (what only a pickle can load), and
    its directory's manifest to match, as a user who rewrote the manifest by hand would."""
    import numpy as np

    from densepass.io import write_manifest

    array = np.load(path, allow_pickle=False)
    np.save(path, array.astype(object), allow_pickle=True)
    directory = next(p for p in path.parents if (p / "manifest.json").is_file())
    facts = json.loads((directory / "manifest.json").read_text())
    write_manifest(directory, **{k: v for k, v in facts.items() if k != "files"})


@pytest.mark.parametrize("kind", ["exact", "bm25"])
def test_an_object_array_in_a_saved_index_under_a_matching_manifest_is_one_data_error(
    tiny_beir, tiny_model_dir, tmp_path, capsys, kind
):
    from densepass.index.base import load_index
    from densepass.io import manifest_problem

    index = tmp_path / "idx"
    model = ["--model", str(tiny_model_dir)] if kind == "exact" else []
    assert main(["index", str(tiny_beir), "--kind", kind, *model, "--output", str(index)]) == 0
    as_object_array(index / ("embeddings.npy" if kind == "exact" else "bm25s/data.csc.index.npy"))
    assert manifest_problem(index) is None  # the digests match: only reading the array can tell
    capsys.readouterr()
    assert main(["search", str(index), "audio editor"]) == 2
    [line] = error_lines(capsys)
    assert line.startswith(f"densepass: error: {index} is not a usable densepass index: its files do not load")
    with pytest.raises(DataError, match="its files do not load"):
        load_index(index)


@pytest.mark.parametrize("kind", ["faiss-hnsw", "faiss-flat"])  # IVF-PQ is read the same way (load_faiss_index)
def test_a_faiss_file_damaged_under_a_matching_manifest_is_one_line(tiny_beir, tiny_model_dir, tmp_path, capsys, kind):
    from densepass.index.base import load_index
    from densepass.io import write_manifest

    index = tmp_path / "idx"
    built = ["index", str(tiny_beir), "--kind", kind, "--model", str(tiny_model_dir), "--output", str(index)]
    assert main(built) == 0
    from conftest import write_tiny_beir

    other = tmp_path / "other"  # another index's faiss.index: 20 vectors, not 40
    small = write_tiny_beir(tmp_path / "small", n_passages=20)
    assert main([*built[:1], str(small), *built[2:-1], str(other)]) == 0
    original = (index / "faiss.index").read_bytes()
    facts = {k: v for k, v in json.loads((index / "manifest.json").read_text()).items() if k != "files"}
    variants = {
        "truncated": (original[: len(original) // 2], r"does not load as a FAISS index \(damaged\?\): .*read error"),
        "header": (original[:8] + (2**40).to_bytes(8, "little") + original[16:], "does not load as a FAISS index"),
    }
    variants["another index's"] = ((other / "faiss.index").read_bytes(), "holds 20 vectors, the index 40")
    if kind == "faiss-hnsw":  # neighbour ids past the vectors
        links = bytearray(original)
        for i in range(len(links) // 2, len(links) // 2 + 400, 4):
            links[i : i + 4] = (0x7FFFFFF0).to_bytes(4, "little")
        variants["neighbours"] = (bytes(links), r"out of range")
    if kind == "faiss-flat":  # NaN vectors
        nan = bytearray(original)
        nan[len(nan) // 2 : len(nan) // 2 + 4] = (0x7FFFFFF0).to_bytes(4, "little")
        variants["NaN"] = (bytes(nan), "holds vectors with NaN or infinity")
    for variant, (data, says) in variants.items():
        (index / "faiss.index").write_bytes(data)
        write_manifest(index, **facts)  # the manifest rewritten to match: only reading the file can tell
        capsys.readouterr()
        assert main(["search", str(index), "audio editor"]) == 2, variant
        [line] = error_lines(capsys)
        assert re.match(rf"densepass: error: {re.escape(str(index / 'faiss.index'))} .*{says}", line), (variant, line)
        with pytest.raises(DataError, match=says):
            load_index(index)


def test_a_dense_index_whose_embeddings_are_not_float32_is_one_data_error(tiny_beir, tiny_model_dir, tmp_path):
    import numpy as np

    from densepass.index.base import load_index
    from densepass.io import write_manifest

    index = tmp_path / "idx"
    assert main(["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(index)]) == 0
    embeddings = index / "embeddings.npy"
    np.save(embeddings, np.load(embeddings).astype(np.int8))
    facts = json.loads((index / "manifest.json").read_text())
    write_manifest(index, **{k: v for k, v in facts.items() if k != "files"})
    with pytest.raises(DataError, match=r"embeddings.npy holds int8 numbers, not float32"):
        load_index(index)


@pytest.mark.parametrize("state", [b"\xff" * 64, b"", b"not safetensors at all"])
def test_a_checkpoint_state_that_is_not_safetensors_under_a_matching_manifest_falls_back(tmp_path, state):
    from densepass.checkpoints import Checkpoints
    from densepass.io import manifest_problem, write_manifest
    from test_checkpoints import _save

    checkpoints = Checkpoints(tmp_path, keep=3, identity={})
    _save(checkpoints, 2)
    newest = _save(checkpoints, 4)
    (newest / "state.safetensors").write_bytes(state)  # safetensors: "header too large" and the like
    write_manifest(newest)
    assert manifest_problem(newest) is None
    with pytest.warns(DataWarning, match=r"step-4 is damaged \(its state does not load"):
        resumed = checkpoints.latest()
    assert resumed.step == 2


# ---------------------------------------------------------------- pickled weights (pytorch_model.bin)


def evil_pickle(marker: Path) -> bytes:
    """A pickle that, if ever unpickled without restriction, runs a shell command creating ``marker``."""
    import os
    import pickle

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps({"weight": Payload()})


@pytest.mark.parametrize("damage", ["pickle", "garbage", "truncated", "empty"])
def test_a_damaged_pytorch_model_bin_is_one_line_naming_it_and_never_unpickled(
    tiny_beir, tiny_model_dir, tmp_path, capsys, damage
):
    from transformers import AutoModel

    from densepass.models.biencoder import BiEncoder

    model = tmp_path / "pmodel"
    shutil.copytree(tiny_model_dir, model)
    (model / "model.safetensors").unlink()
    weights = model / "pytorch_model.bin"
    torch.save(AutoModel.from_pretrained(tiny_model_dir).state_dict(), weights)
    BiEncoder.from_pretrained(str(model))  # intact, it loads (transformers' weights-only loader)
    marker = tmp_path / "unpickled"
    data = {
        "pickle": evil_pickle(marker),
        "garbage": bytes(range(256)) * 4,
        "truncated": weights.read_bytes()[: weights.stat().st_size // 2],
        "empty": b"",
    }[damage]
    weights.write_bytes(data)
    capsys.readouterr()
    assert main(["index", str(tiny_beir), "--model", str(model), "--output", str(tmp_path / "x")]) == 2
    [line] = error_lines(capsys)
    assert line.startswith(f"densepass: error: {weights} does not load (truncated or damaged?): not tensors")
    assert "weights_only" not in line  # torch's advice to load it with weights_only=False is not repeated
    assert not marker.exists() and not (tmp_path / "x").exists()
    with pytest.raises(DataError, match="pytorch_model.bin does not load"):
        BiEncoder.from_pretrained(str(model))


# ---------------------------------------------------------------- sizes that allocate


@pytest.mark.parametrize(
    "override",
    [
        "model.projection_dim=100000000",
        "model.projection_dim=10000000000",
        "model.colbert.dim=100000000",
        "negatives.dense_dim=100000000",
        "loss.queue_size=10000000000",
    ],
)
def test_a_size_that_would_allocate_without_bound_is_a_one_line_config_error(capsys, override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=rf"{re.escape(key)}: must be <= \d+"):
        load_config(None, [override])
    capsys.readouterr()
    assert main(["run", "--set", override]) == 2  # before the dataset or the model is looked at
    [line] = error_lines(capsys)
    assert re.match(rf"densepass: error: .*{re.escape(key)}: must be <= \d+", line)


def test_pretraining_sizes_that_allocate_are_bounded_and_dense_dim_specs_too():
    from densepass.config import NegativesConfig
    from densepass.negatives.mine import dense_dim
    from densepass.pretraining.config import PretrainConfig

    for override in ("contriever.queue_size=10000000000", "model.head_layers=1000000"):
        with pytest.raises(ConfigError, match=rf"{re.escape(override.split('=')[0])}: must be <= \d+"):
            load_config(None, [override], PretrainConfig)
    assert dense_dim("dense:65536", NegativesConfig()) == 65536
    for spec in ("dense:100000000", "dense:0"):
        with pytest.raises(ConfigError, match=r"the dimension after 'dense:' must be in \[1, 65536\]"):
            dense_dim(spec, NegativesConfig())


def test_rerank_with_an_encoder_for_a_model_is_one_line_without_transformers_load_report(
    tiny_beir, tiny_model_dir, tmp_path
):
    """`rerank --model` given a bi-encoder densepass saved, or a plain BERT: the missing relevance head is
    densepass's one line; transformers' LOAD REPORT table and its loading progress bar are not printed (a fresh
    process, at transformers' default verbosity)."""
    from conftest import run_densepass
    from densepass.models.biencoder import BiEncoder

    BiEncoder.from_pretrained(str(tiny_model_dir)).save(tmp_path / "bi")
    (tmp_path / "first.trec").write_text("q30 Q0 p30 1 1.0 densepass\n")
    for model in (tmp_path / "bi", tiny_model_dir):
        rerank = ["rerank", str(tiny_beir), "first.trec", "--model", str(model), "--output", "second.trec"]
        done = run_densepass(*rerank, cwd=tmp_path)
        assert done.returncode == 2
        assert done.stderr.strip().splitlines() == [
            f"densepass: error: {model} has no trained relevance head (classifier.bias, classifier.weight missing): "
            "it is an encoder, not a cross-encoder; train one first (reranker.train in a run config)"
        ]
    assert not (tmp_path / "second.trec").exists()


def test_a_diverged_training_ends_stderr_with_its_one_line_and_no_progress_bar(tiny_beir, tiny_model_dir, tmp_path):
    """The training bar is cleared before the divergence error: it was drawn again after the error, at exit, and
    kept on the line before it."""
    from conftest import run_densepass

    sets = [f"data.name={tiny_beir}", f"model.name_or_path={tiny_model_dir}", f"output_dir={tmp_path}", "name=pt"]
    sets += ["model.mode=mlm", "train.max_steps=4", "train.batch_size=2", "train.max_length=16"]
    sets += ["train.learning_rate=1e308", "train.checkpoint_every=10"]
    done = run_densepass("pretrain", *[a for s in sets for a in ("--set", s)], cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.rstrip("\n").split("\n")  # read as text: each of the bar's carriage returns is a newline
    assert lines[-1].startswith("densepass: error: training diverged at step 2: the loss is nan"), lines[-3:]
    assert lines[-2].strip() == "", lines[-3:]  # the bar's last state overwritten with blanks, not kept


def test_a_fifo_or_a_folder_given_as_a_config_or_queries_file_is_not_a_regular_file(tmp_path, capsys):
    """A named pipe (which reading would wait on) or a folder is "not a regular file", not "not found"."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a named pipe"), (tmp_path, "a folder")):
        not_regular = f"is not a regular file ({kind}): give the path of a file"
        for command in (["run", str(path)], ["pretrain", str(path)], ["config", str(path)]):
            assert main(command) == 2
            assert error_lines(capsys) == [f"densepass: error: config file {path} {not_regular}"]
        search = ["search", str(tmp_path / "idx"), "--queries", str(path), "--output", str(tmp_path / "run.trec")]
        assert main(search) == 2
        assert error_lines(capsys) == [f"densepass: error: queries file {path} {not_regular}"]
    assert main(["run", str(tmp_path / "missing.yaml")]) == 2
    assert error_lines(capsys) == [f"densepass: error: config file not found: {tmp_path / 'missing.yaml'}"]
    assert not (tmp_path / "run.trec").exists()


# ---------------------------------------------------------------- code of its own, anywhere in a model


def _with_auto_map(folder: Path) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "evil.Model"}}))


@pytest.mark.parametrize("sub", ["query", "phrase", "question", "reranker/model"])
def test_a_model_holding_a_subfolder_that_asks_for_its_own_code_is_refused_before_transformers_reads_it(
    tiny_model_dir, tmp_path, sub
):
    from densepass.models.biencoder import resolve_model_path

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    shutil.copytree(tiny_model_dir, model / sub)
    _with_auto_map(model / sub)
    with pytest.raises(ConfigError, match=f"{re.escape(str(model / sub))} needs code of its own"):
        resolve_model_path(str(model))


def test_the_cross_encoder_filter_checks_its_model_before_mining(tiny_model_dir, tmp_path):
    from densepass.negatives.filters import cross_encoder_scorer

    evil = tmp_path / "evil"
    shutil.copytree(tiny_model_dir, evil)
    _with_auto_map(evil)
    with pytest.raises(ConfigError, match="needs code of its own"):
        cross_encoder_scorer(str(evil))
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, pickled)
    for weights in pickled.glob("*.safetensors"):
        weights.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not a torch archive at all")
    from densepass.errors import DensepassError

    with pytest.raises(DensepassError) as caught:
        cross_encoder_scorer(str(pickled))
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("damage", "says"), [("auto_map", "needs code of its own"), ("hidden", "model.safetensors does not fit")]
)
def test_mine_checks_the_cross_encoder_of_its_filter_before_any_mining(
    tiny_beir, tiny_model_dir, tmp_path, capsys, damage, says
):
    from densepass.pipelines.experiment import check

    model = tmp_path / "ce"
    shutil.copytree(tiny_model_dir, model)
    if damage == "auto_map":
        _with_auto_map(model)
    else:
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    output = tmp_path / "neg.jsonl"
    args = ["mine", str(tiny_beir), "--output", str(output), "--filters", "cross-encoder", "--cross-encoder"]
    assert main([*args, str(model), "--max-queries", "4", "--depth", "5"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "mining" not in err and "bm25" not in err.lower()  # nothing mined first
    [line] = err.strip().splitlines()
    assert says in line, line
    assert not output.exists()
    sets = ["negatives.filters=[cross-encoder]", f"negatives.cross_encoder={model}", f"output_dir={tmp_path / 'r'}"]
    with pytest.raises(DensepassError, match=says):  # a run checks it before any work too
        check(load_config(None, sets))


# ---------------------------------------------------------------- the fourth probe's inputs


def test_a_dataset_file_that_is_a_named_pipe_is_one_line_not_a_wait(tiny_beir):
    import os

    from densepass.errors import DataError

    qrels = tiny_beir / "qrels" / "dev.tsv"
    qrels.unlink()
    os.mkfifo(qrels)
    with pytest.raises(DataError, match="dev.tsv is a named pipe"):
        load_dataset(str(tiny_beir))


def test_a_byte_order_mark_before_a_queries_tsv_is_not_part_of_the_first_id(tmp_path):
    from densepass.pipelines.search import read_queries

    path = tmp_path / "queries.tsv"
    path.write_text("\ufeffq1\taudio editor\nq2\tnetwork terminal\n", encoding="utf-8")
    assert read_queries(path) == (["q1", "q2"], ["audio editor", "network terminal"])


def test_a_damaged_line_in_a_training_log_is_left_out_of_the_plots(tmp_path):
    from densepass.plots import read_log

    log = tmp_path / "train_log.jsonl"
    log.write_bytes(b'{"step": 1, "loss": 2.0}\n{"step": 2, "lo\xff\xfe\n[1, 2]\n{"step": 3, "loss": 1.5}\n')
    assert [r["step"] for r in read_log(log)] == [1, 3]


def test_bytes_that_are_not_utf8_in_a_training_log_are_dropped_when_a_run_resumes(tmp_path):
    from densepass.checkpoints import trim_log

    log = tmp_path / "log.jsonl"
    log.write_bytes(b'{"step": 1}\n\xff\xfe\n{"step": 2, "note": "\xc3\xa9"}\n{"step": 3}\n')
    trim_log(log, 2)  # as a resumed (or finished, run again) run trims its log: the damaged line goes as a cut one
    assert log.read_bytes() == b'{"step": 1}\n{"step": 2, "note": "\xc3\xa9"}\n'


def test_a_model_folder_without_weights_or_with_a_damaged_densepass_json_is_one_line(tiny_model_dir, tmp_path):
    from densepass.models.biencoder import BiEncoder

    empty = tmp_path / "no-weights"
    shutil.copytree(tiny_model_dir, empty)
    (empty / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match="holds no weights to load"):
        BiEncoder.from_pretrained(str(empty))
    damaged = tmp_path / "damaged"
    shutil.copytree(tiny_model_dir, damaged)
    (damaged / "densepass.json").write_text('{"pooling": "me')
    with pytest.raises(DataError, match="densepass.json does not load"):
        BiEncoder.from_pretrained(str(damaged))


def test_analyze_attention_beyond_the_models_positions_is_one_line(tiny_model_dir, tiny_beir, tmp_path):
    from densepass.analysis.attention import analyze_attention

    with pytest.raises(ConfigError, match="--max-length 100000 exceeds"):
        analyze_attention([str(tiny_model_dir)], tmp_path / "a.png", str(tiny_beir), samples=2, max_length=100000)


def test_a_saved_phrase_model_whose_tower_asks_for_its_own_code_is_refused(tmp_path):
    from densepass.phrase.model import PhraseEncoder
    from phrase_fixtures import tiny_phrase_model

    model = tiny_phrase_model(tmp_path / "bert")
    model.save(tmp_path / "pm")
    _with_auto_map(tmp_path / "pm" / "question")
    with pytest.raises(ConfigError, match="needs code of its own"):
        PhraseEncoder.from_pretrained(str(tmp_path / "pm"))


def test_the_ensemble_and_the_study_check_their_metric_names_before_any_encoding():
    """A misspelt metric failed only after every model had encoded the corpus (ensemble) or a checkpoint had
    (validate-study); accuracy@k, which neither can compute without answers, is refused too."""
    from densepass.pipelines.ensemble import EnsembleSettings
    from densepass.pipelines.study import StudySettings

    with pytest.raises(ConfigError, match="MRR@10"):
        EnsembleSettings(metrics=["MRR@10"])
    with pytest.raises(ConfigError, match="mrr@0"):
        EnsembleSettings(tune_metric="mrr@0")
    with pytest.raises(ConfigError, match="ndcg10"):
        StudySettings(metric="ndcg10")
    with pytest.raises(ConfigError, match="needs answer strings"):
        StudySettings(metric="accuracy@20")


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--method", "rrf", "--tune-metric", "ndcg@10"], "--tune-metric: an option of --method embedding (or both)"),
        (["--method", "embedding", "--rrf-k", "10"], "--rrf-k: an option of --method rrf (or both), not of --method"),
    ],
)
def test_the_ensemble_refuses_an_option_of_the_method_it_does_not_run(tiny_beir, tmp_path, capsys, flags, message):
    """``--method rrf --tune-metric`` tuned nothing (RRF has no weights) and ``--method embedding --rrf-k`` fused
    nothing by rank: both were accepted in silence; now one line before any model loads."""
    from densepass.cli import main

    models = ["--models", str(tmp_path / "no-model-a"), str(tmp_path / "no-model-b")]
    assert main(["ensemble", str(tiny_beir), *models, *flags]) == 2
    assert capsys.readouterr().err.strip().startswith(f"densepass: error: {message}")


def test_a_cutoff_on_r_precision_is_refused_and_metrics_deeper_than_the_ensembles_depth_are_said():
    """ranx ignores an @k on r-precision (it cuts at each query's count of relevant passages): r-precision@1 was
    r-precision under another name. The ensemble reported recall@1000 of its top 100 without a word."""
    from densepass.pipelines.ensemble import EnsembleSettings

    with pytest.raises(ConfigError, match=r"r-precision@1: r-precision takes no cutoff"):
        check_metrics(["mrr@10", "r-precision@1"])
    check_metrics(["r-precision"])
    with pytest.warns(UserWarning, match=r"metrics cut at 1000 and the ensemble's depth \(--depth\) retrieves 100"):
        EnsembleSettings(metrics=["mrr@10", "recall@1000"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        EnsembleSettings(metrics=["mrr@10", "recall@100"])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--kind", "bm25", "--fusion", "linear"], "--fusion: options of --kind hybrid, not of --kind bm25"),
        (["--kind", "bm25", "--dense-kind", "faiss-flat"], "--dense-kind: options of --kind hybrid"),
        (["--kind", "hybrid", "--fusion-weight", "0.3"], "--fusion-weight weighs --fusion linear"),
    ],
)
def test_index_refuses_hybrid_options_it_would_ignore(tiny_beir, tmp_path, capsys, flags, message):
    assert main(["index", str(tiny_beir), *flags, "--output", str(tmp_path / "idx")]) == 2
    [line] = stderr_lines(capsys)
    assert message in line and not (tmp_path / "idx").exists()


# ---------------------------------------------------------------- the command line, fourth hunt


def test_a_run_tag_with_a_space_or_empty_is_refused_before_the_search(bm25_index, tmp_path, capsys):
    """It was written (``... 0.9 my tag``: seven columns) and then refused by evaluate, and by the same command."""
    queries = tmp_path / "q.tsv"
    queries.write_text("qa\tvideo player\nqb\tmail agent\n")
    for tag in ("my tag", ""):
        out = tmp_path / "r.trec"
        args = ["search", str(bm25_index), "--queries", str(queries), "--output", str(out), "--tag", tag]
        assert main(args) == 2 and not out.exists()
        assert "a TREC run's tag is one word" in capsys.readouterr().err
    out = tmp_path / "deep.trec"
    assert main(["search", str(bm25_index), "--queries", str(queries), "--output", str(out), "--k", "1000000"]) == 0
    deepest = max(sum(1 for line in out.read_text().splitlines() if line.startswith(q + " ")) for q in ("qa", "qb"))
    assert f"top {deepest} each" in capsys.readouterr().out  # what it wrote, not the --k asked for


def test_index_update_refuses_a_precision_for_a_bm25_index(bm25_index, tmp_path, capsys):
    import shutil

    live = tmp_path / "live"
    shutil.copytree(bm25_index, live)
    upsert = tmp_path / "new.jsonl"
    upsert.write_text(json.dumps({"_id": "n1", "text": "a new passage"}) + "\n")
    assert main(["index-update", str(live), "--precision", "bf16", "--upsert", str(upsert)]) == 2
    assert "--precision bf16 applies to model indexes" in capsys.readouterr().err
    assert not (live / "v000001").exists()


def test_a_corpus_file_given_as_a_dataset_says_a_dataset_is_a_folder(tiny_beir, tmp_path, capsys):
    run = tmp_path / "run.trec"
    run.write_text("q1 Q0 p1 1 1.0 x\n")
    assert main(["evaluate", str(tiny_beir / "corpus.jsonl"), str(run)]) == 2
    assert "corpus.jsonl is a file: a dataset with queries and judgements is a folder" in capsys.readouterr().err


def test_a_cross_encoder_is_refused_as_an_index_model_and_as_a_retriever_to_export(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    """It was indexed with its bare encoder, and exported (to ONNX too) as "a bi-encoder retriever", head dropped."""
    from densepass.models.cross_encoder import CrossEncoder

    CrossEncoder.new(str(tiny_model_dir), max_length=32).save(tmp_path / "ce")
    assert main(["index", str(tiny_beir), "--model", str(tmp_path / "ce"), "--output", str(tmp_path / "idx")]) == 2
    assert "holds a cross-encoder" in capsys.readouterr().err and not (tmp_path / "idx").exists()
    for to in ("onnx", "dir"):
        assert main(["export", str(tmp_path / "ce"), "--to", to, str(tmp_path / f"out-{to}")]) == 2
        assert "holds a cross-encoder" in capsys.readouterr().err


def test_a_relative_checkpoint_named_model_is_labelled_by_its_folder(tmp_path, monkeypatch):
    from densepass.pipelines.study import checkpoint_name

    (tmp_path / "run-a" / "model").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "run-a")
    assert checkpoint_name(Path("model")) == "run-a"


def test_export_and_config_refuse_the_options_they_would_ignore(tiny_model_dir, tmp_path, capsys):
    """`export --to dir --force --collection ...` and `config --explain CONFIG --set ... --output F` exited 0 and
    ignored what they were given (nothing written to --output); --pretrain --phrase picked one in silence."""
    out = tmp_path / "pub"
    for extra, message in (
        (["--force", "--collection", "foo"], "--collection, --force: options of --to qdrant"),
        (["--batch-size", "3"], "--batch-size: options of --to qdrant"),
        (["--private"], "--private: an option of --to hub"),
    ):
        assert main(["export", str(tiny_model_dir), "--to", "dir", str(out), *extra]) == 2
        assert message in capsys.readouterr().err and not out.exists()
    assert main(["config", "--explain", "--output", str(tmp_path / "keys.txt")]) == 2
    assert "--explain lists the keys" in capsys.readouterr().err and not (tmp_path / "keys.txt").exists()
    assert main(["config", "--explain", "--set", "train.batch_size=abc"]) == 2
    assert main(["config", "--pretrain", "--phrase", "--explain"]) == 2
    assert "give one" in capsys.readouterr().err
    assert main(["config", "--explain"]) == 0


@pytest.mark.parametrize(
    ("kind", "extra", "message"),
    [
        ("bm25", ["--top-terms", "5"], "--top-terms: an option of --kind splade, not of --kind bm25"),
        ("bm25", ["--compression", "residual"], "--compression: an option of --kind colbert"),
        ("bm25", ["--nprobe", "3"], "--nprobe: an option of --kind colbert and --kind faiss-ivfpq-disk"),
        ("exact", ["--pq-bits", "4"], "--pq-bits: an option of --kind faiss-ivfpq-disk, not of --kind exact"),
        ("faiss-hnsw", ["--nprobe", "8"], "--nprobe: an option of --kind colbert and --kind faiss-ivfpq-disk"),
        ("colbert", ["--residual-bits", "4"], "--residual-bits sets --compression residual's bits"),
    ],
)
def test_index_refuses_the_options_of_other_kinds(tiny_beir, tmp_path, capsys, kind, extra, message):
    """They were accepted and ignored: `--kind bm25 --top-terms 5` exited 0, `--residual-bits 4` with fp16 vectors
    stored a setting nothing used."""
    assert main(["index", str(tiny_beir), "--kind", kind, "--output", str(tmp_path / "idx"), *extra]) == 2
    assert message in capsys.readouterr().err and not (tmp_path / "idx").exists()
