"""Cross-encoders: a fresh head on any encoder, saves that transformers and sentence-transformers score
identically, batched length-sorted scoring equal to one pair at a time, and one-line errors for models
without a usable head."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertForSequenceClassification

from conftest import needs_onednn_bf16
from densepass.errors import ConfigError, DataError
from densepass.models.cross_encoder import CrossEncoder
from densepass.models.inputs import forward_in_pieces

CPU = torch.device("cpu")
QUERIES = ["audio editor", "kernel driver for printers", "x", "a long query " * 30]
PASSAGES = ["Audacity: fast audio editor", "printer driver " * 40, "", "the tar archiver"]


@pytest.fixture(scope="module")
def saved_cross_encoder(tiny_model_dir, tmp_path_factory):
    # fp32 pinned: ``auto`` scores in bf16 on a CPU with fast bfloat16, and these tests compare with fp32 scorers
    model = CrossEncoder.new(str(tiny_model_dir), seed=3, max_length=48, device=CPU, precision="fp32")
    path = tmp_path_factory.mktemp("ce") / "model"
    model.save(path)
    return model, path


def test_a_new_cross_encoder_has_a_seeded_one_logit_head_on_the_encoder(tiny_model_dir):
    a = CrossEncoder.new(str(tiny_model_dir), seed=3, device=CPU)
    b = CrossEncoder.new(str(tiny_model_dir), seed=3, device=CPU)
    c = CrossEncoder.new(str(tiny_model_dir), seed=4, device=CPU)
    assert a.model.config.num_labels == 1
    np.testing.assert_array_equal(a.score_pairs(QUERIES, PASSAGES), b.score_pairs(QUERIES, PASSAGES))
    assert not np.allclose(a.score_pairs(QUERIES, PASSAGES), c.score_pairs(QUERIES, PASSAGES))


def test_batched_length_sorted_scores_equal_one_pair_at_a_time(saved_cross_encoder):
    model, _ = saved_cross_encoder
    model.batch_size = 3
    batched = model.score_pairs(QUERIES, PASSAGES)
    model.batch_size = 1
    single = model.score_pairs(QUERIES, PASSAGES)
    np.testing.assert_allclose(batched, single, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_a_decoder_cross_encoder_scores_a_batch_as_one_pair_at_a_time(tmp_path, padding_side):
    """A decoder's head scores each pair at its last token that is not padding: its tokenizer (no pad token) pads
    with its EOS and the head knows that id, where batches of more than one pair were refused with a traceback."""
    from test_decoder_embedders import save_tiny_decoder

    model = CrossEncoder.new(str(save_tiny_decoder(tmp_path / "qwen2")), seed=3, device=CPU, precision="fp32")
    assert model.tokenizer.pad_token_id == model.tokenizer.eos_token_id == model.model.config.pad_token_id
    model.tokenizer.padding_side = padding_side
    queries, passages = [*QUERIES[:2], QUERIES[3]], [*PASSAGES[:2], PASSAGES[3]]  # (its tiny vocabulary lacks "x")
    model.batch_size = 3
    batched = model.score_pairs(queries, passages)
    model.batch_size = 1
    np.testing.assert_allclose(batched, model.score_pairs(queries, passages), rtol=1e-5, atol=1e-5)


def test_a_saved_cross_encoder_scores_the_same_in_transformers_and_sentence_transformers(saved_cross_encoder):
    from sentence_transformers import CrossEncoder as STCrossEncoder

    model, path = saved_cross_encoder
    ours = model.score_pairs(QUERIES, PASSAGES)
    reloaded = CrossEncoder.from_pretrained(str(path), device=CPU, precision="fp32")
    assert reloaded.max_length == 48
    np.testing.assert_allclose(reloaded.score_pairs(QUERIES, PASSAGES), ours, rtol=1e-5, atol=1e-5)
    st = STCrossEncoder(str(path), device="cpu")
    np.testing.assert_allclose(st.predict(list(zip(QUERIES, PASSAGES)), batch_size=2), ours, rtol=1e-5, atol=1e-5)
    hf = AutoModelForSequenceClassification.from_pretrained(str(path)).eval()
    tokens = AutoTokenizer.from_pretrained(str(path))(
        QUERIES, PASSAGES, truncation=True, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        np.testing.assert_allclose(hf(**tokens).logits.squeeze(-1).numpy(), ours, rtol=1e-5, atol=1e-5)


def test_an_encoder_without_a_trained_head_is_a_one_line_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="no trained relevance head"):
        CrossEncoder.from_pretrained(str(tiny_model_dir), device=CPU)


def test_a_classifier_with_two_labels_is_a_one_line_error(tiny_model_dir, tmp_path):
    config = BertConfig.from_pretrained(str(tiny_model_dir), num_labels=2)
    BertForSequenceClassification(config).save_pretrained(tmp_path / "two")
    AutoTokenizer.from_pretrained(str(tiny_model_dir)).save_pretrained(tmp_path / "two")
    with pytest.raises(ConfigError, match="one-logit head; .* has 2 labels"):
        CrossEncoder.from_pretrained(str(tmp_path / "two"), device=CPU)


def test_a_directory_that_is_no_model_is_a_one_line_error(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(DataError, match="is not a transformers model config"):  # checked before transformers reads it
        CrossEncoder.from_pretrained(str(tmp_path), device=CPU)


def test_scoring_needs_as_many_queries_as_passages_and_a_sane_length(saved_cross_encoder, tiny_model_dir):
    model, _ = saved_cross_encoder
    with pytest.raises(ConfigError, match="2 queries but 1 passages"):
        model.score_pairs(["a", "b"], ["c"])
    with pytest.raises(ConfigError, match="exceeds the model's 128 positions"):
        CrossEncoder.new(str(tiny_model_dir), max_length=1000, device=CPU)


def test_scoring_batches_pairs_of_similar_token_length_padded_to_their_longest(saved_cross_encoder):
    from densepass.models.cross_encoder import length_sorted_batches

    model, _ = saved_cross_encoder
    model.batch_size = 2
    encoded = model.tokenizer(QUERIES, PASSAGES, truncation=True, max_length=model.max_length)
    lengths = [len(ids) for ids in encoded["input_ids"]]
    batches = length_sorted_batches(encoded, model)
    rows = [int(r) for batch_rows, _ in batches for r in batch_rows]
    assert sorted(rows) == list(range(len(QUERIES)))
    assert [lengths[r] for r in rows] == sorted(lengths, reverse=True)
    for batch_rows, tensors in batches:
        assert tensors["input_ids"].shape == (len(batch_rows), max(lengths[r] for r in batch_rows))
        assert tensors["attention_mask"].sum(1).tolist() == [lengths[r] for r in batch_rows]
        for j, r in enumerate(batch_rows):
            assert tensors["input_ids"][j, : lengths[r]].tolist() == encoded["input_ids"][r]


def test_gpu_batches_round_up_to_8_but_never_past_the_tokens_the_model_reads(monkeypatch):
    """On a GPU a batch is padded to a multiple of 8 (tensor cores): a BERT of 36 positions got 40-token batches,
    past its position embeddings."""
    from types import SimpleNamespace

    from densepass.models.cross_encoder import length_sorted_batches

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # (no CUDA here: pinning is beside the point)
    tokenizer = SimpleNamespace(pad_token_id=0, padding_side="right")
    scorer = SimpleNamespace(device=torch.device("cuda"), tokenizer=tokenizer, batch_size=2, max_length=36)
    encoded = {"input_ids": [[1] * 36, [1] * 20, [1] * 11, [1] * 3]}
    widths = [tensors["input_ids"].shape[1] for _, tensors in length_sorted_batches(encoded, scorer)]
    assert widths == [36, 16]  # 36 (not 40), and 11 rounded up to 16


def test_training_logits_in_pieces_equal_one_forward(saved_cross_encoder):
    """The trainer scores a batch's pairs in length-sorted pieces on the CPU: same logits as one forward."""
    model, _ = saved_cross_encoder
    queries = ["font", "audio editor", "kernel driver for printers", "a"] * 4
    passages = ["python library", "a game", "the terminal shell with a long description of it", "mail"] * 4
    tokens = model.tokenize(queries, passages)
    torch.testing.assert_close(forward_in_pieces(model.logits, tokens, 24), model.logits(tokens), rtol=1e-5, atol=1e-5)


def _classifier(name: str, **overrides) -> torch.nn.Module:
    """A tiny random one-logit classifier of the ``transformers`` architecture ``name`` (seeded, eval mode)."""
    import transformers

    config_class = getattr(transformers, name.replace("ForSequenceClassification", "Config"))
    settings = dict(vocab_size=120, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=48)
    settings.update(num_labels=1, max_position_embeddings=64, **overrides)
    torch.manual_seed(5)
    return getattr(transformers, name)(config_class(**settings)).eval()


def _padded_tokens(rows: int = 6, width: int = 14) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, 120, (rows, width), generator=generator)
    mask = torch.ones_like(ids)
    for row, length in enumerate([width, 9, 3, width, 1, 6][:rows]):
        mask[row, length:] = 0
    return {"input_ids": ids.masked_fill(mask == 0, 1), "attention_mask": mask}


@pytest.mark.parametrize(
    "name",
    [
        "BertForSequenceClassification",
        "RobertaForSequenceClassification",
        "XLMRobertaForSequenceClassification",
        "ElectraForSequenceClassification",
    ],
)
def test_the_last_layer_on_the_first_position_only_gives_the_full_forwards_logits(name):
    from densepass.models.cross_encoder import first_position_logits, reads_first_position

    model = _classifier(name)
    tokens = _padded_tokens()
    assert reads_first_position(model)
    with torch.inference_mode():
        full = model(**tokens).logits.squeeze(-1)
        torch.testing.assert_close(first_position_logits(model, tokens), full, rtol=1e-5, atol=1e-6)
        # the shortcut changes nothing in the model: the full forward still gives every position
        assert model.base_model(**tokens).last_hidden_state.shape == (6, 14, 32)
        # padding matters to the first position: unmasking the pads changes its logits, so the mask is applied
        unmasked = {**tokens, "attention_mask": torch.ones_like(tokens["attention_mask"])}
        assert not torch.allclose(first_position_logits(model, unmasked)[1:3], full[1:3])


def test_architectures_without_the_shortcut_are_scored_by_the_full_forward(saved_cross_encoder):
    from densepass.models.cross_encoder import reads_first_position

    relative = _classifier("BertForSequenceClassification", position_embedding_type="relative_key")
    distil = _classifier(
        "DistilBertForSequenceClassification", vocab_size=30522, dim=32, n_layers=2, n_heads=4, hidden_dim=48
    )
    training = _classifier("BertForSequenceClassification").train()
    assert not any(reads_first_position(m) for m in (relative, distil, training))
    model, _ = saved_cross_encoder
    scorer = CrossEncoder(distil, model.tokenizer, max_length=48, device=CPU, precision="fp32")
    tokens = scorer.tokenize(QUERIES, PASSAGES)
    with torch.inference_mode():
        full = distil(**tokens).logits.squeeze(-1).numpy()
    np.testing.assert_allclose(scorer.score_pairs(QUERIES, PASSAGES), full, rtol=1e-5, atol=1e-5)


def test_bf16_scoring_with_the_shortcut_stays_near_the_full_forward(saved_cross_encoder):
    from densepass.models.cross_encoder import _logits, first_position_logits

    model, _ = saved_cross_encoder
    tokens = model.tokenize(QUERIES, PASSAGES)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        short, full = first_position_logits(model.model, tokens), _logits(model.model, tokens)
    torch.testing.assert_close(short, full, rtol=0.02, atol=0.02)


@pytest.mark.parametrize(
    "name", ["BertForSequenceClassification", "RobertaForSequenceClassification", "XLMRobertaForSequenceClassification"]
)
@pytest.mark.parametrize("width", [14, 60])  # 60 is padded to 64 inside the fused layers
def test_fused_layers_with_the_last_on_the_first_position_give_the_full_forwards_logits(name, width):
    """In float32 the fused encoder (``models.fused``), its last layer on the first position only, gives the
    classifier's logits to float32 rounding, segments and padding included."""
    import copy

    from densepass.models.cross_encoder import fused_first_position_logits
    from densepass.models.fused import FusedBertEncoder

    model = _classifier(name)
    tokens = _padded_tokens(width=width)
    if name.startswith("Bert"):
        tokens["token_type_ids"] = (torch.arange(width)[None, :] >= 4).long() * tokens["attention_mask"]
    fused = copy.deepcopy(model)
    setattr(fused, fused.base_model_prefix, FusedBertEncoder(fused.base_model, first_position=True))
    with torch.inference_mode():
        full = model(**tokens).logits.squeeze(-1)
        torch.testing.assert_close(fused_first_position_logits(fused, tokens), full, rtol=1e-5, atol=2e-5)
        with pytest.raises(ValueError, match="first_position=True"):
            FusedBertEncoder(model.base_model)(**tokens, first_position=True)


@needs_onednn_bf16
def test_bf16_scoring_on_the_cpu_runs_a_fused_copy_near_fp32_and_near_autocast(saved_cross_encoder):
    """bf16 on the CPU scores with a fused bf16 copy (reused while the weights stay), close to fp32 and to the
    bf16 autocast of the model itself; the model stays float32."""
    from densepass.models.cross_encoder import _logits
    from densepass.models.fused import FusedBertEncoder

    trained, _ = saved_cross_encoder  # its fresh head scores every pair alike: a random classifier instead
    classifier = _classifier("BertForSequenceClassification", vocab_size=30522)
    with torch.no_grad():  # weights large enough that pairs score apart
        for param in classifier.parameters():
            param.normal_(0, 0.3)
    model = CrossEncoder(classifier, trained.tokenizer, max_length=48, device=CPU, precision="fp32")
    fp32 = model.score_pairs(QUERIES, PASSAGES, precision="fp32")
    bf16 = model.score_pairs(QUERIES, PASSAGES, precision="bf16")
    assert isinstance(model.fused_model().base_model, FusedBertEncoder) and model.fused_model() is model.fused_model()
    assert {p.dtype for p in model.model.parameters()} == {torch.float32}
    tokens = model.tokenize(QUERIES, PASSAGES)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = _logits(model.model, tokens).numpy()
    scale = np.abs(fp32).max()
    assert not np.array_equal(bf16, fp32)  # it really ran in bf16
    assert np.abs(bf16 - fp32).max() < 0.02 * scale and np.abs(bf16 - autocast).max() < 0.02 * scale
