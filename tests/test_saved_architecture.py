"""A model loads as it was saved: a sentence-transformers model's pooling, Dense, Normalize and prompts are read
(``models.st_layout``), and a run from a saved model takes the saved settings its config leaves at their defaults
(``pipelines.retrievers.with_saved_architecture``) instead of silently running another model."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import save_tiny_bert
from densepass.config import BiEncoderConfig, ExperimentConfig, load_config
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts
from densepass.pipelines.retrievers import model_from_config, with_saved_architecture

TEXTS = ["a terminal emulator for the desktop", "kernel driver for network printers", "mail server"]


def _st_model(tmp_path, tiny_model_dir, pooling="cls", dense=True, normalize=False, activation=None):
    from sentence_transformers import SentenceTransformer, models

    torch.manual_seed(3)
    modules = [models.Transformer(str(tiny_model_dir), max_seq_length=64), models.Pooling(32, pooling_mode=pooling)]
    if dense:
        modules.append(models.Dense(32, 8, activation_function=activation or torch.nn.Identity()))
    if normalize:
        modules.append(models.Normalize())
    st = SentenceTransformer(modules=modules, device="cpu", prompts={"query": "q: ", "document": "d: "})
    st.save(str(tmp_path / "st"))
    return tmp_path / "st", st


@pytest.mark.parametrize(
    "pooling,dense,normalize", [("cls", True, False), ("mean", False, True), ("lasttoken", True, True)]
)
def test_a_sentence_transformers_model_embeds_as_sentence_transformers_does(
    tmp_path, tiny_model_dir, pooling, dense, normalize
):
    path, st = _st_model(tmp_path, tiny_model_dir, pooling, dense, normalize)
    model = BiEncoder.from_pretrained(str(path))
    assert model.config.pooling == {"lasttoken": "last"}.get(pooling, pooling)
    assert model.config.projection_dim == (8 if dense else None) and model.config.normalize is normalize
    assert (model.config.query_prompt, model.config.passage_prompt) == ("q: ", "d: ")
    if pooling == "lasttoken":
        return  # densepass appends an EOS for last-token pooling (its tokenizer's), sentence-transformers does not
    for side, prompt in (("query", "query"), ("passage", "document")):
        ours = encode_texts(model, TEXTS, side, precision="fp32", show_progress=False)
        theirs = st.encode(TEXTS, prompt_name=prompt, convert_to_numpy=True)
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


@pytest.mark.parametrize(
    "change,message",
    [
        ("max", "pooled by max"),
        ("tanh", "Dense layer has torch.nn.modules.activation.Tanh"),
        ("module", "modules densepass does not have"),
        ("weights", "weights are not in"),
    ],
)
def test_a_sentence_transformers_model_densepass_cannot_reproduce_is_one_line(
    tmp_path, tiny_model_dir, change, message
):
    path, _ = _st_model(
        tmp_path,
        tiny_model_dir,
        pooling="max" if change == "max" else "cls",
        activation=torch.nn.Tanh() if change == "tanh" else None,
    )
    if change == "module":
        modules = json.loads((path / "modules.json").read_text())
        modules.append({"idx": 3, "name": "3", "path": "3_LayerNorm", "type": "sentence_transformers.models.LayerNorm"})
        (path / "modules.json").write_text(json.dumps(modules))
    if change == "weights":
        (path / "2_Dense" / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=message) as err:
        BiEncoder.from_pretrained(str(path))
    assert "\n" not in str(err.value)


def test_lower_casing_only_sentence_transformers_does_is_refused_and_a_module_without_a_path_is_the_root(
    tmp_path, tiny_model_dir
):
    """``do_lower_case`` in sentence_bert_config.json has sentence-transformers lower-case the texts itself: with
    a cased tokenizer densepass embedded other tokens ("Audio" as [UNK]) in silence. An uncased tokenizer lowers
    them anyway (MiniLM's: accepted). A module listed without a path was a KeyError."""
    path, _ = _st_model(tmp_path, tiny_model_dir)
    settings = json.loads((path / "sentence_bert_config.json").read_text())
    (path / "sentence_bert_config.json").write_text(json.dumps({**settings, "do_lower_case": True}))
    BiEncoder.from_pretrained(str(path))  # MiniLM's tokenizer lower-cases: the same tokens
    tokenizer = json.loads((path / "tokenizer.json").read_text())  # a cased tokenizer: both its files say so
    tokenizer["normalizer"]["lowercase"] = False
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    settings_file = path / "tokenizer_config.json"
    settings_file.write_text(json.dumps({**json.loads(settings_file.read_text()), "do_lower_case": False}))
    from transformers import AutoTokenizer

    cased = AutoTokenizer.from_pretrained(str(path))
    assert cased("Audio")["input_ids"] != cased("audio")["input_ids"]  # the tokens do differ
    with pytest.raises(ConfigError, match=r"lower-cases the texts \(do_lower_case\) where its tokenizer does not"):
        BiEncoder.from_pretrained(str(path))
    (path / "sentence_bert_config.json").write_text(json.dumps(settings))
    modules = json.loads((path / "modules.json").read_text())
    del modules[0]["path"]
    (path / "modules.json").write_text(json.dumps(modules))
    assert BiEncoder.from_pretrained(str(path)).config.projection_dim == 8


@pytest.mark.parametrize(
    ("file", "change", "message"),
    [
        ("1_Pooling/config.json", {"pooling_mode": 5}, "pooling_mode 5 is not a pooling name"),
        ("2_Dense/config.json", {"out_features": True}, "no readable Dense config"),
        ("config_sentence_transformers.json", {"prompts": {"query": 3}}, "its prompts are not names with texts"),
    ],
)
def test_a_malformed_sentence_transformers_config_is_one_line_not_a_default(
    tmp_path, tiny_model_dir, file, change, message
):
    """A pooling mode of another type was read as mean pooling, ``out_features: true`` as a 1-dimensional
    projection, and prompts of another type were all dropped: each embedded otherwise in silence."""
    from densepass.errors import DataError

    path, _ = _st_model(tmp_path, tiny_model_dir)
    values = json.loads((path / file).read_text())
    (path / file).write_text(json.dumps({**values, **change}))
    with pytest.raises(DataError, match=message):
        BiEncoder.from_pretrained(str(path))


def _run_config(path, tmp_path, *overrides):
    return load_config(
        None, [f"model.name_or_path={path}", f"output_dir={tmp_path / 'runs'}", "name=x", *overrides], ExperimentConfig
    )


def test_a_run_from_a_saved_model_runs_the_model_saved_there(tmp_path, tiny_model_dir):
    config = BiEncoderConfig(
        shared=False, pooling="cls", projection_dim=8, normalize=False, query_prompt="query: ", passage_max_length=64
    )
    saved = BiEncoder.from_pretrained(str(tiny_model_dir), config=config)
    with torch.no_grad():
        next(saved.query_encoder.parameters()).add_(0.5)  # a trained query tower, not a copy of the passage one
    saved.save(tmp_path / "m")
    merged = with_saved_architecture(_run_config(tmp_path / "m", tmp_path))
    assert merged.model.architecture() == config
    model = model_from_config(merged)
    for side in ("query", "passage"):
        np.testing.assert_allclose(
            encode_texts(model, TEXTS, side, precision="fp32", show_progress=False),
            encode_texts(saved, TEXTS, side, precision="fp32", show_progress=False),
            atol=1e-6,
        )
    # a length the config sets is the run's choice and kept; a projection of another size is refused in one line
    assert (
        with_saved_architecture(
            _run_config(tmp_path / "m", tmp_path, "model.passage_max_length=48")
        ).model.passage_max_length
        == 48
    )
    with pytest.raises(ConfigError, match="saved with projection_dim 8, not the 16"):
        with_saved_architecture(_run_config(tmp_path / "m", tmp_path, "model.projection_dim=16"))
    with pytest.raises(ConfigError, match="saved with a projection to 8 dimensions"):
        BiEncoder.from_pretrained(str(tmp_path / "m"), config=BiEncoderConfig(projection_dim=16))


def test_a_value_the_config_sets_is_kept_even_where_it_is_the_default(tmp_path, tiny_model_dir):
    """The saved settings fill only what the file and overrides leave out: a default set on purpose (passages at
    128 tokens for a model saved at 64) is the user's choice; a config built in Python, with no record of what
    was set, takes the saved value wherever it holds the default."""
    BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(passage_max_length=64)).save(tmp_path / "m")
    merged = with_saved_architecture(_run_config(tmp_path / "m", tmp_path, "model.passage_max_length=128"))
    assert merged.model.passage_max_length == 128
    assert with_saved_architecture(_run_config(tmp_path / "m", tmp_path)).model.passage_max_length == 64
    built = ExperimentConfig(name="x", output_dir=str(tmp_path / "runs"))
    built.model.name_or_path = str(tmp_path / "m")
    assert with_saved_architecture(built).model.passage_max_length == 64


def test_a_plain_hugging_face_model_keeps_the_configs_settings(tmp_path, tiny_model_dir):
    config = _run_config(tiny_model_dir, tmp_path, "model.pooling=cls")
    assert with_saved_architecture(config) is config


def test_a_colbert_run_takes_the_saved_dimension_and_refuses_another(tmp_path):
    from densepass.models.colbert import ColBERT, ColbertArchitecture

    base = save_tiny_bert(tmp_path / "bert")
    torch.manual_seed(0)
    ColBERT.from_pretrained(str(base), config=ColbertArchitecture(dim=16, markers=False)).save(tmp_path / "c")
    merged = with_saved_architecture(_run_config(tmp_path / "c", tmp_path, "model.kind=colbert"))
    assert (merged.model.colbert.dim, merged.model.colbert.markers) == (16, False)
    with pytest.raises(ConfigError, match="colbert.dim 16, not the 32"):
        with_saved_architecture(_run_config(tmp_path / "c", tmp_path, "model.kind=colbert", "model.colbert.dim=32"))
    with pytest.raises(ConfigError, match="16-dimensional token vectors"):
        ColBERT.from_pretrained(str(tmp_path / "c"), config=ColbertArchitecture(dim=32))
    shutil.rmtree(tmp_path / "c")


def test_a_saved_projection_is_never_dropped(tmp_path, tiny_model_dir):
    """A config without a projection (null set on purpose, or a BiEncoderConfig built without one) would load the
    model without its trained projection: both are one-line errors."""
    BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(projection_dim=8)).save(tmp_path / "m")
    with pytest.raises(ConfigError, match="saved with projection_dim 8, not the None"):
        with_saved_architecture(_run_config(tmp_path / "m", tmp_path, "model.projection_dim=null"))
    with pytest.raises(ConfigError, match="saved with a projection .* would drop it"):
        BiEncoder.from_pretrained(str(tmp_path / "m"), config=BiEncoderConfig())


def test_a_runs_checks_see_the_saved_settings(tmp_path, tiny_model_dir):
    """A crop longer than the saved model's passages is refused (the checks ran on the config's default 128)."""
    from densepass.pipelines.experiment import run_experiment

    BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(passage_max_length=64)).save(tmp_path / "m")
    config = _run_config(tmp_path / "m", tmp_path, "train.passage_max_length=100")
    with pytest.raises(ConfigError, match="train.passage_max_length=100 is longer than model.passage_max_length=64"):
        run_experiment(config)
    assert not (tmp_path / "runs").exists()


def test_an_index_saved_before_settings_were_recorded_refuses_a_model_that_now_loads_otherwise(
    tmp_path, tiny_model_dir
):
    """An index built before densepass read sentence-transformers modules embedded a CLS-pooled model's passages
    with mean pooling: its queries would now be CLS-pooled. Such an index is refused (index again)."""
    import json

    from densepass.index import load_index
    from densepass.index.dense import DenseIndex
    from densepass.io import write_manifest

    path, _ = _st_model(tmp_path, tiny_model_dir, pooling="cls", dense=False, normalize=True)
    model = BiEncoder.from_pretrained(str(path))
    DenseIndex.build(model, ["a terminal emulator", "a mail server"], show_progress=False).save(tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["model"]["settings"]["pooling"] == "cls"
    assert len(load_index(tmp_path / "idx", model=model)) == 2
    # the manifest as an index of before: no settings (its digest rewritten, as the save writes it)
    del manifest["model"]["settings"]
    write_manifest(tmp_path / "idx", **{k: v for k, v in manifest.items() if k != "files"})
    with pytest.raises(ConfigError, match=r"other settings: pooling 'cls' \(the index's: 'mean'\)"):
        load_index(tmp_path / "idx", model=model)
