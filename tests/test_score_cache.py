"""The cross-encoder score cache (``models.score_cache``): a pair is scored once per model, precision and code
version, whichever run asks (distillation targets, a denoising filter), its cached score is the model's own, and
an entry that cannot be read is passed over with a warning, never trusted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from densepass.errors import ConfigError, DataWarning
from densepass.models.cross_encoder import CrossEncoder
from densepass.models.score_cache import CACHE_FOLDER, DATABASE, CachedPairScores, pair_key
from densepass.negatives.pool import Candidate
from densepass.training.teacher_scores import compute_teacher_scores

CPU = torch.device("cpu")
QUERIES = ["audio editor", "greek letters", "audio editor", "counting words"]
PASSAGES = ["A   audio editor for linux", "B   alpha beta", "A   audio editor for linux", "C   one two three"]


@pytest.fixture
def model(tiny_model_dir):
    return CrossEncoder.new(str(tiny_model_dir), seed=2, max_length=32, batch_size=2, device=CPU, precision="fp32")


class Counting:
    """A model whose ``score_pairs`` calls are counted (pairs asked for)."""

    def __init__(self, model):
        self.inner, self.asked = model, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def score_pairs(self, queries, passages, precision=None):
        self.asked.append(len(queries))
        return self.inner.score_pairs(queries, passages, precision)


def test_cached_scores_are_the_models_own_and_a_second_reader_scores_nothing(model, tmp_path):
    first = Counting(model)
    cache = CachedPairScores(first, tmp_path)
    scores = cache.score_pairs(QUERIES, PASSAGES)
    # the model's scores (to float32 rounding: a batch of 3 pairs instead of 4 sums in another order)
    np.testing.assert_allclose(scores, model.score_pairs(QUERIES, PASSAGES), rtol=1e-5)
    assert scores[0] == scores[2] and first.asked == [3] and cache.scored == 3 and cache.found == 0  # scored once
    again = Counting(model)  # another run: another object, the same model
    reader = CachedPairScores(again, tmp_path)
    np.testing.assert_array_equal(reader.score_pairs(QUERIES[::-1], PASSAGES[::-1]), scores[::-1])  # bit for bit
    assert again.asked == [] and reader.found == 3
    # one new pair among known ones: only it is scored
    more = reader.score_pairs([*QUERIES, "video"], [*PASSAGES, "A   video editor"])
    np.testing.assert_array_equal(more[:4], scores)
    assert again.asked == [1]
    assert more[4] == model.score_pairs(["video"], ["A   video editor"])[0]


def test_a_pair_is_kept_under_both_texts_whole(model):
    assert pair_key("ab", "c") != pair_key("a", "bc") and pair_key("q", "p") == pair_key("q", "p")
    assert len(pair_key("q", "p")) == 16


def test_another_precision_or_other_weights_score_into_another_entry(model, tmp_path):
    CachedPairScores(model, tmp_path).score_pairs(QUERIES, PASSAGES)
    counted = Counting(model)
    bf16 = CachedPairScores(counted, tmp_path)
    bf16.score_pairs(QUERIES, PASSAGES, "bf16")
    assert counted.asked == [3]
    with torch.no_grad():
        model.model.classifier.weight.add_(0.5)  # a model trained since: its old scores are not its scores now
    changed = Counting(model)
    fresh = CachedPairScores(changed, tmp_path).score_pairs(QUERIES, PASSAGES)
    assert changed.asked == [3]
    np.testing.assert_allclose(fresh, model.score_pairs(QUERIES, PASSAGES), rtol=1e-5)
    assert len(list((tmp_path / CACHE_FOLDER).iterdir())) == 3


@pytest.mark.parametrize("change", ["config", "truncation side", "max_length"])
def test_a_setting_that_changes_scores_without_changing_weights_is_another_entry(model, tmp_path, change):
    """The key follows what the forward pass reads besides the weights: the model's configuration (here its
    layer-norm epsilon) and the tokenizer's truncation side."""
    passages = [p + " extra words" * 20 for p in PASSAGES]  # past max_length 32: truncation matters
    reused = CachedPairScores(model, tmp_path / "reused")  # one cache object kept across the change
    before = CachedPairScores(model, tmp_path).score_pairs(QUERIES, passages)
    np.testing.assert_array_equal(reused.score_pairs(QUERIES, passages), before)
    if change == "config":
        model.model.config.layer_norm_eps = 0.5
        for module in model.model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.eps = 0.5
    elif change == "max_length":
        model.max_length = 16
    else:
        model.tokenizer.truncation_side = "left"
    counted = Counting(model)
    after = CachedPairScores(counted, tmp_path).score_pairs(QUERIES, passages)
    assert counted.asked == [3] and not np.allclose(before, after)
    np.testing.assert_allclose(after, model.score_pairs(QUERIES, passages), rtol=1e-5)
    np.testing.assert_allclose(reused.score_pairs(QUERIES, passages), after, rtol=1e-5)  # not its first entry's


def test_saving_a_model_keeps_its_key_and_the_model_loaded_back_finds_its_scores(model, tmp_path):
    """Saving set the live model's architectures and sentence-transformers activation in its configuration: a
    model scored before it was saved keyed otherwise than after, and than its copy loaded from disk (under torchrun
    the rank that saved a teacher and the one that did not disagreed about one file of its scores)."""
    from densepass.models.score_cache import scorer_identity

    before = scorer_identity(model, "fp32")
    first = CachedPairScores(model, tmp_path / "cache").score_pairs(QUERIES, PASSAGES)
    model.save(tmp_path / "saved")
    assert scorer_identity(model, "fp32") == before
    loaded = CrossEncoder.from_pretrained(str(tmp_path / "saved"), device=CPU, precision="fp32")
    assert scorer_identity(loaded, "fp32") == before
    counted = Counting(loaded)
    np.testing.assert_array_equal(CachedPairScores(counted, tmp_path / "cache").score_pairs(QUERIES, PASSAGES), first)
    assert counted.asked == []


def test_int8_scores_and_empty_calls_are_not_kept_and_an_empty_folder_is_refused(model, tmp_path):
    counted = Counting(model)
    cache = CachedPairScores(counted, tmp_path)
    assert cache.score_pairs([], []).shape == (0,)
    cache.score_pairs(QUERIES, PASSAGES, "int8")  # one activation scale per batch: a score depends on its batch
    cache.score_pairs(QUERIES, PASSAGES, "int8")
    assert counted.asked == [0, 4, 4] and not (tmp_path / CACHE_FOLDER).exists()
    with pytest.raises(ConfigError, match="empty path"):
        CachedPairScores(model, "")


def test_an_entry_locked_by_another_process_is_waited_for_once_then_passed_over(model, tmp_path, monkeypatch):
    import sqlite3

    from densepass.models import score_cache

    CachedPairScores(model, tmp_path).score_pairs(QUERIES[:1], PASSAGES[:1])
    [entry] = (tmp_path / CACHE_FOLDER).iterdir()
    holder = sqlite3.connect(entry / DATABASE)
    holder.execute("BEGIN EXCLUSIVE")  # a process stopped inside its transaction
    monkeypatch.setattr(score_cache, "LOCK_TIMEOUT_S", 0.2)
    counted = Counting(model)
    cache = CachedPairScores(counted, tmp_path)
    with pytest.warns(DataWarning, match="cannot be used"):
        cache.score_pairs(QUERIES, PASSAGES)
    cache.score_pairs(QUERIES, PASSAGES)  # the cache is off now: no second wait, no warning
    holder.rollback()
    holder.close()
    assert counted.asked == [3, 3]


def test_a_damaged_entry_is_passed_over_with_a_warning_and_the_pairs_scored(model, tmp_path):
    CachedPairScores(model, tmp_path).score_pairs(QUERIES, PASSAGES)
    [entry] = (tmp_path / CACHE_FOLDER).iterdir()
    (entry / DATABASE).write_bytes(b"not a database, " * 100)
    counted = Counting(model)
    with pytest.warns(DataWarning, match="cannot be used"):
        scores = CachedPairScores(counted, tmp_path).score_pairs(QUERIES, PASSAGES)
    np.testing.assert_allclose(scores, model.score_pairs(QUERIES, PASSAGES), rtol=1e-5)
    assert counted.asked == [3] and (entry / DATABASE).read_bytes().startswith(b"not a database")  # left as it is


def test_a_link_where_the_database_goes_is_not_followed(model, tmp_path):
    CachedPairScores(model, tmp_path / "first").score_pairs(QUERIES, PASSAGES)
    [entry] = (tmp_path / "first" / CACHE_FOLDER).iterdir()
    target = tmp_path / "users-file.sqlite"
    target.write_bytes(b"mine")
    (entry / DATABASE).unlink()
    (entry / DATABASE).symlink_to(target)
    with pytest.warns(DataWarning, match="not a plain file"):
        CachedPairScores(model, tmp_path / "first").score_pairs(QUERIES, PASSAGES)
    assert target.read_bytes() == b"mine"


def test_two_students_of_one_teacher_score_its_targets_once(distillation_setup, tmp_path):
    """Distillation targets computed for a second run (another scores file) with the same ``cache_dir`` are read from
    the first run's, and equal the scores computed without a cache."""
    dataset, pairs, teacher = distillation_setup
    plain = compute_teacher_scores(teacher, dataset, pairs, tmp_path / "plain.jsonl", show_progress=False)
    compute_teacher_scores(teacher, dataset, pairs, tmp_path / "a.jsonl", show_progress=False, cache_dir=tmp_path)
    counted = Counting(teacher)
    second = compute_teacher_scores(
        counted, dataset, pairs, tmp_path / "b.jsonl", show_progress=False, cache_dir=tmp_path / "."
    )
    assert counted.asked == [] and second == plain


def test_a_denoising_filter_and_distillation_of_one_teacher_share_its_scores(
    distillation_setup, tiny_model_dir, tmp_path
):
    """The relative-margin filter scores each query's positives and candidates as distillation does ("title text",
    the teacher's precision): with one ``cache_dir``, distilling after denoising scores nothing new."""
    from densepass.negatives.filters import build_filters

    dataset, pairs, _ = distillation_setup
    positives = dataset.positives("train")
    pool = {q: [Candidate(p, "bm25", 1.0) for p in pids if p not in positives[q]] for q, pids in pairs.items()}
    path = tmp_path / "teacher"
    CrossEncoder.new(str(tiny_model_dir), seed=1, max_length=32, batch_size=4, device=CPU, precision="fp32").save(path)
    [relative] = build_filters(
        ["relative-margin"], dataset, relative_teacher=str(path), relative_activation="exp", cache_dir=tmp_path
    )
    relative.keep_all(pool)
    teacher = Counting(CrossEncoder.from_pretrained(str(path), device=CPU, precision="fp32"))
    scores = compute_teacher_scores(
        teacher, dataset, pairs, tmp_path / "s.jsonl", show_progress=False, precision="fp32", cache_dir=tmp_path
    )
    assert teacher.asked == [] and len(scores) == len(pairs)
