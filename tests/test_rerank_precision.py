"""Cross-encoder scoring precision (``models.cross_encoder``): int8 follows fp32 without being fp32, its
quantised copy is made once and rebuilt after a weight change, ``auto`` picks by device, bad settings are
one-line errors, and the run, ``densepass search`` and ``serve`` pass ``reranker.precision`` /
``--rerank-precision`` on (teacher scores stay in the automatic precision)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from densepass.config import RerankerConfig, explain, load_config
from densepass.device import resolve_precision
from densepass.errors import ConfigError
from densepass.models.cross_encoder import CrossEncoder, fp32_logit_layer

CPU = torch.device("cpu")
QUERIES = ["audio editor", "kernel driver for printers", "python library for http", "fonts for maths", "mail server"]
PASSAGES = [
    "Audacity: fast audio editor",
    "printer driver for the kernel",
    "requests: http for humans",
    "TeX fonts for mathematics",
    "postfix mail transfer agent with spam filters",
    "GNU tar archiving utility",
    "a window manager with tabs",
    "the C compiler",
]
PAIR_QUERIES = [q for q in QUERIES for _ in PASSAGES]
PAIR_PASSAGES = [p for _ in QUERIES for p in PASSAGES]


@pytest.fixture
def tiny(tiny_model_dir):
    return CrossEncoder.new(str(tiny_model_dir), seed=3, max_length=48, batch_size=8, device=CPU, precision="fp32")


def test_int8_scores_follow_fp32_on_minilm_but_are_not_fp32():
    """MiniLM with a seeded fresh head, 40 pairs. The head reads MiniLM's pooler, whose outputs are near zero
    (spread 0.016), so int8's error is large relative to it: about 0.25 of the spread here, against 0.11 for a
    trained MiniLM cross-encoder (models.cross_encoder): bounds 0.5 and Spearman 0.9 (measured 0.97)."""
    model = CrossEncoder.new("all-MiniLM-L6-v2", seed=13, max_length=64, device=CPU, precision="int8")
    low = model.score_pairs(PAIR_QUERIES, PAIR_PASSAGES)
    full = model.score_pairs(PAIR_QUERIES, PAIR_PASSAGES, precision="fp32")
    assert low.dtype == np.float32 and low.shape == full.shape
    assert spearmanr(low, full).statistic >= 0.9
    assert np.mean(np.abs(low - full)) <= 0.5 * np.std(full)
    assert np.mean(np.abs(low - full)) > 1e-4  # not fp32 (batching changes fp32 scores by 1e-6 at most)


def test_int8_runs_the_fused_int8_layers_where_the_kernels_run(monkeypatch):
    """Where densepass's CPU kernels run MiniLM's heads, int8 scoring runs a bf16 copy whose encoder is
    ``models.fused``'s int8 layers: a pair's score does not depend on the pairs batched with it (a scale per token;
    one per batch moves scores by about 1e-3 of their size); with the kernels off, dynamic quantisation."""
    from densepass.models import cpu_kernels
    from densepass.models.fused import FusedBertEncoder

    model = CrossEncoder.new("all-MiniLM-L6-v2", seed=13, max_length=64, device=CPU, precision="int8")
    if not model.int8_fuses():
        pytest.skip("densepass's CPU kernels do not run here")
    assert isinstance(model.quantized_model().bert, FusedBertEncoder)
    together = model.score_pairs(PAIR_QUERIES, PAIR_PASSAGES)
    alone = np.array([model.score_pairs([q], [p])[0] for q, p in zip(PAIR_QUERIES[:8], PAIR_PASSAGES[:8])])
    np.testing.assert_allclose(together[:8], alone, rtol=1e-5, atol=1e-8)  # the head's float32 rounding alone
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert not model.int8_fuses() and not isinstance(model.quantized_model().bert, FusedBertEncoder)
    dynamic = model.score_pairs(PAIR_QUERIES, PAIR_PASSAGES)
    assert np.isfinite(dynamic).all() and not np.array_equal(dynamic, together)


def test_int8_quantises_every_linear_layer_but_the_feed_forward_outputs(tiny):
    from torch.ao.nn.quantized.dynamic import Linear as QuantizedLinear

    quantized = dict(tiny.quantized_model().named_modules())
    for layer in range(2):
        for name in ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense"):
            assert isinstance(quantized[f"bert.encoder.layer.{layer}.{name}"], QuantizedLinear), name
        assert isinstance(quantized[f"bert.encoder.layer.{layer}.intermediate.dense"], QuantizedLinear)
        output = quantized[f"bert.encoder.layer.{layer}.output.dense"]
        assert isinstance(output, torch.nn.Linear) and output.weight.dtype == torch.float32
    assert isinstance(quantized["classifier"], QuantizedLinear)
    assert all(p.dtype == torch.float32 for p in tiny.model.parameters())  # the model itself is untouched
    full = tiny.score_pairs(PAIR_QUERIES, PAIR_PASSAGES)
    low = tiny.score_pairs(PAIR_QUERIES, PAIR_PASSAGES, precision="int8")
    assert not np.array_equal(low, full)
    np.testing.assert_allclose(low, full, atol=0.01)


def test_the_quantised_copy_is_reused_until_the_weights_change(tiny):
    """A server scores with one quantised copy; after the weights change (a training step), int8 scoring
    quantises the new weights instead of using the stale copy."""
    tiny.precision = "int8"
    first = tiny.quantized_model()
    before = tiny.score_pairs(PAIR_QUERIES, PAIR_PASSAGES)
    assert tiny.quantized_model() is first
    torch.manual_seed(0)
    with torch.no_grad():
        for param in tiny.model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    assert tiny.quantized_model() is not first
    after = tiny.score_pairs(PAIR_QUERIES, PAIR_PASSAGES)
    fresh = CrossEncoder(copy.deepcopy(tiny.model), tiny.tokenizer, 48, 8, CPU, precision="int8")
    np.testing.assert_array_equal(after, fresh.score_pairs(PAIR_QUERIES, PAIR_PASSAGES))  # the new weights'
    assert not np.allclose(before, after, atol=1e-3)  # the change matters


def test_auto_is_bf16_where_it_is_fast_else_fp32(tiny_model_dir, monkeypatch):
    for fast, expected in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setenv("DENSEPASS_FAST_BF16", str(int(fast)))
        model = CrossEncoder.new(str(tiny_model_dir), max_length=32, device=CPU)
        assert model.precision == expected and model.describe()["precision"] == expected
        assert CrossEncoder.new(str(tiny_model_dir), max_length=32, device=CPU, precision="fp32").precision == "fp32"
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    assert resolve_precision("int8", CPU) == "int8"


def test_int8_off_the_cpu_and_an_unknown_precision_are_one_line_errors(tiny, tiny_model_dir):
    with pytest.raises(ConfigError, match="int8 .* runs on the CPU only") as err:
        CrossEncoder.new(str(tiny_model_dir), max_length=32, device=torch.device("cuda"), precision="int8")
    assert "\n" not in str(err.value)
    for bad in ("fp16", "INT8", ""):
        with pytest.raises(ConfigError, match="unknown precision") as err:
            CrossEncoder.new(str(tiny_model_dir), max_length=32, device=CPU, precision=bad)
        assert "\n" not in str(err.value)
        with pytest.raises(ConfigError, match="unknown precision"):
            tiny.score_pairs(["a"], ["b"], precision=bad)


def test_reranker_precision_is_a_documented_config_key_checked_at_load():
    rows = {key: help_text for key, _, _, help_text in explain(RerankerConfig)}
    assert "int8" in rows["precision"] and "CPU only" in rows["precision"]
    assert load_config(None, ["reranker.precision=int8"]).reranker.precision == "int8"
    with pytest.raises(ConfigError, match="reranker.precision") as err:
        load_config(None, ["reranker.precision=int4"])
    assert "\n" not in str(err.value)


def test_the_run_reranks_in_reranker_precision_and_computes_teacher_scores_in_auto(
    tiny_beir, tiny, tmp_path, monkeypatch
):
    """Rows, search and serve rerank in reranker.precision; the distillation targets stay in the automatic
    precision (the run's training precision: fp32 here), whatever the reranker's."""
    from densepass.data import load_dataset
    from densepass.data.keys import passage_input
    from densepass.pipelines import reranking
    from densepass.pipelines.distillation import teacher_scores

    monkeypatch.setenv("DENSEPASS_FAST_BF16", "0")
    base = [f"reranker.distill.scores_file={tmp_path / 'scores.jsonl'}"]
    assert reranking.scoring_options(load_config(None, base), CPU)["precision"] == "fp32"
    config = load_config(None, [*base, "reranker.precision=int8"])
    assert reranking.scoring_options(config, CPU)["precision"] == "int8"
    tiny.precision = "int8"
    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))[:3]
    pairs = {q: [f"p{i}" for i in range(5)] for q in qids}
    scores = teacher_scores(config, dataset, pairs, tiny, show_progress=False)
    queries = [dataset.queries[q] for q in qids for _ in range(5)]
    passages = [passage_input(dataset.corpus, p, " ") for q in qids for p in pairs[q]]
    flat = [scores[q][p] for q in qids for p in pairs[q]]
    assert reranking.automatic_precision(config, CPU) == "fp32"
    np.testing.assert_allclose(flat, tiny.score_pairs(queries, passages, precision="fp32"), rtol=1e-6)
    assert not np.allclose(flat, tiny.score_pairs(queries, passages), rtol=1e-6, atol=0)  # not the int8 ones


def test_search_and_serve_rerank_in_the_precision_asked_for(tiny_beir, tiny, tmp_path, capsys):
    from densepass import cli

    tiny.save(tmp_path / "ce")
    index = str(tmp_path / "idx")
    assert cli.main(["index", str(tiny_beir), "--kind", "bm25", "--output", index]) == 0
    rerank = ["--rerank", str(tmp_path / "ce")]
    for command in ("search", "serve"):
        extra = ["audio"] if command == "search" else []
        args = cli.build_parser().parse_args([command, index, *extra, *rerank, "--rerank-precision", "int8"])
        assert cli._load_pipeline(args).reranker.precision == "int8"
    assert cli.main(["search", index, "audio", *rerank, "--rerank-precision", "int8", "--k", "3"]) == 0
    assert "'audio': 3 hits" in capsys.readouterr().out
    assert cli.main(["search", index, "audio", "--rerank-precision", "int8"]) == 2
    err = capsys.readouterr().err
    assert (
        err.strip()
        == "densepass: error: --rerank-precision int8 applies to the second stage of --rerank, which is not given"
    )
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        cli.main(["search", index, "audio", *rerank, "--rerank-precision", "fp16"])


def test_score_agreement_matches_a_query_by_query_count():
    from densepass.errors import DataError
    from densepass.evaluation.agreement import score_agreement

    rng = np.random.default_rng(5)
    reference = rng.normal(size=(30, 12))
    scores = reference + rng.normal(scale=0.3, size=reference.shape)
    scores[4] = reference[4]  # one query unchanged
    got = score_agreement(scores.ravel(), reference.ravel(), per_query=12)
    same_top = [list(np.argsort(-s)[:10]) == list(np.argsort(-r)[:10]) for s, r in zip(scores, reference)]
    same_first = [np.argmax(s) == np.argmax(r) for s, r in zip(scores, reference)]
    ranks = [(np.argsort(np.argsort(s)), np.argsort(np.argsort(r))) for s, r in zip(scores, reference)]
    spearman = [np.corrcoef(a, b)[0, 1] for a, b in ranks]
    assert got["top10_order_unchanged"] == pytest.approx(np.mean(same_top)) and np.mean(same_top) > 0
    assert got["top1_unchanged"] == pytest.approx(np.mean(same_first))
    assert got["mean_query_spearman"] == pytest.approx(np.mean(spearman))
    assert got["mean_abs_difference"] == pytest.approx(np.abs(scores - reference).mean())
    assert got["reference_std"] == pytest.approx(reference.std())
    with pytest.raises(DataError, match="multiple of per_query"):
        score_agreement(scores.ravel()[:-1], reference.ravel()[:-1], per_query=12)


def test_bf16_scores_keep_a_float32_logit_layer(tiny):
    """Under bf16 autocast the encoder runs in bf16 but the one-logit layer in float32, so close candidates
    do not tie: the scores are not rounded to bf16, and equal that layer applied in float32 to its input."""
    seen = {}
    head = tiny.model.classifier
    handle = head.register_forward_pre_hook(lambda module, args: seen.update(x=args[0].detach().clone()))
    try:
        scores = tiny.score_pairs(PAIR_QUERIES, PAIR_PASSAGES, precision="bf16")
    finally:
        handle.remove()
    assert seen["x"].dtype == torch.bfloat16  # the layers before it did run in bf16
    as_bf16 = torch.from_numpy(scores).bfloat16().float().numpy()
    assert (as_bf16 != scores).mean() > 0.5, "bf16 scores were rounded to bf16"
    with torch.no_grad():
        last = torch.nn.functional.linear(seen["x"].float(), head.weight, head.bias).squeeze(-1)
    assert set(np.round(last.numpy(), 5)) <= set(np.round(scores, 5))  # the last batch's pairs, in fp32
    assert fp32_logit_layer(tiny.model) is tiny.model and len(head._forward_hooks) == 1  # applied once
