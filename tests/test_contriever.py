"""Contriever-style pre-training: crops and the inverse cloze task, the MoCo loss against a literal one, exact
gradient accumulation, exact resume with the queue and momentum encoder, a backbone that fine-tunes, errors, and
two gloo processes (and ``torchrun``) on shares of each batch ending with the weights of one process."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import AutoTokenizer

from conftest import run_densepass
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, resolve_model_path
from densepass.pretraining.config import PretrainConfig
from densepass.pretraining.contriever import Contriever, contriever_forward_backward
from densepass.pretraining.crops import (
    CropSettings,
    contriever_batches,
    crop_pair,
    delete_tokens,
    document_sentences,
    ict_pair,
    random_crop,
)
from densepass.pretraining.spans import group_documents
from densepass.pretraining.trainer import pretrain

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))


# ---- pairs ---------------------------------------------------------------------------------------------------


def test_crops_take_their_share_of_the_document_at_any_start():
    rng = random.Random(0)
    for length in (1, 7, 100, 256):
        for _ in range(200):
            start, end = random_crop(length, 0.05, 0.5, rng)
            assert 0 <= start < end <= length
            assert max(1, round(0.05 * length)) <= end - start <= max(1, round(0.5 * length))


def test_two_crops_come_from_one_window_and_are_drawn_independently():
    tokens = list(range(1000))
    rng = random.Random(1)
    overlaps = 0
    for _ in range(300):
        a, b = crop_pair(tokens, CropSettings(deletion=0.0, document_tokens=100), rng)
        assert a == list(range(a[0], a[-1] + 1)) and b == list(range(b[0], b[-1] + 1))  # contiguous, no deletion
        assert max(a + b) - min(a + b) < 100  # inside one 100-token window
        overlaps += bool(set(a) & set(b))
    assert 0 < overlaps < 300  # sometimes overlapping, sometimes not


def test_token_deletion_drops_about_its_share_and_never_everything():
    rng = random.Random(2)
    kept = [len(delete_tokens(list(range(100)), 0.1, rng)) for _ in range(300)]
    assert 88 < sum(kept) / len(kept) < 92
    assert all(len(delete_tokens([5, 6], 0.99, rng)) >= 1 for _ in range(100))


def test_the_inverse_cloze_task_pairs_a_sentence_with_the_rest():
    sentences = [[1, 1], [2, 2, 2], [3], [4, 4]]
    rng = random.Random(3)
    for _ in range(50):
        query, context = ict_pair(sentences, CropSettings(deletion=0.0, keep_sentence=0.0), rng)
        assert query in sentences
        assert not set(query) & set(context) and context
    _, context = ict_pair(sentences, CropSettings(deletion=0.0, keep_sentence=1.0, document_tokens=100), rng)
    assert sorted(context) == sorted(t for s in sentences for t in s)


def test_document_sentences_split_passages_and_keep_every_word(tiny_beir, tokenizer):
    corpus = load_dataset(str(tiny_beir)).corpus
    doc = group_documents(corpus)[0]  # two passages
    sentences = document_sentences(corpus, doc, tokenizer)
    text = tokenizer.decode([t for s in sentences for t in s])
    for passage in corpus.passage_inputs("[SEP]", doc):
        assert all(word in text for word in passage.lower().replace("[sep]", " ").split())
    assert text.count("[SEP]") == 3  # title [SEP] text, twice, joined by [SEP]


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (["", ""], [["[UNK]"]]),  # a document of empty passages: an IndexError
        (["", "a b. c d"], [["a", "b", "."], ["c", "d"]]),  # a [SEP] was put after the document's last sentence
        (["x.", "", "y."], [["x", ".", "[SEP]"], ["y", "."]]),  # two [SEP]s after x.
    ],
)
def test_empty_passages_of_a_document_end_no_sentence(tmp_path, tokenizer, texts, expected):

    root = tmp_path / "beir"
    root.mkdir()
    rows = [{"_id": f"p{i}", "title": "", "text": text, "doc_id": "d0"} for i, text in enumerate(texts)]
    rows.append({"_id": "other", "title": "", "text": "another document", "doc_id": "d1"})
    (root / "corpus.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "queries.jsonl").write_text(json.dumps({"_id": "q", "text": "a"}) + "\n")
    (root / "qrels").mkdir()
    (root / "qrels" / "train.tsv").write_text("query-id\tcorpus-id\tscore\nq\tother\t1\n")
    corpus = load_dataset(str(root)).corpus
    doc = next(d for d in group_documents(corpus) if corpus.ids[d[0]] == "p0")
    sentences = document_sentences(corpus, doc, tokenizer)
    assert [tokenizer.convert_ids_to_tokens(s) for s in sentences] == expected


def test_batches_pair_two_views_of_one_document_and_depend_only_on_the_seed(tiny_beir, tokenizer):
    corpus = load_dataset(str(tiny_beir)).corpus
    settings = CropSettings(ratio_min=1.0, ratio_max=1.0, deletion=0.0)
    batch = next(contriever_batches(corpus, tokenizer, 4, 64, settings, seed=5))
    assert batch["input_ids"].shape[0] == 8 and batch["documents"].shape == (4,)
    documents = group_documents(corpus)
    for i, doc in enumerate(batch["documents"].tolist()):
        query, key = (batch["input_ids"][2 * i + j][batch["attention_mask"][2 * i + j].bool()] for j in (0, 1))
        assert torch.equal(query, key)  # 100% crops without deletion: the whole (short) document, twice
        assert tokenizer.decode(query[1:-1]).split()[0] == corpus.passage_inputs("[SEP]", documents[doc])[0].split()[0]
    again = next(contriever_batches(corpus, tokenizer, 4, 64, CropSettings(), seed=5))
    other = next(contriever_batches(corpus, tokenizer, 4, 64, CropSettings(), seed=6))
    assert torch.equal(
        next(contriever_batches(corpus, tokenizer, 4, 64, CropSettings(), seed=5))["input_ids"], again["input_ids"]
    )
    assert not torch.equal(other["documents"], again["documents"])


# ---- the loss ------------------------------------------------------------------------------------------------


def _model(tiny_model_dir, negatives="moco", queue_size=6, momentum=0.5):
    torch.manual_seed(0)
    return Contriever.from_pretrained(str(tiny_model_dir), "mean", True, 0.1, 64, negatives, queue_size, momentum)


def _batches(tiny_beir, tokenizer, n=3, pairs=4):
    stream = contriever_batches(load_dataset(str(tiny_beir)).corpus, tokenizer, pairs, 64, CropSettings(), seed=1)
    return [next(stream) for _ in range(n)]


def literal_moco_loss(q, keys, queue, queue_docs, docs, temperature):
    """-log e^{q.k+/t} / (e^{q.k+/t} + sum over other keys and queue entries of other documents of e^{q.k/t})."""
    total = 0.0
    for i in range(len(q)):
        positive = float(q[i] @ keys[i]) / temperature
        denominator = math.exp(positive)
        denominator += sum(math.exp(float(q[i] @ keys[j]) / temperature) for j in range(len(keys)) if j != i)
        newest = {int(d): j for j, d in enumerate(queue_docs)}
        for j, d in enumerate(queue_docs.tolist()):
            if d not in docs and newest[d] == j:
                denominator += math.exp(float(q[i] @ queue[j]) / temperature)
        total += -(positive - math.log(denominator))
    return total / len(q)


def test_the_moco_loss_equals_the_literal_one_and_fills_the_queue(tiny_model_dir, tiny_beir, tokenizer):
    model = _model(tiny_model_dir)
    batches = _batches(tiny_beir, tokenizer)
    for batch in batches[:2]:
        contriever_forward_backward(model, batch, 1, CPU, False)
    assert len(model.queue) == 6 and model.queue.sizes == [2, 4]  # K = 6 newest keys
    batch = batches[2]
    queue, queue_docs = model.queue.reps.clone(), model.queue.keys.clone()
    model.key_encoder.update(model.encoder)  # what the step does first
    with torch.no_grad():
        keys = model.key_encoder.encode({k: batch[k][1::2] for k in ("input_ids", "attention_mask")})
        q = model.encoder(batch["input_ids"][0::2], batch["attention_mask"][0::2], side="passage")
    expected = literal_moco_loss(q, keys, queue, queue_docs, set(batch["documents"].tolist()), 0.1)
    fresh = _model(tiny_model_dir)
    for earlier in batches[:2]:
        contriever_forward_backward(fresh, earlier, 1, CPU, False)
    assert contriever_forward_backward(fresh, batch, 1, CPU, False)["loss"] == pytest.approx(expected, rel=1e-5)


def test_gradient_accumulation_over_queries_equals_the_whole_batch(tiny_model_dir, tiny_beir, tokenizer):
    grads = {}
    for accumulation in (1, 3):
        model = _model(tiny_model_dir)
        for batch in _batches(tiny_beir, tokenizer, pairs=6):
            model.zero_grad()
            contriever_forward_backward(model, batch, accumulation, CPU, False)
        grads[accumulation] = {n: p.grad.clone() for n, p in model.encoder.named_parameters() if p.grad is not None}
    for name, grad in grads[1].items():
        torch.testing.assert_close(grads[3][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not any(p.requires_grad for p in model.key_encoder.parameters())


def test_in_batch_mode_trains_both_views_against_the_batch(tiny_model_dir, tiny_beir, tokenizer):
    model = _model(tiny_model_dir, negatives="in-batch")
    assert model.key_encoder is None and model.queue is None
    batch = _batches(tiny_beir, tokenizer, n=1)[0]
    views = [model.encoder(batch["input_ids"][j::2], batch["attention_mask"][j::2], side="passage") for j in (0, 1)]
    for view in views:
        view.retain_grad()
    scores = (views[0] @ views[1].T / 0.1).tolist()
    expected = sum(-(row[i] - math.log(sum(map(math.exp, row)))) for i, row in enumerate(scores)) / len(scores)
    torch.nn.functional.cross_entropy(views[0] @ views[1].T / 0.1, torch.arange(len(scores))).backward()
    assert all(view.grad.abs().sum() > 0 for view in views)  # the loss reaches both views
    assert contriever_forward_backward(model, batch, 1, CPU, False)["loss"] == pytest.approx(expected, rel=1e-5)
    with pytest.raises(ConfigError, match="grad_accumulation 1"):
        contriever_forward_backward(model, batch, 2, CPU, False)


# ---- the run -------------------------------------------------------------------------------------------------


def _config(tiny_beir, tiny_model_dir, tmp_path, *extra) -> PretrainConfig:
    return load_config(
        None,
        [
            f"data.name={tiny_beir}",
            f"model.name_or_path={tiny_model_dir}",
            f"output_dir={tmp_path}",
            "name=ct",
            "model.mode=contriever",
            "model.temperature=0.1",
            "model.save_pooling=mean",
            "contriever.queue_size=10",
            "contriever.momentum=0.9",
            "contriever.ict_probability=0.5",
            "train.max_steps=6",
            "train.batch_size=8",
            "train.max_length=32",
            "train.checkpoint_every=3",
            "train.log_every=1",
            *extra,
        ],
        PretrainConfig,
    )


def test_an_interrupted_contriever_run_resumes_to_bitwise_equal_weights(tiny_beir, tiny_model_dir, tmp_path):
    config = _config(tiny_beir, tiny_model_dir, tmp_path, "train.grad_accumulation=2")
    result = pretrain(config)
    run = config.run_dir
    assert result.steps == 6 and "MoCo queue K=10" in (run / "report.md").read_text()
    first = BiEncoder.from_pretrained(str(run / "backbone")).state_dict()
    shutil.rmtree(run / "checkpoints" / "step-6")  # as if interrupted after step 3's checkpoint
    pretrain(config)
    second = BiEncoder.from_pretrained(str(run / "backbone")).state_dict()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_the_backbone_fine_tunes_and_loads_as_a_bi_encoder(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.pipelines.experiment import run_experiment

    config = _config(tiny_beir, tiny_model_dir, tmp_path, "train.max_steps=2")
    backbone = pretrain(config).backbone_path
    model = BiEncoder.from_pretrained(str(backbone))
    assert model.config.pooling == "mean" and model.config.normalize
    fine_tune = load_config(
        None,
        [
            f"data.name={tiny_beir}",
            f"model.name_or_path={backbone}",
            f"output_dir={tmp_path}",
            "name=ft",
            "negatives.source=none",
            "train.batch_size=8",
            "eval.baselines=[zero-shot]",
            "eval.metrics=[mrr@10]",
            "eval.depth=10",
        ],
    )
    results = run_experiment(fine_tune)
    assert set(results) == {"zero-shot", "fine-tuned"}


def test_a_saved_run_without_its_queue_is_a_one_line_error(tiny_model_dir):
    model = _model(tiny_model_dir)
    with pytest.raises(ConfigError, match="no saved MoCo queue") as error:
        model.load_memory_state({})
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("contriever.queue_size=0", "contriever.queue_size: must be >= 1, got 0"),
        ("contriever.crop_ratio_min=0", "contriever.crop_ratio_min: must be > 0"),
        ("contriever.crop_ratio_min=0.6", "crop ratios need 0 < min <= max <= 1"),
        ("train.batch_size=2", "even batch size >= 4"),
        ("contriever.negatives=in-batch", "grad_accumulation 1"),
        ("contriever.token_deletion=1", "must be <= 0.99"),
    ],
)
def test_bad_contriever_settings_are_one_line_errors(tiny_beir, tiny_model_dir, tmp_path, override, message):
    with pytest.raises(ConfigError) as error:
        pretrain(_config(tiny_beir, tiny_model_dir, tmp_path, "train.grad_accumulation=2", override))
    assert message in str(error.value) and "\n" not in str(error.value)


# ---- torch.distributed ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _step_gradients(model_dir, beir, negatives: str, accumulation: int, pairs: int) -> tuple[float, dict]:
    """The loss of a second step (MoCo: its queue holds the first's keys) and the gradients it leaves, summed over
    processes."""
    from densepass.training.distributed import sum_gradients

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    model = _model(model_dir, negatives)
    for batch in _batches(beir, tokenizer, n=2, pairs=pairs):
        model.zero_grad()
        loss = contriever_forward_backward(model, batch, accumulation, CPU, False)["loss"]
        sum_gradients(model.encoder.parameters())
    return loss, {n: p.grad.clone() for n, p in model.encoder.named_parameters() if p.grad is not None}


def _pretrain_worker(rank, world, port, beir, model_dir, out_dir, extra, step):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        gradients = _step_gradients(model_dir, beir, *step)
        torch.save(gradients, Path(out_dir) / f"step-rank{rank}.pt")
        pretrain(_config(Path(beir), Path(model_dir), Path(out_dir), *extra))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("negatives", "documents", "accumulation"),
    [
        ("moco", 6, 2),  # 3 documents a process, in micro-batches of 2 and 1 (one process: the whole batch at once)
        ("in-batch", 5, 1),  # shares of 3 and 2 documents
    ],
)
def test_two_gloo_processes_end_with_the_weights_of_one_process_on_the_whole_batch(
    tiny_beir, tiny_model_dir, tmp_path, negatives, documents, accumulation
):
    settings = [f"contriever.negatives={negatives}", f"train.batch_size={2 * documents}", "train.max_steps=4"]
    common = [*settings, "train.cpu_bf16=false"]  # float32: bf16 rounding would blur the comparison
    extra = [*common, f"train.grad_accumulation={accumulation}"]
    (tmp_path / "dist").mkdir()
    step = (negatives, accumulation, documents)
    args = (2, _free_port(), str(tiny_beir), str(tiny_model_dir), str(tmp_path / "dist"), extra, step)
    mp.spawn(_pretrain_worker, args=args, nprocs=2)
    loss, grads = _step_gradients(tiny_model_dir, tiny_beir, negatives, 1, documents)
    for rank in range(2):  # one step: the global batch's loss, and its gradient once (not once per process)
        got_loss, got_grads = torch.load(tmp_path / "dist" / f"step-rank{rank}.pt")
        assert got_loss == pytest.approx(loss, rel=1e-5) and got_grads.keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    single = pretrain(_config(tiny_beir, tiny_model_dir, tmp_path / "single", *common))
    dist_run, single_run = tmp_path / "dist" / "ct", single.backbone_path.parent
    got = BiEncoder.from_pretrained(str(dist_run / "backbone")).state_dict()
    expected = BiEncoder.from_pretrained(str(single.backbone_path)).state_dict()
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=name)

    def losses(run: Path) -> list[float]:
        return [json.loads(line)["loss"] for line in (run / "train_log.jsonl").read_text().splitlines()]

    assert len(losses(dist_run)) == 4  # written once, by rank 0, with the global batch's loss
    assert losses(dist_run) == pytest.approx(losses(single_run), rel=1e-4)
    assert (dist_run / "report.md").is_file() and (dist_run / "config.yaml").is_file()


def test_densepass_pretrain_runs_contriever_under_torchrun(tiny_beir, tiny_model_dir, tmp_path):
    settings = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        "name=ct",
        "model.mode=contriever",
        "contriever.queue_size=10",
        "train.max_steps=3",
        "train.batch_size=8",
        "train.grad_accumulation=2",
        "train.max_length=32",
        "train.log_every=1",
    ]
    done = run_densepass("pretrain", *(arg for kv in settings for arg in ("--set", kv)), cwd=tmp_path, processes=2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("backbone:") == 1  # printed by rank 0 alone
    run = tmp_path / "ct"
    assert len((run / "train_log.jsonl").read_text().splitlines()) == 3
    assert "MoCo queue K=10" in (run / "report.md").read_text()
    assert BiEncoder.from_pretrained(str(run / "backbone")).config.shared  # the trained encoder, saved once
    assert not list(run.rglob("*.tmp"))  # no partial file of a second writer
