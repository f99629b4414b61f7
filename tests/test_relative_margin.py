"""Relative-margin denoising (negatives.filters: relative-margin, nv-retriever): the rule on a hand-worked example
and against a brute-force reference on random scores, the filter inside mining (its drops counted apart from the
absolute cross-encoder threshold's), its teacher checked before any work, and a bi-encoder as the teacher."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.config import NegativesConfig
from densepass.data import load_dataset
from densepass.data.keys import passage_input
from densepass.errors import ConfigError
from densepass.negatives.filters import apply_filters, build_filters, check_denoising, relative_margin_keep
from densepass.negatives.mine import MiningContext, mine_negatives


def test_the_rule_on_a_hand_worked_example():
    # positive 0.8, margin 0.95: the bar is 0.76; a candidate at the bar is dropped (strictly below stays)
    assert relative_margin_keep([0.9, 0.76, 0.7599, 0.2], [0.8], 0.95) == [False, False, True, True]
    # two positives: the weaker (0.5) sets the bar, 0.475
    assert relative_margin_keep([0.6, 0.48, 0.47], [0.9, 0.5], 0.95) == [False, False, True]
    assert relative_margin_keep([0.3, 5.0], [], 0.95) == [True, True]  # nothing to compare with: kept
    # a negative positive score (a bi-encoder teacher's cosine, -0.4): the bar is as far below it, -0.42 (0.95 x
    # -0.4 = -0.38 lies above it, and kept a candidate scored -0.39, above the positive)
    assert relative_margin_keep([-0.39, -0.41, -0.43], [-0.4], 0.95) == [False, False, True]


scores = st.floats(min_value=-10, max_value=10, allow_nan=False, width=32)


@settings(max_examples=200, deadline=None)
@given(st.lists(scores, max_size=12), st.lists(scores, min_size=1, max_size=3), st.floats(min_value=0.01, max_value=1))
def test_the_rule_equals_a_brute_force_reference(candidates, positives, margin):
    expected = [all(c < p - (1 - margin) * abs(p) for p in positives) for c in candidates]
    assert relative_margin_keep(candidates, positives, margin) == expected


def _fake_teacher(query: str, passages: list[str]) -> list[float]:
    """A deterministic teacher: a score in [0, 1) from a hash of the (query, passage) pair."""
    return [int(hashlib.sha256(f"{query}|{p}".encode()).hexdigest()[:8], 16) / 2**32 for p in passages]


def test_mining_drops_by_each_rule_and_counts_them_apart(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    queries = sorted(dataset.positives("train"))[:12]
    config = NegativesConfig(pool_depth=8, filters=["qrels"])
    raw = mine_negatives(dataset, queries, config, MiningContext(show_progress=False)).pool
    threshold, margin = 0.8, 0.9
    filters = build_filters(
        ["cross-encoder", "relative-margin"],
        dataset,
        cross_encoder=_fake_teacher,
        threshold=threshold,
        relative_margin=margin,
        relative_teacher=_fake_teacher,
    )
    pool, removed = apply_filters(raw, filters)
    # brute force: the absolute rule first, then the relative one on what it kept
    expected_abs = expected_rel = 0
    for qid, cands in raw.items():
        query = dataset.queries[qid]
        score = {
            c.passage_id: _fake_teacher(query, [passage_input(dataset.corpus, c.passage_id, "[SEP]")])[0] for c in cands
        }
        kept = [c for c in cands if score[c.passage_id] <= threshold]
        expected_abs += len(cands) - len(kept)
        positives = [
            _fake_teacher(query, [passage_input(dataset.corpus, p, "[SEP]")])[0]
            for p in dataset.positives("train")[qid]
        ]
        survivors = [c for c in kept if all(score[c.passage_id] < margin * p for p in positives)]
        expected_rel += len(kept) - len(survivors)
        assert [c.passage_id for c in pool[qid]] == [c.passage_id for c in survivors]
    assert removed == {"cross-encoder": expected_abs, "relative-margin": expected_rel}
    assert expected_abs > 0 and expected_rel > 0  # the example exercises both rules


def test_the_teacher_is_checked_before_any_work(tmp_path):
    with pytest.raises(ConfigError, match="the relative-margin filter needs a cross-encoder"):
        check_denoising(NegativesConfig(filters=["qrels", "relative-margin"]), "all-MiniLM-L6-v2")
    with pytest.raises(ConfigError, match="not-a-model"):
        check_denoising(
            NegativesConfig(
                filters=["relative-margin"], relative_teacher="bi-encoder", model=str(tmp_path / "not-a-model")
            ),
            "all-MiniLM-L6-v2",
        )
    check_denoising(NegativesConfig(filters=["relative-margin"], relative_teacher="bi-encoder"), "all-MiniLM-L6-v2")


def test_a_bi_encoder_teaches_through_mining(tiny_beir, tiny_model_dir):
    from densepass.models.biencoder import BiEncoder

    dataset = load_dataset(str(tiny_beir))
    queries = sorted(dataset.positives("train"))[:6]
    context = MiningContext(show_progress=False, base_model=str(tiny_model_dir), precision="fp32")
    unfiltered = mine_negatives(dataset, queries, NegativesConfig(pool_depth=50, filters=["qrels"]), context).pool
    config = NegativesConfig(
        pool_depth=50, filters=["qrels", "relative-margin"], relative_teacher="bi-encoder", relative_margin=0.9
    )
    result = mine_negatives(dataset, queries, config, context)
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    expected = 0
    for qid in queries:  # by hand: cosine similarities of the starting model, the weakest positive's bar
        q = model.encode_queries([dataset.queries[qid]], show_progress=False, precision="fp32")[0]
        ids = [*dataset.positives("train")[qid], *(c.passage_id for c in unfiltered[qid])]
        texts = [passage_input(dataset.corpus, pid, "[SEP]") for pid in ids]
        sims = dict(zip(ids, model.encode_passages(texts, show_progress=False, precision="fp32") @ q))
        bar = 0.9 * min(sims[p] for p in dataset.positives("train")[qid])
        kept = [c.passage_id for c in unfiltered[qid] if sims[c.passage_id] < bar]
        assert [c.passage_id for c in result.pool[qid]] == kept
        expected += len(unfiltered[qid]) - len(kept)
    assert result.removed["relative-margin"] == expected > 0


def test_a_run_counts_what_the_relative_margin_filter_drops(tiny_model_dir, tiny_beir, tmp_path):
    import json

    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "out", "denoised")
    overrides += ["train.batch_size=6", "train.max_steps=1", "negatives.relative_teacher=bi-encoder"]
    overrides += ["negatives.relative_margin=0.9", "negatives.filters=[qrels, relative-margin]"]
    run_experiment(load_config(None, overrides))
    notes = json.loads((tmp_path / "out" / "denoised" / "metrics.json").read_text())["notes"]
    mined = next(n for n in notes if n.startswith("Hard negatives (bm25)"))
    assert "removed by filter: qrels: " in mined and ", relative-margin: " in mined, mined


def test_a_bi_encoder_teacher_encodes_each_text_once_and_scores_as_one_query_at_a_time(tiny_model_dir):
    """The teacher's batched scoring (many queries' pairs per call, each distinct text encoded once and kept for the
    next call) gives the similarities of encoding one query and its passages at a time."""
    from densepass.models.biencoder import BiEncoder
    from densepass.negatives.filters import bi_encoder_scorer

    scorer = bi_encoder_scorer(str(tiny_model_dir), batch_size=4, precision="fp32")
    encoded: list[str] = []

    def spy(real):
        def encode(texts, *args, **kwargs):
            encoded.extend(texts)
            return real(texts, *args, **kwargs)

        return encode

    for side in ("encode_queries", "encode_passages"):
        setattr(scorer.model, side, spy(getattr(scorer.model, side)))
    queries = ["apt package manager", "text editor", "apt package manager", "web server"]
    passages = ["apt - command-line package manager", "vim - vi improved", "vim - vi improved", "nginx http server"]
    got = scorer.score_pairs(queries, passages)
    second = (["apt package manager", "text editor"], ["nginx http server", "apt - command-line package manager"])
    again = scorer.score_pairs(*second)
    assert sorted(encoded) == sorted(set(queries) | set(passages))  # the second call encoded nothing new
    reference = BiEncoder.from_pretrained(str(tiny_model_dir))
    for q, p, score in [*zip(queries, passages, got), *zip(*second, again)]:
        qv = reference.encode_queries([q], show_progress=False, precision="fp32")[0]
        pv = reference.encode_passages([p], show_progress=False, precision="fp32")[0]
        assert abs(score - float(qv @ pv)) < 1e-5
    assert scorer("text editor", ["vim - vi improved"]) == pytest.approx([got[1]], abs=1e-9)


def _with_another_separator(model_dir, tmp_path):
    """A copy of the model at ``model_dir`` whose tokenizer's separator is not [SEP]."""
    import shutil

    from transformers import AutoTokenizer

    copy = tmp_path / "other-sep"
    shutil.copytree(model_dir, copy)
    AutoTokenizer.from_pretrained(str(copy), sep_token="[unused1]").save_pretrained(str(copy))
    return copy


def test_densepass_mine_gives_a_bi_encoder_teacher_the_runs_separator(tiny_beir, tiny_model_dir, tmp_path):
    """``densepass mine`` built its filters with the literal [SEP], ``densepass run`` with its model's separator: for a
    model whose separator is another, a bi-encoder teacher read other passage texts and the file was not the pool a
    run mines."""
    from densepass.config import load_config
    from densepass.models.biencoder import BiEncoder
    from densepass.pipelines.mine_command import mine_training_negatives

    model = _with_another_separator(tiny_model_dir, tmp_path)
    sep = BiEncoder.from_pretrained(str(model)).tokenizer.sep_token
    assert sep == "[unused1]"
    overrides = [f"data.name={tiny_beir}", f"model.name_or_path={model}", "negatives.pool_depth=10", "device=cpu"]
    overrides += ["negatives.filters=[qrels, relative-margin]", "negatives.relative_teacher=bi-encoder"]
    config = load_config(None, [*overrides, "negatives.relative_margin=0.99"])
    mined = mine_training_negatives(config, tmp_path / "pool.jsonl").pool
    dataset = load_dataset(str(tiny_beir))
    queries = sorted(dataset.positives("train"))
    context = MiningContext(base_model=str(model), precision=config.eval.precision, show_progress=False)

    def ids(pool):
        return {q: [c.passage_id for c in cands] for q, cands in pool.items()}

    as_run = mine_negatives(dataset, queries, config.negatives, context, sep).pool  # as densepass run calls it
    with_sep = mine_negatives(dataset, queries, config.negatives, context, "[SEP]").pool
    assert ids(mined) == ids(as_run) != ids(with_sep)


def test_densepass_mine_takes_a_precision_for_a_bi_encoder_teacher(tiny_beir, tiny_model_dir, tmp_path, monkeypatch):
    """``--precision`` was refused for a strategy that mines with no model (bm25) though a bi-encoder relative-margin
    teacher encodes in it."""
    from densepass.config import load_config
    from densepass.negatives import mine as mine_module
    from densepass.pipelines.mine_command import mine_training_negatives

    precisions = []
    real = mine_module.bi_encoder_scorer

    def spy(path, batch_size=64, device=None, precision="auto"):
        precisions.append(precision)
        return real(path, batch_size, device, precision)

    monkeypatch.setattr(mine_module, "bi_encoder_scorer", spy)
    overrides = [f"data.name={tiny_beir}", f"model.name_or_path={tiny_model_dir}", "negatives.source=bm25"]
    overrides += ["negatives.filters=[qrels, relative-margin]", "negatives.relative_teacher=bi-encoder", "device=cpu"]
    mine_training_negatives(load_config(None, overrides), tmp_path / "pool.jsonl", "fp32")
    assert precisions == ["fp32"] and (tmp_path / "pool.jsonl").is_file()
    cross = load_config(None, [*overrides[:3], "negatives.filters=[qrels, relative-margin]"])  # a cross-encoder's
    with pytest.raises(ConfigError, match="^--precision sets how a model encodes; the bm25 strategy mines with no"):
        mine_training_negatives(cross, tmp_path / "other.jsonl", "fp32")
