"""Training rows (anchor, positive[, negatives...]) from JSONL, CSV, Parquet and ``datasets`` (data.pairs): what
the reader builds, its one-line errors, the same weights from every source, and ``densepass run`` on them."""

from __future__ import annotations

import csv
import gzip
import json
import random
from pathlib import Path

import datasets
import pytest
import torch

import densepass as dp
from conftest import WORDS, densepass_here, write_tiny_beir
from densepass.data import load_dataset
from densepass.data.pairs import PairsDataset, load_pairs, text_id
from densepass.errors import ConfigError, DataError


def rows(n: int = 24, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words(k: int, tag: str) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)) + f" {tag}"

    return [
        {"anchor": words(3, f"a{i}"), "positive": words(10, f"p{i}"), "negative_1": words(10, f"n{i}"),
         "negative_2": words(10, f"m{i}")}
        for i in range(n)
    ]  # fmt: skip


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_rows_become_a_corpus_queries_qrels_and_negatives(tmp_path):
    records = [
        {"query": "what is tar", "pos": "tar archives files", "neg": "vlc plays video", "neg2": "gimp edits photos"},
        {"query": "play a movie", "pos": "vlc plays video", "neg": "tar archives files", "neg2": None},
        {"query": "what is tar", "pos": "tar archives files", "neg": "emacs edits text", "neg2": None},
    ]
    data = load_pairs(write_jsonl(tmp_path / "r.jsonl", records))
    assert isinstance(data, PairsDataset)
    tar, vlc = text_id("p", "tar archives files"), text_id("p", "vlc plays video")
    q_tar, q_movie = text_id("q", "what is tar"), text_id("q", "play a movie")
    # distinct texts once each, in the order first seen; ids from the text alone
    assert data.corpus.ids == [tar, vlc, text_id("p", "gimp edits photos"), text_id("p", "emacs edits text")]
    assert data.corpus.texts[0] == "tar archives files"
    assert data.queries == {q_tar: "what is tar", q_movie: "play a movie"}
    assert data.qrels == {"train": {q_tar: {tar: 1}, q_movie: {vlc: 1}}}
    # a repeated anchor adds its negatives to its pool; null negatives are none
    assert data.negatives == {q_tar: [vlc, text_id("p", "gimp edits photos"), text_id("p", "emacs edits text")],
                              q_movie: [tar]}  # fmt: skip
    assert data.teacher_scores is None


def test_a_negative_another_row_gives_as_the_anchors_positive_leaves_its_pool():
    """Rows of one anchor: a negative that another row gives as a positive (exactly, or up to whitespace) is not in
    the anchor's hard-negative pool; a false negative would push the positive away."""
    data = load_pairs(
        datasets.Dataset.from_list(
            [
                {"anchor": "what is tar", "positive": "tar archives  files", "negative": "vlc plays video"},
                {"anchor": "what is tar", "positive": "gnu tar", "negative": " tar archives files\n"},
                {"anchor": "what is tar", "positive": "gnu tar", "negative": "tar archives  files"},
            ]
        )
    )
    assert data.negatives == {text_id("q", "what is tar"): [text_id("p", "vlc plays video")]}


def test_every_source_reads_the_same_dataset(tmp_path):
    records = rows(6)
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "r.parquet"))
    table.to_csv(str(tmp_path / "r.csv"), index=False)
    table.save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": table}).save_to_disk(str(tmp_path / "saved-dict"))
    with gzip.open(tmp_path / "r.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(r) + "\n" for r in records)
    sources = [write_jsonl(tmp_path / "r.jsonl", records), tmp_path / "r.jsonl.gz", tmp_path / "r.parquet"]
    sources += [tmp_path / "r.csv", tmp_path / "saved", tmp_path / "saved-dict", table]
    loaded = [load_pairs(source) for source in sources]
    first = loaded[0]
    for data in loaded[1:]:
        assert (data.corpus.ids, data.corpus.texts) == (first.corpus.ids, first.corpus.texts)
        assert (data.queries, data.qrels, data.negatives) == (first.queries, first.qrels, first.negatives)
        assert data.file_fingerprints() == {f"{data.name}/rows": first.digest}
    assert len(first.corpus) == 18 and len(first.queries) == 6


def test_a_column_mapping_lists_and_teacher_scores(tmp_path):
    records = [
        {"q": "what is tar", "good": ["tar archives files", "tar bundles files"], "bad": ["vlc plays video"],
         "teacher": [9.0, 8.5, -1.0]},
        {"q": "play a movie", "good": ["vlc plays video"], "bad": None, "teacher": [7.0]},
    ]  # fmt: skip
    columns = {"anchor": "q", "positive": "good", "negatives": ["bad"], "scores": "teacher"}
    data = load_pairs(write_jsonl(tmp_path / "r.jsonl", records), columns)
    q = text_id("q", "what is tar")
    assert list(data.qrels["train"][q]) == [text_id("p", "tar archives files"), text_id("p", "tar bundles files")]
    assert data.teacher_scores[q] == {
        text_id("p", "tar archives files"): 9.0,
        text_id("p", "tar bundles files"): 8.5,
        text_id("p", "vlc plays video"): -1.0,
    }
    assert load_dataset(str(tmp_path / "r.jsonl"), format="pairs", columns=columns).digest == data.digest


@pytest.mark.parametrize(
    "records, columns, message",
    [
        ([{"anchor": "a", "negative": "n"}], None, r"r.jsonl:1: no positive column \(looked for positive or pos"),
        ([{"anchor": "a", "positive": "p"}, {"anchor": "b", "positive": None}], None, r"r.jsonl:2: no positive"),
        ([{"anchor": "a", "positive": "p"}, {"anchor": "b"}], None, r"r.jsonl:2: no positive \(column 'positive'\)"),
        ([{"anchor": "a", "positive": "p"}, {"anchor": " ", "positive": "p"}], None, r"r.jsonl:2: the anchor .* empty"),
        ([{"anchor": "a", "positive": "p", "negative": ""}], None, r"r.jsonl:1: the negative .* is empty"),
        ([{"anchor": "a", "positive": "p", "neg_1": "p"}], None, r"r.jsonl:1: a negative is the row's positive"),
        (
            [{"anchor": "a", "positive": ["x", "apt  get\n"], "neg_1": " apt get"}],
            None,
            r"r.jsonl:1: a negative is the row's positive \(' apt get'\)",
        ),
        ([{"anchor": "a", "positive": 7}], None, r"r.jsonl:1: the positive .* should be a string, got int"),
        ([{"anchor": "a", "positive": "p"}], {"anchor": "question"}, r"r.jsonl:1: data.columns.anchor names column "),
        ([{"anchor": "a", "positive": "p"}], {"negatives": ["hard"]}, r"names column 'hard', which it does not have"),
        ([{"anchor": "a", "positive": "p"}], {"labels": "x"}, r"data.columns: unknown key 'labels'"),
        ([{"anchor": "a", "positive": "p", "negative": "n", "scores": [1.0]}], None, r"r.jsonl:1: .*1 scores for 2"),
        ([{"anchor": "a", "positive": "p", "scores": [float("nan")]}], None, r"r.jsonl:1: .*not a finite number"),
        ([{"anchor": "a", "positive": "p", "scores": [10**400]}], None, r"r.jsonl:1: .*not a finite number"),
        (
            [{"anchor": "a", "positive": "p", "scores": [1.0]}, {"anchor": "a", "positive": "p", "scores": [2.0]}],
            None,
            r"r.jsonl:2: the score 2 of a passage differs from the 1",
        ),
        ([], None, r"r.jsonl: no rows"),
        (  # scores from the second row on: refused as in the other order, not silently dropped
            [{"anchor": "a", "positive": "p"}, {"anchor": "b", "positive": "q", "scores": [1.0]}],
            None,
            r"1 of its 2 rows have teacher scores: give all or none",
        ),
        (
            [{"anchor": "b", "positive": "q", "scores": [1.0]}, {"anchor": "a", "positive": "p"}],
            None,
            r"1 of its 2 rows have teacher scores: give all or none",
        ),
    ],
)
def test_a_bad_row_is_one_line_naming_its_line(tmp_path, records, columns, message):
    path = write_jsonl(tmp_path / "r.jsonl", records)
    with pytest.raises(DataError, match=message) as caught:
        load_pairs(path, columns)
    assert "\n" not in str(caught.value)


def test_parquet_csv_and_datasets_errors_name_the_row(tmp_path):
    table = datasets.Dataset.from_list([{"anchor": "a", "positive": "p"}, {"anchor": "b", "positive": "  "}])
    table.to_parquet(str(tmp_path / "r.parquet"))
    with pytest.raises(DataError, match=r"r.parquet: row 2: the positive \(column 'positive'\) is empty"):
        load_pairs(tmp_path / "r.parquet")
    with pytest.raises(DataError, match=r"dataset: row 2: the positive"):
        load_pairs(table, name="dataset")
    (tmp_path / "r.csv").write_text("anchor,positive,negative_1\na,p,n\nb,,n\n")
    with pytest.raises(DataError, match=r"r.csv: row 2: no positive"):
        load_pairs(tmp_path / "r.csv")
    with pytest.raises(DataError, match=r"data.columns.anchor names column 'query', which it does not have"):
        load_pairs(tmp_path / "r.csv", {"anchor": "query"})
    (tmp_path / "bad.parquet").write_text("not parquet\n")
    with pytest.raises(DataError, match=r"bad.parquet: not a readable PARQUET file"):
        load_pairs(tmp_path / "bad.parquet")
    with pytest.raises(DataError, match=r"training rows not found"):
        load_pairs(tmp_path / "missing.jsonl")


def test_a_csv_file_of_quoted_multi_line_cells_reads_past_its_first_block(tmp_path):
    """csv.writer quotes a text holding a line break; pyarrow reads a CSV file in blocks of 1 MB, cut at a line break
    unless told a cell may hold one: "CSV parser got out of sync with chunker" after the first block."""
    path = tmp_path / "rows.csv"
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["anchor", "positive", "negative"])
        for i in range(3000):
            writer.writerow([f"query {i}", f"positive {i}\n" + "another line, quoted\n" * 20, f"negative {i}\nend"])
    assert path.stat().st_size > 2**20  # more than one block
    data = load_pairs(path)
    assert len(data.queries) == 3000 and len(data.corpus) == 6000
    assert data.corpus.texts[-2:] == ["positive 2999\n" + "another line, quoted\n" * 20, "negative 2999\nend"]


def test_a_score_beyond_a_floats_range_is_one_line_in_csv_as_in_jsonl(tmp_path):
    """An integer of 401 digits is valid JSON, and float() of it an OverflowError: a traceback."""
    (tmp_path / "r.csv").write_text('anchor,positive,scores\nq,p,[1.0]\nr,s,"[1' + "0" * 400 + ']"\n')
    with pytest.raises(DataError, match=r"r\.csv: row 2: column 'scores' holds a score that is not a finite number$"):
        load_pairs(tmp_path / "r.csv")
    (tmp_path / "deep.csv").write_text('anchor,positive,scores\nq,p,"' + "[" * 100_000 + '"\n')  # RecursionError
    with pytest.raises(DataError, match=r"deep\.csv: row 1: column 'scores' should hold a list of numbers"):
        load_pairs(tmp_path / "deep.csv")


@pytest.mark.parametrize(
    "text", ['[{"anchor": "a", "positive": "p"}]\n', '\n [\n  {"anchor": "a", "positive": "p"}\n]\n']
)
def test_a_json_file_holding_an_array_says_rows_are_json_lines(tmp_path, text):
    """It said "r.json:1: not valid JSON" of valid JSON (or "expected a JSON object")."""
    (tmp_path / "r.json").write_text(text)
    with pytest.raises(
        DataError, match=r"r\.json: a JSON array; training rows are read as JSON lines: one JSON object"
    ):
        load_pairs(tmp_path / "r.json")
    (tmp_path / "ok.json").write_text('{"anchor": "a", "positive": "p"}\n')  # JSON lines named .json: read
    assert load_pairs(tmp_path / "ok.json").corpus.texts == ["p"]


def train_once(source, out: Path, model_dir: Path, **kw) -> dict[str, torch.Tensor]:
    model = dp.BiEncoder.from_pretrained(str(model_dir), dp.BiEncoderConfig(passage_max_length=32))
    args = dp.TrainConfig(batch_size=8, max_steps=3, cpu_bf16=False, learning_rate=1e-3)
    output = dp.train(model, source, output_dir=out, args=args, device="cpu", **kw)
    assert output.steps == 3
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_jsonl_parquet_and_a_saved_dataset_train_bit_identical_weights(tmp_path, tiny_model_dir):
    records = rows(24)
    table = datasets.Dataset.from_list(records)
    table.to_parquet(str(tmp_path / "r.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    start = dp.BiEncoder.from_pretrained(str(tiny_model_dir)).state_dict()
    reference = train_once(write_jsonl(tmp_path / "r.jsonl", records), tmp_path / "a", tiny_model_dir)
    assert any(not torch.equal(reference[k], start[k]) for k in start)  # it trained
    for n, source in enumerate([tmp_path / "r.parquet", tmp_path / "saved", table]):
        weights = train_once(source, tmp_path / f"out{n}", tiny_model_dir)
        assert all(torch.equal(weights[k], reference[k]) for k in reference), source
    # the given negatives are drawn: in-batch negatives alone train other weights
    in_batch = train_once(
        tmp_path / "r.jsonl", tmp_path / "none", tiny_model_dir, negatives=dp.NegativesConfig(source="none")
    )
    assert any(not torch.equal(in_batch[k], reference[k]) for k in reference)


def test_given_negatives_need_rows_that_give_some(tmp_path, tiny_model_dir, tiny_beir):
    path = write_jsonl(tmp_path / "r.jsonl", [{"anchor": r["anchor"], "positive": r["positive"]} for r in rows(8)])
    given = dp.NegativesConfig(source="given")
    with pytest.raises(ConfigError, match="give no negatives: set negatives.source: none"):
        train_once(path, tmp_path / "out", tiny_model_dir, negatives=given)
    assert not (tmp_path / "out").exists()  # refused before anything was written
    with pytest.raises(ConfigError, match="given takes the negatives of training rows"):
        train_once(str(tiny_beir), tmp_path / "beir", tiny_model_dir, negatives=given)


def test_densepass_run_trains_on_a_triplets_file_and_evaluates_on_a_beir_set(tmp_path, tiny_model_dir):
    records = rows(24)
    write_jsonl(tmp_path / "triplets.jsonl", [{"query": r["anchor"], "pos": r["positive"],
                                              "hard": r["negative_1"]} for r in records])  # fmt: skip
    beir = write_tiny_beir(tmp_path / "beir")
    command = [
        "run",
        "--set", "data.format=pairs",
        "--set", f"data.name={tmp_path / 'triplets.jsonl'}",
        "--set", "data.columns.negatives=[hard]",
        "--set", f"data.eval_name={beir}",
        "--set", "negatives.source=given",
        "--set", f"model.name_or_path={tiny_model_dir}",
        "--set", f"output_dir={tmp_path / 'out'}",
        "--set", "name=triplets",
        "--set", "model.passage_max_length=32",
        "--set", "eval.metrics=[mrr@10]",
        "--set", "eval.depth=10",
        "--set", "eval.baselines=[]",
        "--set", "train.batch_size=8",
    ]  # fmt: skip
    result = densepass_here(*command, cwd=tmp_path)  # the runs in this process, the refusals as a program
    assert result.returncode == 0, result.stderr[-3000:]
    report = (tmp_path / "out" / "triplets" / "report.md").read_text()
    assert f"evaluated on `{beir}`: 10 queries, full corpus (40 passages)" in report
    assert "Hard negatives given by the training rows: 24 for 24 queries (0 with none)" in report
    metrics = json.loads((tmp_path / "out" / "triplets" / "metrics.json").read_text())
    assert set(metrics["results"]) == {"fine-tuned"}
    # the same command again: the finished run is recognised as the same run (its identity is stable)
    again = densepass_here(*command, cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    # without an evaluation set: one line, exit 2, before any work
    refused = densepass_here(*command, "--set", "data.eval_name=null", "--set", "name=other", cwd=tmp_path)
    assert refused.returncode == 2 and "data.eval_name" in refused.stderr, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "other").exists()
    bad = write_jsonl(tmp_path / "bad.jsonl", [records[0], {"anchor": "a", "positive": "p", "negative_1": "p"}])
    overrides = ["--set", f"data.name={bad}", "--set", "data.columns.negatives=null", "--set", "name=bad"]
    refused = densepass_here(*command, *overrides, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert f"{bad}:2: a negative is the row's positive" in refused.stderr


def test_mine_given_writes_the_rows_negatives_as_a_hard_negatives_file_through_the_filters(tmp_path):
    from densepass.negatives.pool import load_pool

    records = [
        {"anchor": "what is tar", "positive": "tar archives files", "negative": ["vlc plays video", "gimp edits"]},
        {"anchor": "play a movie", "positive": "vlc plays video", "negative": ["tar archives files"]},
        {"anchor": "what is tar", "positive": "gimp edits", "negative": None},  # gimp: a positive of 'what is tar'
        {"anchor": "edit a photo", "positive": "gimp edits", "negative": None},
    ]
    rows_file = write_jsonl(tmp_path / "r.jsonl", records)
    out = tmp_path / "given.jsonl"
    args = ["mine", str(rows_file), "--format", "pairs", "--strategy", "given", "--output", str(out)]
    result = densepass_here(*args, "--filters", "qrels", "duplicates", cwd=tmp_path)  # the refusals as a program
    assert result.returncode == 0, result.stderr[-3000:]
    data = load_pairs(rows_file)
    pool = load_pool(out, data)
    q_tar, q_movie, q_photo = (text_id("q", t) for t in ("what is tar", "play a movie", "edit a photo"))
    vlc, tar = text_id("p", "vlc plays video"), text_id("p", "tar archives files")
    # the qrels filter removed 'gimp edits' (a positive the third row gives 'what is tar'); order as given
    assert {q: [c.passage_id for c in cands] for q, cands in pool.items()} == {
        q_tar: [vlc],
        q_movie: [tar],
        q_photo: [],
    }
    assert {c.source for cands in pool.values() for c in cands} == {"given"}
    # rows without negatives: one line, exit 2, nothing written
    bare = write_jsonl(tmp_path / "bare.jsonl", [{"anchor": "a b", "positive": "c d"}])
    refused = densepass_here("mine", str(bare), "--format", "pairs", "--strategy", "given", "--output",
                            str(tmp_path / "none.jsonl"), cwd=tmp_path)  # fmt: skip
    assert refused.returncode == 2 and "give no negatives" in refused.stderr, refused.stderr[-2000:]
    assert len(refused.stderr.strip().splitlines()) == 1 and not (tmp_path / "none.jsonl").exists()
    # not training rows: one line
    beir = write_tiny_beir(tmp_path / "beir")
    refused = densepass_here(
        "mine", str(beir), "--strategy", "given", "--output", str(tmp_path / "b.jsonl"), cwd=tmp_path
    )
    assert refused.returncode == 2 and "data.format: pairs" in refused.stderr, refused.stderr[-2000:]


def test_a_column_or_key_given_twice_is_refused_instead_of_dropping_one(tmp_path):
    """A row is a dict: of two columns (or JSON keys) named alike it kept the last, so a negative was lost."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "rows.csv").write_text("anchor,positive,negative,negative\nfast audio editor,audacity,sox,mpg123\n")
    (tmp_path / "rows.jsonl").write_text('{"anchor": "a", "positive": "b", "negative": "c", "negative": "d"}\n')
    columns = [pa.array([text]) for text in ("a", "b", "c", "d")]
    pq.write_table(pa.table(columns, names=["anchor", "positive", "negative", "negative"]), tmp_path / "rows.parquet")
    for name, error in (
        ("rows.csv", r"rows\.csv: column 'negative' appears twice"),
        ("rows.parquet", r"rows\.parquet: column 'negative' appears twice"),
        ("rows.jsonl", r"rows\.jsonl:1: key 'negative' appears twice in one object"),
    ):
        with pytest.raises(dp.DataError, match=error):
            load_dataset(str(tmp_path / name), format="pairs")
    (tmp_path / "ok.csv").write_text("anchor,positive,negative_1,negative_2\nfast audio editor,audacity,sox,mpg123\n")
    assert sorted(load_dataset(str(tmp_path / "ok.csv"), format="pairs").corpus.texts) == ["audacity", "mpg123", "sox"]


def test_an_in_memory_dataset_dict_gives_its_split_as_a_saved_one_does():
    """It used to be read as one dataset, whose columns were its split names: "no anchor column (its columns:
    'train')"."""
    both = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"anchor": ["fast audio editor"], "positive": ["audacity"]}),
            "dev": datasets.Dataset.from_dict({"anchor": ["tar archiver"], "positive": ["gnu tar"]}),
        }
    )
    assert load_pairs(both).corpus.texts == ["audacity"]
    assert load_pairs(both, split="dev").corpus.texts == ["gnu tar"]
    with pytest.raises(dp.DataError, match=r"the DatasetDict has no split 'test' \(available: dev, train\)"):
        load_pairs(both, split="test")
