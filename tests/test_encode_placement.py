"""Encoding walks a model's modules (``to``, ``eval``, ``train``) only where its device or mode must change: a
service encodes a few texts per call and would otherwise pay the walks on every request. The mode a model was in
is kept, and the embeddings are those of a model placed and put in eval mode the plain way."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import densepass as dp
from conftest import save_tiny_bert
from densepass.serve.backends import Embedder

TEXTS = ["a video player", "mail server for the desktop", "image viewer"]


def counting(monkeypatch) -> dict[str, int]:
    calls = {"to": 0, "train": 0}
    to, train = nn.Module.to, nn.Module.train

    def counted_to(self, *args, **kwargs):
        calls["to"] += 1
        return to(self, *args, **kwargs)

    def counted_train(self, mode=True):
        calls["train"] += 1
        return train(self, mode)

    monkeypatch.setattr(nn.Module, "to", counted_to)
    monkeypatch.setattr(nn.Module, "train", counted_train)
    return calls


def test_a_placed_model_in_eval_mode_is_not_walked_again(tiny_model_dir, monkeypatch):
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
    cpu = torch.device("cpu")
    reference = model.to(cpu).eval().encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    calls = counting(monkeypatch)
    again = model.encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    assert calls == {"to": 0, "train": 0}
    np.testing.assert_array_equal(again, reference)


def test_a_model_in_training_mode_is_encoded_in_eval_mode_and_left_training(tmp_path):
    model = dp.BiEncoder.from_pretrained(str(save_tiny_bert(tmp_path / "model", dropout=0.5)))
    cpu = torch.device("cpu")
    reference = model.eval().encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    model.train()
    out = model.encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    assert all(m.training for m in model.modules())
    np.testing.assert_array_equal(out, reference)  # dropout (0.5) was off while encoding


def test_the_service_embedder_puts_its_model_in_eval_mode_once(tiny_model_dir, monkeypatch):
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir)).train()
    embedder = Embedder(model, str(tiny_model_dir), torch.device("cpu"), "fp32", 8)
    assert not any(m.training for m in model.modules())
    calls = counting(monkeypatch)
    (vector, tokens), *_ = embedder.embed(TEXTS, "passage")
    assert calls == {"to": 0, "train": 0} and vector.shape == (model.dim,) and tokens > 0


def test_a_position_table_that_is_not_a_multiple_of_8_encodes_texts_cut_at_its_length(tmp_path, monkeypatch):
    """Batches were padded to a multiple of 8 past ``max_length``: a BERT with 100 positions met a 104-token batch
    (a RuntimeError). A text cut at 100 tokens encodes as it trains; the fp32 path, and bf16 without the kernels."""
    from transformers import AutoTokenizer, BertModel

    from conftest import tiny_bert_config
    from densepass.models.biencoder import BiEncoderConfig, resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = tiny_bert_config(tokenizer.vocab_size)
    config.max_position_embeddings = 100  # not a multiple of 8
    torch.manual_seed(0)
    BertModel(config).save_pretrained(tmp_path / "m100")
    tokenizer.save_pretrained(tmp_path / "m100")
    model = dp.BiEncoder.from_pretrained(
        str(tmp_path / "m100"), config=BiEncoderConfig(query_max_length=32, passage_max_length=100)
    )
    texts = ["word " * 300, "short"]
    monkeypatch.setenv("DENSEPASS_CPU_KERNELS", "0")
    alone = model.encode_passages(texts[:1], precision="fp32", show_progress=False)
    both = model.encode_passages(texts, precision="fp32", show_progress=False)
    assert both.shape == (2, 32) and np.allclose(both[0], alone[0], atol=1e-5)
    assert model.encode_passages(texts, precision="bf16", show_progress=False).shape == (2, 32)
