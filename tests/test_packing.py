"""Padding-free (packed) training (issue 54, ``models.packing``): the packed forward of every model kind gives the
padded forward's outputs and every parameter's gradient (float32 rounding; bf16 rounding under autocast), the packed
attention equals a per-sequence float64 softmax attention, and a run trained packed ends at the padded run's
weights. Tiny random models (2 layers, 32 wide), random lengths including 1."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModel, AutoTokenizer

from densepass.config import BiEncoderConfig
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, resolve_model_path, token_pooling
from densepass.models.colbert import ColBERT
from densepass.models.cross_encoder import CrossEncoder
from densepass.models.inputs import forward_in_pieces
from densepass.models.packing import Packing, enable_packing, packed_attention, packed_forward
from densepass.models.splade import SpladeEncoder
from densepass.training.trainer import train
from test_training import _config, _fp32_config, make_data

CPU = torch.device("cpu")
LENGTHS = [5, 1, 12, 3, 12, 7]  # a text of one token, two of the longest
TEXTS = [
    "audio editor",
    "x",
    "a network terminal for unix shells with tabs and many profiles",
    "kernel driver",
    "python library for image viewer plugins and mail server backups",
    "music player with playlists",
]


def _padded(lengths: list[int], vocab: int, pad: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    width = max(lengths) + 2  # padding after the longest too
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
    ids = torch.randint(5, vocab, (len(lengths), width), generator=generator)
    return ids * mask + pad * (1 - mask), mask


def _tiny(family: str) -> torch.nn.Module:
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    extra = {"num_attention_heads": 4, "num_key_value_heads": 2} if family == "qwen2" else {}
    config = AutoConfig.for_model(
        family, vocab_size=120, max_position_embeddings=40, pad_token_id=1, **{**sizes, **extra}
    )
    for key in ("hidden_dropout_prob", "attention_probs_dropout_prob", "attention_dropout"):
        if hasattr(config, key):
            setattr(config, key, 0.0)
    torch.manual_seed(0)
    return AutoModel.from_config(config).train()


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return grads


def _assert_same_grads(packed: dict, padded: dict, atol: float, rtol: float) -> None:
    assert packed.keys() == padded.keys() and len(padded) > 0
    for name in padded:  # sums over thousands of tokens in another order: atol relative to the gradient's scale
        scale = max(1.0, float(padded[name].abs().max()))
        torch.testing.assert_close(packed[name], padded[name], atol=atol * scale, rtol=rtol, msg=name)


def _reference_attention(q, k, v, lengths, causal):
    """Per sequence, per head: softmax(q k^T / sqrt(d)) v in float64 (loops, no masks)."""
    out, start = [], 0
    for n in lengths:
        qs, ks, vs = (x[start : start + n].double() for x in (q, k, v))  # [n, heads, size]
        scores = torch.einsum("qhd,khd->hqk", qs, ks) / math.sqrt(q.shape[-1])
        if causal:
            scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vs))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("causal", [False, True])
def test_packed_attention_is_per_sequence_softmax_attention_in_float64(causal):
    torch.manual_seed(1)
    tokens, heads, size = sum(LENGTHS), 2, 8
    q, k, v = (torch.randn(tokens, heads, size, dtype=torch.float64, requires_grad=True) for _ in range(3))
    mask = (torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    module = torch.nn.Module()
    module.is_causal = causal
    out, _ = packed_attention(
        module, *(x.transpose(0, 1)[None] for x in (q, k, v)), None, densepass_packing=Packing.of(mask)
    )
    reference = _reference_attention(q, k, v, LENGTHS, causal)
    torch.testing.assert_close(out[0], reference, atol=1e-12, rtol=1e-12)
    weights = torch.randn_like(reference)
    packed_grads = torch.autograd.grad((out[0] * weights).sum(), (q, k, v))
    reference_grads = torch.autograd.grad((reference * weights).sum(), (q, k, v))
    for ours, theirs in zip(packed_grads, reference_grads):
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)


def test_packing_pools_and_unpacks_as_the_padded_tensors_do():
    hidden = torch.randn(len(LENGTHS), max(LENGTHS) + 2, 4)
    _, mask = _padded(LENGTHS, 50, 0)
    packing = Packing.of(mask)
    assert packing.tokens == sum(LENGTHS)
    packed = packing.pack(hidden)
    for how in ("cls", "mean", "last"):
        torch.testing.assert_close(packing.pool(packed, how), token_pooling(hidden, mask, how))
    torch.testing.assert_close(packing.unpack(packed), hidden * mask[..., None])
    expected = hidden.masked_fill(~mask.bool()[..., None], float("-inf")).amax(1)
    torch.testing.assert_close(packing.max(packed), expected)
    with pytest.raises(ValueError, match="at least one token"):
        Packing.of(torch.tensor([[1, 1], [0, 0]]))


class _GpuWaits(TorchDispatchMode):
    """The ops that, on a GPU, each wait for it to bring a device value to the host: a scalar read, ``nonzero``
    and boolean indexing (a result sized by the data), ``repeat_interleave`` without its output size."""

    WAITING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default"}

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        sized_by_data = (name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None) or (
            name == "aten.index.Tensor" and any(i is not None and i.dtype == torch.bool for i in args[1])
        )
        if name in self.WAITING or sized_by_data:
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("family", ["bert", "qwen2"])
def test_a_packed_forward_and_backward_read_device_values_on_the_host_once(family, monkeypatch):
    """On a GPU each such read waits for the device: the packing reads its lengths once (``Packing.of``), and
    nothing else in the packed forward and backward of the model waits (counted on the CPU by the ops a GPU
    would wait on, and by ``Tensor.tolist`` calls)."""
    model = _tiny(family)
    ids, mask = _padded(LENGTHS, 120, 1)
    reads = []
    tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(self.shape) or tolist(self))
    with _GpuWaits() as waits:
        out, packing = packed_forward(model, ids, mask)
        packing.pool(out.last_hidden_state[0], "mean").sum().backward()
    assert waits.seen == [] and reads == [torch.Size([3])]
    assert packing.tokens == sum(LENGTHS) and packing.longest == max(LENGTHS)


def test_the_attention_grid_holds_each_sequence_from_its_start_and_both_ways_have_exact_gradients():
    _, mask = _padded(LENGTHS, 50, 0)
    packing = Packing.of(mask)
    packed = torch.randn(packing.tokens, 3, 2, dtype=torch.float64, requires_grad=True)
    grid = packing.to_grid(packed)
    assert grid.shape == (len(LENGTHS), max(LENGTHS), 3, 2)
    for b, (start, length) in enumerate(zip(packing.offsets[:-1].tolist(), LENGTHS)):
        torch.testing.assert_close(grid[b, :length], packed[start : start + length], rtol=0, atol=0)
        assert not grid[b, length:].any()
    torch.testing.assert_close(packing.from_grid(grid), packed, rtol=0, atol=0)
    torch.autograd.gradcheck(packing.to_grid, (packed,))
    on_grid = torch.randn(len(LENGTHS), max(LENGTHS), 3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(packing.from_grid, (on_grid,))


def test_packed_bf16_steps_on_the_cpu_take_the_larger_bf16_pieces(tiny_model_dir, monkeypatch):
    from densepass.models.inputs import BF16_PIECE_TOKENS, CPU_PIECE_TOKENS
    from densepass.training import step

    seen = []

    def record(fn, tokens, pieces, embed, packed):
        seen.append((pieces, packed))
        return torch.zeros(1)

    monkeypatch.setattr(step, "forward_in_pieces", record)
    model = BiEncoder.from_pretrained(tiny_model_dir)
    tokens = model.tokenize(["a b c", "d"], "passage")
    for packing in (False, True):
        model.packing = packing
        for autocast in (contextlib.nullcontext, lambda: torch.autocast("cpu", dtype=torch.bfloat16)):
            step._embed(model, tokens, "passage", autocast)
    assert seen == [(CPU_PIECE_TOKENS, False)] * 2 + [(CPU_PIECE_TOKENS, True), (BF16_PIECE_TOKENS, True)]


def test_packed_pieces_are_cut_by_real_tokens_not_by_padded_rows():
    ids, mask = _padded(LENGTHS, 50, 0)
    seen = []

    def first_id(piece):
        seen.append(int(piece["attention_mask"].sum()))
        return piece["input_ids"][:, :1].float()

    out = forward_in_pieces(first_id, {"input_ids": ids, "attention_mask": mask}, 15, packed=True)
    assert seen == [12, 12, 7 + 5 + 3, 1]  # longest first, as many whole texts as 15 tokens hold (one at least)
    torch.testing.assert_close(out, ids[:, :1].float())  # back in input order


@pytest.mark.parametrize("family", ["bert", "roberta", "xlm-roberta", "qwen2"])
@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_a_packed_encoder_gives_the_padded_outputs_and_gradients(family, pooling):
    """Float32: outputs at every token and every parameter's gradient of a loss on the pooled vectors."""
    model = _tiny(family)
    ids, mask = _padded(LENGTHS, 120, 1)
    weights = torch.randn(len(LENGTHS), 32)
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    (token_pooling(hidden, mask, pooling) * weights).sum().backward()
    padded_grads = _grads(model)
    out, packing = packed_forward(model, ids, mask)
    packed = out.last_hidden_state[0]
    torch.testing.assert_close(packing.unpack(packed), hidden * mask[..., None], atol=1e-5, rtol=1e-4)
    (packing.pool(packed, pooling) * weights).sum().backward()
    _assert_same_grads(_grads(model), padded_grads, atol=1e-5, rtol=1e-4)
    assert model.config._attn_implementation != "densepass_packed"  # switched for the one call only


@pytest.mark.parametrize("family", ["bert", "qwen2"])
def test_a_packed_encoder_under_bf16_autocast_gives_the_padded_gradients_to_bf16_rounding(family):
    model = _tiny(family)
    ids, mask = _padded(LENGTHS, 120, 1)
    weights = torch.randn(len(LENGTHS), 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        (token_pooling(hidden, mask, "mean") * weights).sum().backward()
        padded_grads = _grads(model)
        out, packing = packed_forward(model, ids, mask)
        (packing.pool(out.last_hidden_state[0], "mean") * weights).sum().backward()
    packed_grads = _grads(model)
    for name, grad in padded_grads.items():  # bf16 rounding: within a few per cent of the gradient's scale
        scale = grad.abs().max().clamp_min(1e-3)
        assert (packed_grads[name] - grad).abs().max() <= 0.05 * scale, name


def _encoded(model, texts: list[str], side: str) -> torch.Tensor:
    tokens = model.tokenize(texts, side)
    return model(tokens["input_ids"], tokens["attention_mask"], side=side)


def _same_forward_and_grads(model, run, atol=1e-5, rtol=1e-4) -> None:
    """``run()`` (a loss-shaped output) padded, then with ``model.packing`` on: same values, same gradients."""
    model.train()
    padded = run()
    (padded * torch.linspace(-1, 1, padded.numel()).view_as(padded)).sum().backward()
    padded_grads = _grads(model)
    model.packing = True
    packed = run()
    model.packing = False
    torch.testing.assert_close(packed, padded, atol=atol, rtol=rtol)
    (packed * torch.linspace(-1, 1, packed.numel()).view_as(packed)).sum().backward()
    _assert_same_grads(_grads(model), padded_grads, atol=atol, rtol=rtol)


@pytest.mark.parametrize("projection", [None, 8])
def test_a_packed_bi_encoder_gives_the_padded_embeddings_and_gradients(tiny_model_dir, projection):
    model = BiEncoder.from_pretrained(
        str(tiny_model_dir), config=BiEncoderConfig(projection_dim=projection, shared=False)
    )
    tokens = model.tokenize(TEXTS, "passage")
    embed = model.token_embeddings("passage")

    def run():  # as a training step runs it: one lookup, pieces of 40 tokens
        def piece(p):
            return model(p["input_ids"], p["attention_mask"], "passage", inputs_embeds=p["inputs_embeds"])

        return forward_in_pieces(piece, tokens, 40, embed, packed=model.packing)

    _same_forward_and_grads(model, run)
    _same_forward_and_grads(model, lambda: _encoded(model, TEXTS, "query"))


def test_a_packed_splade_encoder_gives_the_padded_term_weights_and_gradients(tiny_model_dir):
    model = SpladeEncoder.from_pretrained(str(tiny_model_dir), head_bias=0.0)
    _same_forward_and_grads(model, lambda: _encoded(model, TEXTS, "passage"))


def test_a_packed_colbert_gives_the_padded_token_vectors_and_gradients(tiny_model_dir):
    model = ColBERT.from_pretrained(str(tiny_model_dir))
    _same_forward_and_grads(model, lambda: _encoded(model, TEXTS, "passage"))
    _same_forward_and_grads(model, lambda: _encoded(model, TEXTS, "query"))  # run padded


def test_packed_cross_encoder_logits_are_the_padded_logits_with_the_same_gradients(tiny_model_dir):
    from densepass.models.cross_encoder import packed_logits

    scorer = CrossEncoder.new(str(tiny_model_dir), seed=3, max_length=48, device=CPU, precision="fp32")
    model = scorer.model.train()
    tokens = scorer.tokenize(TEXTS[:3] * 2, TEXTS[3:] + TEXTS[:3])
    assert "token_type_ids" in tokens and int(tokens["attention_mask"].sum()) < tokens["attention_mask"].numel()
    padded = scorer.logits(tokens)
    padded.pow(2).sum().backward()
    padded_grads = _grads(model)
    packed = packed_logits(model, tokens)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-4)
    packed.pow(2).sum().backward()
    _assert_same_grads(_grads(model), padded_grads, atol=1e-5, rtol=1e-4)


def test_a_packed_decoder_embedder_gives_the_padded_embeddings_and_gradients(tmp_path):
    """A Qwen2 embedder (causal attention, rotary positions, grouped keys and values) with last-token pooling."""
    from test_decoder_embedders import CONFIG, save_tiny_decoder

    model = BiEncoder.from_pretrained(str(save_tiny_decoder(tmp_path / "qwen2")), config=CONFIG)
    _same_forward_and_grads(model, lambda: _encoded(model, TEXTS, "passage"))


@pytest.mark.parametrize("options", [{}, {"lora_rank": 4, "learning_rate": 1e-2}, {"gradient_checkpointing": True}])
def test_a_packed_run_ends_at_the_padded_runs_weights(tiny_model_dir, tiny_beir, tmp_path, options):
    """Three float32 steps of InfoNCE with a hard negative each (full fine-tuning, and LoRA): the same weights
    within float32 tolerance."""
    data = make_data(tiny_beir)
    padded = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(padded, data, _fp32_config(max_steps=3, packing=False, **options), tmp_path / "padded", CPU)
    packed = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(packed, data, _fp32_config(max_steps=3, packing=True, **options), tmp_path / "packed", CPU)
    assert packed.packing and not padded.packing
    start = BiEncoder.from_pretrained(str(tiny_model_dir)).state_dict()
    ours, theirs = packed.state_dict(), padded.state_dict()
    assert any(not torch.equal(theirs[k], start[k]) for k in theirs)  # training moved the weights
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_model_switched_to_packed_attention_encodes_padded_batches_as_before(tiny_model_dir):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    before = model.encode_passages(TEXTS, show_progress=False, precision="fp32")
    enable_packing(model)
    assert model.passage_encoder.config._attn_implementation == "densepass_packed"
    after = model.encode_passages(TEXTS, show_progress=False, precision="fp32")
    assert (before == after).all()


def test_packing_refuses_model_kinds_it_does_not_compute_in_one_line(tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = AutoConfig.for_model("distilbert", vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    AutoModel.from_config(config).save_pretrained(tmp_path / "distilbert")
    tokenizer.save_pretrained(tmp_path / "distilbert")
    model = BiEncoder.from_pretrained(str(tmp_path / "distilbert"))
    with pytest.raises(ConfigError, match=r"^train\.packing: the query tower is a distilbert model; .*\)$"):
        enable_packing(model)
    with pytest.raises(ConfigError, match=r"train\.packing: a Linear does not train packed"):
        enable_packing(torch.nn.Linear(2, 2))


def test_a_run_refuses_packing_a_model_it_cannot_pack_before_any_work(tmp_path, tiny_beir):
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = AutoConfig.for_model("distilbert", vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    AutoModel.from_config(config).save_pretrained(tmp_path / "distilbert")
    tokenizer.save_pretrained(tmp_path / "distilbert")
    overrides = [*small_run_overrides(tiny_beir, tmp_path / "distilbert", tmp_path, "p"), "train.packing=true"]
    with pytest.raises(ConfigError, match="is a distilbert model"):
        run_experiment(load_config(None, overrides))
    assert not (tmp_path / "p" / "config.yaml").exists()  # refused before the run was recorded
    reranker = ["reranker.enabled=true", f"reranker.name_or_path={tmp_path / 'distilbert'}"]
    reranker.append("reranker.train.packing=true")
    overrides = [*small_run_overrides(tiny_beir, resolve_model_path("all-MiniLM-L6-v2"), tmp_path, "r"), *reranker]
    with pytest.raises(ConfigError, match="^reranker.train.packing: the cross-encoder is a distilbert model"):
        run_experiment(load_config(None, overrides))
    assert not (tmp_path / "r" / "config.yaml").exists()


def test_a_packed_cross_encoder_run_ends_at_the_padded_runs_weights(tiny_model_dir, tiny_beir, tmp_path):
    from densepass.training.cross_encoder import train_cross_encoder
    from test_reranker_training import config, new_model
    from test_reranker_training import make_data as pairs_data

    data = pairs_data(tiny_beir)
    weights = {}
    for packing in (False, True):
        model = new_model(tiny_model_dir)
        run = config(epochs=1, max_steps=3, packing=packing, learning_rate=1e-3)
        train_cross_encoder(model, data, run, tmp_path / f"packing-{packing}", CPU)
        weights[packing] = model.model.state_dict()
    start = new_model(tiny_model_dir).model.state_dict()
    assert any(not torch.equal(weights[False][k], start[k]) for k in start)
    for name in start:
        torch.testing.assert_close(weights[True][name], weights[False][name], atol=1e-5, rtol=1e-4, msg=name)


def test_a_cross_encoder_whose_head_reads_more_than_the_first_position_is_refused():
    from transformers import AutoModelForSequenceClassification

    from densepass.models.cross_encoder import packing_refusal

    sizes = dict(vocab_size=60, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    bert = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("bert", num_labels=1, **sizes))
    assert packing_refusal(bert) is None
    electra = AutoModelForSequenceClassification.from_config(AutoConfig.for_model("electra", num_labels=1, **sizes))
    assert packing_refusal(electra).startswith("train.packing: the cross-encoder is a ElectraForSequenceClassification")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (PyTorch's variable-length flash attention)")
@pytest.mark.parametrize("family", ["bert", "qwen2"])
def test_on_a_gpu_varlen_attention_gives_the_padded_gradients_in_bf16(family):
    model = _tiny(family).cuda()
    ids, mask = _padded(LENGTHS, 120, 1)
    ids, mask = ids.cuda(), mask.cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
        token_pooling(hidden, mask, "mean").pow(2).sum().backward()
        padded_grads = _grads(model)
        out, packing = packed_forward(model, ids, mask)
        packing.pool(out.last_hidden_state[0], "mean").pow(2).sum().backward()
    packed_grads = _grads(model)
    for name, grad in padded_grads.items():
        assert (packed_grads[name] - grad).abs().max() <= 0.05 * grad.abs().max().clamp_min(1e-3), name


def test_packed_training_with_dropout_repeats_itself_and_drops_attention_out_on_the_cpu(tmp_path, tiny_beir):
    """With dropout (hidden and attention probabilities, ``models.dropout``'s masks on the CPU), two packed runs of
    the same seed end at the same weights, and attention dropout acts on the packed path."""
    from conftest import save_tiny_bert

    model_dir = save_tiny_bert(tmp_path / "dropout", dropout=0.1)
    data = make_data(tiny_beir)
    runs = []
    for name in ("a", "b"):
        model = BiEncoder.from_pretrained(str(model_dir))
        train(model, data, _fp32_config(max_steps=2, packing=True), tmp_path / name, CPU)
        runs.append(model.state_dict())
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    model = BiEncoder.from_pretrained(str(model_dir)).train()
    enable_packing(model)
    tokens = model.tokenize(TEXTS, "passage")
    for name, module in model.named_modules():  # attention dropout alone
        if isinstance(module, torch.nn.Dropout) and not name.endswith("attention.self.dropout"):
            module.p = 0.0
    dropped = model(tokens["input_ids"], tokens["attention_mask"], "passage")
    for layer in model.passage_encoder.encoder.layer:
        layer.attention.self.dropout.p = 0.0
    kept = model(tokens["input_ids"], tokens["attention_mask"], "passage")
    torch.testing.assert_close(kept, model.eval()(tokens["input_ids"], tokens["attention_mask"], "passage"))
    assert not torch.allclose(dropped, kept)


def test_a_model_trained_packed_trains_padded_when_told_to(tiny_model_dir, tiny_beir, tmp_path):
    """``train.packing`` is each run's: a model object trained packed once trains padded in a run without it."""
    data = make_data(tiny_beir)
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(model, data, _fp32_config(max_steps=1, packing=True), tmp_path / "packed", CPU)
    assert model.packing is True
    train(model, data, _fp32_config(max_steps=1, packing=False), tmp_path / "padded", CPU)
    assert model.packing is False


@pytest.mark.parametrize("setting", ["true", "false", "auto"])
def test_a_runs_report_says_how_its_steps_ran(tiny_model_dir, tiny_beir, tmp_path, setting):
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    overrides = [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "r"), "train.max_steps=1"]
    overrides += ["train.batch_size=8", "train.cpu_bf16=false", f"train.packing={setting}"]
    run_experiment(load_config(None, overrides))
    report = (tmp_path / "r" / "report.md").read_text()
    said = "float32, padded steps" if setting == "false" else "float32, packed steps"  # auto: packed on the CPU
    assert f"examples/s on cpu ({said})." in report


def test_packing_auto_packs_a_dense_bi_encoder_on_the_cpu(tiny_model_dir, tmp_path, monkeypatch):
    """``train.packing: auto`` (the default) packs the measured case only: a dense bi-encoder whose encoders pack,
    its steps on the CPU (bf16 or float32), without LoRA, gradient checkpointing, gradient caching or FSDP; padded
    (without an error) everywhere else. True and false are obeyed as set."""
    from densepass.config import TrainConfig
    from densepass.device import resolved_packing
    from densepass.training.trainer import packs

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = AutoConfig.for_model("distilbert", vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    AutoModel.from_config(config).save_pretrained(tmp_path / "distilbert")
    tokenizer.save_pretrained(tmp_path / "distilbert")
    dense, auto = BiEncoder.from_pretrained(str(tiny_model_dir)), TrainConfig()
    assert auto.packing == "auto" and resolved_packing(auto, CPU, dense=True) and packs(dense, auto, CPU)
    for fast in ("1", "0"):  # steps in bf16 autocast, and in float32
        monkeypatch.setenv("DENSEPASS_FAST_BF16", fast)
        assert packs(dense, auto, CPU) and packs(dense, TrainConfig(cpu_bf16=False), CPU)
    cuda = torch.device("cuda")
    assert not packs(dense, auto, cuda) and not resolved_packing(auto, cuda, dense=True)  # GPU: not timed there yet
    assert packs(dense, TrainConfig(packing=True), cuda)
    for unmeasured in ({"lora_rank": 4}, {"gradient_checkpointing": True}, {"grad_cache_chunk": 4}, {"fsdp": True}):
        assert not resolved_packing(TrainConfig(**unmeasured), CPU, dense=True), unmeasured
        assert not packs(dense, TrainConfig(**unmeasured), CPU), unmeasured
        assert packs(dense, TrainConfig(packing=True, **unmeasured), CPU), unmeasured
    for other in (SpladeEncoder.from_pretrained(str(tiny_model_dir)), ColBERT.from_pretrained(str(tiny_model_dir))):
        assert not packs(other, auto, CPU) and packs(other, TrainConfig(packing=True), CPU)
    assert not resolved_packing(auto, CPU, dense=False)
    assert not packs(BiEncoder.from_pretrained(str(tmp_path / "distilbert")), auto, CPU)  # cannot pack: padded
    assert not packs(dense, TrainConfig(packing=False), CPU)
    assert not resolved_packing(TrainConfig(packing=False), CPU, dense=True)
    with pytest.raises(ConfigError, match="'false' is not true, false or auto"):  # a string from Python code
        resolved_packing(TrainConfig(packing="false"), CPU, dense=True)


def test_a_default_run_trains_packed_and_a_padded_run_resumes_only_padded(tiny_model_dir, tiny_beir, tmp_path):
    """A run with the default settings trains packed on the CPU, and its checkpoints record it: a run written padded
    (``packing: false``, the default before ``auto``) is refused by a default run, with the setting that resumes it
    in the error, and resumes with it."""
    data = make_data(tiny_beir)
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(model, data, _config(max_steps=2, checkpoint_every=1), tmp_path / "packed", CPU)
    assert model.packing is True
    padded = BiEncoder.from_pretrained(str(tiny_model_dir))
    first = train(padded, data, _config(max_steps=2, checkpoint_every=1, packing=False), tmp_path / "padded", CPU)
    assert padded.packing is False
    again = BiEncoder.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ConfigError, match=r"train\.packing differ .*resumes with train\.packing: false; use"):
        train(again, data, _config(max_steps=2, checkpoint_every=1), tmp_path / "padded", CPU)
    said = _config(max_steps=2, checkpoint_every=1, packing=False)
    assert train(again, data, said, tmp_path / "padded", CPU).steps == first.steps
    assert again.packing is False


@pytest.mark.parametrize("kind", ["bi-encoder", "splade", "colbert"])
def test_a_runs_identity_resolves_packing_auto_as_its_trainer_does(tiny_model_dir, tiny_beir, tmp_path, kind):
    """``densepass run`` checks a run's checkpoints before it builds the model (``experiment.packing_of``, from the
    config's model kind); the trainer writes them from the model (``trainer.asks_packing``): both resolve
    ``packing: auto`` alike, so a run always resumes its own checkpoints."""
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import model_from_config, packing_of
    from densepass.training.trainer import asks_packing

    config = load_config(None, [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "r"), f"model.kind={kind}"])
    assert config.train.packing == "auto"
    model = model_from_config(config)
    assert packing_of(config, CPU) == asks_packing(model, config.train, CPU) == (kind == "bi-encoder")
    cuda = torch.device("cuda")
    assert packing_of(config, cuda) is asks_packing(model, config.train, cuda) is False


def test_a_run_directory_written_padded_is_refused_by_a_default_run_with_the_setting_that_resumes_it(
    tiny_model_dir, tiny_beir, tmp_path
):
    """A run directory whose run trained padded (``train.packing: false``, the default before ``auto``) holds
    another run for the default settings, which pack on the CPU: refused before any work, naming the setting."""
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    overrides = [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "r"), "train.max_steps=1"]
    overrides += ["train.batch_size=8", "train.cpu_bf16=false"]
    run_experiment(load_config(None, [*overrides, "train.packing=false"]))
    said = r"train\.packing differ from its config\.yaml\); a run written padded resumes with train\.packing: false"
    with pytest.raises(ConfigError, match=said + "; use"):  # the run directory's refusal, before its checkpoints
        run_experiment(load_config(None, overrides))
    run_experiment(load_config(None, [*overrides, "train.packing=false"]))  # said so: the same run, evaluated again


def test_a_run_directory_written_on_a_gpu_is_checked_on_a_machine_without_one(tiny_model_dir, tiny_beir, tmp_path):
    """A run directory's saved ``device: cuda`` is read for what it meant (``packing: auto`` padded there) on a
    machine without a GPU: a CPU run of the same settings, which packs, is refused naming the setting that resumes
    it, and with it the run directory is this run's (the device is not part of a run's identity)."""
    from conftest import small_run_overrides
    from densepass.config import load_config, save_config
    from densepass.pipelines.experiment import check_run_directory

    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "r")
    gpu = load_config(None, [*overrides, "device=cuda"])
    gpu.run_dir.mkdir(parents=True)
    save_config(gpu, gpu.run_dir / "config.yaml")
    said = r"train\.packing differ from its config\.yaml\); a run written padded resumes with train\.packing: false"
    with pytest.raises(ConfigError, match=said):
        check_run_directory(load_config(None, [*overrides, "device=cpu"]))
    check_run_directory(load_config(None, [*overrides, "device=cpu", "train.packing=false"]))


def test_a_model_that_cannot_pack_resumes_its_own_run_under_auto(tiny_beir, tmp_path):
    """Under ``packing: auto`` an encoder that cannot pack (DistilBERT) trains padded, and its checkpoints hold what
    ``auto`` asked for (``trainer.asks_packing``), the value ``densepass run`` checks them with before it builds the
    model (``experiment.packing_of``): the run resumes its own checkpoints."""
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import model_from_config, packing_of
    from densepass.training.trainer import resume_step

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = AutoConfig.for_model("distilbert", vocab_size=len(tokenizer), dim=32, n_layers=1, n_heads=2, hidden_dim=64)
    AutoModel.from_config(config).save_pretrained(tmp_path / "distilbert")
    tokenizer.save_pretrained(tmp_path / "distilbert")
    overrides = [*small_run_overrides(tiny_beir, tmp_path / "distilbert", tmp_path, "r"), "train.cpu_bf16=false"]
    config = load_config(None, [*overrides, "train.max_steps=1", "train.checkpoint_every=1", "train.batch_size=4"])
    model = model_from_config(config)
    train(model, make_data(tiny_beir), config.train, config.run_dir, CPU)
    assert not model.packing  # padded: DistilBERT does not pack
    assert resume_step(config.run_dir, config.train, None, packing_of(config, CPU)) == 1


def test_the_refusal_names_the_packing_that_resumes_a_run():
    """A run written padded resumes with ``packing: false``, one written packed (on the CPU, resumed where ``auto``
    pads) with ``true``; a cross-encoder's setting is ``reranker.train.packing``."""
    from densepass.checkpoints import packing_hint

    assert packing_hint({"train": {"lr": 1}}, {"train": {"lr": 1, "packing": True}}) == (
        "a run written padded resumes with train.packing: false; "
    )
    assert packing_hint({"train": {"packing": True}}, {"train": {}}) == (
        "a run written packed resumes with train.packing: true; "
    )
    assert packing_hint({"reranker": {}}, {"reranker": {"packing": True}}).endswith("reranker.train.packing: false; ")
    assert packing_hint({"train": {"lr": 1}}, {"train": {"lr": 2}}) == ""


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_a_tokenizer_that_pads_on_the_left_trains_on_what_encoding_reads(tmp_path, pooling):
    """Encoding pads on the right whatever the tokenizer says; training padded as the tokenizer did, so a BERT whose
    tokenizer pads on the left trained on positions counted from its padding, and CLS pooling read a pad. Every
    retriever now pads on the right: the padded and the packed training forward give encoding's embeddings."""
    from conftest import save_tiny_bert

    path = save_tiny_bert(tmp_path / "m")
    left = AutoTokenizer.from_pretrained(path)
    left.padding_side = "left"
    left.save_pretrained(path)
    model = BiEncoder.from_pretrained(str(path), config=BiEncoderConfig(pooling=pooling, normalize=False))
    assert model.tokenizer.padding_side == "right"
    texts = ["a short one", "a much longer passage about tar archives and the tapes they were made for"]
    tokens = model.tokenize(texts, "passage")
    assert tokens["attention_mask"][:, 0].all()  # column 0 is every text's [CLS]
    encoded = torch.from_numpy(model.encode_passages(texts, precision="fp32", show_progress=False))
    padded = model(tokens["input_ids"], tokens["attention_mask"], "passage")
    torch.testing.assert_close(padded, encoded, atol=1e-5, rtol=1e-5)
    model.packing = True
    model.train()
    packed = model(tokens["input_ids"], tokens["attention_mask"], "passage")
    torch.testing.assert_close(packed, encoded, atol=1e-5, rtol=1e-5)
