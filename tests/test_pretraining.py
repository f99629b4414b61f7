"""Condenser / coCondenser pre-training: architecture, losses, masking, spans, saving, resume, attention."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModel, AutoTokenizer, BertForMaskedLM

from densepass.analysis.attention import attention_entropy, cls_attention_entropy, entropy_shift, plot_entropy
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError, DensepassError
from densepass.models.biencoder import BiEncoder, resolve_model_path
from densepass.pretraining.condenser import Condenser, head_input, mlm_loss, span_contrastive_loss
from densepass.pretraining.config import PretrainConfig
from densepass.pretraining.data import collate, mlm_batches, packed_sequences, span_batches
from densepass.pretraining.masking import IGNORE, Masker
from densepass.pretraining.spans import group_documents, span_pair
from densepass.pretraining.trainer import forward_backward, pretrain

TEXTS = [
    "the printer driver supports colour laser devices",
    "a terminal multiplexer for unix shells",
    "python bindings for the kernel keyring",
    "backup archive viewer with compression",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))


def make(tiny_model_dir, mode="condenser", head_layers=2) -> Condenser:
    torch.manual_seed(0)
    return Condenser.from_pretrained(str(tiny_model_dir), mode, early_layers=1, head_layers=head_layers).eval()


def masked_batch(model: Condenser, seed: int = 0):
    tokens = model.tokenizer(TEXTS, padding=True, return_tensors="pt")
    ids, labels = Masker.from_tokenizer(model.tokenizer, probability=0.3)(
        tokens["input_ids"], tokens["attention_mask"], torch.Generator().manual_seed(seed)
    )
    return ids, tokens["attention_mask"], labels


def test_head_input_is_late_cls_then_early_tokens(tiny_model_dir):
    model = make(tiny_model_dir)
    ids, mask, _ = masked_batch(model)
    early, late = model.encode(ids, mask)
    x = head_input(early, late)
    assert x.shape == early.shape == late.shape == (*ids.shape, 32)
    assert torch.equal(x[:, 0], late[:, 0]) and torch.equal(x[:, 1:], early[:, 1:])
    assert not torch.allclose(early[:, 0], late[:, 0])


def test_head_gradient_reaches_late_layers_only_through_cls(tiny_model_dir):
    model = make(tiny_model_dir)
    ids, mask, labels = masked_batch(model)
    early, late = model.encode(ids, mask)
    early, late = early.detach().requires_grad_(), late.detach().requires_grad_()
    masked = labels != IGNORE

    def head_loss(e, late):
        return mlm_loss(model.mlm_head(model.run_head(e, late, mask)[masked]), labels[masked])

    loss = head_loss(early, late)
    loss.backward()
    assert late.grad[:, 1:].abs().max() == 0 and late.grad[:, 0].abs().max() > 0
    assert early.grad[:, 0].abs().max() == 0 and early.grad[:, 1:].abs().max() > 0
    perturbed = late.detach().clone()
    perturbed[:, 1:] += torch.randn_like(perturbed[:, 1:])
    assert torch.equal(head_loss(early.detach(), perturbed), loss.detach())
    # Through the whole model: the head loss trains both the early and the late layers (late via CLS).
    model.zero_grad()
    model(ids, mask, labels).head_mlm.backward()
    for layer in model.backbone.encoder.layer:
        assert layer.attention.self.query.weight.grad.abs().max() > 0


def test_mlm_loss_equals_hand_computed_cross_entropy(tiny_model_dir):
    model = make(tiny_model_dir)
    ids, mask, labels = masked_batch(model)
    out = model(ids, mask, labels)
    early, late = model.encode(ids, mask)
    expected = {}
    for name, hidden in (("late", late), ("head", model.run_head(early, late, mask))):
        logits = model.mlm_head(hidden).double()
        terms = [
            -torch.log_softmax(logits[b, i], -1)[labels[b, i]]
            for b in range(ids.shape[0])
            for i in range(ids.shape[1])
            if labels[b, i] != IGNORE
        ]
        expected[name] = sum(terms) / len(terms)
    assert out.n_masked == int((labels != IGNORE).sum()) > 0
    assert out.late_mlm.item() == pytest.approx(expected["late"].item(), rel=1e-5)
    assert out.head_mlm.item() == pytest.approx(expected["head"].item(), rel=1e-5)
    assert model.loss(out).item() == pytest.approx((expected["late"] + expected["head"]).item(), rel=1e-5)


def test_mlm_mode_is_bert_for_masked_lm_and_projection_is_shared(tiny_model_dir):
    model = make(tiny_model_dir, mode="mlm")
    assert model.head is None
    W = model.mlm_head.predictions.decoder.weight
    assert W is model.backbone.embeddings.word_embeddings.weight
    ids, mask, labels = masked_batch(model)
    reference = BertForMaskedLM(model.backbone.config).eval()
    reference.bert.load_state_dict(model.backbone.state_dict(), strict=False)
    reference.cls.load_state_dict(model.mlm_head.state_dict())
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert model(ids, mask, labels).late_mlm.item() == pytest.approx(expected.item(), rel=1e-5)
    condenser = make(tiny_model_dir)
    assert sum(isinstance(m, type(condenser.mlm_head)) for m in condenser.modules()) == 1


def test_a_checkpoint_with_an_mlm_head_starts_with_it(tmp_path, tiny_model_dir):
    """Condenser §3.4 starts everything but the head from BERT: a BertForMaskedLM's trained prediction head was
    dropped for a random one (another loss from the first step). Now the MLM loss is the checkpoint's own."""
    from conftest import tiny_bert_config

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    torch.manual_seed(0)
    reference = BertForMaskedLM(tiny_bert_config(tokenizer.vocab_size)).eval()
    with torch.no_grad():
        reference.cls.predictions.transform.dense.weight.normal_()
        reference.cls.predictions.bias.normal_()
    reference.save_pretrained(tmp_path / "mlm")
    tokenizer.save_pretrained(tmp_path / "mlm")
    for mode in ("mlm", "condenser"):
        model = Condenser.from_pretrained(str(tmp_path / "mlm"), mode=mode, early_layers=1).eval()
        head = model.mlm_head.predictions
        assert torch.equal(head.transform.dense.weight, reference.cls.predictions.transform.dense.weight)
        assert (
            head.decoder.weight is model.backbone.embeddings.word_embeddings.weight and head.decoder.bias is head.bias
        )
    ids, mask, labels = masked_batch(model)
    expected = reference(input_ids=ids, attention_mask=mask, labels=labels).loss
    assert model(ids, mask, labels).late_mlm.item() == pytest.approx(expected.item(), rel=1e-5)


def test_bad_configuration_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="early_layers"):
        Condenser.from_pretrained(str(tiny_model_dir), "condenser", early_layers=2)
    with pytest.raises(ConfigError, match="mode"):
        Condenser.from_pretrained(str(tiny_model_dir), "bert")


def test_masking_statistics(tokenizer):
    rng = random.Random(0)
    words = (
        "network printer driver kernel compiler multiplexer keyring orchestration unicode "
        "the of a bindings libxml2 gtk3 pulseaudio"
    ).split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(5, 40))) for _ in range(600)]
    tokens = tokenizer(texts, padding=True, return_tensors="pt")
    ids, mask = tokens["input_ids"], tokens["attention_mask"]
    masker = Masker.from_tokenizer(tokenizer)
    out, labels = masker(ids, mask, torch.Generator().manual_seed(1))
    selected = labels != IGNORE
    maskable = mask.bool() & ~masker.special[ids]
    assert not (selected & ~maskable).any()  # never special tokens or padding
    assert torch.equal(labels[selected], ids[selected])
    assert torch.equal(out[~selected], ids[~selected])
    n = int(selected.sum())
    assert n / int(maskable.sum()) == pytest.approx(0.15, abs=0.01)
    as_mask = (out[selected] == tokenizer.mask_token_id).sum().item() / n
    unchanged = (out[selected] == ids[selected]).sum().item() / n
    assert as_mask == pytest.approx(0.8, abs=0.02)
    assert unchanged == pytest.approx(0.1, abs=0.015)
    assert 1 - as_mask - unchanged == pytest.approx(0.1, abs=0.015)
    assert not masker.special[out[selected & (out != tokenizer.mask_token_id) & (out != ids)]].any()
    # whole words: every piece of a word shares the word's fate
    whole = Masker.from_tokenizer(tokenizer, whole_word=True)
    _, labels = whole(ids, mask, torch.Generator().manual_seed(2))
    selected = labels != IGNORE
    word_ids = whole.word_ids(ids)
    multi = 0
    for row in range(ids.shape[0]):
        for word in word_ids[row].unique():
            cells = (word_ids[row] == word) & maskable[row]
            if cells.sum() > 1:
                multi += 1
                assert selected[row][cells].all() or not selected[row][cells].any()
    assert multi > 100
    assert selected.sum() / maskable.sum() == pytest.approx(0.15, abs=0.04)


def test_word_ids_follow_wordpiece_continuations(tokenizer):
    ids = tokenizer(["pulseaudio keyring"], return_tensors="pt")["input_ids"]
    pieces = tokenizer.convert_ids_to_tokens(ids[0])
    words = Masker.from_tokenizer(tokenizer).word_ids(ids)[0].tolist()
    for i in range(1, len(pieces)):
        assert (words[i] == words[i - 1]) == pieces[i].startswith("##")


def test_span_pairs_lie_in_their_document(tiny_beir, tokenizer):
    corpus = load_dataset(str(tiny_beir)).corpus
    docs = group_documents(corpus)
    assert sum(len(d) for d in docs) == len(corpus)
    assert all(len({corpus.doc_ids[p] for p in d}) == 1 for d in docs)
    rng = random.Random(0)
    for length in [1, 5, 30, 200]:
        for _ in range(50):
            for start, end in span_pair(length, 4, 20, rng):
                assert 0 <= start < end <= length and end - start == min(length, end - start)
                assert min(4, length) <= end - start <= 20
    batch = next(span_batches(corpus, tokenizer, 8, 64, 4, 20, seed=3))
    assert batch["input_ids"].shape[0] == 8
    rows = [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    sep = tokenizer.sep_token_id
    doc_tokens = []
    for d in docs:
        tokens = []
        for text in corpus.passage_inputs(tokenizer.sep_token, d):
            tokens += tokenizer(text, add_special_tokens=False)["input_ids"] + [sep]
        doc_tokens.append(tokens[:-1])
    for i in range(0, 8, 2):
        bodies = [rows[i][1:-1], rows[i + 1][1:-1]]
        assert all(rows[j][0] == tokenizer.cls_token_id and rows[j][-1] == sep for j in (i, i + 1))
        owners = [
            [k for k, t in enumerate(doc_tokens) if any(t[s : s + len(b)] == b for s in range(len(t)))] for b in bodies
        ]
        assert set(owners[0]) & set(owners[1])  # both spans come from one document
        assert all(4 <= len(b) <= 20 for b in bodies)


def test_single_passage_document_gives_two_spans_of_it(tiny_beir, tokenizer):
    corpus = load_dataset(str(tiny_beir)).corpus
    single = corpus.subset([0, 2, 4, 6])  # one passage per document
    batch = next(span_batches(single, tokenizer, 8, 64, 60, 62, seed=0))
    rows = [r[m.bool()].tolist() for r, m in zip(batch["input_ids"], batch["attention_mask"])]
    for i in range(0, 8, 2):
        assert rows[i] == rows[i + 1]  # spans longer than the passage: the whole passage, twice


def test_packing_keeps_every_token(tiny_beir, tokenizer):
    corpus = load_dataset(str(tiny_beir)).corpus
    sequences = list(packed_sequences(corpus, tokenizer, 24, seed=0, epoch=0))
    assert all(len(s) == 24 for s in sequences[:-1]) and len(sequences[-1]) <= 24
    assert all(s[0] == tokenizer.cls_token_id and s[-1] == tokenizer.sep_token_id for s in sequences)
    stream = [t for s in sequences for t in s[1:-1]]
    total = sum(
        len(tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in corpus.passage_inputs(tokenizer.sep_token)
    )
    assert len(stream) == total - 1
    batch = next(mlm_batches(corpus, tokenizer, 4, 24, seed=0))
    assert batch["input_ids"].shape == (4, 24) and batch["attention_mask"].all()
    assert collate([[1, 2], [3]], 0)["attention_mask"].tolist() == [[1, 1], [1, 0]]


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5), st.integers(1, 6), st.floats(0.2, 3.0), st.integers(0, 10_000))
def test_span_contrastive_loss_matches_eq10(n, dim, temperature, seed):
    h = torch.randn(2 * n, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    total = 0.0
    for i in range(n):
        for j in range(2):
            a, b = 2 * i + j, 2 * i + 1 - j
            s = lambda x, y: math.exp(float(h[x] @ h[y]) / temperature)  # noqa: E731
            denom = sum(s(a, k) for k in range(2 * n) if k != a)
            total += -math.log(s(a, b) / denom)
    assert span_contrastive_loss(h, temperature).item() == pytest.approx(total / (2 * n), rel=1e-6, abs=1e-9)


def test_grad_cache_accumulation_equals_full_batch(tiny_model_dir, tiny_beir):
    model = make(tiny_model_dir, mode="cocondenser")
    corpus = load_dataset(str(tiny_beir)).corpus
    batch = next(span_batches(corpus, model.tokenizer, 8, 32, 4, 16, seed=0))
    batch["input_ids"], batch["labels"] = Masker.from_tokenizer(model.tokenizer)(
        batch["input_ids"], batch["attention_mask"], torch.Generator().manual_seed(0)
    )
    grads = []
    for parts in (1, 4):
        model.zero_grad()
        terms = forward_backward(model, dict(batch), parts, torch.device("cpu"), bf16=False)
        grads.append((terms, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    (t1, g1), (t4, g4) = grads
    assert t1["loss"] == pytest.approx(t4["loss"], rel=1e-5) and t1["contrastive"] > 0
    assert len(g1) == len(g4) and all(torch.allclose(a, b, atol=1e-5, rtol=1e-4) for a, b in zip(g1, g4))


def test_saved_backbone_loads_everywhere_with_identical_outputs(tiny_model_dir, tmp_path):
    model = make(tiny_model_dir, mode="cocondenser")
    with torch.no_grad():  # move the backbone away from its initial weights
        for p in model.backbone.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.save_backbone(tmp_path / "bb")
    tokens = model.tokenizer(TEXTS, padding=True, return_tensors="pt")
    _, late = model.encode(tokens["input_ids"], tokens["attention_mask"])
    loaded = AutoModel.from_pretrained(tmp_path / "bb").eval()
    assert type(loaded).__name__ == "BertModel"
    assert not any("head" in k for k in loaded.state_dict())
    assert torch.allclose(loaded(**tokens).last_hidden_state, late, atol=1e-6)
    encoder = BiEncoder.from_pretrained(str(tmp_path / "bb"))
    assert encoder.config.pooling == "cls"
    assert torch.allclose(encoder(tokens["input_ids"], tokens["attention_mask"], "passage"), late[:, 0], atol=1e-6)
    from sentence_transformers import SentenceTransformer

    st_model = SentenceTransformer(str(tmp_path / "bb"), device="cpu")
    assert torch.allclose(torch.as_tensor(st_model.encode(TEXTS[:1])[0]), late[0, 0], atol=1e-5)


def test_entropy_against_hand_computed_attention(tiny_model_dir):
    attention = torch.zeros(2, 2, 3, 3)
    attention[0, 0, 0] = torch.tensor([0.5, 0.5, 0.0])
    attention[0, 1, 0] = torch.tensor([1.0, 0.0, 0.0])
    attention[1, :, 0] = torch.tensor([0.2, 0.3, 0.5])
    h = cls_attention_entropy(attention)
    expected = -(0.2 * math.log(0.2) + 0.3 * math.log(0.3) + 0.5 * math.log(0.5))
    assert torch.allclose(h, torch.tensor([[math.log(2), 0.0], [expected, expected]], dtype=h.dtype))
    # a real model: layer 1's CLS attention rebuilt by hand from the embeddings and Q/K weights
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    bert = AutoModel.from_pretrained(tiny_model_dir).eval()
    text = TEXTS[0]
    ids = tokenizer([text], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        x = bert.embeddings(input_ids=ids)[0]
        attn = bert.encoder.layer[0].attention.self
        heads, size = bert.config.num_attention_heads, bert.config.hidden_size // bert.config.num_attention_heads
        q, k = attn.query(x).view(-1, heads, size), attn.key(x).view(-1, heads, size)
        probs = torch.softmax(torch.einsum("hd,khd->hk", q[0], k) / math.sqrt(size), -1)
    by_hand = float(-(probs * probs.log()).sum(-1).mean())
    assert attention_entropy(str(tiny_model_dir), [text])[0] == pytest.approx(by_hand, rel=1e-5)


def test_entropy_shift_and_panel_plot(tmp_path):
    results = {"A pre-trained": [1.0, 2.0, 3.0], "A fine-tuned": [1.5, 2.0, 1.0], "B pre-trained": [0.0, 0.0, 0.0]}
    assert entropy_shift(results["A pre-trained"], results["A fine-tuned"]) == pytest.approx((0.5 + 0 + 2) / 3)
    with pytest.raises(DensepassError, match="3 vs 2 layers"):
        entropy_shift([1.0, 2.0, 3.0], [1.0, 2.0])
    out = tmp_path / "fig" / "attention.png"
    plot_entropy(results, out, panels={"A": ["A pre-trained", "A fine-tuned"], "B": ["B pre-trained"]})
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(DensepassError, match="no entropy for \\['C'\\]"):
        plot_entropy(results, out, panels={"C": ["C"]})


def _config(tiny_beir, tiny_model_dir, tmp_path, *extra) -> PretrainConfig:
    return load_config(
        None,
        [
            f"data.name={tiny_beir}",
            f"model.name_or_path={tiny_model_dir}",
            f"output_dir={tmp_path}",
            "name=pt",
            "model.early_layers=1",
            "train.max_steps=4",
            "train.batch_size=4",
            "train.max_length=32",
            "train.checkpoint_every=2",
            "train.log_every=1",
            *extra,
        ],
        PretrainConfig,
    )


def test_pretrain_run_directory_and_exact_resume(tiny_beir, tiny_model_dir, tmp_path, monkeypatch):
    import shutil

    from densepass.pretraining import trainer

    config = _config(tiny_beir, tiny_model_dir, tmp_path, "model.mode=cocondenser", "train.grad_accumulation=2")
    result = pretrain(config)
    run = config.run_dir
    assert result.steps == 4 and (run / "report.md").is_file() and (run / "loss.png").is_file()
    assert (run / "config.yaml").is_file() and "## " not in (run / "report.md").read_text()[:2]
    first = AutoModel.from_pretrained(run / "backbone").state_dict()
    log = (run / "train_log.jsonl").read_text()
    assert len(log.splitlines()) == 4
    shutil.rmtree(run / "checkpoints" / "step-4")  # as if interrupted after step 2's checkpoint
    calls = []
    monkeypatch.setattr(trainer, "forward_backward", lambda *a: calls.append(1) or forward_backward(*a))
    pretrain(config)
    assert len(calls) == 2  # resumed at step 2, not restarted
    second = AutoModel.from_pretrained(run / "backbone").state_dict()
    assert all(torch.allclose(first[k], second[k], atol=1e-6) for k in first)
    assert (run / "train_log.jsonl").read_text().splitlines()[:2] == log.splitlines()[:2]
    assert len((run / "train_log.jsonl").read_text().splitlines()) == 4


def test_pretrain_cli_and_config_errors(tiny_beir, tiny_model_dir, tmp_path, capsys):
    from densepass.cli import main

    args = [
        "pretrain",
        "--set",
        f"data.name={tiny_beir}",
        "--set",
        f"model.name_or_path={tiny_model_dir}",
        "--set",
        f"output_dir={tmp_path}",
        "--set",
        "model.early_layers=1",
        "--set",
        "train.max_steps=1",
        "--set",
        "train.batch_size=2",
        "--set",
        "train.max_length=16",
        "--set",
        "model.mode=mlm",
    ]
    assert main(args) == 0
    assert (tmp_path / "pretrain" / "backbone" / "config.json").is_file()
    assert main([*args, "--set", "train.grad_accumulaton=2"]) == 2
    assert "grad_accumulation" in capsys.readouterr().err
    assert main([*args, "--set", "train.grad_accumulation=3"]) == 2


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["masking.probability=1.0"], r"^masking probability must be in \(0, 1\), got 1.0$"),
        (["model.mode=cocondenser", "train.span_min_tokens=40"], r"exceeds the longest span that fits .* \(30\)$"),
        (["model.mode=cocondenser", "train.batch_size=5"], r"^coCondenser needs an even batch size >= 4"),
        (["model.mode=cocondenser", "train.batch_size=200"], r"documents cannot fill a batch of 100 span pairs$"),
    ],
)
def test_a_restart_refused_by_the_masking_or_the_batches_removes_nothing(tiny_beir, tiny_model_dir, tmp_path, extra,
                                                                          message):  # fmt: skip
    """``pretrain --restart`` with settings the masker or the batch stream refuse: their checks came after the
    restart's removal, so the earlier run's backbone, checkpoints and log were gone."""
    from densepass.errors import DensepassError

    run = _config(tiny_beir, tiny_model_dir, tmp_path, "train.max_steps=1").run_dir
    pretrain(_config(tiny_beir, tiny_model_dir, tmp_path, "train.max_steps=1"))
    before = sorted(p.relative_to(run) for p in run.rglob("*") if ".lock" not in p.name)
    with pytest.raises(DensepassError, match=message):
        pretrain(_config(tiny_beir, tiny_model_dir, tmp_path, "train.max_steps=1", *extra), restart=True)
    assert sorted(p.relative_to(run) for p in run.rglob("*") if ".lock" not in p.name) == before


# two runs of two gloo processes: coCondenser with accumulation (shares of 3 spans in micro-batches of 2 and 1, the
# contrastive pool gathered from both processes) and Condenser on shares of 3 and 2 sequences (uneven MLM weights)
DISTRIBUTED_RUNS = {
    "co": ("model.mode=cocondenser", "train.batch_size=6", "train.grad_accumulation=2"),
    "cd": ("model.mode=condenser", "train.batch_size=5"),
}


def _distributed_config(tiny_beir, tiny_model_dir, out, extra) -> PretrainConfig:
    return _config(tiny_beir, tiny_model_dir, out, *extra, "train.cpu_bf16=false")  # float32: no bf16 blur


def _pretrain_worker(rank, world, port, beir, model_dir, out_dir):
    import os
    from pathlib import Path

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        for name, extra in DISTRIBUTED_RUNS.items():
            pretrain(_distributed_config(Path(beir), Path(model_dir), Path(out_dir) / "dist" / name, extra))
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_end_with_the_weights_of_one_process_on_the_whole_batch(tiny_beir, tiny_model_dir, tmp_path):
    """Each process trains on its share of every step's sequences (the same masks: seeded by the step), its MLM
    terms weighed by the global batch's masked tokens and coCondenser's contrastive loss on the CLS vectors of both
    processes: the summed gradient is the whole batch's, so the backbone equals one process's up to float rounding
    (one thread in every run: only the order of sums differs). Rank 0 alone writes the log, with the global loss."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_pretrain_worker, args=(2, port, str(tiny_beir), str(tiny_model_dir), str(tmp_path)), nprocs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        singles = {
            name: pretrain(_distributed_config(tiny_beir, tiny_model_dir, tmp_path / "single" / name, extra))
            for name, extra in DISTRIBUTED_RUNS.items()
        }
    finally:
        torch.set_num_threads(threads)
    start = AutoModel.from_pretrained(tiny_model_dir).state_dict()
    for name, single in singles.items():
        dist_run, single_run = tmp_path / "dist" / name / "pt", single.backbone_path.parent
        got = AutoModel.from_pretrained(dist_run / "backbone").state_dict()
        expected = AutoModel.from_pretrained(single.backbone_path).state_dict()
        assert any(not torch.equal(expected[k], start[k]) for k in expected)  # it trained
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")

        def records(run):
            return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]

        assert len(records(dist_run)) == len(records(single_run)) == 4
        for key in ("loss", "late_mlm", "head_mlm", "contrastive"):
            assert [r[key] for r in records(dist_run)] == pytest.approx([r[key] for r in records(single_run)], rel=1e-4)
        assert records(single_run)[0]["head_mlm"] > 0 and (name == "cd" or records(single_run)[0]["contrastive"] > 0)
        assert (dist_run / "report.md").is_file() and not list(dist_run.rglob("*.tmp"))
