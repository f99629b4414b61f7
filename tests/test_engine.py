"""The training engine (``densepass.training.engine``) on a toy task whose every step is known: exact resume after
an interruption at any step, logs as means since the previous record, callbacks in order, the divergence guard,
bf16 autocast handed to the step, one optimiser for the whole package, and every task under bf16."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from densepass.checkpoints import Checkpoints, training_identity
from densepass.config import OptimConfig
from densepass.errors import ConfigError
from densepass.numerics import Diverged
from densepass.training import engine

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


class Interrupt(Exception):
    pass


class Regression(engine.Task):
    """Linear regression with dropout on a fixed random dataset; batches drawn from (seed, epoch); a running
    count of examples seen as the task's own state."""

    throughput = None

    def __init__(self, n=24, batch=5, epochs=3, fail_at=None, nan_at=()):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 4, generator=g), torch.randn(n, generator=g)
        self.batch, self.epochs = batch, epochs
        self.steps_per_epoch = n // batch
        torch.manual_seed(0)  # the same starting weights for every run
        self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
        torch.nn.init.constant_(self.model[0].weight, 0.1)
        self.seen, self.fail_at, self.nan_at, self.bf16_seen = 0, fail_at, set(nan_at), []

    def setup(self, device):
        self.model.to(device).train()

    def parameter_groups(self):
        return [{"params": list(self.model.parameters())}]

    def named_weights(self):
        return self.model.named_parameters()

    def plan(self, epoch):
        order = torch.randperm(len(self.x), generator=torch.Generator().manual_seed(100 + epoch)).tolist()
        return [order[i : i + self.batch] for i in range(0, len(order), self.batch)]  # the last batch is partial

    def step(self, rows, context):
        if context.step + 1 == self.fail_at:
            raise Interrupt
        self.bf16_seen.append((context.bf16, torch.is_autocast_enabled("cpu")))
        loss = ((self.model(self.x[rows]).squeeze(1) - self.y[rows]) ** 2).mean()
        if context.step + 1 in self.nan_at:
            loss = loss * float("nan")
        loss.backward()
        return engine.StepOutput(loss, size=len(rows), terms={"rows": float(len(rows))})

    def after_step(self, output, rows):
        self.seen += len(rows)

    def save(self, checkpoint):
        from safetensors.torch import save_file

        (checkpoint / "model").mkdir()
        save_file({k: v.contiguous() for k, v in self.model.state_dict().items()}, str(checkpoint / "model" / "w"))

    def load(self, checkpoint, device):
        from safetensors.torch import load_file

        self.model.load_state_dict(load_file(str(checkpoint / "model" / "w")))

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, state):
        self.seen = state["seen"]


class Record(engine.Callback):
    def __init__(self):
        self.events, self.count = [], 0

    def on_train_begin(self, state):
        self.events.append(("begin", state.step))

    def on_step_end(self, state):
        self.count += 1
        self.events.append(("step", state.step, state.epoch_end))

    def on_epoch_end(self, state, epoch):
        self.events.append(("epoch", epoch))

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


def optim(**kw):
    base = dict(learning_rate=0.05, warmup_ratio=0.2, checkpoint_every=2, keep_checkpoints=2, log_every=3, seed=7)
    return OptimConfig(**{**base, **kw})


def fit(task, run_dir, callbacks=(), **kw):
    total = engine.planned_steps(task.steps_per_epoch, task.epochs, kw.pop("max_steps", None))
    config = optim(**kw)
    identity = {"optim": training_identity(config)}
    return engine.fit(
        task, config, run_dir, CPU, total=total, identity=identity, callbacks=callbacks, show_progress=False
    )


def weights(task):
    return torch.cat([p.detach().flatten() for p in task.model.parameters()])


def test_a_run_trains_every_planned_step_and_logs_means_since_the_previous_record(tmp_path):
    task, record = Regression(), Record()
    result = fit(task, tmp_path / "run", [record])
    assert result.steps == 12 and task.seen == 12 * 5  # 3 epochs of 4 full batches; the partial one never trains
    log = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert [r["step"] for r in log] == [3, 6, 9, 12]
    assert all(r["rows"] == 5.0 and r["loss"] > 0 and r["grad_norm"] > 0 for r in log)
    assert record.events[0] == ("begin", 0)
    ends = [e for e in record.events if e[0] == "step" and e[2]]
    assert [e[1] for e in ends] == [4, 8, 12]
    assert [e for e in record.events if e[0] == "epoch"] == [("epoch", 0), ("epoch", 1), ("epoch", 2)]


@pytest.mark.parametrize("fail_at", [1, 3, 4, 6, 11])
def test_a_run_interrupted_at_any_step_resumes_to_the_same_weights_state_and_log(tmp_path, fail_at):
    straight, rec = Regression(), Record()
    fit(straight, tmp_path / "a", [rec])
    interrupted = Regression(fail_at=fail_at)
    with pytest.raises(Interrupt):
        fit(interrupted, tmp_path / "b", [Record()])
    again, rec_again = Regression(), Record()
    fit(again, tmp_path / "b", [rec_again])
    assert torch.equal(weights(straight), weights(again))
    assert again.seen == straight.seen and rec_again.count == rec.count
    assert (tmp_path / "a" / "train_log.jsonl").read_text() == (tmp_path / "b" / "train_log.jsonl").read_text()


@pytest.mark.parametrize("fail_at", [3, 11, None])
def test_a_run_trained_in_pieces_reports_its_last_loss_and_its_whole_throughput(tmp_path, fail_at):
    """The result of a resumed run (and of a resume that finds nothing left, fail_at None) names the loss of the
    run's last step, whichever piece took it, and its units over all pieces, not NaN and 0 units a second."""
    straight = fit(Regression(), tmp_path / "a")
    if fail_at is None:
        fit(Regression(), tmp_path / "b")
    else:
        with pytest.raises(Interrupt):
            fit(Regression(fail_at=fail_at), tmp_path / "b")
    again = fit(Regression(), tmp_path / "b")
    assert again.final_loss == straight.final_loss and not math.isnan(again.final_loss)
    assert again.per_second > 0 and again.earlier_seconds > 0 and straight.earlier_seconds == 0
    config = optim()
    last = Checkpoints(tmp_path / "b", config.keep_checkpoints, {"optim": training_identity(config)}).latest()
    assert last.step == 12 and last.extra["totals"]["units"] == 12 * 5  # each step counted once over the pieces
    assert last.extra["totals"]["loss"] == straight.final_loss


def test_cpu_steps_give_freed_memory_back_every_few_steps(tmp_path, monkeypatch):
    """Every RELEASE_EVERY CPU steps the engine returns the heap memory that steps of varying shapes leave freed;
    the weights are those of a run that does not."""
    released = []
    monkeypatch.setattr(engine, "release_freed_memory", lambda: released.append(True) or True)
    monkeypatch.setattr(engine, "RELEASE_EVERY", 4)
    task = Regression()
    fit(task, tmp_path / "a")
    assert len(released) == 3  # after steps 4, 8 and 12
    monkeypatch.setattr(engine, "RELEASE_EVERY", 10**9)
    without = Regression()
    fit(without, tmp_path / "b")
    assert torch.equal(weights(task), weights(without))


def test_a_checkpoint_of_other_settings_is_refused(tmp_path):
    fit(Regression(), tmp_path / "run")
    with pytest.raises(ConfigError, match="other settings"):
        fit(Regression(), tmp_path / "run", learning_rate=0.01)


def test_max_steps_ends_inside_an_epoch(tmp_path):
    task = Regression()
    assert fit(task, tmp_path / "run", max_steps=5).steps == 5 and task.seen == 25


def test_an_epoch_ends_once_and_only_after_steps_of_it(tmp_path):
    """max_steps ending training in epoch 1 of 3: epoch 1's end comes once, at the last step, and the untrained
    epoch 2 has none; a resume of the finished run calls none again (each called it at step 5 before)."""
    record = Record()
    fit(Regression(), tmp_path / "run", [record], max_steps=5)
    assert [e for e in record.events if e[0] == "epoch"] == [("epoch", 0), ("epoch", 1)]
    again = Record()
    fit(Regression(), tmp_path / "run", [again], max_steps=5)
    assert [e for e in again.events if e[0] == "epoch"] == []


def test_the_log_records_the_learning_rate_of_the_steps_it_logs(tmp_path):
    """Linear warm-up over int(0.2 x 12) = 2 steps, then decay to 0 at step 12: the update of step n (from 1) uses
    lr x min((n - 1) / 2, (12 - (n - 1)) / 10); each record's lr is its step's (it was the next step's)."""
    import json

    result = fit(Regression(), tmp_path / "run")
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    for record in records:
        n = record["step"]
        assert record["lr"] == pytest.approx(0.05 * min((n - 1) / 2, (12 - (n - 1)) / 10)), record


def test_a_run_whose_every_step_was_skipped_is_a_failure(tmp_path):
    """skip_nonfinite: a run that skipped every batch trained nothing; it ended as if trained."""
    with pytest.warns(UserWarning), pytest.raises(Diverged, match="every one of its 4 steps .* was skipped"):
        fit(Regression(epochs=1, nan_at={1, 2, 3, 4}), tmp_path / "run", skip_nonfinite=True)


def test_a_non_finite_loss_stops_the_run_naming_the_step_or_is_skipped(tmp_path):
    with pytest.raises(Diverged, match="training diverged at step 3"):
        fit(Regression(nan_at={3}), tmp_path / "a")
    task = Regression(nan_at={3})
    with pytest.warns(UserWarning, match="step 3"):
        fit(task, tmp_path / "b", skip_nonfinite=True)
    assert task.seen == 11 * 5  # the skipped batch left the task's state alone


def test_the_step_is_told_to_autocast_and_the_engine_leaves_autocast_to_it(tmp_path):
    task = Regression(epochs=1)
    engine.fit(task, optim(), tmp_path / "run", CPU, total=2, identity={}, bf16=True, show_progress=False)
    assert task.bf16_seen == [(True, False), (True, False)]


def test_a_task_not_written_for_several_processes_is_refused_under_torch_distributed(tmp_path, monkeypatch):
    from densepass import distributed

    monkeypatch.setattr(distributed, "world_size", lambda: 2)
    with pytest.raises(ConfigError, match="one process"):
        fit(Regression(), tmp_path / "run")


def test_the_package_builds_one_optimiser_in_one_place():
    found = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in (ROOT / "src" / "densepass").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bAdamW\(", line)
    ]
    assert found == [f"src/densepass/training/engine.py:{_line_of('AdamW(')}"], found


def _line_of(text: str) -> int:
    lines = (ROOT / "src" / "densepass" / "training" / "engine.py").read_text().splitlines()
    return next(n for n, line in enumerate(lines, 1) if text in line)


def test_phrase_training_runs_its_encoders_under_bf16_autocast_when_the_run_trains_in_bf16(tmp_path, monkeypatch):
    from densepass.data.squad import load_squad_spans
    from densepass.phrase.config import PhraseTrainConfig
    from densepass.phrase.model import PhraseEncoder
    from densepass.phrase.train import build_phrase_data, train_phrases
    from phrase_fixtures import tiny_phrase_model, write_phrase_squad

    data = load_squad_spans(write_phrase_squad(tmp_path / "squad"))
    seen = []
    for name in ("phrase_vectors", "question_vectors"):
        real = getattr(PhraseEncoder, name)

        def recording(self, *args, _real=real, _name=name, **kwargs):
            seen.append((_name, torch.is_autocast_enabled("cpu")))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(PhraseEncoder, name, recording)
    for bf16 in (True, False):
        seen.clear()
        model = tiny_phrase_model(tmp_path / f"bert-{bf16}")
        config = PhraseTrainConfig(cpu_bf16=bf16, passages_per_batch=2, max_steps=2, prebatch=0, log_every=1)
        with pytest.warns(UserWarning) if bf16 and not _fast_bf16() else _no_warning():  # forced bf16 warns there
            result = train_phrases(model, build_phrase_data(model, data, "train"), config, tmp_path / f"r{bf16}", CPU)
        assert result.steps == 2 and result.final_loss == result.final_loss  # finite, not NaN
        assert {s for _, s in seen} == {bf16} and {n for n, _ in seen} == {"phrase_vectors", "question_vectors"}


def test_contriever_pretraining_steps_in_bf16_when_the_run_trains_in_bf16(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch
):
    from densepass.pretraining import trainer
    from test_contriever import _config

    seen = []
    real = trainer.contriever_forward_backward

    def recording(model, batch, accumulation, device, bf16):
        seen.append(bf16)
        return real(model, batch, accumulation, device, bf16)

    monkeypatch.setattr(trainer, "contriever_forward_backward", recording)
    config = _config(tiny_beir, tiny_model_dir, tmp_path, "train.cpu_bf16=true", "train.max_steps=2")
    with pytest.warns(UserWarning) if not _fast_bf16() else _no_warning():
        result = trainer.pretrain(config)
    assert result.steps == 2 and seen == [True, True]


def _fast_bf16() -> bool:
    from densepass.device import cpu_has_fast_bf16

    return cpu_has_fast_bf16()


def _no_warning():
    import contextlib

    return contextlib.nullcontext()


def test_gradient_checkpointing_recomputes_the_layers_and_trains_the_same_weights(tmp_path, tiny_beir):
    from conftest import save_tiny_bert
    from densepass.models.biencoder import BiEncoder
    from densepass.training.trainer import train
    from test_training import _fp32_config, make_data

    model_dir = save_tiny_bert(tmp_path / "bert", seed=1, dropout=0.1)  # dropout: the replay must be exact
    trained, forwards = {}, {}
    for on in (False, True):
        model = BiEncoder.from_pretrained(str(model_dir))
        calls = forwards[on] = []
        query = model.query_encoder.encoder.layer[0].attention.self.query
        query.register_forward_hook(lambda *_, seen=calls: seen.append(1))
        train(
            model,
            make_data(tiny_beir),
            _fp32_config(gradient_checkpointing=on, packing=False),
            tmp_path / f"run-{on}",
            CPU,
        )
        trained[on] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert len(forwards[True]) == 2 * len(forwards[False])  # every layer ran again in the backward pass
    torch.testing.assert_close(trained[True], trained[False], rtol=1e-5, atol=1e-6)


def test_gradient_checkpointing_without_a_transformer_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        fit(Regression(), tmp_path / "run", gradient_checkpointing=True)


FRAGMENT = """
import ctypes
from pathlib import Path

from densepass import device

libc = device._glibc()
if libc is None:
    raise SystemExit(3)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: free() itself gives nothing back, whatever this heap's layout


def resident_mb():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


big, kept = [], []
for _ in range(2000):  # 100 KB chunks (under glibc's mmap threshold: on the heap), one kept among them
    chunk = libc.malloc(100_000)
    ctypes.memset(chunk, 1, 100_000)  # resident
    big.append(chunk)
    kept.append(libc.malloc(64))
for chunk in big:
    libc.free(chunk)
before = resident_mb()
assert device.release_freed_memory()
print(before - resident_mb())
"""


def test_release_freed_memory_returns_a_fragmented_heap_to_the_system():
    """glibc keeps memory it has freed (chunks between chunks in use, as steps of varying shapes leave them, and here
    the heap's top too); ``release_freed_memory`` gives the pages back: the resident size falls by most of the 190 MB
    freed. In a process of its own, whose heap no earlier test has shaped."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", FRAGMENT], capture_output=True, text=True)
    if done.returncode == 3:
        pytest.skip("not glibc")
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.split()[-1]) > 100
