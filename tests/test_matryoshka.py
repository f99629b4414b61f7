"""Matryoshka training (MRL): the loss against a literal loop over prefix dimensions (values and gradients, over
InfoNCE, the unified λ loss and distillation), its one-line errors, a tiny ``densepass run`` that records its
dimensions in the saved model, and sentence-transformers' ``truncate_dim`` giving densepass's prefixes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import write_tiny_beir
from densepass.config import load_config
from densepass.errors import ConfigError
from densepass.losses.batch import BatchTensors
from densepass.losses.contrastive import info_nce
from densepass.losses.matryoshka import Matryoshka, trained_dims
from densepass.losses.objectives import TEACHER_SCORES, Distillation, InfoNCE
from densepass.losses.unified import unified_loss
from densepass.models.matryoshka import check_index_dim, principal_rotation, truncate
from densepass.training.more_negatives import HARD, IN_BATCH, MultiSource, PreBatch


class Dot(torch.nn.Module):
    """The scoring part of a bi-encoder: dot products, a temperature, normalised or not."""

    def __init__(self, normalize: bool) -> None:
        super().__init__()
        self.config = type("C", (), {"temperature": 0.1, "normalize": normalize})()

    def similarity(self, q, p):
        return q.float() @ p.float().T


def batch_of(b: int, h: int, seed: int) -> BatchTensors:
    """b queries, each with its positive (column i) and h hard negatives; teacher scores for distillation."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, b + b * h, dtype=torch.bool)
    mask[0, -1] = b > 1  # one false negative masked
    teacher = torch.randn(b, 1 + h, generator=g)
    return BatchTensors({}, {}, torch.arange(b), mask, extras={TEACHER_SCORES: teacher})


def reference(base_loss, queries, passages, dims, weights, normalize):
    """Literally: for each dimension, cut every embedding to its first d numbers, normalise it again (when the
    model normalises) one row at a time, and add the weighted base loss."""
    total = 0.0
    for d, w in zip(dims, weights):
        q = torch.stack([row[:d] / row[:d].norm() if normalize else row[:d] for row in queries])
        p = torch.stack([row[:d] / row[:d].norm() if normalize else row[:d] for row in passages])
        total = total + w * base_loss(q, p)
    return total


def contrastive_ref(batch):
    return lambda q, p: info_nce((q @ p.T) / 0.1, batch.positive_index, batch.mask, False)


def unified_ref(batch, weights):
    def loss(q, p):
        sources = torch.full((len(p),), HARD, dtype=torch.long)
        sources[batch.positive_index] = IN_BATCH
        return unified_loss((q @ p.T) / 0.1, batch.positive_index, sources, weights, batch.mask)

    return loss


def kl_ref(batch, h):
    def loss(q, p):
        scores = (q @ p.T) / 0.1
        b = len(q)
        student = torch.stack(
            [torch.cat([scores[i, i : i + 1], scores[i, b + i * h : b + (i + 1) * h]]) for i in range(b)]
        )
        teacher = batch.extras[TEACHER_SCORES]
        return torch.nn.functional.kl_div(
            student.log_softmax(1), teacher.log_softmax(1), log_target=True, reduction="batchmean"
        )

    return loss


@settings(max_examples=25, deadline=None)
@given(
    b=st.integers(1, 5),
    h=st.integers(1, 2),
    seed=st.integers(0, 10_000),
    normalize=st.booleans(),
    dims=st.lists(st.integers(1, 12), min_size=1, max_size=4, unique=True),
    base=st.sampled_from(["contrastive", "unified", "kl"]),
    data=st.data(),
)
def test_the_loss_is_the_weighted_sum_of_the_base_loss_at_each_normalised_prefix(
    b, h, seed, normalize, dims, base, data
):
    weights = data.draw(st.lists(st.floats(0.1, 3.0), min_size=len(dims), max_size=len(dims)))
    g = torch.Generator().manual_seed(seed)
    q0, p0 = torch.randn(b, 12, generator=g), torch.randn(b + b * h, 12, generator=g)
    if normalize:
        q0, p0 = torch.nn.functional.normalize(q0, dim=1), torch.nn.functional.normalize(p0, dim=1)
    batch = batch_of(b, h, seed)
    if base == "contrastive":
        objective, ref = InfoNCE(), contrastive_ref(batch)
    elif base == "unified":
        lambdas = (1.0, 2.0, 0.5)
        objective, ref = MultiSource(lambdas, "unified", None, None, False), unified_ref(batch, lambdas)
    else:
        objective, ref = Distillation("kl"), kl_ref(batch, h)
    q1, p1 = q0.clone().requires_grad_(), p0.clone().requires_grad_()
    got = Matryoshka(objective, dims, weights)(Dot(normalize), q1, p1, batch)
    got.backward()
    q2, p2 = q0.clone().requires_grad_(), p0.clone().requires_grad_()
    want = reference(ref, q2, p2, dims, weights, normalize)
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q1.grad, q2.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(p1.grad, p2.grad, rtol=1e-4, atol=1e-6)


def test_one_dimension_at_full_size_is_the_base_loss():
    batch = batch_of(4, 1, 0)
    q, p = (
        torch.nn.functional.normalize(torch.randn(4, 8), dim=1),
        torch.nn.functional.normalize(torch.randn(8, 8), dim=1),
    )
    assert torch.allclose(Matryoshka(InfoNCE(), [8])(Dot(True), q, p, batch), InfoNCE()(Dot(True), q, p, batch))


def test_bad_dimensions_weights_and_bases_are_one_line_errors():
    memory = MultiSource((1.0, 1.0, 1.0), "unified", PreBatch(2), None, False)
    for args, match in [
        (([],), "empty"),
        (([8, 8],), "repeats"),
        (([0, 4],), "positive"),
        (([8, 4], [1.0]), "1 weights for 2"),
        (([8, 4], [0.0, 0.0]), "not all 0"),
        (([8, 4], [1.0, float("nan")]), ">= 0"),
    ]:
        with pytest.raises(ConfigError, match=match):
            Matryoshka(InfoNCE(), *args)
    with pytest.raises(ConfigError, match="scores the embeddings alone"):
        Matryoshka(memory, [8])
    with pytest.raises(ConfigError, match="asks for 16 dimensions of 8"):
        Matryoshka(InfoNCE(), [16, 4])(Dot(True), torch.randn(2, 8), torch.randn(2, 8), batch_of(2, 0, 0))


def test_weights_follow_their_dimensions_whatever_the_order():
    m = Matryoshka(InfoNCE(), [64, 256, 128], [0.5, 2.0, 1.0])
    assert m.dims == (256, 128, 64) and m.weights == (2.0, 1.0, 0.5)
    assert m.describe() == "Matryoshka (256, 128, 64; weights 2, 1, 0.5) of contrastive"
    # a dimension of weight 0 trains nothing: not recorded as trained (an index there would not warn)
    assert trained_dims(Matryoshka(InfoNCE(), [32, 16, 8], [1, 1, 0])) == (32, 16)


def test_index_dimensions_are_checked_against_the_model_and_its_training():
    with pytest.raises(ConfigError, match="above the model's 32"):
        check_index_dim(64, 32, None)
    with pytest.warns(UserWarning, match="not trained at 8 dimensions"):
        check_index_dim(8, 32, [32, 16])
    assert check_index_dim(16, 32, [32, 16]) == 16


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.matryoshka_weights=[1.0]", "without train.matryoshka_dims"),
        ("train.matryoshka_init=pca", "matryoshka_init without train.matryoshka_dims"),
        ("train.matryoshka_dims=[64]", "64 dimensions of a 32-dimensional model"),
        ("loss.memory=pre-batch", "loss.memory=none"),
        ("model.kind=splade", "model.kind=splade has none"),
    ],
)
def test_a_run_refuses_what_matryoshka_cannot_train_before_any_work(
    tiny_beir, tiny_model_dir, tmp_path, override, match
):
    from densepass.pipelines.experiment import run_experiment

    base = run_overrides(tiny_beir, tiny_model_dir, tmp_path)
    if override.startswith("train.matryoshka"):
        base = [o for o in base if not o.startswith("train.matryoshka")]
    with pytest.raises(ConfigError, match=match):
        run_experiment(load_config(None, [*base, override]))
    assert not (tmp_path / "mrl" / "model").exists()


def run_overrides(dataset, model_dir, output):
    return [
        f"data.name={dataset}",
        f"model.name_or_path={model_dir}",
        f"output_dir={output}",
        "name=mrl",
        "train.batch_size=8",
        "train.max_steps=3",
        "negatives.source=none",
        "eval.baselines=[]",
        "eval.metrics=[mrr@10]",
        "eval.depth=10",
        "train.matryoshka_dims=[32, 16, 8]",
        "train.matryoshka_weights=[1.0, 1.0, 0.5]",
    ]


def test_a_tiny_run_trains_records_its_dimensions_and_sentence_transformers_truncates_alike(
    tiny_beir, tiny_model_dir, tmp_path
):
    from sentence_transformers import SentenceTransformer

    from densepass.models.biencoder import BiEncoder
    from densepass.pipelines.experiment import run_experiment

    run_experiment(load_config(None, run_overrides(tiny_beir, tiny_model_dir, tmp_path)))
    run_dir = tmp_path / "mrl"
    assert "Matryoshka (32, 16, 8; weights 1, 1, 0.5) of contrastive" in (run_dir / "report.md").read_text()
    model_dir = run_dir / "model"
    assert json.loads((model_dir / "densepass.json").read_text())["matryoshka_dims"] == [32, 16, 8]
    st_config = json.loads((model_dir / "config_sentence_transformers.json").read_text())
    assert st_config["matryoshka_dims"] == [32, 16, 8]
    model = BiEncoder.from_pretrained(str(model_dir))
    assert model.config.matryoshka_dims == [32, 16, 8]
    texts = ["audio editor library", "kernel driver for printers", "python shell"]
    ours = truncate(model.encode_passages(texts, show_progress=False, precision="fp32"), 16, normalize=True)
    st_model = SentenceTransformer(str(model_dir), device="cpu", truncate_dim=16)
    theirs = st_model.encode(texts, normalize_embeddings=True)
    assert theirs.shape == (3, 16)
    np.testing.assert_allclose(theirs, ours, atol=1e-5)


def test_an_index_at_a_prefix_dimension_cuts_passages_and_queries_and_remembers_it(tiny_model_dir, tmp_path):
    from densepass.index import load_index
    from densepass.index.dense import DenseIndex
    from densepass.models.biencoder import BiEncoder

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    model.save(tmp_path / "model")
    model = BiEncoder.from_pretrained(str(tmp_path / "model"))
    passages = [
        f"{w} package for the {v}" for w in ("audio", "kernel", "python", "mail") for v in ("desktop", "server")
    ]
    queries = ["audio desktop", "python server", "mail"]
    with pytest.warns(UserWarning, match="not trained at 16 dimensions"):
        index = DenseIndex.build(model, passages, dim=16, show_progress=False, precision="fp32")
    full = model.encode_passages(passages, show_progress=False, precision="fp32")
    q_full = model.encode_queries(queries, show_progress=False, precision="fp32")
    cut = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)  # the literal prefix, normalised
    q_cut = q_full[:, :16] / np.linalg.norm(q_full[:, :16], axis=1, keepdims=True)
    np.testing.assert_allclose(index.embeddings, cut, atol=1e-6)
    scores, rows = index.search_rows(queries, 3)
    brute = q_cut @ cut.T
    np.testing.assert_array_equal(rows, np.argsort(-brute, axis=1, kind="stable")[:, :3])
    np.testing.assert_allclose(scores, np.sort(brute, axis=1)[:, ::-1][:, :3], atol=1e-5)
    assert index.search_rows(q_full, 3)[1].tolist() == rows.tolist()  # full query embeddings are cut too
    index.save(tmp_path / "index")
    manifest = json.loads((tmp_path / "index" / "manifest.json").read_text())
    assert manifest["dim"] == 16 and manifest["truncate_dim"] == 16
    loaded = load_index(tmp_path / "index")
    assert loaded.dim == 16 and loaded.search_rows(queries, 3)[1].tolist() == rows.tolist()
    loaded.upsert_embeddings([{"id": "0", "text": passages[0]}], full[:1])  # the model's embeddings, cut as add's
    np.testing.assert_allclose(loaded.embeddings[-1], cut[0], atol=1e-6)
    with pytest.raises(ConfigError, match="above the model's 32"):
        DenseIndex(model, dim=64)


def test_densepass_index_dim_on_the_command_line(tiny_beir, tiny_model_dir, tmp_path):
    from conftest import run_densepass
    from densepass.pipelines.indexing import IndexSettings
    from densepass.pipelines.search import SearchPipeline

    out = tmp_path / "idx"
    done = run_densepass(
        "index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(out), "--dim", "8", cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "not trained at 8 dimensions" in done.stderr
    assert json.loads((out / "manifest.json").read_text())["truncate_dim"] == 8
    assert SearchPipeline.load(str(out)).search("audio editor", k=3)
    bad = run_densepass(
        "index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(tmp_path / "bad"), "--dim", "64",
        cwd=tmp_path,
    )  # fmt: skip
    last = bad.stderr.strip().splitlines()[-1]  # (after transformers' progress bar of the weights)
    assert bad.returncode == 2 and last == "densepass: error: --dim 64 is above the model's 32 dimensions", bad.stderr
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="a bm25 index has none to cut"):
        IndexSettings(kind="bm25", dim=8)


def test_the_python_api_trains_matryoshka_from_its_args_or_its_loss_alike(tiny_beir, tiny_model_dir, tmp_path):
    import densepass as dp

    def call(name, **kw):
        model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
        negatives = dp.NegativesConfig(source="none")
        return dp.train(model, str(tiny_beir), output_dir=tmp_path / name, negatives=negatives, device="cpu", **kw)

    base = {"max_steps": 2, "batch_size": 6, "cpu_bf16": False, "learning_rate": 1e-3}
    by_args = call("args", args=dp.TrainConfig(**base, matryoshka_dims=[16, 32]))
    by_loss = call("loss", args=dp.TrainConfig(**base), loss=Matryoshka(InfoNCE(), [32, 16]))
    for out in (by_args, by_loss):
        assert json.loads((out.model_dir / "densepass.json").read_text())["matryoshka_dims"] == [32, 16]
    for a, b in zip(by_args.model.state_dict().values(), by_loss.model.state_dict().values()):
        assert torch.equal(a, b)
    plain = call("plain", args=dp.TrainConfig(**base))
    assert not all(
        torch.equal(a, b) for a, b in zip(plain.model.state_dict().values(), by_loss.model.state_dict().values())
    )
    with pytest.raises(ConfigError, match="asks for 64 dimensions of a 32-dimensional"):
        call("big", args=dp.TrainConfig(**base, matryoshka_dims=[64]))
    with pytest.raises(ConfigError, match="matryoshka_init starts Matryoshka training"):
        call("init-alone", args=dp.TrainConfig(**base, matryoshka_init="pca"))
    rotated = call("pca", args=dp.TrainConfig(**base, matryoshka_dims=[32, 16], matryoshka_init="pca"))
    assert json.loads((rotated.model_dir / "densepass.json").read_text())["projection_dim"] == 32
    assert rotated.model.projection is not None and by_args.model.projection is None


def test_a_one_passage_corpus_cannot_give_principal_axes_and_is_refused_before_any_work(tiny_model_dir, tmp_path):
    import densepass as dp
    from densepass.pipelines.experiment import run_experiment

    one = write_tiny_beir(tmp_path / "one", n_passages=1)
    refusal = "matryoshka_init=pca finds the principal axes .* needs at least 2 passages, the corpus has 1"
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
    args = dp.TrainConfig(max_steps=1, batch_size=2, matryoshka_dims=[32, 16], matryoshka_init="pca")
    with pytest.raises(ConfigError, match=refusal):
        dp.train(model, str(one), output_dir=tmp_path / "api", args=args, negatives=dp.NegativesConfig(source="none"))
    assert model.config.matryoshka_dims is None  # a refused call leaves the model untrained at any prefix
    overrides = [*run_overrides(one, tiny_model_dir, tmp_path / "runs"), "train.matryoshka_init=pca"]
    with pytest.raises(ConfigError, match=refusal):
        run_experiment(load_config(None, overrides))
    assert not (tmp_path / "api").exists() and not (tmp_path / "runs" / "mrl").exists()


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 40), d=st.integers(2, 12), seed=st.integers(0, 10_000))
def test_principal_rotation_is_orthogonal_and_its_prefixes_are_the_pca_projection(n, d, seed):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)) * rng.uniform(0.1, 3.0, size=d)  # unequal variances along the axes
    r = principal_rotation(x)
    np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-10)
    assert np.all(r[np.arange(d), np.abs(r).argmax(axis=1)] > 0)  # each axis signed by its largest entry
    centred = x - x.mean(axis=0)
    variances = ((centred @ r.T) ** 2).sum(axis=0)
    assert np.all(np.diff(variances) <= 1e-9 * max(variances.max(), 1.0))  # largest variance first
    # the reference: the top right singular vectors of the centred rows span the same k-dimensional subspace
    _, sv, vt = np.linalg.svd(centred, full_matrices=False)
    for k in range(1, min(n - 1, d)):
        if sv[k - 1] - sv[k] < 1e-6 * sv[0]:  # a tie: the subspace is not unique
            continue
        np.testing.assert_allclose(r[:k].T @ r[:k], vt[:k].T @ vt[:k], atol=1e-6)


def test_rotating_the_output_keeps_every_cosine_and_composes_with_a_projection(tiny_model_dir):
    from densepass.models.biencoder import BiEncoder

    texts = ["audio editor library", "kernel driver for printers", "python shell", "mail server daemon"]
    for projection_dim in (None, 24):
        model = BiEncoder.from_pretrained(str(tiny_model_dir))
        if projection_dim is not None:
            torch.manual_seed(0)
            model = BiEncoder(
                model.query_encoder,
                model.passage_encoder,
                model.tokenizer,
                model.config.__class__(**{**model.config.__dict__, "projection_dim": projection_dim}),
            )
        before = model.encode_passages(texts, show_progress=False, precision="fp32")
        rotation = principal_rotation(np.random.default_rng(1).normal(size=(50, model.dim)))
        model.rotate_output(torch.from_numpy(rotation))
        after = model.encode_passages(texts, show_progress=False, precision="fp32")
        assert model.config.projection_dim == model.dim == before.shape[1]
        np.testing.assert_allclose(after, before @ rotation.T, atol=1e-5)
        np.testing.assert_allclose(after @ after.T, before @ before.T, atol=1e-5)
    with pytest.raises(ConfigError, match=r"is \[24, 24\], got \[3, 3\]"):
        model.rotate_output(torch.eye(3))


def test_a_run_can_start_matryoshka_at_the_principal_axes_and_saves_the_rotation(tiny_beir, tiny_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    from densepass.models.biencoder import BiEncoder
    from densepass.pipelines.experiment import run_experiment

    overrides = [*run_overrides(tiny_beir, tiny_model_dir, tmp_path), "train.matryoshka_init=pca", "train.max_steps=1"]
    overrides += ["train.learning_rate=1e-12", "train.warmup_ratio=0"]  # one step that barely moves: the start itself
    run_experiment(load_config(None, overrides))
    run_dir = tmp_path / "mrl"
    assert "rotated to its principal axes (PCA of 40 corpus passages" in (run_dir / "report.md").read_text()
    model_dir = run_dir / "model"
    assert json.loads((model_dir / "densepass.json").read_text())["projection_dim"] == 32
    rotated, start = BiEncoder.from_pretrained(str(model_dir)), BiEncoder.from_pretrained(str(tiny_model_dir))
    texts = ["audio editor library", "kernel driver for printers", "python shell"]
    ours = rotated.encode_passages(texts, show_progress=False, precision="fp32")
    plain = start.encode_passages(texts, show_progress=False, precision="fp32")
    np.testing.assert_allclose(ours @ ours.T, plain @ plain.T, atol=1e-4)  # the same cosines as the start
    assert not np.allclose(ours, plain, atol=1e-3)  # in other coordinates
    theirs = SentenceTransformer(str(model_dir), device="cpu", truncate_dim=16).encode(texts, normalize_embeddings=True)
    np.testing.assert_allclose(theirs, truncate(ours, 16, normalize=True), atol=1e-5)


def _rotation_worker(rank: int, port: int, model_dir: str, beir: str, out: str) -> None:
    """One of two gloo processes starting at the principal axes; rank 1's encoder differs a little, as another
    GPU's last bits would. Saves the projection it ends with."""
    import os
    from datetime import timedelta

    import torch.distributed as dist
    from safetensors.torch import save_file

    from densepass.data import load_dataset
    from densepass.models.biencoder import BiEncoder
    from densepass.pipelines.training import start_at_principal_axes

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    torch.set_num_threads(1)
    try:
        model = BiEncoder.from_pretrained(model_dir)
        if rank == 1:
            with torch.no_grad():
                for param in model.query_encoder.encoder.parameters():
                    param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 1e-2)
        start_at_principal_axes(model, load_dataset(beir).corpus, 3, torch.device("cpu"))
        save_file(model.projection.state_dict(), f"{out}/rank{rank}.safetensors")
    finally:
        dist.destroy_process_group()


def test_every_process_starts_at_rank_zeros_principal_axes(tiny_model_dir, tiny_beir, tmp_path):
    """Under torch.distributed the processes' rotations are rank 0's, even where their own embeddings differ (the
    processes would otherwise train from other weights), and they are the rotation one process computes."""
    import socket

    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from densepass.data import load_dataset
    from densepass.models.biencoder import BiEncoder
    from densepass.pipelines.training import start_at_principal_axes

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = (port, str(tiny_model_dir), str(tiny_beir), str(tmp_path))
    mp.start_processes(_rotation_worker, args=args, nprocs=2, start_method="fork")  # no new imports: seconds
    alone, corpus = BiEncoder.from_pretrained(str(tiny_model_dir)), load_dataset(str(tiny_beir)).corpus
    start_at_principal_axes(alone, corpus, 3, torch.device("cpu"))
    # the 40 passages are the whole sample: in the rotated coordinates their covariance is diagonal, largest first
    rotated = alone.encode_passages(corpus, show_progress=False, precision="fp32").astype(np.float64)
    covariance = np.cov(rotated, rowvar=False)
    np.testing.assert_allclose(covariance - np.diag(np.diag(covariance)), 0, atol=1e-4 * covariance.max())
    assert np.all(np.diff(np.diag(covariance)) <= 1e-4 * covariance.max())
    for rank in (0, 1):
        saved = load_file(tmp_path / f"rank{rank}.safetensors")
        assert torch.equal(saved["weight"], alone.projection.weight)
        assert torch.equal(saved["bias"], alone.projection.bias)
