"""Valid files with the quirks real files have (a byte-order mark, a ``.GZ`` name, macOS resource forks, files
concatenated with their headers, lines of Unicode whitespace) load as meant; what is read anyway is counted in one
warning per file; a key given twice in a record is an error, not the last value kept in silence; and a run's data
fingerprint tells apart datasets of the same name and datasets built in Python."""

from __future__ import annotations

import gzip
import json
import warnings
from pathlib import Path

import pytest

from densepass.data.beir import load_beir, read_corpus
from densepass.data.dataset import Corpus, RetrievalDataset
from densepass.data.msmarco import load_msmarco
from densepass.data.pairs import load_pairs
from densepass.errors import DataError, DataWarning
from densepass.evaluation.metrics import read_trec_run
from densepass.pipelines.training import data_fingerprints
from test_data_readers import BEIR_CORPUS, jsonl, write, write_beir, write_msmarco

BOM = "\ufeff"


def data_warnings(load) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = load()
    return result, [str(w.message) for w in caught if issubclass(w.category, DataWarning)]


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_byte_order_mark_starts_any_file_without_becoming_part_of_its_first_id(tmp_path, on_disk):
    root = write_beir(tmp_path / "beir", qrels={"train": "q1\tp1\t1\n", "dev": "q2\tp3\t1\n"})
    for name in ("corpus.jsonl", "queries.jsonl", "qrels/train.tsv"):
        path = root / name
        path.write_text(BOM + path.read_text(encoding="utf-8"), encoding="utf-8")
    ds = load_beir(root, passages_on_disk=on_disk)
    assert ds.corpus.ids[0] == "p1" and "q1" in ds.queries and ds.qrels["train"] == {"q1": {"p1": 1}}
    assert list(ds.corpus.texts) == [r["text"] for r in BEIR_CORPUS]  # read back from the file too

    marco = write_msmarco(tmp_path / "marco")
    qrels = marco / "qrels.train.tsv"
    qrels.write_text(BOM + qrels.read_text(encoding="utf-8"), encoding="utf-8")
    assert load_msmarco(marco).qrels["train"]["10"] == {"0": 1}


def test_a_line_of_unicode_whitespace_between_passages_reads_back_from_the_file(tmp_path):
    """It loaded (a blank line) but a read from the file split lines its own way and called the file changed."""
    lines = [json.dumps({"_id": f"p{i}", "title": f"t{i}", "text": f"text {i}"}) + "\n" for i in range(4)]
    for blank in ("\u3000\n", "\u00a0\n", "\x1c\n"):
        path = write(tmp_path / "corpus.jsonl", "".join(lines[:2]) + blank + "".join(lines[2:]))
        corpus = read_corpus(path, on_disk=True)
        assert list(corpus.texts) == [f"text {i}" for i in range(4)]
        assert corpus.texts[2] == "text 2" and list(corpus.titles[1:3]) == ["t1", "t2"]


def crlf(root: Path) -> Path:
    """Every file under ``root`` (gzipped or not) rewritten with Windows line ends (``\\r\\n``)."""
    for path in (p for p in root.rglob("*") if p.is_file()):
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        raw = raw.replace(b"\n", b"\r\n")
        path.write_bytes(gzip.compress(raw) if path.suffix == ".gz" else raw)
    return root


@pytest.mark.parametrize("gz", [False, True])
def test_windows_line_ends_read_as_unix_ones_in_every_text_reader(tmp_path, gz):
    """Only \\n ends a line (``files.open_text``): the \\r of a \\r\\n is no part of an id, a text or a grade."""
    for name, write_files, load in (("beir", write_beir, load_beir), ("marco", write_msmarco, load_msmarco)):
        unix = load(write_files(tmp_path / name, gz))
        for on_disk in (False, True) if name == "beir" else (False,):
            kw = {"passages_on_disk": on_disk} if on_disk else {}
            windows = load(crlf(write_files(tmp_path / f"{name}-crlf", gz)), **kw)
            assert windows.corpus.ids == unix.corpus.ids and list(windows.corpus.texts) == list(unix.corpus.texts)
            assert list(windows.corpus.titles) == list(unix.corpus.titles)
            assert (windows.queries, windows.qrels, windows.answers) == (unix.queries, unix.qrels, unix.answers)
    run = write(tmp_path / "run" / "run.trec", "q1 Q0 p1 1 2.5 bm25\nq1 Q0 p2 2 1.5 bm25\n\n", gz)
    crlf(run.parent)
    assert read_trec_run(run) == {"q1": {"p1": 2.5, "p2": 1.5}}
    rows = write(tmp_path / "rows" / "r.jsonl", '{"anchor": "a", "positive": "p", "negative": "n"}\n\n', gz)
    crlf(rows.parent)
    assert load_pairs(rows).corpus.texts == ["p", "n"]


def test_files_named_in_capitals_are_gzipped_all_the_same(tmp_path):
    path = tmp_path / "c.jsonl.GZ"
    with gzip.open(path, "wt", encoding="utf-8") as handle:
        handle.write(jsonl(BEIR_CORPUS))
    assert read_corpus(path).ids == ["p1", "p2", "p3"]
    rows = tmp_path / "up.JSONL.GZ"
    with gzip.open(rows, "wt", encoding="utf-8") as handle:
        handle.write(jsonl([{"anchor": "a question", "positive": "its answer"}]))
    assert load_pairs(rows).queries and len(load_pairs(rows).corpus) == 1


def test_hidden_resource_forks_beside_the_qrels_are_not_splits(tmp_path):
    root = write_beir(tmp_path / "beir")
    (root / "qrels" / "._train.tsv").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        \xff\xfe")
    (root / "qrels" / "._dev.tsv").write_bytes(b"\x00\x05\x16\x07")
    assert sorted(load_beir(root).qrels) == ["dev", "train"]


def test_header_lines_repeated_by_concatenated_files_are_skipped_and_counted(tmp_path):
    header = "query-id\tcorpus-id\tscore\n"
    root = write_beir(tmp_path / "beir", qrels={"train": header + "q1\tp1\t1\n" + header + "q1\tp2\t2\n"})
    ds, said = data_warnings(lambda: load_beir(root))
    assert ds.qrels["train"] == {"q1": {"p1": 1, "p2": 2}}
    assert any("1 header rows after the first line" in w and "line 3" in w for w in said)

    marco = write_msmarco(tmp_path / "marco")
    write(marco / "collection.tsv", "pid\tpassage\n1\tfoo bar\n2\tbaz\npid\tpassage\n3\tqux\n")
    write(marco / "queries.train.tsv", "qid\tquery\n10\twhat is foo\nqid\tquery\n11\twhat is baz\n")
    write(marco / "qrels.train.tsv", "10\t0\t1\t1\n11\t0\t2\t1\n")
    write(marco / "qrels.dev.tsv", "10\t0\t3\t1\n")
    ds, said = data_warnings(lambda: load_msmarco(marco))
    assert ds.corpus.ids == ["1", "2", "3"] and {"10", "11"} <= set(ds.queries) and "qid" not in ds.queries
    assert any("collection.tsv: 2 header lines skipped (first: line 1)" in w for w in said)
    assert any("queries.train.tsv: 2 header lines skipped" in w for w in said)


@pytest.mark.parametrize("on_disk", [False, True])
def test_passages_with_nothing_to_index_are_counted_in_one_warning(tmp_path, on_disk):
    records = [*BEIR_CORPUS, {"_id": "p4", "title": "", "text": ""}, {"_id": "p5", "text": "  "}]
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", jsonl(records))
    ds, said = data_warnings(lambda: load_beir(root, passages_on_disk=on_disk))
    assert len(ds.corpus) == 5
    assert [w for w in said if "2 passages with an empty title and text" in w]
    marco = write_msmarco(tmp_path / "marco")
    write(marco / "collection.tsv", "0\tfirst passage\n1\t \n2\tthird\n")
    _, said = data_warnings(lambda: load_msmarco(marco))
    assert [w for w in said if "1 passages with an empty title and text" in w and "passage '1'" in w]


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_field_given_twice_in_one_corpus_or_query_record_is_an_error(tmp_path, on_disk):
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", jsonl(BEIR_CORPUS) + '{"_id": "p9", "text": "first text", "text": "second"}\n')
    with pytest.raises(DataError, match=r"corpus.jsonl:4: key 'text' appears twice"):
        load_beir(root, passages_on_disk=on_disk)
    write(root / "corpus.jsonl", jsonl(BEIR_CORPUS) + '{"_id": "p0", "_id": "p9", "text": "t"}\n')
    with pytest.raises(DataError, match=r"key '_id' appears twice"):
        load_beir(root, passages_on_disk=on_disk)
    root = write_beir(tmp_path / "beir2")
    write(root / "queries.jsonl", '{"_id": "q1", "text": "what is alpha", "text": "what"}\n')
    with pytest.raises(DataError, match=r"queries.jsonl:1: key 'text' appears twice"):
        load_beir(root)
    # a text ending in a quoted word holds '"text"' as written in JSON ('x\\"text"'): checked, and no repeat
    write(root / "queries.jsonl", jsonl([{"_id": q, "text": 'say x"text'} for q in ("q1", "q2", "q3")]))
    assert '"text"' in json.dumps({"text": 'say x"text'})[8:]
    assert load_beir(root).queries["q1"] == 'say x"text'


def test_an_iterable_dataset_without_declared_features_reads_its_rows(tmp_path):
    datasets = pytest.importorskip("datasets")

    def rows():
        yield {"anchor": "what is alpha", "positive": "alpha is a letter"}
        yield {"anchor": "what is beta", "positive": "beta is another"}

    stream = datasets.IterableDataset.from_generator(rows)
    assert stream.column_names is None
    ds = load_pairs(stream, name="stream")
    assert sorted(ds.queries.values()) == ["what is alpha", "what is beta"]


def _dataset(name: str, text: str) -> RetrievalDataset:
    corpus = Corpus(["p1", "p2"], ["", ""], [text, "another passage"], ["p1", "p2"])
    return RetrievalDataset(name, corpus, {"q1": "a question"}, {"train": {"q1": {"p1": 1}}})


def test_the_data_fingerprint_tells_apart_same_named_datasets_and_datasets_built_in_python(tmp_path):
    a, b = write_beir(tmp_path / "x" / "tiny"), write_beir(tmp_path / "y" / "tiny")
    before = data_fingerprints([load_beir(a), load_beir(b)])
    write(a / "corpus.jsonl", jsonl([{**r, "text": r["text"] + " changed"} for r in BEIR_CORPUS]))
    assert data_fingerprints([load_beir(a), load_beir(b)]) != before  # the first one's change is seen
    assert len(before) == 2 * len(load_beir(a).files)

    one, other = _dataset("mine", "first passage"), _dataset("mine", "other passage")
    assert data_fingerprints([one]) != data_fingerprints([other])
    assert data_fingerprints([one]) == data_fingerprints([_dataset("mine", "first passage")])


def test_a_passage_whose_id_is_a_header_word_is_kept_inside_a_file(tmp_path):
    """Only the first line is a header by its id alone; further on a header names both columns (``pid<TAB>passage``):
    a string-id collection's passage ``id`` is a passage."""
    marco = write_msmarco(tmp_path / "marco")
    write(marco / "collection.tsv", "0\tfirst passage\n1\tsecond\nid\ta passage whose id is a word\n2\tthird\n")
    ds, said = data_warnings(lambda: load_msmarco(marco))
    assert ds.corpus.ids == ["0", "1", "id", "2"] and not [w for w in said if "header" in w]
