"""Teacher scores: computed once into a file with the teacher's identity, resumed after an interruption,
and a file of another teacher, other queries or another pool refused with a one-line error."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from densepass.errors import DataError
from densepass.models.cross_encoder import CrossEncoder
from densepass.training.teacher_scores import compute_teacher_scores, load_teacher_scores, teacher_identity

CPU = torch.device("cpu")


def flat(scores):
    return {(q, p): v for q, values in scores.items() for p, v in values.items()}


@pytest.fixture
def setup(distillation_setup):
    return distillation_setup


def test_scores_are_the_teachers_logits_of_every_positive_and_candidate(setup, tmp_path):
    from densepass.data.keys import passage_input

    dataset, pairs, teacher = setup
    scores = compute_teacher_scores(teacher, dataset, pairs, tmp_path / "s.jsonl", show_progress=False)
    assert list(scores) == list(pairs) and all(list(scores[q]) == pairs[q] for q in pairs)
    q = next(iter(pairs))
    direct = teacher.score_pairs(
        [dataset.queries[q]] * len(pairs[q]), [passage_input(dataset.corpus, p, " ") for p in pairs[q]]
    )
    np.testing.assert_allclose([scores[q][p] for p in pairs[q]], direct, rtol=1e-5)
    header = json.loads((tmp_path / "s.jsonl").read_text().splitlines()[0])
    assert header["teacher"] == teacher_identity(teacher) and header["queries"] == len(pairs)
    assert not (tmp_path / "s.jsonl.partial").exists()
    assert load_teacher_scores(tmp_path / "s.jsonl", pairs, teacher_identity(teacher)) == scores


def test_an_interrupted_computation_resumes_after_its_last_complete_line(setup, tmp_path, monkeypatch):
    dataset, pairs, teacher = setup
    full = compute_teacher_scores(teacher, dataset, pairs, tmp_path / "full.jsonl", chunk=2, show_progress=False)
    calls = []
    real = teacher.score_pairs

    def crash_on_third(queries, passages, precision=None):
        calls.append(len(queries))
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(queries, passages, precision)

    monkeypatch.setattr(teacher, "score_pairs", crash_on_third)
    path = tmp_path / "s.jsonl"
    with pytest.raises(KeyboardInterrupt):
        compute_teacher_scores(teacher, dataset, pairs, path, chunk=2, show_progress=False)
    partial = tmp_path / "s.jsonl.partial"
    assert not path.exists() and len(partial.read_text().splitlines()) == 1 + 4
    with open(partial, "a") as handle:
        handle.write('{"query_id": "q1", "sco')  # a line cut short
    calls.clear()
    resumed = compute_teacher_scores(teacher, dataset, pairs, path, chunk=2, show_progress=False)
    assert len(calls) == 1  # only the last two queries were scored again
    assert flat(resumed) == pytest.approx(flat(full))
    assert flat(load_teacher_scores(path, pairs)) == pytest.approx(flat(full))


@pytest.mark.parametrize("cut", ["a record's newline", "the header's newline"])
def test_a_partial_file_that_lost_only_a_newline_resumes_into_a_valid_file(setup, tmp_path, cut):
    """Killed just before a line's newline: the line parses, and was kept without it, so the next record was
    appended to the same line and the finished file did not load (`s.jsonl:2: expected ...`)."""
    dataset, pairs, teacher = setup
    full = compute_teacher_scores(teacher, dataset, pairs, tmp_path / "full.jsonl", chunk=2, show_progress=False)
    lines = (tmp_path / "full.jsonl").read_bytes().split(b"\n")
    kept = lines[0] + b"\n" + lines[1] if cut == "a record's newline" else lines[0]
    (tmp_path / "s.jsonl.partial").write_bytes(kept)
    path = tmp_path / "s.jsonl"
    resumed = compute_teacher_scores(teacher, dataset, pairs, path, chunk=2, show_progress=False)
    assert flat(resumed) == pytest.approx(flat(full))
    assert flat(load_teacher_scores(path, pairs)) == pytest.approx(flat(full))
    assert len(path.read_text().splitlines()) == 1 + len(pairs)


def test_a_file_of_another_teacher_is_refused(setup, tmp_path, tiny_model_dir):
    dataset, pairs, teacher = setup
    path = tmp_path / "s.jsonl"
    compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False)
    other = CrossEncoder.new(str(tiny_model_dir), seed=2, max_length=32, device=CPU)
    before = path.read_bytes()
    with pytest.raises(DataError, match="was scored by teacher .* not by"):
        compute_teacher_scores(other, dataset, pairs, path, show_progress=False)
    assert path.read_bytes() == before


def test_a_file_of_other_queries_or_another_pool_is_refused(setup, tmp_path):
    dataset, pairs, teacher = setup
    path = tmp_path / "s.jsonl"
    compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False)
    more_queries = {**pairs, "q20": ["p20", "p3"]}
    with pytest.raises(DataError, match="no teacher scores for query 'q20'"):
        load_teacher_scores(path, more_queries)
    q = next(iter(pairs))
    other_pool = {**pairs, q: [*pairs[q], "p39"]}
    with pytest.raises(DataError, match=f"no teacher score for query '{q}' and passage 'p39'"):
        load_teacher_scores(path, other_pool)
    fewer = dict(list(pairs.items())[:2])  # a file covering more than asked is fine
    assert list(load_teacher_scores(path, fewer)) == list(fewer)


def test_a_file_that_is_not_a_scores_file_or_is_damaged_is_a_one_line_error(setup, tmp_path):
    _, pairs, _ = setup
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"query_id": "q1", "negatives": []}\n')
    with pytest.raises(DataError, match="not a teacher-scores file"):
        load_teacher_scores(bad, pairs)
    header = {"format": "densepass-teacher-scores", "version": 1, "teacher": {}, "pairs": "", "queries": 1}
    bad.write_text(json.dumps(header) + "\nnot json\n")
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected"):
        load_teacher_scores(bad, pairs)
    with pytest.raises(DataError, match="not found"):
        load_teacher_scores(tmp_path / "missing.jsonl", pairs)


def test_a_users_file_or_link_where_the_partial_scores_go_is_never_written_over(setup, tmp_path):
    dataset, pairs, teacher = setup
    path = tmp_path / "s.jsonl"
    partial = tmp_path / "s.jsonl.partial"
    partial.write_text("my notes on the teacher\n")
    with pytest.raises(DataError, match="not a teacher-scores file densepass began"):
        compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False)
    assert partial.read_text() == "my notes on the teacher\n"
    partial.unlink()
    target = tmp_path / "elsewhere.txt"
    target.write_text("mine")
    partial.symlink_to(target)
    with pytest.raises(DataError, match="is not a plain file"):
        compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False)
    assert target.read_text() == "mine"


def test_a_scores_file_that_is_a_folder_or_a_pipe_is_refused_before_scoring(setup, tmp_path):
    import os

    dataset, pairs, teacher = setup
    (tmp_path / "folder.jsonl").mkdir()
    os.mkfifo(tmp_path / "pipe.jsonl")
    for name in ("folder.jsonl", "pipe.jsonl"):
        with pytest.raises(DataError, match="is not a teacher-scores file"):
            compute_teacher_scores(teacher, dataset, pairs, tmp_path / name, show_progress=False)
    assert (tmp_path / "folder.jsonl").is_dir() and (tmp_path / "pipe.jsonl").is_fifo()


def test_a_teacher_score_that_is_not_finite_is_refused(setup, tmp_path):
    dataset, pairs, teacher = setup
    path = tmp_path / "s.jsonl"
    compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False)
    lines = path.read_text().splitlines()
    record = json.loads(lines[1])
    record["scores"] = {p: float("nan") for p in record["scores"]}
    path.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    with pytest.raises(DataError, match="not a finite number"):
        load_teacher_scores(path, pairs)
    record["scores"] = {p: 1e308 for p in record["scores"]}  # finite in Python, infinite in float32: margins dropped
    path.write_text("\n".join([lines[0], json.dumps(record), *lines[2:]]) + "\n")
    with pytest.raises(DataError, match=r"s\.jsonl:2: a teacher score beyond \+-1\.7e38"):
        load_teacher_scores(path, pairs)


def test_a_file_of_other_texts_or_scoring_settings_is_refused_and_one_written_before_them_warned(setup, tmp_path):
    """The file was matched by ids alone: a passage rewritten under its id, or a teacher truncating on the other
    side, was served the old scores in silence (the content cache, ``models.score_cache``, keys on both)."""
    import dataclasses
    import warnings

    from densepass.data.dataset import Corpus
    from densepass.errors import DataWarning

    dataset, pairs, teacher = setup
    path = tmp_path / "s.jsonl"
    scores = compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False, precision="fp32")
    assert compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False, precision="fp32") == scores
    c = dataset.corpus
    rewritten = Corpus(c.ids, c.titles, [t + " (revised)" for t in c.texts], c.doc_ids)
    changed = dataclasses.replace(dataset, corpus=rewritten)
    with pytest.raises(DataError, match="scored other texts for query .* than the data's now"):
        compute_teacher_scores(teacher, changed, pairs, path, show_progress=False, precision="fp32")
    # bf16 for fp32 is a rounding away: read (a GPU's file serves a CPU student); another tokenizer side is not
    assert compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False, precision="bf16") == scores
    teacher.tokenizer.truncation_side = "left"
    try:
        with pytest.raises(DataError, match=r"scored in other settings \(sides differ\)"):
            compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False, precision="fp32")
    finally:
        teacher.tokenizer.truncation_side = "right"
    lines = path.read_text().splitlines()
    header = json.loads(lines[0])
    old = {k: v for k, v in header.items() if k != "scoring"} | {"version": 1}
    records = [{k: v for k, v in json.loads(line).items() if k != "texts"} for line in lines[1:]]
    path.write_text("".join(json.dumps(r) + "\n" for r in [old, *records]))  # as densepass wrote it before
    with pytest.warns(DataWarning, match="written before teacher-score files recorded the texts"):
        assert compute_teacher_scores(teacher, changed, pairs, path, show_progress=False) == scores
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert load_teacher_scores(path, pairs, teacher_identity(teacher)) == scores  # nothing asked: nothing said


def test_a_partial_file_of_other_texts_starts_over_and_a_file_covering_more_queries_checks_only_those_asked(
    setup, tmp_path
):
    import dataclasses

    from densepass.data.dataset import Corpus
    from densepass.errors import DataWarning

    dataset, pairs, teacher = setup
    path = tmp_path / "s.jsonl"
    full = compute_teacher_scores(teacher, dataset, pairs, path, show_progress=False, precision="fp32")
    first, last = list(pairs)[0], list(pairs)[-1]
    revised = next(p for p in pairs[last] if p not in pairs[first])  # a passage of the last query, not the first's
    c = dataset.corpus
    texts = [t + " (revised)" if pid == revised else t for pid, t in zip(c.ids, c.texts)]
    changed = dataclasses.replace(dataset, corpus=Corpus(c.ids, c.titles, texts, c.doc_ids))
    assert load_teacher_scores(path, {first: pairs[first]}, dataset=changed) == {first: full[first]}
    partial = tmp_path / "p.jsonl.partial"
    partial.write_text(path.read_text())  # every line written, not yet renamed: then the texts changed
    with pytest.warns(DataWarning, match="was scored for other texts; starting it over"):
        again = compute_teacher_scores(
            teacher, changed, pairs, partial.with_suffix(""), show_progress=False, precision="fp32"
        )
    assert again[first] == pytest.approx(full[first]) and again[last] != full[last]
