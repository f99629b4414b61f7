"""The Python training API (``densepass.train``): the same weights as the equivalent YAML run, loss objects that
compose, the output folder owned and resumed like a run directory, bad input refused before any work."""

from __future__ import annotations

import pytest
import torch

import densepass as dp
from conftest import small_run_overrides
from densepass.config import load_config
from densepass.errors import ConfigError, DensepassError
from densepass.models.biencoder import BiEncoder
from densepass.pipelines.experiment import run_experiment

SETTINGS = [
    "train.epochs=2",
    "train.batch_size=6",
    "train.learning_rate=1e-3",
    "train.cpu_bf16=false",
    "train.checkpoint_every=3",
    "train.log_every=1",
    "data.max_train_queries=20",
    "negatives.per_query=1",
    "eval.each_epoch=false",
]


def _state(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_python_training_gives_the_same_weights_as_the_yaml_run(tiny_model_dir, tiny_beir, tmp_path):
    config = load_config(None, small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "yaml") + SETTINGS)
    run_experiment(config)
    from_yaml = _state(BiEncoder.from_pretrained(str(config.run_dir / "model")))

    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir), config=config.model.architecture())
    out = dp.train(
        model,
        str(tiny_beir),
        output_dir=tmp_path / "python",
        loss=dp.losses.InfoNCE(),
        negatives=dp.NegativesConfig(source="bm25", pool_depth=5, per_query=1),
        args=dp.TrainConfig(
            epochs=2, batch_size=6, learning_rate=1e-3, cpu_bf16=False, checkpoint_every=3, log_every=1
        ),
        max_queries=20,
        device="cpu",
    )
    assert out.model is model and out.steps == 6 and len(out.log) == 6
    saved = _state(BiEncoder.from_pretrained(str(out.model_dir)))
    assert saved.keys() == from_yaml.keys()
    assert all(torch.equal(saved[k], from_yaml[k]) for k in saved)
    changed = dp.BiEncoder.from_pretrained(str(tiny_model_dir)).state_dict()
    assert not all(torch.equal(saved[k], changed[k]) for k in saved)  # it trained


def test_a_second_call_resumes_and_a_restart_trains_again(tiny_model_dir, tiny_beir, tmp_path):
    def call(**kw):
        model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
        args = dp.TrainConfig(max_steps=2, batch_size=6, cpu_bf16=False, checkpoint_every=1)
        return dp.train(model, str(tiny_beir), output_dir=tmp_path / "out", args=args, device="cpu", **kw)

    first = call()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    again = call()  # every step is in the checkpoints: nothing trains again
    assert again.steps == 2 and all(
        torch.equal(a, b) for a, b in zip(first.model.state_dict().values(), again.model.state_dict().values())
    )
    with pytest.raises(ConfigError, match="other settings"):
        call(loss=dp.losses.InfoNCE(temperature=0.5))
    with pytest.warns(UserWarning, match="notes.txt"):
        call(loss=dp.losses.InfoNCE(temperature=0.5), restart=True)
    assert (tmp_path / "out" / "notes.txt").read_text() == "mine"  # a user's file survives --restart


def test_another_model_of_the_same_settings_does_not_resume_a_runs_checkpoints(tiny_model_dir, tiny_beir, tmp_path):
    """The run's identity named the model's settings only: another base model (same config) resumed the first
    one's checkpoints in silence and came back holding its weights."""
    from conftest import save_tiny_bert

    other = save_tiny_bert(tmp_path / "other-bert", seed=1)
    args = dp.TrainConfig(max_steps=2, batch_size=6, cpu_bf16=False, checkpoint_every=1)
    for path in (tiny_model_dir, other):
        model = dp.BiEncoder.from_pretrained(str(path))
        if path == other:
            with pytest.raises(ConfigError, match="other settings"):
                dp.train(model, str(tiny_beir), output_dir=tmp_path / "out", args=args, device="cpu")
        else:
            dp.train(model, str(tiny_beir), output_dir=tmp_path / "out", args=args, device="cpu")


def test_a_folder_of_someone_else_is_refused_before_any_work(tiny_model_dir, tiny_beir, tmp_path):
    (tmp_path / "thesis").mkdir()
    (tmp_path / "thesis" / "chapter1.tex").write_text("...")
    with pytest.raises(ConfigError):
        dp.train(dp.BiEncoder.from_pretrained(str(tiny_model_dir)), str(tiny_beir), output_dir=tmp_path / "thesis")
    assert sorted(p.name for p in (tmp_path / "thesis").iterdir()) == ["chapter1.tex"]


def test_loss_objects_compose_and_describe_themselves():
    loss = dp.losses.InfoNCE(temperature=0.05) + dp.losses.FLOPS(lambda_q=1e-3, lambda_d=1e-3, warmup_steps=10)
    assert (
        loss.describe()
        == "contrastive (τ 0.05) + FLOPS (lambda_q 0.001, lambda_d 0.001, quadratic warm-up over 10 steps)"
    )
    assert len((loss + dp.losses.InfoNCE()).terms) == 3
    with pytest.raises(ConfigError, match="temperature"):
        dp.losses.InfoNCE(temperature=0)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"args": dp.TrainConfig(batch_size=0)}, r"^args.batch_size: must be >= 1, got 0"),
        ({"args": dp.TrainConfig(warmup_ratio=2)}, r"^args.warmup_ratio: must be <= 1"),
        ({"negatives": dp.NegativesConfig(per_query=-1)}, r"^negatives.per_query: must be >= 0"),
        ({"negatives": dp.NegativesConfig(per_query=5, pool_depth=2)}, r"per_query 5 is more than .*pool_depth 2"),
        ({"args": dp.TrainConfig(wise_ft=0.5)}, r"^args.wise_ft: an option of `densepass run`"),
        ({"args": dp.TrainConfig(enabled=False)}, r"^args.enabled: an option of `densepass run`"),
        ({"args": dp.TrainConfig(matryoshka_weights=[1, 0.5])}, r"give the dimensions too"),
        (
            {"args": dp.TrainConfig(matryoshka_dims=[8]), "loss": dp.losses.Matryoshka(dp.losses.InfoNCE(), [32, 16])},
            r"args.matryoshka_dims \[8\] and the loss's \[32, 16\]: give them once",
        ),
        ({"args": dp.TrainConfig(passage_max_length=1000)}, r"longer than the model's passage_max_length"),
        (  # a dimension of weight 0 trains nothing, yet the loss cuts it: checked against the model too
            {"loss": dp.losses.Matryoshka(dp.losses.InfoNCE(), [1024, 16], [0, 1])},
            r"the Matryoshka dimensions asks for 1024 dimensions of a 32-dimensional model",
        ),
        # checked after the pool was mined and the directory claimed, as they were
        ({"schedule": dp.ScheduleConfig(method="abs-beam", beam_width=1)}, r"beam_width must be >= 2"),
        ({"args": dp.TrainConfig(fsdp=True)}, r"^args.fsdp shards the model over torchrun's processes"),
        ({"args": dp.TrainConfig(batch_size=1000), "max_queries": 8}, r"^batch size 1000 is larger than the 8 train"),
        # of other types: a TypeError or AttributeError deep inside
        ({"args": {"batch_size": 8}}, r"^args: a dp.TrainConfig, not a dict$"),
        ({"negatives": {"source": "none"}}, r"^negatives: a dp.NegativesConfig, not a dict$"),
        ({"loss": torch.nn.CrossEntropyLoss()}, r"^loss: a loss object of dp.losses, not a CrossEntropyLoss$"),
        ({"max_queries": "8"}, r"^max_queries: an integer >= 1, got '8'$"),
        ({"seed": -1}, r"^seed: an integer >= 0, got -1$"),
    ],
)
def test_settings_a_run_refuses_or_applies_are_not_ignored_by_dp_train(
    tiny_model_dir, tiny_beir, tmp_path, options, message
):
    """Configs built in Python skipped the ranges YAML is held to (a ZeroDivisionError after mining), and options of
    a run's other stages (wise-ft) were ignored in silence."""
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
    with pytest.raises(ConfigError, match=message):
        dp.train(model, str(tiny_beir), output_dir=tmp_path / "out", device="cpu", **options)
    assert not (tmp_path / "out").exists()  # before any work


def test_list_settings_given_as_tuples_are_taken(tiny_model_dir, tiny_beir, tmp_path):
    """YAML's type checks want lists; a tuple in Python is the same setting."""
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
    args = dp.TrainConfig(max_steps=1, batch_size=6, cpu_bf16=False, matryoshka_dims=(16, 8))
    assert dp.train(model, str(tiny_beir), output_dir=tmp_path / "out", args=args, device="cpu").steps == 1


def test_a_checkpoint_written_before_the_model_source_was_recorded_resumes(tmp_path, monkeypatch):
    from densepass.checkpoints import Checkpoints
    from densepass.pipelines.training import model_source

    identity = {"model": {"pooling": "mean"}, "model_source": "/models/a"}
    checkpoints = Checkpoints(tmp_path, 1, identity)
    checkpoints._check_identity(tmp_path / "step-1", {"model": {"pooling": "mean"}})  # an older run: resumes
    with pytest.raises(ConfigError, match="model_source differ"):
        checkpoints._check_identity(tmp_path / "step-1", {**identity, "model_source": "/models/b"})
    (tmp_path / "m").mkdir()
    monkeypatch.chdir(tmp_path)
    sources = {model_source(type("M", (), {"source": name})()) for name in ("m", "./m", str(tmp_path / "m"))}
    assert sources == {str((tmp_path / "m").resolve())}  # one local folder, however it is named


def test_a_loss_setting_past_its_description_s_rounding_still_refuses_a_resume(tiny_model_dir, tiny_beir, tmp_path):
    """The identity held the loss by its description, whose numbers are rounded to six digits: τ 0.05 and
    0.05000001 read the same, and a resume across them went on in silence. A checkpoint written before the exact
    settings were recorded still resumes."""
    from densepass.checkpoints import Checkpoints

    near = [dp.losses.InfoNCE(temperature=0.05), dp.losses.InfoNCE(temperature=0.05000001)]
    assert near[0].describe() == near[1].describe() and near[0].identity() != near[1].identity()
    args = dp.TrainConfig(max_steps=1, batch_size=6, cpu_bf16=False, checkpoint_every=1)

    def call(loss):
        model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
        return dp.train(model, str(tiny_beir), output_dir=tmp_path / "out", args=args, loss=loss, device="cpu")

    call(near[0])
    with pytest.raises(ConfigError, match="objective.temperature differ"):
        call(near[1])
    sum_ = dp.losses.InfoNCE() + dp.losses.FLOPS(lambda_q=1e-3, lambda_d=2e-3, warmup_steps=4)
    assert sum_.identity() == {
        "objective": "Sum",
        "terms": [
            {"objective": "InfoNCE", "bidirectional": False, "temperature": None},
            {"objective": "FLOPS", "lambda_q": 1e-3, "lambda_d": 2e-3, "warmup": 4},
        ],
    }
    import json

    import numpy as np

    json.dumps(dp.losses.InfoNCE(temperature=np.float32(0.05)).identity())  # numpy numbers given: JSON's identity
    identity = {"loss": near[0].describe(), "objective": near[0].identity()}
    Checkpoints(tmp_path, 1, identity)._check_identity(tmp_path / "step-1", {"loss": near[0].describe()})  # older


TORCHRUN_SCRIPT = """
import sys
import torch
import densepass as dp
from densepass import distributed

model_dir, data, out = sys.argv[1:4]
model = dp.BiEncoder.from_pretrained(model_dir)
args = dp.TrainConfig(max_steps=3, batch_size=6, cpu_bf16=False, checkpoint_every=1, learning_rate=1e-3)
done = dp.train(model, data, output_dir=out, args=args, device="cpu", max_queries=18)  # joins the group itself
print("steps", done.steps, "world", distributed.world_size())
"""


def test_dp_train_under_torchrun_trains_as_one_process_does(tiny_model_dir, tiny_beir, tmp_path):
    """Every process took the run directory's lock (the second died "in use by another densepass training") and
    every one saved the model: now rank 0 claims the folder and saves, and two processes end with one process's
    weights (up to float rounding: the gradients are summed over them)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(Path(dp.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    results = {}
    for processes in (1, 2):
        out = tmp_path / f"out{processes}"
        launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
        done = subprocess.run(
            [sys.executable, *launcher, str(script), str(tiny_model_dir), str(tiny_beir), str(out)],
            env=env,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.count("steps 3") == processes
        results[processes] = dp.BiEncoder.from_pretrained(str(out / "model")).state_dict()
    for key, value in results[1].items():
        torch.testing.assert_close(results[2][key], value, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "negatives, message",
    [
        (dict(source="mixed", mix=["bm25", "bogus"]), "unknown negatives strategy 'bogus'"),
        (dict(source="model"), "negatives.source=model needs negatives.model"),
        (dict(source="file", file="/no/such/pool.jsonl"), "hard-negatives file not found"),
        (dict(source="mixed", mix=["bm25", "given"]), "'given' takes the negatives of training rows"),
        (dict(filters=["qrels", "cross-encoder"]), "the cross-encoder filter needs a cross-encoder"),
    ],
)
def test_negatives_that_cannot_be_mined_are_refused_before_the_folder_is_claimed(
    tiny_model_dir, tiny_beir, tmp_path, negatives, message
):
    """dp.train checked its strategies and filters only while mining, after claiming (with restart: emptying) its
    output folder."""
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
    args = dp.TrainConfig(max_steps=1, batch_size=4, cpu_bf16=False)
    with pytest.raises(DensepassError, match=message):
        dp.train(
            model,
            str(tiny_beir),
            output_dir=tmp_path / "out",
            args=args,
            negatives=dp.NegativesConfig(pool_depth=5, **negatives),
            device="cpu",
            restart=True,
        )
    assert not (tmp_path / "out").exists()
