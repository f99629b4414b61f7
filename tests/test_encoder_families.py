"""Encoders beyond BERT (issue 51): RoBERTa, XLM-R, DeBERTa-v2, MPNet, ModernBERT, DistilBERT and ELECTRA train,
save and load as bi-encoders, and sentence-transformers encodes the saved model as densepass does. Tiny random
configs of each architecture, built in the test (no download), with MiniLM's tokenizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoTokenizer

from densepass.models.biencoder import BiEncoder, resolve_model_path
from densepass.training.trainer import train
from test_training import _fp32_config, make_data

CPU = torch.device("cpu")
FAMILIES = {
    "roberta": {},
    "xlm-roberta": {},
    "deberta-v2": {},
    "mpnet": {},
    "modernbert": {"global_attn_every_n_layers": 1, "local_attention": 16},
    "distilbert": None,  # its own names for the sizes
    "electra": {},
}


def save_tiny(path, family: str):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    if FAMILIES[family] is None:
        sizes = dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64)
    ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "cls_token_id", "sep_token_id")}
    # 130 positions: RoBERTa-style models count from the padding index (128 usable)
    config = AutoConfig.for_model(
        family, vocab_size=len(tokenizer), max_position_embeddings=130, **sizes, **(FAMILIES[family] or {}), **ids
    )
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_family_trains_saves_and_encodes_as_sentence_transformers_does(family, tmp_path, tiny_beir):
    from sentence_transformers import SentenceTransformer

    model = BiEncoder.from_pretrained(str(save_tiny(tmp_path / family, family)))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    result = train(model, make_data(tiny_beir), _fp32_config(max_steps=2), tmp_path / "run", CPU)
    assert result.steps == 2 and any(not torch.equal(v, start[k]) for k, v in model.state_dict().items())
    model.save(tmp_path / "saved")
    texts = ["audio editor", "a network terminal for unix shells", "kernel driver", "x"]
    ours = BiEncoder.from_pretrained(str(tmp_path / "saved")).encode_passages(
        texts, show_progress=False, precision="fp32"
    )
    theirs = SentenceTransformer(str(tmp_path / "saved"), device="cpu").encode(texts)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999
