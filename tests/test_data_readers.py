"""Dataset readers (BEIR, MS MARCO, DPR, SQuAD), their error messages, and the offline parts of download."""

from __future__ import annotations

import copy
import gzip
import io
import json
import re
import zipfile
from pathlib import Path
from urllib.error import URLError

import pytest

from densepass.data import load_corpus, load_dataset
from densepass.data.beir import load_beir
from densepass.data.dpr import dpr_hard_negatives, load_dpr
from densepass.data.msmarco import load_msmarco
from densepass.data.squad import load_squad
from densepass.errors import DataError
from densepass.fingerprints import fingerprint_corpus

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def write(path: Path, text: str, gz: bool = False) -> Path:
    """Write ``text`` to ``path`` (or ``path.gz``, gzipped) and return the written path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if gz:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wt", encoding="utf-8") as handle:
            handle.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


# ---------------------------------------------------------------- BEIR

BEIR_CORPUS = [
    {"_id": "p1", "title": "Alpha", "text": "alpha text", "doc_id": "docA"},
    {"_id": "p2", "title": "Alpha", "text": "more alpha", "doc_id": "docA"},
    {"_id": "p3", "text": "untitled, no doc id"},
]
BEIR_QUERIES = [
    {"_id": "q1", "text": "what is alpha", "metadata": {"answers": ["alpha", "Alpha"]}},
    {"_id": "q2", "text": "untitled?", "answers": ["p3 text"]},
    {"_id": "q3", "text": "no answers"},
]


def write_beir(root: Path, gz: bool = False, qrels: dict[str, str] | None = None) -> Path:
    write(root / "corpus.jsonl", jsonl(BEIR_CORPUS), gz)
    write(root / "queries.jsonl", jsonl(BEIR_QUERIES), gz)
    qrels = qrels or {
        "train": "query-id\tcorpus-id\tscore\nq1\tp1\t1\nq1\tp2\t2\n",
        "dev": "q2\tp3\t1\nq3\tp1\t0\n",  # no header line
    }
    for split, text in qrels.items():
        write(root / "qrels" / f"{split}.tsv", text, gz)
    return root


@pytest.mark.parametrize("gz", [False, True])
def test_beir_reader(tmp_path, gz):
    ds = load_beir(write_beir(tmp_path / "beir", gz))
    assert ds.name == "beir"
    assert ds.corpus.ids == ["p1", "p2", "p3"]
    assert ds.corpus.doc_ids == ["docA", "docA", "p3"]  # missing doc_id falls back to the passage id
    assert ds.corpus.titles == ["Alpha", "Alpha", ""]
    assert ds.queries["q3"] == "no answers"
    assert ds.answers == {"q1": ["alpha", "Alpha"], "q2": ["p3 text"]}
    assert ds.qrels["train"] == {"q1": {"p1": 1, "p2": 2}}  # header line skipped
    assert ds.qrels["dev"] == {"q2": {"p3": 1}, "q3": {"p1": 0}}  # first line kept without a header
    assert ds.positives("train") == {"q1": ["p2", "p1"]}
    assert ds.positives("dev") == {"q2": ["p3"]}


def test_load_dataset_dispatches_by_format(tmp_path):
    write_beir(tmp_path / "mine")
    assert len(load_dataset("mine", data_dir=tmp_path).corpus) == 3
    assert load_dataset(str(tmp_path / "mine")).name == "mine"  # a path works as the name


def test_passages_on_disk_read_the_same_corpus_as_the_loaded_one(tmp_path):
    records = [*BEIR_CORPUS, {"_id": 7, "title": None, "text": "an integer id, ünïcode", "doc_id": 3}]
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", jsonl(records[:2]) + "\n  \n" + jsonl(records[2:]))  # blank lines are skipped
    loaded, on_disk = load_beir(root).corpus, load_beir(root, passages_on_disk=True).corpus
    assert not isinstance(on_disk.texts, list) and on_disk.ids == loaded.ids == ["p1", "p2", "p3", "7"]
    assert on_disk.doc_ids == loaded.doc_ids and on_disk.position("7") == 3
    assert list(on_disk.titles) == loaded.titles and list(on_disk.texts) == loaded.texts
    assert (
        on_disk.texts[-1] == "an integer id, ünïcode"
        and on_disk.titles[3] == ""
        and on_disk.texts[1:3] == loaded.texts[1:3]
    )
    assert on_disk.texts[::2] == loaded.texts[::2] and on_disk.texts[3:1] == []
    assert on_disk.passage_inputs("[SEP]") == loaded.passage_inputs("[SEP]")
    assert on_disk.passage_inputs("[SEP]", [3, 0]) == loaded.passage_inputs("[SEP]", [3, 0])
    assert fingerprint_corpus(on_disk) == fingerprint_corpus(loaded)
    assert list(copy.deepcopy(on_disk).texts) == loaded.texts  # copies (and pickles) reopen the file
    with pytest.raises(IndexError):
        on_disk.texts[4]


def test_passages_on_disk_close_their_file_when_the_corpus_is_dropped(tmp_path):
    import gc
    import warnings

    corpus = load_beir(write_beir(tmp_path / "beir"), passages_on_disk=True).corpus
    assert corpus.texts[0] == "alpha text"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del corpus
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


def test_an_index_command_refused_after_reading_the_corpus_prints_one_line(tmp_path, tiny_beir, tiny_model_dir):
    """``densepass index`` over 40 passages as faiss-ivfpq (which needs 256) fails after the corpus was read: one
    line on stderr, not that line and an "unclosed file ... corpus.jsonl" warning (shown under -W default)."""
    import os
    import subprocess
    import sys

    import densepass

    env = {**os.environ, "PYTHONPATH": str(Path(densepass.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    env.update(PYTHONWARNINGS="default", HF_HUB_OFFLINE="1", HF_HUB_DISABLE_PROGRESS_BARS="1")
    command = [sys.executable, "-m", "densepass", "index", str(tiny_beir), "--model", str(tiny_model_dir)]
    command += ["--kind", "faiss-ivfpq", "--output", str(tmp_path / "idx")]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 2 and done.stderr.startswith("densepass: error: a faiss-ivfpq index"), done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_passages_on_disk_of_a_gzipped_corpus_are_loaded_whole(tmp_path):
    corpus = load_beir(write_beir(tmp_path / "beir", gz=True), passages_on_disk=True).corpus
    assert corpus.texts == [r["text"] for r in BEIR_CORPUS]  # a gzip stream cannot be read at an offset


def test_passages_on_disk_refuse_a_file_changed_after_loading(tmp_path):
    root = write_beir(tmp_path / "beir")
    corpus = load_beir(root, passages_on_disk=True).corpus
    assert corpus.texts[0] == "alpha text"
    records = [dict(r) for r in BEIR_CORPUS]
    records[1]["_id"] = "other"
    write(root / "corpus.jsonl", jsonl(records))
    with pytest.raises(DataError, match=r"row 1 is not passage 'p2' any more \(the file changed after loading\)"):
        corpus.texts[1]
    write(root / "corpus.jsonl", jsonl(BEIR_CORPUS[:1]))
    with pytest.raises(DataError, match="the file changed after loading"):
        corpus.passage_inputs("[SEP]")


@pytest.mark.parametrize(
    "lines, error",
    [
        (['{"_id": "p1", "text": "a"}', '{"_id": "p1", "text": "b"}'], r"corpus\.jsonl:2: duplicate passage id 'p1'"),
        (['{"_id": "p1", "text": "a"}', '{"_id": "p2", "text": '], r"corpus\.jsonl:2: not valid JSON"),
        (['{"_id": "p1", "text": 3}'], r"corpus\.jsonl:1: field 'text' should be a str"),
        (["", " "], r"corpus\.jsonl: the corpus is empty"),
    ],
)
def test_passages_on_disk_check_the_file_as_the_loaded_corpus_does(tmp_path, lines, error):
    root = write_beir(tmp_path / "beir")
    write(root / "corpus.jsonl", "\n".join(lines) + "\n")
    with pytest.raises(DataError, match=error):
        load_beir(root, passages_on_disk=True)


def test_passages_on_disk_refuse_the_raw_bytes_of_a_lone_surrogate_as_the_loaded_corpus_does(tmp_path):
    """UTF-8 has no lone surrogates; ``json.loads`` of bytes decodes them anyway (``surrogatepass``)."""
    root = write_beir(tmp_path / "beir")
    (root / "corpus.jsonl").write_bytes(b'{"_id": "p1", "text": "a"}\n{"_id": "p2", "text": "b \xed\xa0\x80"}\n')
    for on_disk in (False, True):
        with pytest.raises(DataError, match=r"corpus\.jsonl:2: not valid UTF-8 \(byte 0xed"):
            load_beir(root, passages_on_disk=on_disk)


# ---------------------------------------------------------------- MS MARCO


def write_msmarco(root: Path, gz: bool = False) -> Path:
    write(root / "collection.tsv", '0\tfirst passage\n1\tsecond passage, with "quotes"\n\n2\tthird\tpassage\n', gz)
    write(root / "queries.train.tsv", "10\twhat is first\n11\twhat is second\n", gz)
    write(root / "queries.dev.tsv", "20\twhat is third\n", gz)
    write(root / "queries.eval.tsv", "30\tunjudged query\n", gz)
    write(root / "qrels.train.tsv", "10\t0\t0\t1\n11\t0\t1\t1\n", gz)  # tab separated
    write(root / "qrels.dev.tsv", "20 0 2 1\n", gz)  # whitespace separated
    return root


# ---------------------------------------------------------------- the corpus alone


@pytest.mark.parametrize("gz", [False, True])
def test_load_corpus_reads_the_passages_of_a_folder_or_a_file_without_queries_or_judgements(tmp_path, gz):
    full = load_dataset(str(write_beir(tmp_path / "beir", gz)))
    write(tmp_path / "only" / "corpus.jsonl", jsonl(BEIR_CORPUS), gz)  # no queries, no qrels
    file = write(tmp_path / "loose" / "my-passages.jsonl", jsonl(BEIR_CORPUS), gz)
    for name, label in ((tmp_path / "only", "only"), (file, "my-passages"), (tmp_path / "beir", "beir")):
        corpus, got = load_corpus(str(name))
        assert got == label and fingerprint_corpus(corpus) == fingerprint_corpus(full.corpus)
    corpus, label = load_corpus(file.name, data_dir=file.parent)  # a file's name under the data directory
    assert label == "my-passages" and corpus.ids == full.corpus.ids
    collection = write_msmarco(tmp_path / "marco", gz)
    dataset = load_dataset(str(collection), format="msmarco")
    corpus, label = load_corpus(str(collection), format="msmarco")
    assert label == "marco" and fingerprint_corpus(corpus) == fingerprint_corpus(dataset.corpus)
    tsv = next((tmp_path / "marco").glob("collection.tsv*"))
    corpus, label = load_corpus(str(tsv))  # the file's name says its layout, whatever the format
    assert label == "marco" and corpus.ids == dataset.corpus.ids


def test_load_corpus_of_a_file_neither_layout_names_is_one_line(tmp_path):
    write(tmp_path / "passages.txt", "a passage\n")
    with pytest.raises(DataError, match=r"passages.txt: a corpus file is BEIR passages \(.jsonl\) or an MS MARCO"):
        load_corpus(str(tmp_path / "passages.txt"))
    write(tmp_path / "empty" / "queries.jsonl", jsonl(BEIR_QUERIES))
    with pytest.raises(DataError, match=r"missing file: .*corpus.jsonl"):
        load_corpus(str(tmp_path / "empty"))


def test_the_index_command_indexes_a_corpus_file_and_keeps_its_folder_apart(tmp_path):
    from conftest import densepass_here

    file = write(tmp_path / "data" / "passages.jsonl", jsonl(BEIR_CORPUS))
    done = densepass_here("index", str(file), "--kind", "bm25", "--output", str(tmp_path / "idx"), cwd=tmp_path)
    assert done.returncode == 0 and "indexed 3 passages of passages" in done.stdout
    for output in (file, file.parent):  # the file itself, or the folder holding it, even with --force
        refused = densepass_here("index", str(file), "--kind", "bm25", "--output", str(output), "--force", cwd=tmp_path)
        assert refused.returncode == 2 and "which this command reads" in refused.stderr
    assert file.read_text(encoding="utf-8") == jsonl(BEIR_CORPUS) and sorted(p.name for p in file.parent.iterdir()) == [
        "passages.jsonl"
    ]


@pytest.mark.parametrize("gz", [False, True])
def test_msmarco_reader(tmp_path, gz):
    ds = load_msmarco(write_msmarco(tmp_path / "marco", gz), "marco")
    assert ds.corpus.ids == ["0", "1", "2"]
    assert ds.corpus.texts == ["first passage", 'second passage, with "quotes"', "third\tpassage"]
    assert ds.corpus.titles == ["", "", ""]
    assert ds.corpus.doc_ids == ["0", "1", "2"]
    assert ds.queries == {"10": "what is first", "11": "what is second", "20": "what is third", "30": "unjudged query"}
    assert ds.qrels == {"train": {"10": {"0": 1}, "11": {"1": 1}}, "dev": {"20": {"2": 1}}}
    assert ds.answers == {}


def test_msmarco_through_load_dataset(tmp_path):
    write_msmarco(tmp_path / "marco")
    assert len(load_dataset("marco", data_dir=tmp_path, format="msmarco").split("dev")) == 1


def test_msmarco_malformed_line_names_file_and_line(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    write(root / "collection.tsv", "0\tfine\nno tab on this line\n")
    with pytest.raises(DataError, match=r"collection\.tsv:2: expected 'id<TAB>text'"):
        load_msmarco(root)


def test_msmarco_missing_and_empty_collection(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    (root / "collection.tsv").unlink()
    with pytest.raises(DataError, match=r"missing file: .*collection\.tsv"):
        load_msmarco(root)
    write(root / "collection.tsv", "\n")
    with pytest.raises(DataError, match="corpus is empty"):
        load_msmarco(root)


def test_msmarco_duplicate_passage_and_missing_qrels(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    write(root / "collection.tsv", "0\ta\n0\tb\n")
    with pytest.raises(DataError, match=r"collection\.tsv:2: duplicate passage id '0'"):
        load_msmarco(root)
    root = write_msmarco(tmp_path / "marco2")
    for split in ("train", "dev"):
        (root / f"qrels.{split}.tsv").unlink()
    with pytest.raises(DataError, match=r"no qrels\.<split>\.tsv file"):
        load_msmarco(root)


# ---------------------------------------------------------------- DPR


def ctx(title: str, text: str, **ids: str) -> dict:
    return {"title": title, "text": text, "score": 1.0, **ids}


DPR_TRAIN = [
    {
        "question": "who wrote alpha",
        "answers": ["Ann", "Ann", "A. N."],
        "positive_ctxs": [ctx("Alpha", "Alpha was written by Ann.", passage_id="100")],
        "negative_ctxs": [ctx("Beta", "Beta is a letter.", passage_id="200")],
        "hard_negative_ctxs": [ctx("Alpha", "Alpha has two parts.", psg_id="101"), ctx("Gamma", "no id here")],
    },
    {
        "question": "what is beta",
        "answers": ["a letter"],
        "positive_ctxs": [ctx("Beta", "Beta is a letter.", passage_id="200")],  # seen before: de-duplicated
        "negative_ctxs": [],
        "hard_negative_ctxs": [ctx("Gamma", "no id here"), ctx("Gamma", "no id here")],  # same hashed id twice
    },
]
DPR_DEV = [
    {"question": "no positives here", "answers": [], "positive_ctxs": [], "hard_negative_ctxs": []},
    {
        "question": "alpha parts",
        "answers": ["two"],
        "positive_ctxs": [ctx("Alpha", "Alpha has two parts.", psg_id="101")],
    },
]


def write_dpr(root: Path, gz: bool = False) -> Path:
    write(root / "biencoder-nq-train.json", json.dumps(DPR_TRAIN), gz)
    write(root / "dev.json", json.dumps(DPR_DEV), gz)
    return root


@pytest.mark.parametrize("gz", [False, True])
def test_dpr_reader(tmp_path, gz):
    ds = load_dpr(write_dpr(tmp_path / "nq", gz), "nq")
    gamma = [pid for pid, title in zip(ds.corpus.ids, ds.corpus.titles) if title == "Gamma"]
    assert len(gamma) == 1 and gamma[0] not in {"100", "101", "200"}
    assert ds.corpus.ids == ["100", "200", "101", gamma[0]]
    assert ds.corpus.doc_ids == ["Alpha", "Beta", "Alpha", "Gamma"]
    assert ds.queries == {
        "train-0": "who wrote alpha",
        "train-1": "what is beta",
        "dev-0": "no positives here",
        "dev-1": "alpha parts",
    }
    assert ds.qrels == {"train": {"train-0": {"100": 1}, "train-1": {"200": 1}}, "dev": {"dev-1": {"101": 1}}}
    assert ds.answers == {"train-0": ["Ann", "A. N."], "train-1": ["a letter"], "dev-1": ["two"]}
    assert dpr_hard_negatives(tmp_path / "nq") == {"train-0": ["101", gamma[0]], "train-1": [gamma[0]]}


def test_dpr_hashed_ids_are_stable(tmp_path):
    first = load_dpr(write_dpr(tmp_path / "a")).corpus.ids
    second = load_dpr(write_dpr(tmp_path / "b", gz=True)).corpus.ids
    assert first == second


def test_dpr_malformed_records(tmp_path):
    root = tmp_path / "dpr"
    write(root / "train.json", json.dumps([{"answers": []}]))
    with pytest.raises(DataError, match=r"train\.json: record 0: missing field 'question'"):
        load_dpr(root)
    write(root / "train.json", json.dumps([{"question": "q", "positive_ctxs": [{"title": "t"}]}]))
    with pytest.raises(DataError, match=r"record 0\.positive_ctxs\[0\]: missing field 'text'"):
        load_dpr(root)
    write(root / "train.json", json.dumps({"question": "not a list"}))
    with pytest.raises(DataError, match="expected a JSON list"):
        load_dpr(root)
    write(root / "train.json", '[{"question": "q",\n "answers": [}]')
    with pytest.raises(DataError, match=r"train\.json:2:\d+: not valid JSON"):
        load_dpr(root)


def test_dpr_two_files_for_one_split(tmp_path):
    root = write_dpr(tmp_path / "dpr")
    write(root / "train.json", json.dumps(DPR_TRAIN))
    with pytest.raises(DataError, match="two files for split 'train'"):
        load_dpr(root)


# ---------------------------------------------------------------- SQuAD


def squad_file(articles: list[tuple[str, list[tuple[str, list[tuple[str, str, list[str]]]]]]]) -> str:
    """SQuAD JSON from ``[(title, [(context, [(qid, question, [answer texts])])])]``."""
    data = [
        {
            "title": title,
            "paragraphs": [
                {
                    "context": context,
                    "qas": [
                        {"id": qid, "question": question, "answers": [{"text": a, "answer_start": 0} for a in answers]}
                        for qid, question, answers in qas
                    ],
                }
                for context, qas in paragraphs
            ],
        }
        for title, paragraphs in articles
    ]
    return json.dumps({"version": "1.1", "data": data})


def write_squad(root: Path, gz: bool = False) -> Path:
    train = [
        (
            "Super_Bowl_50",
            [
                ("Denver won Super Bowl 50.", [("t1", "Who won? ", ["Denver", "Denver", "Denver Broncos"])]),
                (
                    "It was held in Santa Clara.",
                    [("t2", "Where?", ["Santa Clara"]), ("t3", "Which city?", ["Santa Clara"])],
                ),
            ],
        ),
        ("Nikola_Tesla", [("Tesla was an inventor.", [("t4", "What was Tesla?", ["inventor"])])]),
    ]
    dev = [("Normans", [("The Normans were in France.", [("d1", "Where were the Normans?", ["France"])])])]
    write(root / "train-v1.1.json", squad_file(train), gz)
    write(root / "dev-v1.1.json", squad_file(dev), gz)
    return root


@pytest.mark.parametrize("gz", [False, True])
def test_squad_reader(tmp_path, gz):
    ds = load_squad(write_squad(tmp_path / "squad", gz))
    assert ds.corpus.ids == ["dev-0-0", "train-0-0", "train-0-1", "train-1-0"]
    assert ds.corpus.titles == ["Normans", "Super Bowl 50", "Super Bowl 50", "Nikola Tesla"]
    assert ds.corpus.doc_ids == ["Normans", "Super_Bowl_50", "Super_Bowl_50", "Nikola_Tesla"]
    assert ds.corpus.texts[2] == "It was held in Santa Clara."
    assert ds.queries["t1"] == "Who won?"
    assert ds.qrels == {
        "train": {"t1": {"train-0-0": 1}, "t2": {"train-0-1": 1}, "t3": {"train-0-1": 1}, "t4": {"train-1-0": 1}},
        "dev": {"d1": {"dev-0-0": 1}},
    }
    assert ds.answers["t1"] == ["Denver", "Denver Broncos"]
    assert ds.answers["d1"] == ["France"]


def test_squad_through_load_dataset(tmp_path):
    write_squad(tmp_path / "squad")
    assert load_dataset("squad", data_dir=tmp_path, format="squad").positives("dev") == {"d1": ["dev-0-0"]}


def test_squad_malformed_structure(tmp_path):
    root = tmp_path / "squad"
    write(root / "dev-v1.1.json", json.dumps({"version": "1.1"}))
    with pytest.raises(DataError, match=r"dev-v1\.1\.json: missing field 'data'"):
        load_squad(root)
    write(root / "dev-v1.1.json", json.dumps({"data": [{"title": "T", "paragraphs": [{"qas": []}]}]}))
    with pytest.raises(DataError, match=r"data\[0\]\.paragraphs\[0\]: missing field 'context'"):
        load_squad(root)
    write(root / "dev-v1.1.json", json.dumps({"data": [{"title": "T", "paragraphs": "oops"}]}))
    with pytest.raises(DataError, match=r"data\[0\]: field 'paragraphs' should be a list, got str"):
        load_squad(root)
    write(root / "dev-v1.1.json", squad_file([("T", [("c", [("x", "q", []), ("x", "q again", [])])])]))
    with pytest.raises(DataError, match="duplicate question id 'x'"):
        load_squad(root)


# ---------------------------------------------------------------- bad input (shared checks)


def test_missing_corpus_file(tmp_path):
    root = write_beir(tmp_path / "beir")
    (root / "corpus.jsonl").unlink()
    with pytest.raises(DataError, match=r"missing file: .*corpus\.jsonl"):
        load_beir(root)


def test_invalid_json_line_names_file_and_line(tmp_path):
    root = write_beir(tmp_path / "beir")
    lines = (root / "queries.jsonl").read_text().splitlines()
    lines[1] = '{"_id": "q2", "text": '
    (root / "queries.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=r"queries\.jsonl:2: not valid JSON"):
        load_beir(root)


@pytest.mark.parametrize("gz", [False, True])
def test_empty_corpus(tmp_path, gz):
    root = write_beir(tmp_path / "beir", gz)
    write(root / "corpus.jsonl", "\n", gz)
    with pytest.raises(DataError, match="corpus is empty"):
        load_beir(root)


def test_empty_dpr_and_squad_corpus(tmp_path):
    write(tmp_path / "dpr" / "train.json", json.dumps([{"question": "q"}]))
    with pytest.raises(DataError, match="corpus is empty"):
        load_dpr(tmp_path / "dpr")
    write(tmp_path / "squad" / "dev-v1.1.json", json.dumps({"data": []}))
    with pytest.raises(DataError, match="corpus is empty"):
        load_squad(tmp_path / "squad")


def test_qrels_with_unknown_query(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "q1\tp1\t1\nq9\tp1\t1\n"})
    with pytest.raises(DataError, match=r"qrels/dev names query 'q9', which is not in the queries"):
        load_beir(root)


def test_two_qrels_files_of_one_split_are_one_line(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"test": "q1\tp1\t1\n", "test.v2": "q2\tp3\t1\n"})
    with pytest.raises(DataError, match=r"qrels: two files for split 'test': test.tsv and test.v2.tsv") as caught:
        load_beir(root)
    assert "\n" not in str(caught.value)


def test_qrels_with_unknown_passage(tmp_path):
    root = write_beir(tmp_path / "beir", qrels={"dev": "q1\tp1\t1\nq2\tp9\t1\n"})
    with pytest.raises(DataError, match=r"qrels/dev names passage 'p9' \(query 'q2'\), which is not in the corpus"):
        load_beir(root)


def test_msmarco_dangling_qrels(tmp_path):
    root = write_msmarco(tmp_path / "marco")
    write(root / "qrels.dev.tsv", "20 0 99 1\n")
    with pytest.raises(DataError, match="names passage '99'"):
        load_msmarco(root)


def test_empty_split(tmp_path):
    ds = load_beir(write_beir(tmp_path / "beir", qrels={"train": "q1\tp1\t1\n", "dev": "q1\tp1\t0\n"}))
    with pytest.raises(DataError, match="split 'dev' has no relevant query-passage pair"):
        ds.split("dev")
    header_only = load_beir(write_beir(tmp_path / "beir2", qrels={"dev": "query-id\tcorpus-id\tscore\n"}))
    with pytest.raises(DataError, match="split 'dev' has no relevant"):
        header_only.split("dev")


def test_unknown_split(tmp_path):
    ds = load_beir(write_beir(tmp_path / "beir"))
    with pytest.raises(DataError, match=r"no split 'test' \(available: dev, train\)"):
        ds.split("test")


def test_unknown_format(tmp_path):
    write_beir(tmp_path / "beir")
    with pytest.raises(DataError, match="unknown dataset format 'csv'"):
        load_dataset("beir", data_dir=tmp_path, format="csv")


def test_dataset_dir_not_found(tmp_path):
    with pytest.raises(DataError, match="dataset 'nowhere' not found"):
        load_dataset("nowhere", data_dir=tmp_path)
    for loader in (load_beir, load_msmarco, load_dpr, load_squad, dpr_hard_negatives):
        with pytest.raises(DataError, match="dataset directory not found"):
            loader(tmp_path / "nowhere")


def test_no_split_files(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no DPR <split>\.json file"):
        load_dpr(tmp_path / "empty")
    with pytest.raises(DataError, match=r"no SQuAD <split>-v1\.1\.json file"):
        load_squad(tmp_path / "empty")


# ---------------------------------------------------------------- download (offline parts only)


def test_download_rejects_bad_names(tmp_path):
    from densepass.data.download import download_dataset

    for name in ("", "../etc", "a/b", ".hidden"):
        with pytest.raises(DataError, match="invalid dataset name"):
            download_dataset(name, tmp_path)


def test_download_skips_existing_dataset(tmp_path, monkeypatch):
    from densepass.data import download

    write_beir(tmp_path / "scifact")
    (tmp_path / "squad").mkdir()
    for filename in download.SQUAD_URLS:
        (tmp_path / "squad" / filename).write_text('{"data": []}')
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda *a, **k: pytest.fail("no network expected"))
    assert download.download_dataset("scifact", tmp_path) == tmp_path / "scifact"
    assert download.download_dataset("squad", tmp_path) == tmp_path / "squad"


def test_download_into_a_folder_holding_a_users_files_is_refused_before_any_download(tmp_path, monkeypatch, capsys):
    """`densepass download NAME` where NAME/ holds only a user's file: one line, nothing fetched or written (it
    exited 0 as if it had downloaded); an empty folder is downloaded into."""
    from densepass.cli import main
    from densepass.data import download

    (tmp_path / "scifact").mkdir()
    (tmp_path / "scifact" / "notes.txt").write_text("my notes")
    (tmp_path / "squad").mkdir()
    (tmp_path / "squad" / "train-v1.1.json").write_text("{}")  # one of its files, not the dataset
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda *a, **k: pytest.fail("no network expected"))
    for name, found in (("scifact", "notes.txt"), ("squad", "train-v1.1.json")):
        assert main(["download", name, "--data-dir", str(tmp_path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"holds files that are not a downloaded '{name}' dataset ({found})" in err[0], err
    assert (tmp_path / "scifact" / "notes.txt").read_text() == "my notes"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["notes.txt", "scifact", "squad", "train-v1.1.json"]

    source = write_beir(tmp_path / "src" / "tinyset")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path in source.rglob("*"):
            zf.write(path, path.relative_to(source.parent).as_posix())
    monkeypatch.setattr(download.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(buffer.getvalue()))
    (tmp_path / "data" / "tinyset").mkdir(parents=True)
    assert download.download_dataset("tinyset", tmp_path / "data") == tmp_path / "data" / "tinyset"
    assert len(load_dataset("tinyset", data_dir=tmp_path / "data").corpus) == 3


def test_download_network_failure_is_a_data_error(tmp_path, monkeypatch):
    from densepass.data import download

    def unreachable(*args, **kwargs):
        raise URLError("no route to host")

    monkeypatch.setattr(download.urllib.request, "urlopen", unreachable)
    with pytest.raises(DataError, match="download failed: cannot reach .*scifact.zip"):
        download.download_dataset("scifact", tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_download_extracts_a_served_zip(tmp_path, monkeypatch):
    """The zip path end to end, with ``urlopen`` serving an in-memory BEIR zip (no network)."""
    from densepass.data import download

    source = write_beir(tmp_path / "src" / "tinyset")
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for path in source.rglob("*"):
            zf.write(path, path.relative_to(source.parent).as_posix())
    served = []

    def serve(url, timeout):
        served.append(url)
        return io.BytesIO(buffer.getvalue())

    monkeypatch.setattr(download.urllib.request, "urlopen", serve)
    data_dir = tmp_path / "data"
    assert download.download_dataset("tinyset", data_dir) == data_dir / "tinyset"
    assert served == [download.BEIR_URL.format(name="tinyset")]
    assert [p.name for p in data_dir.iterdir()] == ["tinyset"]
    assert len(load_dataset("tinyset", data_dir=data_dir).corpus) == 3

    monkeypatch.setattr(download.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(b"<html>404</html>"))
    with pytest.raises(DataError, match="not a zip archive"):
        download.download_dataset("other", data_dir)


# ---------------------------------------------------------------- real data


def test_real_debian_packages():
    if not (SHARED_DATA / "debian-packages").is_dir():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    ds = load_dataset("debian-packages", data_dir=SHARED_DATA)
    assert len(ds.corpus) == 60_240
    dev = ds.split("dev")
    assert len(dev) == 5_987
    assert all(ds.corpus.doc_ids)
    assert len(set(ds.corpus.doc_ids)) < len(ds.corpus)  # passages are grouped into source-package documents
    assert all(pid in ds.corpus for rels in dev.values() for pid, grade in rels.items() if grade > 0)
    assert all(qid in ds.queries for qid in dev)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"split": "dev"}, "split is an option of format='pairs'"),
        ({"columns": {"anchor": "question"}}, "columns is an option of format='pairs'"),
        ({"subset": "a", "revision": "v1"}, "subset, revision are options of format='pairs'"),
    ],
)
def test_options_of_training_rows_given_for_another_layout_are_one_line(tmp_path, options, message):
    """``dp.load_dataset`` took them and read the whole layout as if they were not there."""
    root = write_beir(tmp_path / "beir")
    with pytest.raises(DataError, match=re.escape(message)):
        load_dataset(str(root), format="beir", **options)
    assert load_dataset(str(root), format="beir", columns={"anchor": None}).qrels.keys() == {"train", "dev"}


def test_a_sample_of_k_queries_has_k_queries_with_a_relevant_passage(tmp_path):
    """Queries judged only irrelevant are left out before the seeded draw, not after it (which gave fewer)."""
    from densepass.data.dataset import Corpus, RetrievalDataset

    ids = [f"p{i}" for i in range(4)]
    qrels = {f"q{i}": {"p0": 1 if i % 2 else 0} for i in range(40)}  # half of them judged only irrelevant
    dataset = RetrievalDataset("d", Corpus(ids, [""] * 4, ids, ids), {q: q for q in qrels}, {"dev": qrels})
    for seed in range(5):
        sample = dataset.sample("dev", 10, seed)
        assert len(sample) == 10 and all(v == {"p0": 1} for v in sample.values())
    assert len(dataset.sample("dev", None)) == 20


@pytest.mark.parametrize(
    "text, qrels",
    [
        ("query-id\tcorpus-id\tscore\nq1\tp1\t1\n", {"q1": {"p1": 1}}),  # BEIR's header
        ("qid\tpid\tlabel\nq1\tp1\t2\n", {"q1": {"p1": 2}}),
        ("query_id\tdoc_id\trel\nq1\tp1\t1\n", {"q1": {"p1": 1}}),
        ("q1 0 p1 1.0\n", {"q1": {"p1": 1}}),  # TREC, no header
        ("topic_id\tdoc_id\trelevant\nq1\tp1\t1\n", {"q1": {"p1": 1}}),
        ("queryid\tdocid\trelevant\nq1\tp1\t1\n", {"q1": {"p1": 1}}),
        ("q1\tp1\t0000000000000000000000001\n", {"q1": {"p1": 1}}),  # zero-padded: a small grade
    ],
)
def test_a_qrels_header_is_a_row_that_names_its_columns(tmp_path, text, qrels):
    assert load_beir(write_beir(tmp_path / "beir", qrels={"dev": text})).qrels["dev"] == qrels


@pytest.mark.parametrize("grade", ["", "yes", "1_0", "\u0661", "0x1", "1.5"])
@pytest.mark.parametrize("line", [1, 2])
def test_a_judgement_whose_grade_is_not_an_integer_is_refused_even_on_the_first_line(tmp_path, grade, line):
    """A first row with an empty or misspelt grade used to be skipped as a header, in silence: one query lost."""
    rows = [f"q1\tp1\t{grade}", "q2\tp3\t1"]
    root = write_beir(tmp_path / "beir", qrels={"dev": "\n".join(rows if line == 1 else rows[::-1]) + "\n"})
    with pytest.raises(DataError, match=rf"dev\.tsv:{line}: relevance '{grade}' is not an integer"):
        load_beir(root)


@pytest.mark.parametrize("end", ["\t", "\t\t", "\t \t"])
def test_a_qrels_line_ending_in_a_tab_says_so(tmp_path, end):
    """Its empty 4th column made it a TREC line (qid 0 pid grade) with an empty grade: "relevance '' is not an
    integer" of a line whose grade is 1."""
    root = write_beir(tmp_path / "beir", qrels={"dev": f"query-id\tcorpus-id\tscore\nq1\tp1\t1{end}\n"})
    with pytest.raises(
        DataError, match=r"dev\.tsv:2: the line ends in an empty column \(a tab at its end\?\); expected"
    ):
        load_beir(root)


@pytest.mark.parametrize("twin", ["corpus.jsonl", "queries.jsonl", "qrels/dev.tsv"])
def test_a_file_beside_its_gzipped_copy_is_refused_instead_of_one_read_in_silence(tmp_path, twin):
    root = write_beir(tmp_path / "beir")
    plain = root / twin
    with gzip.open(plain.with_name(plain.name + ".gz"), "wt", encoding="utf-8") as handle:
        handle.write(plain.read_text(encoding="utf-8"))
    with pytest.raises(DataError, match=rf"both {plain.name} and {plain.name}\.gz: keep one of them"):
        load_beir(root)


def test_load_corpus_refuses_training_rows():
    with pytest.raises(DataError, match="format='pairs' is training rows, which hold no corpus to index"):
        load_corpus("rows.jsonl", format="pairs")
