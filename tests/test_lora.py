"""LoRA adapters in the training engine (``training.adapters``): only the adapters (and heads outside the
transformer) train, the result is a plain model with the adapters merged in, runs resume exactly, and callbacks see
the merged model."""

from __future__ import annotations

import pytest
import torch

from conftest import interrupted_at_step, save_tiny_bert
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder
from densepass.training.trainer import train
from test_training import _fp32_config, make_data

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dropout_bert(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("bert"), seed=1, dropout=0.1)


def _weights(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_lora_trains_only_the_adapted_layers_and_ends_with_a_plain_merged_model(dropout_bert, tiny_beir, tmp_path):
    from sentence_transformers import SentenceTransformer

    model = BiEncoder.from_pretrained(str(dropout_bert))
    start = _weights(model)
    result = train(model, make_data(tiny_beir), _fp32_config(lora_rank=4, learning_rate=1e-2), tmp_path / "run", CPU)
    assert result.steps == 10
    assert not any(type(m).__module__.startswith("peft") or hasattr(m, "peft_config") for m in model.modules())
    after = _weights(model)
    assert after.keys() == start.keys()
    changed = {k for k in after if not torch.equal(after[k], start[k])}
    assert changed and all(k.endswith(("query.weight", "value.weight")) for k in changed), (
        changed
    )  # peft's BERT default
    model.save(tmp_path / "saved")
    again = BiEncoder.from_pretrained(str(tmp_path / "saved"))
    assert all(torch.equal(again.state_dict()[k], after[k]) for k in after)
    texts = ["audio editor", "network terminal"]
    st = SentenceTransformer(str(tmp_path / "saved"), device="cpu").encode(texts)
    ours = again.encode_passages(texts, precision="fp32", show_progress=False)
    torch.testing.assert_close(torch.from_numpy(st), torch.from_numpy(ours), atol=1e-5, rtol=0)


def test_lora_leaves_the_layers_freeze_layers_froze_as_they_were(dropout_bert, tiny_beir, tmp_path):
    """train.freeze_layers with lora_rank: the adapters in the frozen bottom layers stay frozen, so after the merge
    those layers are the starting ones (they were trained, and changed, before)."""
    model = BiEncoder.from_pretrained(str(dropout_bert))
    start = _weights(model)
    config = _fp32_config(lora_rank=4, learning_rate=1e-2, freeze_layers=1)
    train(model, make_data(tiny_beir), config, tmp_path / "run", CPU)
    changed = {k for k, v in _weights(model).items() if not torch.equal(v, start[k])}
    assert changed and not any(".layer.0." in k for k in changed) and any(".layer.1." in k for k in changed), changed


def test_an_interrupted_lora_run_resumes_to_the_same_weights(dropout_bert, tiny_beir, tmp_path):
    config = _fp32_config(lora_rank=4, learning_rate=1e-2)
    straight = BiEncoder.from_pretrained(str(dropout_bert))
    train(straight, make_data(tiny_beir), config, tmp_path / "a", CPU)
    with interrupted_at_step(5):
        train(BiEncoder.from_pretrained(str(dropout_bert)), make_data(tiny_beir), config, tmp_path / "b", CPU)
    resumed = BiEncoder.from_pretrained(str(dropout_bert))
    train(resumed, make_data(tiny_beir), config, tmp_path / "b", CPU)
    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_callbacks_see_the_merged_model(dropout_bert, tiny_beir, tmp_path):
    seen = []

    def on_step_end(step):
        seen.append(any(type(m).__module__.startswith("peft") for m in model.modules()))

    model = BiEncoder.from_pretrained(str(dropout_bert))
    train(
        model,
        make_data(tiny_beir),
        _fp32_config(lora_rank=4, max_steps=2),
        tmp_path / "run",
        CPU,
        on_step_end=on_step_end,
    )
    assert seen == [False, False]


def test_a_cross_encoder_trains_its_head_and_the_adapters_only(tiny_model_dir, tiny_beir, tmp_path):
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.training.cross_encoder import train_cross_encoder
    from test_reranker_training import config
    from test_reranker_training import make_data as ce_data

    model = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=CPU)
    start = _weights(model.model)
    train_cross_encoder(model, ce_data(tiny_beir), config(epochs=1, lora_rank=2), tmp_path / "ce", CPU)
    after = _weights(model.model)
    changed = {k for k in after if not torch.equal(after[k], start[k])}
    assert any(k.startswith("classifier") for k in changed)  # the head outside the transformer trains in full
    assert all(k.startswith("classifier") or k.endswith(("query.weight", "value.weight")) for k in changed), changed


def test_lora_needs_a_transformer_and_layers_that_exist(dropout_bert, tiny_beir, tmp_path):
    with pytest.raises(ConfigError, match="lora_targets"):
        train(
            BiEncoder.from_pretrained(str(dropout_bert)),
            make_data(tiny_beir),
            _fp32_config(lora_rank=4, lora_targets=["no_such_layer"]),
            tmp_path / "run",
            CPU,
        )


def test_an_interrupted_lora_run_leaves_the_callers_model_plain_and_it_resumes(dropout_bert, tiny_beir, tmp_path):
    """Training stopped mid-way (Ctrl-C in a notebook): the model object it was given is as it was, without
    adapters (a second call put its adapters on top of the first's, which no checkpoint matched), and training that
    same object again resumes to the weights of an uninterrupted run."""
    config = _fp32_config(lora_rank=4, learning_rate=1e-2)
    straight = BiEncoder.from_pretrained(str(dropout_bert))
    train(straight, make_data(tiny_beir), config, tmp_path / "a", CPU)
    model = BiEncoder.from_pretrained(str(dropout_bert))
    start = _weights(model)
    with interrupted_at_step(5):
        train(model, make_data(tiny_beir), config, tmp_path / "b", CPU)
    assert not any(type(m).__module__.startswith("peft") or hasattr(m, "peft_config") for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    assert _weights(model).keys() == start.keys() and all(torch.equal(_weights(model)[k], start[k]) for k in start)
    train(model, make_data(tiny_beir), config, tmp_path / "b", CPU)
    a, b = _weights(straight), _weights(model)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lora_targets_no_layer_matches_are_refused_before_any_mining(tiny_beir, tmp_path, monkeypatch):
    """``densepass run``, dp.train and a reranker's training: lora_targets naming no layer of the model is one
    line before the pool is mined (it came when training started, after mining and the baselines)."""
    import densepass as dp
    from conftest import save_tiny_bert, small_run_overrides
    from densepass.config import TrainConfig, load_config
    from densepass.negatives import mine
    from densepass.pipelines.experiment import check, run_experiment

    model_dir = save_tiny_bert(tmp_path / "m", seed=1)

    def no_mining(*args, **kwargs):
        raise AssertionError("mined before the adapters were checked")

    monkeypatch.setattr(mine, "mine_negatives", no_mining)
    monkeypatch.setattr("densepass.pipelines.training.mine_negatives", no_mining)
    overrides = [*small_run_overrides(tiny_beir, model_dir, tmp_path, "r"), "train.lora_rank=4"]
    with pytest.raises(ConfigError, match="^lora_targets: .*no_such_layer"):
        run_experiment(load_config(None, [*overrides, "train.lora_targets=[no_such_layer]"]))
    assert not (tmp_path / "r").exists()
    model = BiEncoder.from_pretrained(str(model_dir))
    with pytest.raises(ConfigError, match="^lora_targets: .*no_such_layer"):
        dp.train(model, str(tiny_beir), args=TrainConfig(lora_rank=4, lora_targets=["no_such_layer"]),
                 output_dir=tmp_path / "t")  # fmt: skip
    assert not (tmp_path / "t").exists()
    assert not any(type(m).__module__.startswith("peft") for m in model.modules())  # the check changed nothing
    reranker = [
        "reranker.enabled=true",
        f"reranker.name_or_path={model_dir}",
        "reranker.max_length=64",
        "reranker.train.lora_rank=2",
        "reranker.train.lora_targets=[no_such_layer]",
        f"output_dir={tmp_path / 'c'}",
    ]
    with pytest.raises(ConfigError, match="^lora_targets: .*no_such_layer"):
        check(load_config(None, reranker))
    check(load_config(None, [*reranker[:-2], "reranker.train.lora_targets=[query]", f"output_dir={tmp_path / 'c'}"]))
    assert not (tmp_path / "c").exists()


def test_an_adapter_on_a_weight_another_module_shares_is_refused_and_taken_out(tiny_model_dir):
    """SPLADE's MLM decoder is tied to the word embeddings: an adapter there changed the lookup alone while
    training and both once merged (the saved model was not the trained one). Refused in one line; the network is
    left as it was."""
    from densepass.config import OptimConfig
    from densepass.models.splade import SpladeEncoder
    from densepass.training.adapters import Adapters

    model = SpladeEncoder.from_pretrained(str(tiny_model_dir))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ConfigError, match=r"word_embeddings's weight is tied to another module's .*leave it out"):
        Adapters(model, OptimConfig(lora_rank=2, lora_targets=["word_embeddings"]))
    assert not any("lora_" in n for n, _ in model.named_parameters())
    after = dict(model.named_parameters())
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    Adapters(model, OptimConfig(lora_rank=2, lora_targets=["query", "value"])).merge()  # untied layers: fine
