"""SPLADE and ColBERT: the maths against literal definitions, the indexes against exact computation,
save/load round trips, training end to end, and bad input."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from conftest import needs_onednn_bf16
from densepass.cli import main
from densepass.config import load_config
from densepass.device import resolve_precision
from densepass.errors import ConfigError, DataWarning
from densepass.index.base import load_index
from densepass.index.colbert import ColbertIndex, pack_bits, unpack_bits
from densepass.index.splade import SpladeIndex
from densepass.losses.batch import BatchTensors
from densepass.losses.flops import flops, quadratic_warmup
from densepass.losses.objectives import FLOPS, InfoNCE
from densepass.models.biencoder import BiEncoder
from densepass.models.colbert import ColBERT, ColbertReranker, maxsim
from densepass.models.inputs import CPU_PIECE_TOKENS
from densepass.models.splade import CPU_ENCODE_PIECE_TOKENS, SpladeEncoder, splade_weights
from densepass.pipelines.experiment import run_experiment
from densepass.training.step import forward_backward

CPU = torch.device("cpu")
WORDS = "audio video editor library game network terminal python font image mail server kernel".split()


def texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, 6)) + ("!" if i % 3 == 0 else "") for i in range(n)]


@pytest.fixture(scope="module")
def splade(tiny_model_dir) -> SpladeEncoder:
    return SpladeEncoder.from_pretrained(str(tiny_model_dir), head_bias=-0.35)


@pytest.fixture(scope="module")
def colbert(tiny_model_dir) -> ColBERT:
    torch.manual_seed(0)
    return ColBERT.from_pretrained(str(tiny_model_dir))


# ---- the maths ------------------------------------------------------------------------------------------


def test_maxsim_equals_a_literal_double_loop():
    torch.manual_seed(0)
    q, p = torch.randn(3, 5, 4), torch.randn(4, 7, 4)
    p[1, 3:] = 0  # absent tokens (padding, skiplist)
    p[2] = 0  # a passage without tokens
    q[0, 4] = 0  # an absent query token
    expected = torch.zeros(3, 4)
    for a in range(3):
        for b in range(4):
            for i in range(5):
                if q[a, i].abs().sum() == 0:
                    continue
                present = [float(q[a, i] @ p[b, j]) for j in range(7) if p[b, j].abs().sum() > 0]
                expected[a, b] += max(present) if present else 0.0
    torch.testing.assert_close(maxsim(q, p), expected)


def test_flops_equals_its_definition():
    w = torch.rand(6, 9) * (torch.rand(6, 9) > 0.5)
    expected = sum((sum(float(w[i, j]) for i in range(6)) / 6) ** 2 for j in range(9))
    assert float(flops(w)) == pytest.approx(expected, rel=1e-6)


def test_the_regulariser_weight_grows_quadratically_then_stays():
    assert [quadratic_warmup(1.0, s, 4) for s in range(6)] == [0.0, 1 / 16, 4 / 16, 9 / 16, 1.0, 1.0]
    assert quadratic_warmup(0.5, 0, 0) == 0.5


def test_splade_weights_and_gradients_equal_the_literal_definition():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    ours = splade_weights(logits, mask)
    literal = torch.stack(
        [torch.stack([torch.log1p(torch.relu(logits[b, i])) for i in range(5) if mask[b, i]]).amax(0) for b in range(2)]
    )
    torch.testing.assert_close(ours, literal)
    (g1,) = torch.autograd.grad((ours * torch.arange(11.0)).sum(), logits)
    (g2,) = torch.autograd.grad((literal * torch.arange(11.0)).sum(), logits)
    torch.testing.assert_close(g1, g2)


def test_splade_objective_adds_the_warmed_up_flops_terms_and_resumes_its_clock(splade):
    q, p = torch.rand(2, 30), torch.rand(4, 30)
    batch = BatchTensors({}, {}, torch.tensor([0, 1]), torch.zeros(2, 4, dtype=torch.bool))
    objective = InfoNCE() + FLOPS(lambda_q=0.1, lambda_d=0.2, warmup_steps=2)
    from densepass.losses.contrastive import info_nce

    base = info_nce(q @ p.T / splade.config.temperature, batch.positive_index, batch.mask)
    assert float(objective(splade, q, p, batch)) == pytest.approx(float(base))  # step 0: lambda 0
    objective.after_step(splade, q, p, batch)
    resumed = InfoNCE() + FLOPS(lambda_q=0.1, lambda_d=0.2, warmup_steps=2)
    resumed.load_state_dict(objective.state_dict())
    expected = base + 0.1 / 4 * flops(q) + 0.2 / 4 * flops(p)
    assert float(resumed(splade, q, p, batch)) == pytest.approx(float(expected), rel=1e-5)


# ---- models ----------------------------------------------------------------------------------------------


def test_colbert_queries_are_mask_padded_to_a_fixed_length_and_passages_skip_punctuation(colbert):
    tokens = colbert.tokenize(["audio editor", "a much longer query about a network terminal"], "query")
    assert tokens["input_ids"].shape == (2, colbert.config.query_max_length)
    assert (tokens["input_ids"][0, 5:] == colbert.tokenizer.mask_token_id).all()
    assert tokens["input_ids"][0, 1] == colbert.marker_ids["query"]
    encoded = colbert.encode_queries(["audio editor"], device=CPU)
    assert encoded.shape == (1, 32, 128)
    np.testing.assert_allclose(np.linalg.norm(encoded[0], axis=1), 1.0, rtol=1e-5)
    with_punct, without = colbert.encode_passages(["audio, editor!", "audio editor"], device=CPU)
    assert len(with_punct) == len(without)  # the comma and "!" are dropped


def test_gradient_caching_equals_the_plain_step_for_splade_and_colbert(tiny_model_dir, tiny_beir):
    from densepass.data import load_dataset
    from densepass.training.batches import TrainingData

    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]", {q: dataset.corpus.ids[::3] for q in dataset.queries}, 1)
    batch = data.collate(list(range(6)), seed=(1, 0, 0))
    for make, objective in (
        (
            lambda: SpladeEncoder.from_pretrained(str(tiny_model_dir), head_bias=-0.35),
            InfoNCE() + FLOPS(lambda_q=1e-2, lambda_d=1e-2, warmup_steps=0),
        ),
        (lambda: ColBERT.from_pretrained(str(tiny_model_dir)), None),
    ):
        grads = []
        for chunk in (None, 4):
            torch.manual_seed(0)
            model = make()
            loss = forward_backward(model, batch, CPU, objective, chunk_size=chunk).loss
            grads.append((loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        assert float(grads[0][0]) == pytest.approx(float(grads[1][0]), rel=1e-5)
        for name, grad in grads[0][1].items():
            torch.testing.assert_close(grads[1][1][name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_training_steps_on_one_batch_lower_its_loss_for_splade_and_colbert(tiny_model_dir, tiny_beir):
    # learning, measured on the same batch: the end-to-end run below logs losses of different (ABS) batches, whose
    # spread on the tiny data is larger than what six steps of a random tiny model learn
    from densepass.data import load_dataset
    from densepass.training.batches import TrainingData

    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]", {q: dataset.corpus.ids[::3] for q in dataset.queries}, 1)
    batch = data.collate(list(range(8)), seed=(1, 0, 0))
    for make, objective in (
        (lambda: SpladeEncoder.from_pretrained(str(tiny_model_dir), head_bias=-0.35), InfoNCE() + FLOPS()),
        (lambda: ColBERT.from_pretrained(str(tiny_model_dir)), None),
    ):
        torch.manual_seed(0)
        model = make()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for _ in range(6):
            optimizer.zero_grad()
            losses.append(float(forward_backward(model, batch, CPU, objective).loss))
            optimizer.step()
        assert losses[-1] < losses[0] - 0.05, (type(model).__name__, losses)


def test_saved_splade_loads_in_sentence_transformers_with_the_same_weights(splade, tmp_path):
    from sentence_transformers import SparseEncoder

    splade.save(tmp_path / "splade")
    ours = SpladeEncoder.from_pretrained(str(tmp_path / "splade")).encode(
        ["audio editor"], "passage", device=CPU, precision="fp32"
    )
    theirs = SparseEncoder(str(tmp_path / "splade"), device="cpu").encode(["audio editor"], convert_to_tensor=True)
    np.testing.assert_allclose(ours.toarray()[0], theirs.to_dense().numpy()[0], rtol=1e-4, atol=1e-5)


# ---- indexes ---------------------------------------------------------------------------------------------


def test_splade_encoding_in_pieces_equals_one_forward_of_the_batch(splade):
    """On the CPU a batch is encoded in pieces of CPU_ENCODE_PIECE_TOKENS tokens: the same weights as one
    forward over the padded batch, in the order of the texts."""
    batch = texts(80, seed=3)
    encoded = splade.encode(batch, "passage", batch_size=80, device=CPU, precision="fp32").toarray()
    with torch.inference_mode():
        tokens = splade.tokenize(batch, "passage")
        assert tokens["attention_mask"].numel() > 2 * CPU_ENCODE_PIECE_TOKENS  # three pieces or more
        whole = splade(tokens["input_ids"], tokens["attention_mask"], "passage").numpy()
    np.testing.assert_allclose(encoded, whole, rtol=1e-4, atol=1e-5)


def test_colbert_passages_encoded_in_pieces_equal_one_forward_of_the_batch(colbert):
    """On the CPU passages are encoded (and trained) in pieces of 2,048 tokens, padded back to their fixed
    width: the same token vectors as one forward over the padded batch."""
    batch = texts(600, seed=4)
    encoded = colbert.encode(batch, "passage", batch_size=600, device=CPU, precision="fp32")
    with torch.inference_mode():
        tokens = colbert.tokenize(batch, "passage")
        assert tokens["attention_mask"].numel() > 2 * CPU_PIECE_TOKENS  # three pieces or more
        whole = colbert(tokens["input_ids"], tokens["attention_mask"], "passage").numpy()
    for i, vectors in enumerate(encoded):
        present = np.abs(whole[i]).sum(-1) > 0
        np.testing.assert_allclose(vectors, whole[i][present], rtol=1e-4, atol=1e-5)


# ---- precision ------------------------------------------------------------------------------------------


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sum(a * b, 1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


@pytest.mark.filterwarnings("ignore:precision bf16:UserWarning")  # bf16 where it is not fast: expected
def test_splade_and_colbert_in_bf16_agree_with_fp32(splade, colbert):
    """bf16 (a bfloat16 copy, fused layers on the CPU) to the issue's mean cosine 0.99, on both sides."""
    batch = texts(24, seed=5)
    for side in ("passage", "query"):
        full = splade.encode(batch, side, device=CPU, precision="fp32").toarray()
        half = splade.encode(batch, side, device=CPU, precision="bf16").toarray()
        assert half.dtype == np.float32 and not np.array_equal(half, full)  # it really ran in bf16
        assert row_cosines(half, full).mean() >= 0.99
        full_vectors = colbert.encode(batch, side, device=CPU, precision="fp32")
        half_vectors = colbert.encode(batch, side, device=CPU, precision="bf16")
        assert [v.shape for v in half_vectors] == [v.shape for v in full_vectors]  # the same tokens kept
        assert row_cosines(np.concatenate(half_vectors), np.concatenate(full_vectors)).mean() >= 0.99
    assert {p.dtype for p in splade.parameters()} == {p.dtype for p in colbert.parameters()} == {torch.float32}


@needs_onednn_bf16
@pytest.mark.filterwarnings("ignore:precision bf16:UserWarning")
def test_bf16_encoding_runs_a_fused_copy_made_once_per_weights(tiny_model_dir):
    """SPLADE's copy fuses the encoder under its MLM head, ColBERT's the encoder; both are reused until the
    weights change, and the model itself stays float32."""
    from densepass.models.copies import encoder_in_precision
    from densepass.models.fused import FusedBertEncoder

    splade, colbert = SpladeEncoder.from_pretrained(str(tiny_model_dir)), ColBERT.from_pretrained(str(tiny_model_dir))
    mlm = encoder_in_precision(splade.mlm, "bf16", CPU)
    assert isinstance(getattr(mlm, mlm.base_model_prefix), FusedBertEncoder)
    assert encoder_in_precision(splade.mlm, "bf16", CPU) is mlm
    encoder = encoder_in_precision(colbert.encoder, "bf16", CPU)
    assert isinstance(encoder, FusedBertEncoder) and encoder_in_precision(colbert.encoder, "bf16", CPU) is encoder
    assert encoder_in_precision(colbert.encoder, "fp32", CPU) is colbert.encoder
    before = colbert.encode(texts(4), "passage", device=CPU, precision="bf16")
    with torch.no_grad():
        for param in colbert.encoder.parameters():
            param.add_(torch.randn_like(param))
    assert encoder_in_precision(colbert.encoder, "bf16", CPU) is not encoder
    after = colbert.encode(texts(4), "passage", device=CPU, precision="bf16")
    truth = colbert.encode(texts(4), "passage", device=CPU, precision="fp32")
    assert row_cosines(np.concatenate(after), np.concatenate(truth)).mean() >= 0.99
    assert row_cosines(np.concatenate(before), np.concatenate(truth)).mean() < 0.9  # the change mattered


def test_int8_is_refused_for_splade_and_colbert_before_any_work(splade, colbert):
    calls = {
        "SPLADE encode": lambda: splade.encode(texts(2), "passage", device=CPU, precision="int8"),
        "ColBERT encode": lambda: colbert.encode(texts(2), "query", device=CPU, precision="int8"),
        "SPLADE index": lambda: SpladeIndex(splade, device=CPU, precision="int8"),
        "ColBERT index": lambda: ColbertIndex(colbert, device=CPU, precision="int8"),
        "a typo": lambda: SpladeIndex(splade, device=CPU, precision="bf61"),
    }
    for name, call in calls.items():
        with pytest.raises(ConfigError, match="fp32 or bf16|unknown precision") as err:
            call()
        assert "\n" not in str(err.value), name


def test_sparse_search_returns_the_scores_of_the_dense_computation(splade):
    rng = np.random.default_rng(0)
    dense_docs = rng.random((30, splade.dim)) * (rng.random((30, splade.dim)) < 0.001)
    dense_queries = rng.random((5, splade.dim)) * (rng.random((5, splade.dim)) < 0.002)
    index = SpladeIndex(splade)
    index.add_weights([str(i) for i in range(30)], sp.csr_matrix(dense_docs))
    results = index.search(sp.csr_matrix(dense_queries), k=7)
    expected = dense_queries @ dense_docs.T
    for i in range(5):
        want = sorted(((float(s), j) for j, s in enumerate(expected[i]) if s > 0), key=lambda t: (-t[0], t[1]))[:7]
        got = [(float(s), int(r)) for s, r in zip(results.scores[i], results.rows[i]) if r >= 0]
        assert [r for _, r in got] == [r for _, r in want]
        np.testing.assert_allclose([s for s, _ in got], [s for s, _ in want], rtol=1e-5)


def test_splade_index_of_model_weights_equals_their_dot_products_and_prunes(splade):
    passages = texts(20)
    index = SpladeIndex.build(splade, passages, device=CPU)
    q = splade.encode_queries(["audio editor", "python kernel"], device=CPU)
    d = splade.encode_passages(passages, device=CPU).toarray()
    results = index.search(["audio editor", "python kernel"], k=20)
    for i in range(2):
        np.testing.assert_allclose(results.scores[i], np.sort(q[i].toarray()[0] @ d.T)[::-1], rtol=1e-4)
    pruned = SpladeIndex.build(splade, passages, top_terms=3, device=CPU)
    assert pruned.stats()["avg_nnz_per_passage"] <= 3 < index.stats()["avg_nnz_per_passage"]
    stats = index.stats(q)
    assert stats["avg_nnz_per_query"] == q.nnz / 2 and stats["flops"] > 0


def test_a_zero_weight_query_has_no_hits_and_a_warning(splade):
    index = SpladeIndex.build(splade, texts(5), device=CPU)
    with pytest.warns(DataWarning, match="1 of 2 queries have no term"):
        results = index.search(sp.csr_matrix(np.vstack([np.zeros(splade.dim), np.ones(splade.dim)])), k=3)
    assert (results.rows[0] == -1).all() and (results.rows[1] >= 0).all()


def test_colbert_exhaustive_search_is_exact_maxsim_and_full_probing_matches_it(colbert):
    passages = texts(25)
    index = ColbertIndex.build(colbert, passages, device=CPU, centroids=8, nprobe=8, candidates=25)
    queries = ["audio editor", "python kernel font"]
    exhaustive = index.search(queries, k=10, exhaustive=True)
    q = torch.from_numpy(colbert.encode_queries(queries, device=CPU))
    p = torch.stack([colbert(**colbert.tokenize([t], "passage"), side="passage")[0] for t in passages]).detach()
    exact = maxsim(q, p).numpy()
    for i in range(2):
        np.testing.assert_allclose(exhaustive.scores[i], np.sort(exact[i])[::-1][:10], rtol=1e-3)
    pruned = index.search(queries, k=10)  # every centroid probed, every candidate kept: the same ranking
    np.testing.assert_array_equal(pruned.rows, exhaustive.rows)
    few = ColbertIndex.build(colbert, passages, device=CPU, centroids=8, nprobe=1, candidates=3).search(queries, k=10)
    assert ((few.rows >= 0).sum(axis=1) <= 3).all()
    reranked = ColbertReranker(colbert, device=CPU).score_pairs(queries[:1] * 3, passages[:3])
    np.testing.assert_allclose(reranked, exact[0, :3], rtol=1e-3)


def test_reranking_by_colbert_reads_passages_as_its_index_does(colbert):
    """The search pipeline gave every reranker "title text", as a cross-encoder trains; ColBERT trains and indexes
    "title [SEP] text", so `--rerank` with ColBERT scored other inputs (and another order) than its own index."""
    from densepass.pipelines.search import CachedScores, rerank

    passages = [
        {"id": "a", "title": "Audacity", "text": "audio editor"},
        {"id": "b", "title": "Mutt", "text": "mail client"},
        {"id": "c", "title": "GIMP", "text": "image editor"},
    ]
    index = ColbertIndex.build(colbert, passages, device=CPU, precision="fp32")
    first = index.search(["audio editor"], k=3, exhaustive=True)
    for reranker in (
        ColbertReranker(colbert, device=CPU, precision="fp32"),
        CachedScores(ColbertReranker(colbert, precision="fp32")),
    ):
        again = rerank(first, ["audio editor"], reranker, depth=3)
        np.testing.assert_array_equal(again.rows, first.rows)
        np.testing.assert_allclose(again.scores, first.scores, rtol=1e-3)


def test_residual_codes_pack_and_unpack_and_decompress_close_to_the_vectors(colbert):
    codes = np.random.default_rng(0).integers(0, 4, size=(5, 128))
    np.testing.assert_array_equal(unpack_bits(pack_bits(codes, 2), 2), codes)
    passages = texts(25)
    index = ColbertIndex.build(colbert, passages, device=CPU, centroids=8, compression="residual", residual_bits=8)
    fp16 = ColbertIndex.build(colbert, passages, device=CPU, centroids=8)
    original = fp16.token_vectors(0, fp16.n_tokens)
    two_bits = ColbertIndex.build(colbert, passages, device=CPU, centroids=8, compression="residual", residual_bits=2)
    cosine = [
        (v * original).sum(1).mean()
        for v in (two_bits.token_vectors(0, index.n_tokens), index.token_vectors(0, index.n_tokens))
    ]
    assert 0.9 < cosine[0] < cosine[1] and cosine[1] > 0.99
    assert two_bits.stats()["bytes"] < index.stats()["bytes"] < fp16.stats()["bytes"]


@pytest.mark.parametrize("kind", ["splade", "colbert", "colbert-residual"])
def test_save_load_search_round_trips(splade, colbert, tmp_path, kind):
    passages = texts(20)
    if kind == "splade":
        splade.save(tmp_path / "model")
        model = SpladeEncoder.from_pretrained(str(tmp_path / "model"))
        index = SpladeIndex.build(model, passages, device=CPU)
    else:
        colbert.save(tmp_path / "model")
        model = ColBERT.from_pretrained(str(tmp_path / "model"))
        options = {"compression": "residual", "residual_bits": 4} if kind == "colbert-residual" else {}
        index = ColbertIndex.build(model, passages, device=CPU, centroids=6, **options)
    before = index.search(["audio editor", "python"], k=5)
    index.save(tmp_path / "index")
    loaded = load_index(tmp_path / "index", device=CPU)
    after = loaded.search(["audio editor", "python"], k=5)
    np.testing.assert_array_equal(after.rows, before.rows)
    np.testing.assert_allclose(after.scores, before.scores, rtol=1e-5)
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["kind"] == kind.split("-")[0] and manifest["stats"]["bytes"] > 0


def test_a_colbert_without_a_saved_projection_is_not_indexed(tiny_model_dir, tiny_beir, tmp_path, capsys):
    """A ColBERT started from a plain encoder has a new, random projection: its index recorded the encoder's path,
    whose next load drew another projection, so every search and update of it was refused. The CLI refuses before
    encoding; the model once saved is its saved folder's (its source), which an index records."""
    assert main(["index", str(tiny_beir), "--output", str(tmp_path / "cb"), "--kind", "colbert",
                 "--model", str(tiny_model_dir)]) == 2  # fmt: skip
    assert "has no ColBERT projection (colbert_linear.safetensors): a new one is random" in capsys.readouterr().err
    assert not (tmp_path / "cb").exists()
    colbert = ColBERT.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ConfigError, match="has no ColBERT projection"):
        colbert.check_projection_saved()
    colbert.save(tmp_path / "model")  # the saved folder is its source from here on
    ColbertIndex.build(colbert, texts(5), device=CPU, centroids=2).save(tmp_path / "api")
    assert load_index(tmp_path / "api", device=CPU).search(["audio editor"], k=2).ids(0)


# ---- training end to end ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["splade", "colbert"])
def test_both_train_end_to_end_with_abs_batches_validation_resume_and_reload(
    tiny_beir, tiny_model_dir, tmp_path, kind, monkeypatch
):
    overrides = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        "name=t",
        f"model.kind={kind}",
        "model.temperature=1.0",
        "model.passage_max_length=32",
        "model.splade.head_bias=-0.35",
        "model.splade.warmup_steps=2",
        "model.colbert.centroids=8",
        "train.batch_size=8",
        "train.epochs=2",
        "train.checkpoint_every=3",
        "train.log_every=1",
        "train.learning_rate=1e-3",
        "train.grad_cache_chunk=4",
        "negatives.pool_depth=5",
        "schedule.method=abs-greedy",  # ABS batches by BM25 similarity
        "schedule.similarity=bm25",
        "schedule.background=false",
        "validation.enabled=true",
        "validation.every_steps=3",
        "validation.subcorpus=gold",
        "eval.metrics=[mrr@10, recall@20]",
        "eval.depth=20",
        "eval.baselines=[zero-shot]",
    ]
    config = load_config(None, overrides)
    import densepass.pipelines.validation as validation

    built, build = [], validation.index_for_model  # validation searches as the final evaluation will

    def recorded(model, corpus, model_config=None, batch_size=64, device=None, **options):
        built.append((model_config, batch_size, options.get("precision")))
        return build(model, corpus, model_config, batch_size, device, **options)

    monkeypatch.setattr(validation, "index_for_model", recorded)
    results = run_experiment(config)
    assert built and all(b == (config.model, config.eval.batch_size, config.eval.precision) for b in built)
    log = [json.loads(line) for line in (tmp_path / "t" / "train_log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [0] * (len(log) // 2) + [1] * (len(log) // 2)  # learning: the test above
    assert all(np.isfinite(r["loss"]) for r in log)
    assert (tmp_path / "t" / "best-model").is_dir()
    report = (tmp_path / "t" / "report.md").read_text()
    assert ("non-zeros per passage" if kind == "splade" else "token vectors per passage") in report
    again = run_experiment(config)  # resumes from the final checkpoint: the same model
    assert again["fine-tuned"] == pytest.approx(results["fine-tuned"])
    cls = SpladeEncoder if kind == "splade" else ColBERT
    assert isinstance(cls.from_pretrained(str(tmp_path / "t" / "model")), cls)


# ---- bad input ----------------------------------------------------------------------------------------------


def test_an_index_of_another_kind_than_the_model_is_a_one_line_error(splade, colbert, tmp_path, capsys):
    splade.save(tmp_path / "splade-model")
    colbert.save(tmp_path / "colbert-model")
    model = SpladeEncoder.from_pretrained(str(tmp_path / "splade-model"))
    SpladeIndex.build(model, texts(5), device=CPU).save(tmp_path / "index")
    with pytest.raises(ConfigError, match="is a splade index; .* is a colbert model"):
        load_index(tmp_path / "index", model=ColBERT.from_pretrained(str(tmp_path / "colbert-model")))
    with pytest.raises(ConfigError, match="holds a splade model, not a bi-encoder"):
        BiEncoder.from_pretrained(str(tmp_path / "splade-model"))
    with pytest.raises(ConfigError, match="holds a colbert model, not a SPLADE model"):
        SpladeEncoder.from_pretrained(str(tmp_path / "colbert-model"))
    capsys.readouterr()
    code = main(["search", str(tmp_path / "index"), "audio", "--model", str(tmp_path / "colbert-model")])
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # after the model-loading progress bars
    assert code == 2 and last.startswith("densepass: error:") and "Traceback" not in err and "colbert model" in last


@pytest.mark.parametrize("kind", ["colbert", "splade"])
def test_a_query_longer_than_the_configured_length_is_cut_with_a_warning(colbert, splade, kind):
    index = (
        ColbertIndex.build(colbert, texts(5), device=CPU, centroids=4)
        if kind == "colbert"
        else SpladeIndex.build(splade, texts(5), device=CPU)
    )
    long_query = " ".join(["audio"] * 40)
    with pytest.warns(DataWarning, match="1 of 2 queries are longer than the model's 32 query tokens and were cut"):
        results = index.search([long_query, "audio"], k=2)
    assert results.rows.shape == (2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        index.search(["audio"], k=2)


def test_run_options_that_need_a_bi_encoder_are_refused_before_any_work(tmp_path):
    from densepass.pipelines.experiment import check

    for extra in (
        ["schedule.method=clustered"],
        ["model.projection_dim=64"],
        ["negatives.refresh_every=5"],
        ["loss.memory=moco"],
    ):
        config = load_config(None, ["model.kind=splade", f"output_dir={tmp_path}", *extra])
        with pytest.raises(ConfigError, match="model.kind=splade"):
            check(config)


def test_cli_indexes_and_searches_splade_and_colbert(splade, colbert, tiny_beir, tmp_path, capsys):
    splade.save(tmp_path / "splade")
    colbert.save(tmp_path / "colbert")
    for kind, extra in (("splade", ["--top-terms", "50"]), ("colbert", ["--compression", "residual"])):
        out = tmp_path / f"idx-{kind}"
        args = ["index", str(tiny_beir), "--kind", kind, "--model", str(tmp_path / kind), "--output", str(out)]
        assert main([*args, *extra, "--device", "cpu", "--precision", "fp32"]) == 0
        assert main(["search", str(out), "audio editor", "--k", "3", "--device", "cpu", "--precision", "bf16"]) == 0
        assert "hits" in capsys.readouterr().out
        assert main(["search", str(out), "audio", "--device", "cpu", "--precision", "int8"]) == 2
        assert capsys.readouterr().err.strip().splitlines()[-1].startswith("densepass: error:")
    fresh = subprocess.run(  # a fresh process knows the new kinds without importing them first
        [sys.executable, "-m", "densepass", "search", str(tmp_path / "idx-splade"), "audio", "--device", "cpu"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")},
    )
    assert fresh.returncode == 0, fresh.stderr[-500:]
    dense = tmp_path / "idx-bm25"
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", str(dense)]) == 0
    assert main(["search", str(dense), "audio", "--rerank", str(tmp_path / "colbert"), "--device", "cpu"]) == 0
    assert math.isfinite(float(capsys.readouterr().out.count("audio")))


def test_the_bm25_baseline_run_names_corpus_passages_not_rows(tiny_beir, tiny_model_dir, tmp_path):
    overrides = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        "train.enabled=false",
        "eval.baselines=[bm25]",
        "eval.metrics=[mrr@10]",
    ]
    run_experiment(load_config(None, overrides))
    named = {line.split()[2] for line in (tmp_path / "experiment" / "runs" / "bm25.trec").read_text().splitlines()}
    assert named and all(pid.startswith("p") for pid in named)  # the fixture's ids are p0, p1, ...


def test_the_experiment_script_runs_on_a_tiny_dataset(tiny_beir, tiny_model_dir, tmp_path):
    """experiments/sparse_late.py end to end (three kinds trained, indexed and compared), so that it cannot
    drift from the pipeline's functions unnoticed."""
    script = Path(__file__).parent.parent / "experiments" / "sparse_late.py"
    sets = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        "data.max_train_queries=16",
        "data.max_eval_queries=8",
        "data.eval_random=8",
        "model.passage_max_length=32",
        "model.colbert.centroids=8",
        "model.colbert.candidates=16",
        "train.batch_size=8",
        "eval.metrics=[mrr@10, recall@20]",
        "eval.depth=20",
    ]
    out = tmp_path / "out"
    args = [sys.executable, str(script), "--datasets", "debian", "--out", str(out), "--latency-queries", "2"]
    done = subprocess.run(args + [a for s in sets for a in ("--set", s)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((out / "debian" / "results.json").read_text())
    systems = result["systems"]
    expected = {"BM25", "bi-encoder", "SPLADE", "ColBERT", "ColBERT exhaustive", "dense + SPLADE (RRF)"}
    assert expected <= set(systems)
    for name in expected:
        assert 0.0 <= systems[name]["metrics"]["mrr@10"] <= 1.0
    assert systems["SPLADE"]["train_step_s"] > 0 and systems["ColBERT"]["index_bytes"] > 0
    assert (out / "summary.md").is_file()


def test_splade_objective_adds_flops_to_any_base_objective(splade, tiny_beir):
    """FLOPS on top of distillation: the base's loss plus the warmed-up FLOPS terms, and its state kept."""
    from densepass.data import load_dataset
    from densepass.losses.objectives import Distillation
    from densepass.training.batches import TrainingData
    from densepass.training.step import batch_tensors

    dataset = load_dataset(str(tiny_beir))
    teacher = {q: {p: float(len(q) * 3 - len(p)) for p in dataset.corpus.ids} for q in dataset.queries}
    data = TrainingData(
        dataset, "train", "[SEP]", {q: dataset.corpus.ids[::3] for q in dataset.queries}, 2, teacher_scores=teacher
    )
    batch = batch_tensors(splade, data.collate(list(range(4)), seed=(1, 0, 0)))
    base = Distillation("kl", 0.5)
    objective = base + FLOPS(lambda_q=0.1, lambda_d=0.2, warmup_steps=2, step=1)
    with torch.no_grad():
        queries = splade(batch.queries["input_ids"], batch.queries["attention_mask"], "query")
        passages = splade(batch.passages["input_ids"], batch.passages["attention_mask"], "passage")
        flops_q = (queries.abs().mean(0) ** 2).sum()
        flops_d = (passages.abs().mean(0) ** 2).sum()
        expected = base(splade, queries, passages, batch) + 0.1 / 4 * flops_q + 0.2 / 4 * flops_d
        assert float(objective(splade, queries, passages, batch)) == pytest.approx(float(expected), rel=1e-6)
    assert objective.describe().startswith("distillation: 0.5 x listwise KL (T=1) + FLOPS")
    assert objective.state_dict() == {"terms": [{}, {"step": 1}]}


def test_a_hybrid_of_a_dense_part_and_splade_builds_and_searches_in_int8(splade, tiny_beir, tiny_model_dir, tmp_path):
    # SPLADE runs no int8: next to an int8 dense part it encodes in auto at build, and at load as it was built
    splade.save(tmp_path / "splade")
    out = tmp_path / "idx-hybrid"
    args = ["index", str(tiny_beir), "--kind", "hybrid", "--model", str(tiny_model_dir), "--output", str(out)]
    assert main([*args, "--sparse-model", str(tmp_path / "splade"), "--device", "cpu", "--precision", "int8"]) == 0
    hybrid = load_index(out, device=CPU, precision="int8")
    assert [part.kind for part in (hybrid.first, hybrid.second)] == ["exact", "splade"]
    assert hybrid.first.precision == "int8" and hybrid.second.precision == resolve_precision("auto", CPU)
    scores, rows = hybrid.search_rows(["audio editor"], k=3)
    assert rows.shape == (1, 3) and (rows >= 0).all() and np.isfinite(scores).all()
    assert load_index(out, device=CPU, precision="fp32").second.precision == "fp32"
    for model in (tiny_model_dir, tmp_path / "splade"):  # --model: the model of either part, the other as recorded
        assert main(["search", str(out), "audio", "--model", str(model), "--device", "cpu"]) == 0


def test_a_hybrid_checks_its_splade_model_first_and_encodes_it_like_the_dense_part(
    splade, colbert, tiny_beir, tiny_model_dir, tmp_path, capsys, monkeypatch
):
    from densepass.pipelines import indexing

    splade.save(tmp_path / "splade")
    colbert.save(tmp_path / "colbert")
    out = tmp_path / "idx"
    args = ["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(out), "--device", "cpu"]
    assert main([*args, "--kind", "hybrid", "--sparse-model", str(tmp_path / "colbert")]) == 2
    assert capsys.readouterr().err.strip().endswith("holds a colbert model, not a SPLADE model")
    assert not list(tmp_path.glob(".idx.encoding/*.npy")) and not out.exists()  # refused before any encoding
    assert main([*args, "--kind", "exact", "--sparse-model", str(tmp_path / "splade")]) == 2
    assert capsys.readouterr().err.strip().endswith("a exact index has none")
    calls = []
    built = indexing.index_for_model
    monkeypatch.setattr(indexing, "index_for_model", lambda *a, **k: calls.append(a) or built(*a, **k))
    assert main([*args, "--kind", "hybrid", "--sparse-model", str(tmp_path / "splade"), "--batch-size", "8"]) == 0
    assert [call[3:] for call in calls] == [(8, CPU)]  # the SPLADE part's batch size and device: the command's


def test_a_colbert_reranker_scores_in_the_precision_asked_for(colbert, tiny_beir, tmp_path, capsys):
    from densepass import cli

    colbert.save(tmp_path / "colbert")
    index = str(tmp_path / "bm25")
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", index]) == 0
    rerank = ["--rerank", str(tmp_path / "colbert"), "--device", "cpu"]
    for precision in ("fp32", "bf16"):
        args = cli.build_parser().parse_args(["search", index, "audio", *rerank, "--rerank-precision", precision])
        assert cli._load_pipeline(args).reranker.describe()["precision"] == precision
    refused = "densepass: error: ColBERT models encode in fp32 or bf16 (or auto), not int8"
    assert main(["search", index, "audio", *rerank, "--rerank-precision", "int8"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == refused
    missing_run = str(tmp_path / "missing.trec")  # the precision is refused before the run file is read
    out = str(tmp_path / "out.trec")
    assert main(["rerank", str(tiny_beir), missing_run, "--model", str(tmp_path / "colbert"), "--output", out,
                 "--precision", "int8", "--device", "cpu"]) == 2  # fmt: skip
    assert capsys.readouterr().err.strip().splitlines()[-1] == refused


def test_one_string_or_a_text_that_is_no_string_is_one_line_for_every_model_kind(splade, colbert, tiny_model_dir):
    """SPLADE, ColBERT's passages and the cross-encoders encoded one string a character a row (12 rows for "audio
    editor"); ``None`` among the texts was a TypeError deep in the encoding; ``device="cpu"`` an AttributeError."""
    from densepass.models.cross_encoder import CrossEncoder

    cross = CrossEncoder.new(str(tiny_model_dir), max_length=32, device=CPU, precision="fp32")
    bi = BiEncoder.from_pretrained(str(tiny_model_dir))
    for call, message in [
        (lambda: splade.encode_queries("audio editor"), "^encode_queries takes a list of texts, not one string$"),
        (lambda: splade.encode_passages("audio editor"), "^encode_passages takes a list of texts"),
        (lambda: colbert.encode_passages("audio editor"), "^encode_passages takes a list of texts"),
        (lambda: cross.score_pairs("audio", "music"), r"^score_pairs \(queries\) takes a list of texts"),
        (lambda: ColbertReranker(colbert).score_pairs(["a"], "b"), r"^score_pairs \(passages\) takes a list"),
        (lambda: bi.encode_queries(["audio", None]), "^encode_queries: text 1 is NoneType, not a string$"),
        (lambda: splade.encode_passages(["audio", 3]), "^encode_passages: text 1 is int, not a string$"),
        (lambda: cross.score_pairs(["audio"], [None]), r"^score_pairs \(passages\): text 0 is NoneType"),
        (lambda: bi.encode_queries(["audio"], device="gpu"), "^device 'gpu' is not a torch device"),
    ]:
        with pytest.raises(ConfigError, match=message):
            call()
    assert bi.encode_queries(["audio"], device="cpu", show_progress=False).shape == (1, bi.dim)
    assert splade.encode_queries(["audio"], device="cpu").shape[0] == 1
    assert colbert.encode_queries(["audio"], device="cpu").shape[0] == 1


def test_index_settings_of_another_type_and_a_model_of_another_kind_are_one_line(splade, colbert, tmp_path):
    """``nprobe=2.5``, ``candidates=1.5`` and ``top_terms=2.5`` failed inside numpy or torch after the corpus was
    encoded; ``centroids=0`` was taken as the default; a saved ColBERT loaded as SPLADE when given a config."""
    from densepass.models.splade import SpladeArchitecture

    passages = texts(6)
    for options, said in [
        ({"nprobe": 2.5}, r"^nprobe must be a positive integer, got 2.5$"),
        ({"candidates": 1.5}, r"^candidates must be a positive integer, got 1.5$"),
        ({"centroids": 0}, r"^centroids must be a positive integer, got 0$"),
        ({"seed": "x"}, r"^seed must be an integer, got 'x'$"),
    ]:
        with pytest.raises(ConfigError, match=said):
            ColbertIndex.build(colbert, passages, device=CPU, **options)
    with pytest.raises(ConfigError, match=r"^top_terms must be a positive integer, got 2.5$"):
        SpladeIndex.build(splade, passages, device=CPU, top_terms=2.5)
    with pytest.raises(ConfigError, match=r"^top_terms must be a positive integer, got 2.5$"):
        splade.encode(passages, "passage", top_terms=2.5)
    colbert.save(tmp_path / "cb")
    with pytest.raises(ConfigError, match="colbert"):
        SpladeEncoder.from_pretrained(str(tmp_path / "cb"), config=SpladeArchitecture())
    # an index an earlier densepass saved with centroids 0 ("from the corpus's size") still loads
    ColbertIndex.build(colbert, passages, device=CPU, centroids=None).save(tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    manifest["options"]["centroids"] = 0
    (tmp_path / "idx" / "manifest.json").write_text(json.dumps(manifest))
    assert len(load_index(tmp_path / "idx").search(["audio"], k=2)) == 1
