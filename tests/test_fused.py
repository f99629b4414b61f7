"""Fused BERT layers for bf16 CPU inference (``models.fused``): the same function as ``transformers``' BERT on
random weights and inputs (float32 to float32 rounding, bf16 to bf16 rounding), what bf16 encoding on the CPU
runs, and refused for the encoders they do not compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoConfig, AutoModel

from conftest import needs_onednn_bf16, tiny_bert_config
from densepass.models import copies as copies_module
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts, inference_runner
from densepass.models.fused import FusedBertEncoder, fusable

CPU = torch.device("cpu")


def random_encoder(seed: int, dtype: torch.dtype = torch.float32, kind: str = "bert", **changes) -> torch.nn.Module:
    """A 2-layer, 32-dim encoder of ``kind`` (a ``transformers`` model type) with random weights (biases and layer
    norms too, so no term is zero or one)."""
    sizes = {k: v for k, v in tiny_bert_config(100).to_diff_dict().items() if k not in ("model_type", "architectures")}
    config = AutoConfig.for_model(kind, **sizes)
    config.pad_token_id = 0
    for name, value in changes.items():
        setattr(config, name, value)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.5)
    return model.to(dtype).eval()


def right_padded(seed: int, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids [len(lengths), max(lengths)] and their attention mask, padded on the right."""
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.randint(1, 100, (len(lengths), width), generator=generator)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    return ids * mask, mask


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=6),
    kind=st.sampled_from(["bert", "roberta", "xlm-roberta"]),
)
def test_fused_layers_compute_the_encoder_in_float32(seed, lengths, kind):
    """Every token's last hidden state equals the ``transformers`` model's (its own layers, unfused) to float32
    rounding, whatever the batch's lengths; padded positions are not compared (no pooling reads them)."""
    bert = random_encoder(seed, kind=kind)
    ids, mask = right_padded(seed, lengths)
    with torch.inference_mode():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        got = FusedBertEncoder(bert)(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    assert got.shape == expected.shape
    torch.testing.assert_close(got[keep], expected[keep], atol=2e-5, rtol=2e-5)


@needs_onednn_bf16
def test_fused_layers_in_bf16_agree_with_bert_in_bf16_to_its_rounding():
    bert = random_encoder(1, torch.bfloat16)
    ids, mask = right_padded(1, [40, 33, 7, 1])
    with torch.inference_mode():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        got = FusedBertEncoder(bert)(input_ids=ids, attention_mask=mask).last_hidden_state
    assert got.dtype == torch.bfloat16
    keep = mask.bool()
    cosine = torch.nn.functional.cosine_similarity(got.float()[keep], expected[keep], dim=-1)
    assert cosine.min() > 0.999
    torch.testing.assert_close(got.float()[keep], expected[keep], atol=0.1, rtol=0.05)


def test_fused_layers_take_token_vectors_as_the_model_does():
    """``inputs_embeds`` (what training's piecewise forward hands the towers) gives what the ids give."""
    bert = random_encoder(2)
    ids, mask = right_padded(2, [12, 5])
    fused = FusedBertEncoder(bert)
    with torch.inference_mode():
        by_ids = fused(input_ids=ids, attention_mask=mask).last_hidden_state
        by_vectors = fused(inputs_embeds=bert.get_input_embeddings()(ids), attention_mask=mask).last_hidden_state
        unmasked = fused(input_ids=ids[:1, :12]).last_hidden_state
    torch.testing.assert_close(by_vectors, by_ids)
    torch.testing.assert_close(unmasked, by_ids[:1], atol=2e-5, rtol=2e-5)


def test_fused_layers_read_token_types_and_refuse_what_they_do_not_compute():
    """Segments (a cross-encoder's query and passage) as the model reads them, padded along with the ids; the
    arguments a ``transformers`` head passes are accepted where they change nothing, refused where they would."""
    bert = random_encoder(5)
    ids, mask = right_padded(5, [60, 21])  # 60 is padded to 64
    types = (torch.arange(60)[None, :] >= 20).long() * mask
    fused = FusedBertEncoder(bert)
    with torch.inference_mode():
        expected = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        got = fused(ids, mask, token_type_ids=types, return_dict=True, position_ids=None, output_attentions=False)
        untyped = fused(input_ids=ids, attention_mask=mask).last_hidden_state
    keep = mask.bool()
    torch.testing.assert_close(got.last_hidden_state[keep], expected[keep], atol=2e-5, rtol=2e-5)
    assert not torch.allclose(untyped[keep], expected[keep], atol=1e-3)  # the segments matter
    for refused in ({"position_ids": torch.arange(60)[None]}, {"encoder_hidden_states": torch.zeros(2, 3, 32)}):
        with pytest.raises(ValueError, match=f"does not compute {next(iter(refused))}"):
            fused(input_ids=ids, attention_mask=mask, **refused)


@needs_onednn_bf16
def test_a_model_with_a_head_gets_the_encoder_under_its_head_fused():
    """SPLADE's MLM: ``bf16_copy`` fuses its ``bert`` and keeps the head; the logits agree with the model's own in
    bf16 to bf16 rounding, and the model is left in float32."""
    from transformers import BertForMaskedLM

    from densepass.models.copies import bf16_copy

    torch.manual_seed(6)
    mlm = BertForMaskedLM(tiny_bert_config(100)).eval()
    assert not fusable(mlm) and fusable(mlm.bert)  # the model with a head is not the encoder itself
    half = bf16_copy(mlm, fuse=True)
    assert isinstance(half.bert, FusedBertEncoder) and not isinstance(mlm.bert, FusedBertEncoder)
    assert {p.dtype for p in mlm.parameters()} == {torch.float32}
    ids, mask = right_padded(6, [40, 9])
    with torch.inference_mode():
        expected = mlm.to(torch.bfloat16)(input_ids=ids, attention_mask=mask).logits.float()
        got = half(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert got.dtype == torch.bfloat16 and got.shape == expected.shape
    cosine = torch.nn.functional.cosine_similarity(got.float()[keep], expected[keep], dim=-1)
    assert cosine.min() > 0.999
    assert not isinstance(bf16_copy(mlm, fuse=False).bert, FusedBertEncoder)


@pytest.mark.parametrize(
    ("table", "length", "seen"),
    [(128, 15, 16), (128, 57, 64), (128, 13, 13), (128, 53, 53), (128, 32, 32), (50, 45, 48), (50, 49, 49)],
)
@pytest.mark.parametrize("kind", ["bert", "roberta"])  # RoBERTa numbers positions from its non-pad tokens
def test_the_layers_see_lengths_padded_to_whole_tiles_within_the_position_table(table, length, seen, kind):
    """Inputs are padded to a multiple of ``LENGTH_MULTIPLE`` (16) tokens where that adds at most an eighth of the
    length (``PAD_SHARE``) and stays within the position table; the output keeps the input's length and equals the
    unpadded model's."""
    bert = random_encoder(3, kind=kind, max_position_embeddings=table)
    ids, mask = right_padded(3, [length, 4])
    fused, widths = FusedBertEncoder(bert), []
    fused.layers[0].register_forward_pre_hook(lambda layer, args: widths.append(args[0].shape[1]))
    with torch.inference_mode():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state
        got = fused(input_ids=ids, attention_mask=mask).last_hidden_state
    assert widths == [seen] and got.shape == expected.shape
    keep = mask.bool()
    torch.testing.assert_close(got[keep], expected[keep], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "kind, changes",
    [
        ("bert", {"hidden_act": "gelu_new"}),
        ("bert", {"position_embedding_type": "relative_key"}),
        ("bert", {"is_decoder": True}),
        ("electra", {}),  # BERT's layers, but an embedding projection the fused encoder does not run
    ],
)
def test_what_the_fused_layers_do_not_compute_is_refused_and_left_to_transformers(kind, changes):
    bert = random_encoder(3, kind=kind, **changes)
    assert not fusable(bert)
    with pytest.raises(ValueError, match="not a BERT encoder"):
        FusedBertEncoder(bert)
    assert not fusable(torch.nn.Linear(2, 2))


def test_the_fused_layers_are_for_x86_64_only(monkeypatch):
    import densepass.models.fused as fused_module

    assert fusable(random_encoder(4))  # on this machine (CI and development machines are x86-64)
    monkeypatch.setattr(fused_module.platform, "machine", lambda: "aarch64")
    assert not fusable(random_encoder(4))


def test_bf16_layers_are_fused_only_where_onednn_runs_bf16(tiny_model_dir, monkeypatch):
    """On a CPU where oneDNN has no bf16 products (AVX2 only: its fused linear kernels refuse bf16), float32
    encoders still fuse, bf16 ones run as ``transformers`` models, and bf16 encoding works there."""
    import densepass.models.fused as fused_module

    monkeypatch.setattr(fused_module, "_onednn_bf16", lambda: False)
    assert fusable(random_encoder(4)) and not fusable(random_encoder(4, torch.bfloat16))
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    assert not isinstance(inference_runner(model, "bf16", CPU).query_encoder, FusedBertEncoder)
    embeddings = encode_texts(model, ["tar archiving utility", "X11 window manager"], "passage", device=CPU,
                              precision="bf16", show_progress=False)  # fmt: skip
    assert embeddings.shape[0] == 2 and np.isfinite(embeddings).all()


@needs_onednn_bf16
def test_bf16_encoding_on_the_cpu_runs_the_fused_layers_and_agrees_with_the_unfused_copy(tiny_model_dir, monkeypatch):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    runner = inference_runner(model, "bf16", CPU)
    assert isinstance(runner.query_encoder, FusedBertEncoder) and runner.passage_encoder is runner.query_encoder
    texts = ["tar archiving utility", "X11 window manager with tabs", "python3 library for HTTP requests"] * 3
    fused = encode_texts(model, texts, "passage", device=CPU, precision="bf16", show_progress=False)
    monkeypatch.setattr(copies_module, "fusable", lambda tower: False)
    unfused_model = BiEncoder.from_pretrained(str(tiny_model_dir))  # a model with no cached runner
    assert not isinstance(inference_runner(unfused_model, "bf16", CPU).query_encoder, FusedBertEncoder)
    unfused = encode_texts(unfused_model, texts, "passage", device=CPU, precision="bf16", show_progress=False)
    cosine = np.sum(fused * unfused, 1) / (np.linalg.norm(fused, axis=1) * np.linalg.norm(unfused, axis=1))
    assert cosine.min() > 0.999
