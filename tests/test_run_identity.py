"""A run's identity includes its data (docs/reliability.md, section 5): every dataset reader lists the files it
read, their content fingerprints are part of the identity of fine-tuning, cross-encoder, pre-training and phrase
runs, and a run resumed on a changed file is refused in one line naming it (``--restart`` trains on the new data);
a checkpoint written before data files were recorded is refused with its own message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from densepass.checkpoints import DATA_FILES, Checkpoints, check_data_files, data_change
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.data.squad import load_squad_spans
from densepass.errors import ConfigError
from densepass.fingerprints import fingerprint_file_cached


def change_first_text(corpus: Path) -> None:
    lines = corpus.read_text().splitlines()
    record = json.loads(lines[0])
    record["text"] = "a changed text"
    corpus.write_text("\n".join([json.dumps(record), *lines[1:]]) + "\n")


def test_a_reader_lists_every_file_it_read_and_their_fingerprints_follow_the_content(tiny_beir, tmp_path):
    dataset = load_dataset(str(tiny_beir))
    assert list(dataset.files) == ["corpus.jsonl", "queries.jsonl", "qrels/dev.tsv", "qrels/train.tsv"]
    before = dataset.file_fingerprints()
    assert set(before) == {f"tiny/{name}" for name in dataset.files}
    assert load_dataset(str(tiny_beir), passages_on_disk=True).file_fingerprints() == before
    change_first_text(tiny_beir / "corpus.jsonl")
    after = load_dataset(str(tiny_beir)).file_fingerprints()
    assert [name for name in before if before[name] != after[name]] == ["tiny/corpus.jsonl"]
    from phrase_fixtures import write_phrase_squad

    squad = load_squad_spans(write_phrase_squad(tmp_path / "squad")).dataset
    assert squad.files and all(name.endswith(".json") for name in squad.files)


def test_a_file_is_hashed_again_only_when_its_size_or_time_changes(tmp_path, monkeypatch):
    import densepass.fingerprints as fingerprints

    path = tmp_path / "f.txt"
    path.write_text("one")
    calls = []
    real = fingerprints.fingerprint_file
    monkeypatch.setattr(fingerprints, "fingerprint_file", lambda p: calls.append(p) or real(p))
    first = fingerprint_file_cached(path)
    assert fingerprint_file_cached(path) == first and len(calls) == 1
    path.write_text("two!")
    assert fingerprint_file_cached(path) != first and len(calls) == 2


def test_a_changed_data_file_is_named_and_an_older_checkpoint_has_its_own_message(tmp_path):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)

    def save(identity: dict) -> None:
        Checkpoints(tmp_path, 2, identity).save(1, lambda directory: None, optimizer, scheduler)

    settings = {"train": {"learning_rate": 0.1}}
    save(settings)  # as densepass wrote checkpoints before it recorded data files
    now = {**settings, DATA_FILES: {"tiny/corpus.jsonl": "aa", "tiny/queries.jsonl": "bb"}}
    with pytest.raises(ConfigError, match="checkpoint step-1 does not record what its data files held .*--restart"):
        Checkpoints(tmp_path, 2, now).latest()
    with pytest.raises(ConfigError, match="step-1 does not record"):
        check_data_files(tmp_path, now[DATA_FILES])
    save(now)
    assert Checkpoints(tmp_path, 2, now).latest().step == 1
    check_data_files(tmp_path, now[DATA_FILES])
    changed = {**settings, DATA_FILES: {"tiny/corpus.jsonl": "cc", "tiny/queries.jsonl": "bb"}}
    message = r"cannot resume on this data: tiny/corpus.jsonl changed since its checkpoint step-1 was written; use --re"
    with pytest.raises(ConfigError, match=message):
        Checkpoints(tmp_path, 2, changed).latest()
    with pytest.raises(ConfigError, match=message):
        check_data_files(tmp_path, changed[DATA_FILES])
    other = {"train": {"learning_rate": 0.2}, DATA_FILES: changed[DATA_FILES]}
    with pytest.raises(ConfigError, match=r"other settings \(data_files.tiny/corpus.jsonl, train.learning_rate diff"):
        Checkpoints(tmp_path, 2, other).latest()  # settings too: the usual message, with every key
    assert data_change({DATA_FILES: {"a": "1"}}, {DATA_FILES: {"b": "1"}}, "step-3") == (
        "b is new, a is no longer read since its checkpoint step-3 was written"
    )


def test_pretraining_resumed_on_a_changed_corpus_is_refused(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.pretraining.config import PretrainConfig
    from densepass.pretraining.trainer import pretrain

    settings = [f"data.name={tiny_beir}", f"model.name_or_path={tiny_model_dir}", f"output_dir={tmp_path}", "name=pt"]
    settings += ["model.mode=mlm", "train.max_steps=2", "train.batch_size=2", "train.max_length=16"]
    config = load_config(None, settings, PretrainConfig)
    assert pretrain(config).steps == 2
    change_first_text(tiny_beir / "corpus.jsonl")
    with pytest.raises(
        ConfigError, match=r"cannot resume on this data: tiny/corpus.jsonl changed since its checkpoint"
    ):
        pretrain(config)
    assert pretrain(config, restart=True).steps == 2
