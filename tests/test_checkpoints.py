"""Checkpoints: stored without pickle, verified against their manifest, resumed only for the same run."""

from __future__ import annotations

import json
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from densepass.checkpoints import (
    Checkpoints,
    capture_rng,
    load_tree,
    restore_rng,
    save_tree,
    training_identity,
    trim_log,
)
from densepass.config import TrainConfig
from densepass.errors import ConfigError, DataWarning
from densepass.io import manifest_problem

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(allow_nan=False), st.text(max_size=5)
)
trees = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.lists(children, max_size=3),
        st.tuples(children, children),
        st.dictionaries(st.text(max_size=3).filter(lambda k: not k.startswith("__")), children, max_size=3),
        st.dictionaries(st.integers(0, 9), children, max_size=3),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(tree=trees)
def test_any_tree_of_plain_values_round_trips(tmp_path_factory, tree):
    directory = tmp_path_factory.mktemp("tree")
    save_tree({"value": tree}, directory)
    assert load_tree(directory) == {"value": tree}


def test_tensors_and_arrays_round_trip_exactly(tmp_path):
    tree = {
        "state": {0: {"exp_avg": torch.randn(3, 2), "step": torch.tensor(7.0)}},
        "rng": np.random.get_state(),
        "bytes": torch.get_rng_state(),
    }
    save_tree(tree, tmp_path)
    back = load_tree(tmp_path)
    assert torch.equal(back["state"][0]["exp_avg"], tree["state"][0]["exp_avg"])
    assert torch.equal(back["bytes"], tree["bytes"])
    assert back["rng"][0] == "MT19937" and np.array_equal(back["rng"][1], tree["rng"][1])


def test_a_checkpoint_is_never_unpickled(tmp_path):
    """The state files are safetensors + JSON: a pickle planted where state lives is never executed."""
    save_tree({"step": 1}, tmp_path)
    assert (tmp_path / "state.json").read_text().startswith("{")
    with open(tmp_path / "state.safetensors", "rb") as handle:
        header = handle.read(8)
    assert int.from_bytes(header, "little") < 10_000  # a safetensors header length, not a pickle opcode


def test_restored_random_states_replay_every_generator():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = capture_rng()
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    restore_rng(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 2)


def _save(checkpoints: Checkpoints, step: int) -> Path:
    model = _Model()
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    model.layer(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    return checkpoints.save(
        step, lambda d: (d / "model.bin").write_bytes(b"w" * step), optimizer, scheduler, {"note": step}
    )


def test_the_newest_intact_checkpoint_is_resumed_and_older_ones_pruned(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2, identity={"lr": 1})
    for step in (1, 2, 3):
        _save(checkpoints, step)
    assert [p.name for p in checkpoints.paths()] == ["step-2", "step-3"]
    resumed = checkpoints.latest()
    assert resumed.step == 3 and resumed.extra == {"note": 3}
    assert resumed.optimizer["state"][0]["step"].item() == 1


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_a_damaged_newest_checkpoint_falls_back_with_a_warning(tmp_path, damage):
    checkpoints = Checkpoints(tmp_path, keep=3, identity={})
    _save(checkpoints, 2)
    newest = _save(checkpoints, 4)
    target = newest / ("manifest.json" if damage == "manifest" else "state.safetensors")
    data = target.read_bytes()
    if damage == "truncate":
        target.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        target.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif damage == "delete":
        target.unlink()
    else:
        target.write_text("{not json")
    assert manifest_problem(newest) is not None
    with pytest.warns(DataWarning, match="step-4 is damaged"):
        resumed = checkpoints.latest()
    assert resumed.step == 2


def test_no_intact_checkpoint_means_a_fresh_start(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2, identity={})
    (_save(checkpoints, 1) / "manifest.json").unlink()
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert checkpoints.latest() is None


def test_resuming_a_run_with_other_settings_is_refused(tmp_path):
    _save(Checkpoints(tmp_path, keep=2, identity={"train": {"batch_size": 8, "lr": 1e-3}}), 1)
    with pytest.raises(ConfigError, match=r"train\.batch_size differ.*--restart"):
        Checkpoints(tmp_path, keep=2, identity={"train": {"batch_size": 16, "lr": 1e-3}}).latest()


def test_a_distilling_run_resumes_across_its_teachers_bookkeeping_also_when_written_with_it(tmp_path):
    """The identity of a run distilling its own reranker held ``reranker.train`` whole, so changing how often the
    teacher logs or checkpoints refused the student's resume; now its bookkeeping is left out, and dropped from
    the identity of runs written with it; what the teacher trains on still counts."""
    from densepass.config import load_config
    from densepass.pipelines.distillation import distillation_identity

    base = ["reranker.enabled=true", "reranker.train.enabled=true", "reranker.distill.loss=margin-mse"]
    identity = distillation_identity(load_config(None, base))
    assert "log_every" not in identity["distill"]["teacher"]["train"]
    changed = distillation_identity(
        load_config(None, [*base, "reranker.train.log_every=3", "reranker.train.keep_checkpoints=7"])
    )
    assert changed == identity
    written = json.loads(json.dumps(identity))  # as a run written before: the teacher's bookkeeping in its identity
    written["distill"]["teacher"]["train"].update(log_every=50, keep_checkpoints=2, checkpoint_every=500)
    _save(Checkpoints(tmp_path, keep=2, identity=written), 1)
    assert Checkpoints(tmp_path, keep=2, identity=identity).latest().step == 1
    other = distillation_identity(load_config(None, [*base, "reranker.train.epochs=3"]))
    with pytest.raises(ConfigError, match=r"distill\.teacher\.train\.epochs differ"):
        Checkpoints(tmp_path, keep=2, identity=other).latest()


def test_a_run_with_cpu_bf16_auto_never_resumes_in_another_precision(tmp_path, monkeypatch):
    """``cpu_bf16: auto`` is bf16 on a CPU with bf16 instructions and fp32 elsewhere: the identity holds what it
    resolved to, so a run moved to a CPU where auto means the other precision is refused, not silently changed."""
    config = TrainConfig(packing=False)  # cpu_bf16: auto
    monkeypatch.setenv("DENSEPASS_FAST_BF16", "1")
    _save(Checkpoints(tmp_path, keep=2, identity={"train": training_identity(config)}), 1)
    assert Checkpoints(tmp_path, keep=2, identity={"train": training_identity(config)}).latest().step == 1
    forced = {"train": training_identity(TrainConfig(cpu_bf16=True, packing=False))}
    assert Checkpoints(tmp_path, keep=2, identity=forced).latest().step == 1  # the same precision, said outright
    monkeypatch.setenv("DENSEPASS_FAST_BF16", "0")
    with pytest.raises(ConfigError, match=r"train\.cpu_bf16 differ"):
        Checkpoints(tmp_path, keep=2, identity={"train": training_identity(config)}).latest()


def test_a_new_training_option_at_its_default_leaves_earlier_runs_resumable(tmp_path):
    """The identity of the default ``TrainConfig`` holds only the options runs were written with before options
    were added (each later one, at its default, is left out: ``LATER_OPTIONS``), so a run written then resumes; the
    same option set otherwise (here ``matryoshka_init``) is refused. A new option missing from ``LATER_OPTIONS``
    fails the first assertion. ``packing`` is the exception: its default (``auto``) packs where runs written
    before it did not, so the identity holds what it resolved to (the caller's ``packing``) where that is packed,
    and such a run resumes with ``packing: false`` (tests/test_packing.py)."""
    earlier = ["batch_size", "bf16", "bidirectional", "cpu_bf16", "enabled", "epochs", "freeze_layers"]
    earlier += ["grad_cache_chunk", "learning_rate", "max_steps", "passage_max_length", "seed", "warmup_ratio"]
    earlier += ["weight_decay", "wise_ft"]
    assert sorted(training_identity(TrainConfig(), packing=False)) == sorted(earlier)
    assert sorted(training_identity(TrainConfig(packing=False))) == sorted(earlier)
    assert training_identity(TrainConfig(), packing=True)["packing"] is True
    with pytest.raises(ValueError, match="packing: auto needs"):
        training_identity(TrainConfig())  # auto, unresolved: no identity
    _save(Checkpoints(tmp_path, keep=2, identity={"train": training_identity(TrainConfig(), False)}), 1)
    assert Checkpoints(tmp_path, keep=2, identity={"train": training_identity(TrainConfig(), False)}).latest().step == 1
    pca = TrainConfig(matryoshka_dims=[16], matryoshka_init="pca")
    with pytest.raises(ConfigError, match=r"train\.matryoshka_init"):
        Checkpoints(tmp_path, keep=2, identity={"train": training_identity(pca, False)}).latest()


def test_trim_log_drops_records_after_the_step_and_a_cut_line(tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4')
    trim_log(log, 2)
    assert log.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_the_rerankers_data_identity_leaves_out_the_evaluation_part_but_not_training_keys(tmp_path):
    """Reranker runs written before ``data.eval_part*`` existed (a data identity without them) resume, and so does a
    run resumed with another evaluation part (it never changes the cross-encoder's weights); a training key does
    not."""
    from dataclasses import asdict, replace

    from densepass.config import DataConfig
    from densepass.pipelines.reranking import reranker_data_identity

    data = DataConfig()
    before = {k: v for k, v in asdict(data).items() if k not in ("mix", "eval_part", "eval_part_fraction")}
    before.pop("eval_part_seed")
    assert reranker_data_identity(data) == before  # written before the new keys: the same identity
    _save(Checkpoints(tmp_path, keep=2, identity={"data": before}), 1)
    tuned = replace(data, eval_part="report", eval_part_fraction=0.3, eval_part_seed=7)
    assert Checkpoints(tmp_path, keep=2, identity={"data": reranker_data_identity(tuned)}).latest().step == 1
    trained_on_fewer = replace(data, max_train_queries=5)
    with pytest.raises(ConfigError, match=r"data\.max_train_queries differ"):
        Checkpoints(tmp_path, keep=2, identity={"data": reranker_data_identity(trained_on_fewer)}).latest()


def test_the_negatives_filter_precision_at_its_default_leaves_earlier_runs_resumable():
    """``negatives.filter_precision`` came after runs were written: at its default (fp32, what the filters scored in
    before) it is not part of a run's identity, so those runs resume; another value is."""
    from dataclasses import asdict

    from densepass.checkpoints import without_later_defaults
    from densepass.config import NegativesConfig

    assert "filter_precision" not in without_later_defaults(asdict(NegativesConfig()))
    assert without_later_defaults(asdict(NegativesConfig(filter_precision="auto")))["filter_precision"] == "auto"


def test_a_run_resumed_past_a_damaged_checkpoint_keeps_the_one_it_writes(tmp_path):
    """Resumed from step 5 because step 10 is damaged, the run's next save (step 6) is kept with keep=1, and the
    next resume starts from it: pruning by position alone deleted step 6 and step 5 and kept the damaged step 10."""
    checkpoints = Checkpoints(tmp_path, keep=1, identity={})
    _save(checkpoints, 5)
    damaged = _save(checkpoints, 10)
    (damaged / "state.safetensors").write_bytes(b"broken")
    # keep=1 pruned step 5 when step 10 was written: put it back as a run with keep=2 would have left it
    checkpoints_two = Checkpoints(tmp_path, keep=2, identity={})
    _save(checkpoints_two, 5)
    with pytest.warns(DataWarning, match="step-10 is damaged"):
        assert checkpoints.latest().step == 5
    _save(checkpoints, 6)
    assert [p.name for p in checkpoints.paths()] == ["step-6", "step-10"]
    with pytest.warns(DataWarning, match="step-10 is damaged"):
        assert checkpoints.latest().step == 6
    _save(checkpoints, 10)  # the run reaches step 10 again: the damaged one is replaced, the older one pruned
    assert [p.name for p in checkpoints.paths()] == ["step-10"]
    assert checkpoints.latest().step == 10


def test_pruning_keeps_the_newest_older_checkpoints(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3, identity={})
    for step in (1, 2, 3, 4, 5):
        _save(checkpoints, step)
    assert [p.name for p in checkpoints.paths()] == ["step-3", "step-4", "step-5"]


def test_each_process_resumes_its_own_random_states_and_another_count_of_processes_is_warned():
    from densepass.checkpoints import Resumed

    states = [{"torch": i} for i in range(3)]
    resumed = Resumed(Path("step-4"), 4, {}, {}, states[0], {}, states)
    assert [resumed.rng_of(rank, 3) for rank in range(3)] == states
    with pytest.warns(DataWarning, match="written by 3 and resumes in 2: .* not resume bit-exactly"):
        assert resumed.rng_of(1, 2) is states[0]
    older = Resumed(Path("step-4"), 4, {}, {}, states[0], {})  # one process, or a densepass before this
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert older.rng_of(0, 1) is states[0]
    with pytest.warns(DataWarning, match="written by one process"):
        older.rng_of(1, 2)
