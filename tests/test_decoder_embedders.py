"""Decoder-only embedders (Qwen2 / Llama architectures, issue 51): last-token pooling over the EOS the tokenizer
appends, prompts per side, trained by the engine (with LoRA), saved so that sentence-transformers encodes the same.
A tiny random Qwen2 and a BPE tokenizer trained in the test: real code, no download."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from densepass.config import BiEncoderConfig
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, token_pooling

CPU = torch.device("cpu")
WORDS = "audio video editor library game network terminal python font image mail server kernel driver".split()


def save_tiny_decoder(path: Path, architecture: str = "qwen2") -> Path:
    """A 2-layer random decoder of ``architecture`` with a byte-level BPE tokenizer (EOS, no pad token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast, Qwen2Config, Qwen2Model

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    texts = [" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))] * 4 + ["query: passage: what is"]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    small = dict(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = Qwen2Model(Qwen2Config(**small)) if architecture == "qwen2" else LlamaModel(LlamaConfig(**small))
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


CONFIG = BiEncoderConfig(pooling="last", query_prompt="query: ", passage_prompt="passage: ", query_max_length=16,
                         passage_max_length=32)  # fmt: skip


@pytest.fixture(scope="module")
def decoder_dir(tmp_path_factory) -> Path:
    return save_tiny_decoder(tmp_path_factory.mktemp("qwen2"))


def test_last_token_pooling_reads_the_last_kept_position_with_padding_on_either_side():
    hidden = torch.randn(2, 5, 3)
    right = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    left = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(token_pooling(hidden, right, "last"), torch.stack([hidden[0, 2], hidden[1, 4]]))
    torch.testing.assert_close(token_pooling(hidden, left, "last"), torch.stack([hidden[0, 4], hidden[1, 4]]))


def test_a_decoder_pads_with_its_eos_appends_it_and_puts_the_prompts_first(decoder_dir):
    model = BiEncoder.from_pretrained(str(decoder_dir), config=CONFIG)
    tokens = model.tokenize(["audio editor", "kernel"], "query")
    eos = model.tokenizer.eos_token_id
    lengths = tokens["attention_mask"].sum(1)
    assert all(int(tokens["input_ids"][i, lengths[i] - 1]) == eos for i in range(2))  # every text ends with EOS
    assert model.tokenizer.decode(tokens["input_ids"][1, : lengths[1] - 1]).startswith("query: ")
    # the encoded vector is the decoder's hidden state at that EOS, prompt included
    one = model.tokenize(["kernel"], "query")
    eos_at = int(one["attention_mask"][0].sum()) - 1  # right padding: the EOS is the last kept position
    expected = model.query_encoder(**one).last_hidden_state[0, eos_at]
    got = model.encode_queries(["kernel"], precision="fp32", show_progress=False, convert_to="torch")[0]
    torch.testing.assert_close(got, torch.nn.functional.normalize(expected, dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("architecture", ["qwen2", "llama"])
def test_a_trained_decoder_with_lora_loads_in_sentence_transformers_and_encodes_the_same(tmp_path, architecture):
    from sentence_transformers import SentenceTransformer

    from conftest import write_tiny_beir
    from densepass.data import load_dataset
    from densepass.training.batches import TrainingData
    from densepass.training.trainer import train
    from test_training import _fp32_config

    model = BiEncoder.from_pretrained(str(save_tiny_decoder(tmp_path / architecture, architecture)), config=CONFIG)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = load_dataset(str(write_tiny_beir(tmp_path / "beir")))
    data = TrainingData(dataset, "train", " ", {q: dataset.corpus.ids[::3] for q in dataset.queries}, 1)
    train(model, data, _fp32_config(lora_rank=4, learning_rate=1e-2), tmp_path / "run", CPU)
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, start[k])]
    assert changed and all("self_attn" in k for k in changed)  # LoRA's default layers of the architecture
    model.save(tmp_path / "saved")
    ours = BiEncoder.from_pretrained(str(tmp_path / "saved"))
    assert ours.config.pooling == "last" and ours.config.query_prompt == "query: "
    st = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    texts = [" ".join(WORDS[i : i + 1 + i % 4]) for i in range(12)]
    for st_side, side in ((st.encode_query, "query"), (st.encode_document, "passage")):
        theirs = st_side(texts, convert_to_numpy=True)
        mine = ours._encode(texts, side, 8, False, "numpy", CPU, "fp32")
        cosine = (theirs * mine).sum(1) / np.linalg.norm(theirs, axis=1) / np.linalg.norm(mine, axis=1)
        assert cosine.min() >= 0.9999, (side, cosine.min())


def test_last_token_pooling_reads_bert_s_sep_and_an_unknown_pooling_is_one_line(tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))  # BERT: ends texts with [SEP], which serves
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(pooling="last"))
    tokens = model.tokenize(["a"], "query")
    assert tokens["input_ids"][0, int(tokens["attention_mask"][0].sum()) - 1] == tokenizer.sep_token_id
    with pytest.raises(ConfigError, match="unknown pooling"):
        BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(pooling="max"))


def test_densepass_run_trains_a_decoder_with_lora_and_prompts_from_triplets_and_every_command_uses_it(tmp_path):
    """Issue 51's end to end: a tiny random Qwen2 trained by ``densepass run`` with LoRA, last-token pooling and a
    query prompt from a triplets JSONL file; sentence-transformers encodes with the saved model as densepass does
    (100 texts, prompts applied), and ``index`` / ``search`` / ``serve`` take it as any other model."""
    import json

    from fastapi.testclient import TestClient
    from sentence_transformers import SentenceTransformer

    from conftest import densepass_here, write_tiny_beir
    from densepass.pipelines.search import SearchPipeline
    from densepass.serve.app import create_app

    decoder = save_tiny_decoder(tmp_path / "qwen2")
    rng = np.random.default_rng(0)
    lines = []
    for _ in range(24):
        words = [WORDS[j] for j in rng.permutation(len(WORDS))]
        lines.append(
            {"anchor": f"{words[0]} {words[1]}", "positive": " ".join(words[:6]), "negative": " ".join(words[6:12])}
        )
    (tmp_path / "triplets.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    beir = write_tiny_beir(tmp_path / "beir")
    settings = [
        "data.format=pairs", f"data.name={tmp_path / 'triplets.jsonl'}", f"data.eval_name={beir}",
        "negatives.source=given", f"model.name_or_path={decoder}", "model.pooling=last",
        "model.query_prompt='query: '", "model.query_max_length=16", "model.passage_max_length=32",
        "train.lora_rank=4", "train.batch_size=8", "train.cpu_bf16=false", "eval.metrics=[mrr@10]", "eval.depth=10",
        "eval.baselines=[]", f"output_dir={tmp_path / 'out'}", "name=decoder",
    ]  # fmt: skip
    result = densepass_here("run", *[a for s in settings for a in ("--set", s)], cwd=tmp_path)  # in this process
    assert result.returncode == 0, result.stderr[-3000:]
    saved = tmp_path / "out" / "decoder" / "model"
    ours = BiEncoder.from_pretrained(str(saved))
    assert ours.config.pooling == "last" and ours.config.query_prompt == "query: "
    texts = [" ".join(WORDS[(i + k) % len(WORDS)] for k in range(1 + i % 5)) for i in range(100)]
    st = SentenceTransformer(str(saved), device="cpu")
    for theirs, side in ((st.encode_query(texts), "query"), (st.encode_document(texts), "passage")):
        mine = ours._encode(texts, side, 32, False, "numpy", CPU, "fp32")
        cosine = (theirs * mine).sum(1) / np.linalg.norm(theirs, axis=1) / np.linalg.norm(mine, axis=1)
        assert cosine.min() >= 0.9999, (side, cosine.min())
    index = tmp_path / "idx"
    built = densepass_here(
        "index", str(beir), "--model", str(saved), "--kind", "exact", "--output", str(index), cwd=tmp_path
    )
    assert built.returncode == 0, built.stderr[-2000:]
    found = densepass_here("search", str(index), "audio editor", "--k", "3", cwd=tmp_path)
    assert found.returncode == 0 and found.stdout.strip(), found.stderr[-2000:]
    with TestClient(create_app(SearchPipeline.load(str(index))), base_url="http://127.0.0.1") as client:
        hits = client.post("/search", json={"query": "audio editor", "k": 3})
    assert hits.status_code == 200 and len(hits.json()["results"][0]) == 3, hits.text
