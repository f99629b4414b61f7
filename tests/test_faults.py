"""Fault injection: real ``densepass`` processes killed (SIGKILL) part-way through training (every task of the
training engine), indexing and mining, then run again, end exactly where an uninterrupted run ends; damaged saved
files, planted pickles, concurrent runs and changed settings are handled as docs/reliability.md promises. The
training tests (every task) run in this process (``densepass_here``, on one torch thread as the killed processes)
every run but the one they kill: the references, the resumptions and the refusals prove the same there without a new
process's imports."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import densepass_here, save_tiny_bert, write_tiny_beir
from phrase_fixtures import write_phrase_squad

pytestmark = pytest.mark.timeout(900)


# ---- helpers ----------------------------------------------------------------------------------------


def start(*args: str, cwd: Path) -> subprocess.Popen:
    """``python -m densepass ARGS`` started in a process of its own (to be killed), on one torch thread, as
    ``densepass_here`` runs the others (a killed run's steps and the steps of the run that resumes it must add up in
    the same order as a reference's)."""
    return subprocess.Popen(
        [sys.executable, "-m", "densepass", *args],
        cwd=cwd,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


def kill_when(process: subprocess.Popen, ready, seed: int, timeout: float = 300) -> bool:
    """SIGKILL ``process`` a random moment (0-0.3 s, seeded) after ``ready()`` turns true; False if it ended first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if process.poll() is not None:
            return False
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the process never reached the point where it should be killed")
        time.sleep(0.02)
    time.sleep(random.Random(seed).uniform(0, 0.3))
    if process.poll() is not None:
        return False
    process.send_signal(signal.SIGKILL)
    process.wait()
    return True


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(model_dir / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def losses(run_dir: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run_dir / "train_log.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def dropout_model(tmp_path_factory) -> Path:
    """A tiny random BERT *with dropout*, so that resuming must restore the random state to be exact."""
    return save_tiny_bert(tmp_path_factory.mktemp("dropout-bert"), seed=1, dropout=0.1)  # not tiny_model_dir's


def train_config(root: Path, data: Path, model: Path, *extra: str, epochs: int = 6) -> Path:
    lines = [
        "name: run",
        f"output_dir: {root}",
        "data:",
        f"  name: {data}",
        "model:",
        f"  name_or_path: {model}",
        "  passage_max_length: 32",
        "negatives:",
        "  source: bm25",
        "  pool_depth: 5",
        "  per_query: 1",
        "train:",
        "  batch_size: 8",
        f"  epochs: {epochs}",
        "  checkpoint_every: 1",
        "  keep_checkpoints: 3",
        "  log_every: 1",
        "  learning_rate: 1.0e-3",
        "eval:",
        "  baselines: []",
        "  metrics: [mrr@10]",
        "  depth: 10",
        *extra,
    ]
    path = root / "config.yaml"
    root.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- training -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["random", "abs-encoder"])
def test_training_killed_at_a_random_step_resumes_to_the_same_weights(tmp_path, tiny_beir, dropout_model, schedule):
    extra = (
        []
        if schedule == "random"
        else ["schedule:", "  method: abs-greedy", "  similarity: bm25-then-encoder", "  background: false"]
    )
    reference = train_config(tmp_path / "reference", tiny_beir, dropout_model, *extra)
    assert densepass_here("run", str(reference), cwd=tmp_path).returncode == 0
    interrupted = train_config(tmp_path / "interrupted", tiny_beir, dropout_model, *extra)
    run_dir = tmp_path / "interrupted" / "run"
    process = start("run", str(interrupted), cwd=tmp_path)
    assert kill_when(process, lambda: (run_dir / "checkpoints" / "step-5").is_dir(), seed=len(schedule))
    assert not (run_dir / "model").exists()  # interrupted in the middle: 18 steps in all
    result = densepass_here("run", str(interrupted), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert_same_weights(tmp_path / "reference" / "run" / "model", run_dir / "model")
    assert losses(run_dir) == losses(tmp_path / "reference" / "run")  # the resumed steps logged the same losses


def test_a_damaged_newest_checkpoint_falls_back_and_still_ends_exactly(tmp_path, tiny_beir, dropout_model):
    config = train_config(tmp_path / "a", tiny_beir, dropout_model)
    assert densepass_here("run", str(config), cwd=tmp_path).returncode == 0
    run_dir = tmp_path / "a" / "run"
    reference = weights(run_dir / "model")
    newest = sorted((run_dir / "checkpoints").glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
    state = newest / "state.safetensors"
    state.write_bytes(state.read_bytes()[: state.stat().st_size // 2])  # truncated, as by a full disk
    (run_dir / "model" / "model.safetensors").unlink()
    result = densepass_here("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"{newest} is damaged" in result.stderr and "Traceback" not in result.stderr
    again = weights(run_dir / "model")
    assert all(torch.equal(reference[k], again[k]) for k in reference)


def test_a_planted_pickle_in_a_checkpoint_is_never_executed(tmp_path, tiny_beir, dropout_model):
    config = train_config(tmp_path / "a", tiny_beir, dropout_model, epochs=1)
    run_dir = tmp_path / "a" / "run"
    marker = tmp_path / "pwned"
    planted = run_dir / "checkpoints" / "step-99"
    planted.mkdir(parents=True)
    (run_dir / ".densepass-run").write_text('{"densepass": "run"}\n')  # planted in a run directory densepass made

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    payload = __import__("pickle").dumps(Exploit())
    for name in ("trainer_state.pt", "state.safetensors", "state.json", "model.pt"):
        (planted / name).write_bytes(payload)
    result = densepass_here("run", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert not marker.exists()
    assert "step-99 is damaged" in result.stderr


def test_resuming_with_other_settings_is_refused_and_keeps_the_config(tmp_path, tiny_beir, dropout_model):
    config = train_config(tmp_path / "a", tiny_beir, dropout_model)
    assert densepass_here("run", str(config), cwd=tmp_path).returncode == 0
    saved = (tmp_path / "a" / "run" / "config.yaml").read_text()
    changed = densepass_here("run", str(config), "--set", "train.batch_size=4", cwd=tmp_path)
    assert changed.returncode == 2 and "train.batch_size differ" in changed.stderr and "--restart" in changed.stderr
    typo = densepass_here("run", str(config), "--set", "data.name=no-such-dataset", cwd=tmp_path)
    assert typo.returncode == 2 and "not found" in typo.stderr
    assert (tmp_path / "a" / "run" / "config.yaml").read_text() == saved  # neither failed run wrote it
    restarted = densepass_here("run", str(config), "--set", "train.batch_size=4", "--restart", cwd=tmp_path)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    assert "batch_size: 4" in (tmp_path / "a" / "run" / "config.yaml").read_text()


def test_a_diverging_run_stops_with_one_line_naming_the_step_and_writes_no_model(tmp_path, tiny_beir, dropout_model):
    config = train_config(tmp_path / "a", tiny_beir, dropout_model, epochs=1)
    for every, expected in (("100", "at step 2: the loss is nan"), ("1", "at step 1: its optimiser step left nan")):
        result = densepass_here(
            "run", str(config), "--set", "train.learning_rate=1e308", "--set", f"train.checkpoint_every={every}",
            cwd=tmp_path,
        )  # fmt: skip
        errors = [line for line in result.stderr.replace("\r", "\n").splitlines() if "densepass: error:" in line]
        assert result.returncode == 2 and len(errors) == 1 and "Traceback" not in result.stderr
        assert f"training diverged {expected}" in errors[0] and "lower train.learning_rate" in errors[0]
        run_dir = tmp_path / "a" / "run"
        assert not (run_dir / "model").exists() and not list(run_dir.glob("checkpoints/step-*"))
        assert not (run_dir / "metrics.json").exists()


def test_resuming_on_a_changed_data_file_is_refused_naming_it_and_restart_trains_on_it(
    tmp_path, tiny_beir, dropout_model
):
    config = train_config(tmp_path / "a", tiny_beir, dropout_model, epochs=1)  # tiny_beir: this test's own copy
    assert densepass_here("run", str(config), cwd=tmp_path).returncode == 0  # its checkpoints are kept
    corpus = tiny_beir / "corpus.jsonl"
    first, *rest = corpus.read_text().splitlines()
    corpus.write_text("\n".join([json.dumps({**json.loads(first), "text": "a changed text"}), *rest]) + "\n")
    saved = (tmp_path / "a" / "run" / "config.yaml").read_text()
    changed = densepass_here("run", str(config), cwd=tmp_path)
    errors = [line for line in changed.stderr.replace("\r", "\n").splitlines() if "densepass: error:" in line]
    assert changed.returncode == 2 and len(errors) == 1 and "Traceback" not in changed.stderr
    assert "tiny/corpus.jsonl changed since its checkpoint step-" in errors[0] and "--restart" in errors[0]
    assert (tmp_path / "a" / "run" / "config.yaml").read_text() == saved
    restarted = densepass_here("run", str(config), "--restart", cwd=tmp_path)
    assert restarted.returncode == 0, restarted.stderr[-2000:]
    again = densepass_here("run", str(config), cwd=tmp_path)  # the same data: the finished run is taken up again
    assert again.returncode == 0, again.stderr[-2000:]


def test_a_second_run_into_the_same_directory_is_refused(tmp_path, tiny_beir, dropout_model):
    config = train_config(tmp_path / "a", tiny_beir, dropout_model, epochs=200)  # outlasts the second run's start
    first = start("run", str(config), cwd=tmp_path)
    lock = tmp_path / "a" / "run" / ".lock"
    deadline = time.monotonic() + 300
    while not (lock.is_file() and lock.read_text().startswith("pid")) and time.monotonic() < deadline:
        assert first.poll() is None, first.stderr.read()[-2000:]
        time.sleep(0.05)
    second = densepass_here("run", str(config), cwd=tmp_path)
    running = first.poll() is None  # the first run still held the directory when the second was refused
    first.kill()
    first.wait(timeout=60)
    assert running
    assert second.returncode == 2 and "is in use by another densepass run" in second.stderr


# ---- every other training task ------------------------------------------------------------------------


@dataclass(frozen=True)
class Task:
    """A training task run as a densepass command and killed during one of its trainings.

    ``settings``: the command's ``--set`` overrides (``{beir}``, ``{squad}`` and ``{model}`` name the inputs; the
    cross-encoder's ``run`` adds them to ``train_config``'s file); ``checkpoints``: where the killed training writes
    its checkpoints in the run directory, ``steps`` of them in all (checkpoint_every 1), the kill coming after
    ``step-<kill_after>``; ``results``: the folders of the weights the command writes as its result; ``logs``: its
    training (and validation) logs."""

    command: str
    settings: tuple[str, ...]
    checkpoints: str
    steps: int
    kill_after: int
    results: tuple[str, ...]
    logs: tuple[str, ...]


CROSS_ENCODER = (
    "reranker.enabled=true",
    "reranker.name_or_path={model}",
    "reranker.max_length=48",
    "reranker.depth=10",
    "reranker.first_stages=[fine-tuned]",
    "reranker.train.batch_size=5",
    "reranker.train.negatives_per_query=3",
    "reranker.train.epochs=3",  # 30 training queries: 18 steps
    "reranker.train.checkpoint_every=1",
    "reranker.train.log_every=1",
    "reranker.train.learning_rate=1e-3",
)
PHRASE = (
    "data.name={squad}",
    "model.base={model}",
    "model.max_length=40",
    "model.stride=8",
    "model.title_max_tokens=4",
    "model.max_answer_tokens=5",
    "train.epochs=2",  # 12 steps
    "train.passages_per_batch=2",
    "train.checkpoint_every=1",
    "train.log_every=1",
    "train.learning_rate=1e-3",
    "validation.subcorpus=hard",
    "validation.k=1",
    "validation.every_steps=3",
    "filter.epochs=1",
    "filter.thresholds=[-100.0, 0.0]",
    "filter.threshold=-100.0",
    "query_tuning.enabled=true",
    "query_tuning.epochs=2",  # 12 steps
    "query_tuning.batch_size=4",
    "query_tuning.top_k=5",
    "query_tuning.checkpoint_every=1",
    "query_tuning.learning_rate=1e-3",
    "eval.ks=[1, 3]",
)
PRETRAIN = (
    "data.name={beir}",
    "model.name_or_path={model}",
    "model.early_layers=1",
    "train.max_steps=12",
    "train.batch_size=8",
    "train.grad_accumulation=2",
    "train.max_length=32",
    "train.checkpoint_every=1",
    "train.log_every=1",
    "train.learning_rate=1e-3",
)
CONTRIEVER = (
    "model.mode=contriever",
    "model.temperature=0.1",
    "model.save_pooling=mean",
    "contriever.queue_size=10",
    "contriever.momentum=0.9",
    "contriever.ict_probability=0.5",
)
PHRASE_RESULTS = ("best-model", "model", "qsft-model")
PHRASE_LOGS = ("train_log.jsonl", "eval_log.jsonl", "qsft/train_log.jsonl")
TASKS = {
    "cross-encoder": Task(
        "run",
        CROSS_ENCODER,
        "reranker/checkpoints",
        18,
        5,
        ("model", "reranker/model"),
        ("train_log.jsonl", "reranker/train_log.jsonl"),
    ),
    "phrase": Task("phrase", PHRASE, "checkpoints", 12, 4, PHRASE_RESULTS, PHRASE_LOGS),
    "query-tuning": Task("phrase", PHRASE, "qsft/checkpoints", 12, 3, PHRASE_RESULTS, PHRASE_LOGS),
    "condenser": Task("pretrain", PRETRAIN, "checkpoints", 12, 4, ("backbone",), ("train_log.jsonl",)),
    "cocondenser": Task(
        "pretrain", (*PRETRAIN, "model.mode=cocondenser"), "checkpoints", 12, 4, ("backbone",), ("train_log.jsonl",)
    ),
    "contriever": Task("pretrain", (*PRETRAIN, *CONTRIEVER), "checkpoints", 12, 4, ("backbone",), ("train_log.jsonl",)),
}


@pytest.fixture(scope="module")
def task_inputs(tmp_path_factory, dropout_model) -> dict[str, Path]:
    """The tasks' data and their model with dropout, shared by the module (no test here changes them)."""
    root = tmp_path_factory.mktemp("task-inputs")
    return {"beir": write_tiny_beir(root / "beir"), "squad": write_phrase_squad(root / "squad"), "model": dropout_model}


def task_command(task: Task, root: Path, inputs: dict[str, Path]) -> list[str]:
    """The arguments of ``task``'s command writing its run to ``root/run``."""
    sets = [arg for setting in task.settings for arg in ("--set", setting.format(**inputs))]
    if task.command == "run":  # the bi-encoder run of the tests above, with a cross-encoder that trains
        return ["run", str(train_config(root, inputs["beir"], inputs["model"], epochs=1)), *sets]
    return [task.command, "--set", f"output_dir={root}", "--set", "name=run", *sets]


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory, task_inputs):
    """The run directory of a task's uninterrupted run, made once per command and settings (phrase training and
    query tuning share one)."""
    runs: dict[tuple[str, ...], Path] = {}

    def reference(task: Task) -> Path:
        key = (task.command, *task.settings)
        if key not in runs:
            root = tmp_path_factory.mktemp("reference")
            result = densepass_here(*task_command(task, root, task_inputs), cwd=root)
            assert result.returncode == 0, result.stderr[-2000:]
            runs[key] = root / "run"
        return runs[key]

    return reference


def result_weights(run_dir: Path, folders: tuple[str, ...]) -> dict[str, Path]:
    """Every weight file under ``folders`` of ``run_dir``, by its path there."""
    return {
        str(p.relative_to(run_dir)): p for folder in folders for p in sorted((run_dir / folder).rglob("*.safetensors"))
    }


def log_records(path: Path) -> list[dict]:
    """The records of a JSONL log less their timings, which no two runs share."""
    records = map(json.loads, path.read_text().splitlines())
    return [{k: v for k, v in r.items() if not (k.endswith("_per_s") or k == "seconds")} for r in records]


@pytest.mark.parametrize("name", list(TASKS))
def test_every_training_task_killed_at_a_random_step_resumes_to_the_same_weights(
    tmp_path, task_inputs, reference_run, name
):
    """The bi-encoder test above for every other task: a model with dropout, so that the resumed steps draw the same
    masks only if the random states come back (pre-training draws its own from the seed and the step); the
    resumed run starts at the newest checkpoint and ends with the weights and logs of the uninterrupted one."""
    task = TASKS[name]
    reference = reference_run(task)
    assert (reference / task.checkpoints / f"step-{task.steps}").is_dir()  # the training has the steps said
    args = task_command(task, tmp_path, task_inputs)
    run_dir, checkpoints = tmp_path / "run", tmp_path / "run" / task.checkpoints
    process = start(*args, cwd=tmp_path)
    assert kill_when(process, (checkpoints / f"step-{task.kill_after}").is_dir, seed=zlib.crc32(name.encode()))
    assert not (checkpoints / f"step-{task.steps}").exists()  # killed during the training, before its last step
    newest = max(int(p.name[5:]) for p in checkpoints.glob("step-*"))
    result = densepass_here(*args, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = re.findall(rf"\| *(\d+)/{task.steps} \[", result.stderr)  # the training's progress bar, as drawn
    assert counts and int(counts[0]) == newest, counts  # resumed from its newest checkpoint, not started over
    expected, resumed = result_weights(reference, task.results), result_weights(run_dir, task.results)
    assert expected and resumed.keys() == expected.keys()
    for file, path in expected.items():
        if path.read_bytes() != resumed[file].read_bytes():
            a, b = load_file(str(path)), load_file(str(resumed[file]))
            pytest.fail(f"{file} differs: {[k for k in a if k not in b or not torch.equal(a[k], b[k])][:5]}")
    for log in task.logs:
        assert log_records(run_dir / log) == log_records(reference / log), log


# ---- indexing -----------------------------------------------------------------------------------------


def test_indexing_killed_part_way_resumes_to_the_same_index(tmp_path, tiny_model_dir):
    data = write_tiny_beir(tmp_path / "corpus", n_passages=3000, seed=1)
    args = ["index", str(data), "--model", str(tiny_model_dir), "--shard-size", "300", "--batch-size", "64"]
    assert densepass_here(*args, "--output", "reference", cwd=tmp_path).returncode == 0
    work = tmp_path / ".interrupted.encoding"

    def two_shards_done() -> bool:
        return any(len(p.read_text().split()) >= 2 for p in work.glob("*.done"))

    assert kill_when(start(*args, "--output", "interrupted", cwd=tmp_path), two_shards_done, seed=3)
    assert not (tmp_path / "interrupted").exists()  # nothing half-written where the index goes
    assert densepass_here(*args, "--output", "interrupted", cwd=tmp_path).returncode == 0
    for name in ("embeddings.npy", "passages.jsonl"):
        assert (tmp_path / "interrupted" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    assert not work.exists()


def index_state(folder: Path) -> tuple[list[str], bytes]:
    """What a saved index answers with: its live passage ids (in row order) and their embeddings' bytes."""
    from densepass.index import load_index

    index = load_index(folder)
    live = np.flatnonzero(~index.deleted)
    return [index.passages.ids[r] for r in live], np.ascontiguousarray(index.embeddings[live]).tobytes()


def test_an_index_update_killed_at_a_random_moment_leaves_the_old_or_the_new_index(tmp_path, tiny_model_dir):
    import shutil

    from densepass.index import DenseIndex
    from densepass.models.biencoder import BiEncoder

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    rng = np.random.default_rng(0)
    records = [{"id": f"p{i}", "text": f"passage {i}"} for i in range(20_000)]  # big enough to take a while to write
    original = DenseIndex(model, show_progress=False)
    original.add_embeddings(records, rng.standard_normal((20_000, model.dim)))
    original.save(tmp_path / "original")
    (tmp_path / "ids.txt").write_text("".join(f"p{i}\n" for i in range(0, 20_000, 7)))
    (tmp_path / "up.jsonl").write_text(
        "".join(
            json.dumps({"_id": f"p{i}", "text": f"new {i}"}) + "\n" for i in [*range(1, 300, 7), *range(20_000, 20_050)]
        )
    )
    update = ["--delete", str(tmp_path / "ids.txt"), "--upsert", str(tmp_path / "up.jsonl"), "--compact"]
    shutil.copytree(tmp_path / "original", tmp_path / "reference")
    result = densepass_here("index-update", "reference", *update, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    states = {"old": index_state(tmp_path / "original"), "new": index_state(tmp_path / "reference")}
    assert states["old"] != states["new"]
    seen = set()
    for seed in range(2):  # each kill and rerun starts two processes (seconds each on a busy CPU)
        folder = tmp_path / f"killed-{seed}"
        shutil.copytree(tmp_path / "original", folder)
        process = start("index-update", folder.name, *update, cwd=tmp_path)
        kill_when(process, lambda f=folder: any(p.name.startswith((".v000001", "v000001")) for p in f.iterdir()), seed)
        state = index_state(folder)  # loadable, verified by its manifest
        assert state in states.values(), f"seed {seed}: neither the old nor the new index"
        seen.add(next(name for name, s in states.items() if s == state))
        # the lock and temporaries cleared
        result = densepass_here("index-update", folder.name, "--compact", cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-2000:]
        assert index_state(folder) == state
    assert seen  # which of the two each kill left depends on the moment (both are fine)


def test_reindexing_with_another_model_or_corpus_never_reuses_old_rows(tmp_path, tiny_model_dir, dropout_model):
    from densepass.index import load_index

    big, small = write_tiny_beir(tmp_path / "big", 260), write_tiny_beir(tmp_path / "small", 60, seed=2)
    to_idx = ["index", "--output", "idx"]
    assert densepass_here(*to_idx, str(big), "--model", str(tiny_model_dir), cwd=tmp_path).returncode == 0
    result = densepass_here(*to_idx, str(small), "--model", str(tiny_model_dir), cwd=tmp_path)
    assert result.returncode == 0 and "indexed 60 passages" in result.stdout
    index = load_index(tmp_path / "idx")
    assert len(index) == 60 and index.search(["audio"], k=100).rows.max() < 60
    before = np.load(tmp_path / "idx" / "embeddings.npy")
    assert densepass_here(*to_idx, str(small), "--model", str(dropout_model), cwd=tmp_path).returncode == 0
    assert not np.array_equal(np.load(tmp_path / "idx" / "embeddings.npy"), before)


@pytest.mark.parametrize("victim", ["embeddings.npy", "passages.jsonl", "manifest.json", "bm25s"])
def test_a_damaged_saved_index_is_a_one_line_error(tmp_path, tiny_model_dir, victim):
    data = write_tiny_beir(tmp_path / "data", 40)
    model = [] if victim == "bm25s" else ["--model", str(tiny_model_dir)]  # bm25 takes no model
    kind = "bm25" if victim == "bm25s" else "exact"
    assert densepass_here("index", str(data), "--kind", kind, *model, "--output", "idx", cwd=tmp_path).returncode == 0
    target = tmp_path / "idx" / victim
    if target.is_dir():
        target = sorted(p for p in target.iterdir() if p.is_file())[0]
    target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 2)])
    result = densepass_here("search", "idx", "audio editor", cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not a usable densepass index" in result.stderr


# ---- mining -------------------------------------------------------------------------------------------


def test_mining_killed_part_way_writes_nothing_and_resumes_to_the_same_file(tmp_path, tiny_model_dir):
    data = write_tiny_beir(tmp_path / "data", 200, seed=4)
    args = [
        "mine",
        str(data),
        "--strategy",
        "dense",
        "--dense-dim",
        "8",
        "--miner-steps",
        "60",
        "--depth",
        "5",
        "--set",
        f"model.name_or_path={tiny_model_dir}",
        "--set",
        "train.batch_size=8",
    ]
    assert densepass_here(*args, "--output", "reference.jsonl", cwd=tmp_path).returncode == 0
    process = start(*args, "--output", "out.jsonl", cwd=tmp_path)
    # killed while its miner trains (its work folder exists; the output is written only at the very end): a kill
    # at a fixed time could land after the output's atomic rename, while the process is still exiting
    assert kill_when(process, (tmp_path / "out.jsonl.miners").exists, seed=5), "mining ended before the kill"
    assert not (tmp_path / "out.jsonl").exists()  # written atomically, only once complete
    assert densepass_here(*args, "--output", "out.jsonl", cwd=tmp_path).returncode == 0
    assert (tmp_path / "out.jsonl").read_text() == (tmp_path / "reference.jsonl").read_text()


def _small_run(tiny_beir, tiny_model_dir, out, name):
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    extra = ["train.batch_size=8", "train.epochs=2", "train.checkpoint_every=2"]
    return run_experiment(load_config(None, [*small_run_overrides(tiny_beir, tiny_model_dir, out, name), *extra]))


@pytest.mark.parametrize(
    "edit",
    [
        lambda s: s["rng"].update(numpy="oops"),
        lambda s: s["optimizer"].update(param_groups=[]),
        lambda s: s.update(scheduler=7),
        lambda s: s.update(step=1000),
    ],
    ids=["rng", "optimizer", "scheduler", "step"],
)
def test_a_checkpoint_state_edited_by_hand_under_a_matching_manifest_is_one_line(
    tiny_beir, tiny_model_dir, tmp_path, edit
):
    """The manifest verified, then the restore raised a TypeError traceback, or (a step past the run's end) trained
    nothing and saved an earlier step's weights as the model."""
    from densepass.errors import DataError
    from densepass.io import write_manifest

    _small_run(tiny_beir, tiny_model_dir, tmp_path, "r")
    run = tmp_path / "r"
    steps = sorted((run / "checkpoints").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    for later in steps[1:]:
        for f in sorted(later.rglob("*"), reverse=True):
            f.unlink() if f.is_file() else f.rmdir()
        later.rmdir()
    state_path = steps[0] / "state.json"
    state = json.loads(state_path.read_text())
    edit(state)
    state_path.write_text(json.dumps(state))
    write_manifest(steps[0])
    with pytest.raises(DataError, match=rf"checkpoint .*{steps[0].name} (does not restore|is of step 1000)"):
        _small_run(tiny_beir, tiny_model_dir, tmp_path, "r")


def test_a_log_replaced_by_a_link_is_refused_not_written_through(tmp_path):
    """trim_log read a linked log's target into the run (a user's records), or, dangling, let the run append its
    log outside the run directory."""
    from densepass.checkpoints import trim_log
    from densepass.errors import DensepassError

    theirs = tmp_path / "user_notes.jsonl"
    theirs.write_text('{"step": 1, "note": "mine"}\n')
    for target in (theirs, tmp_path / "elsewhere.jsonl"):
        log = tmp_path / "reranker" / "train_log.jsonl"
        log.parent.mkdir(exist_ok=True)
        log.unlink(missing_ok=True)
        log.symlink_to(target)
        with pytest.raises(DensepassError, match="train_log.jsonl is a link"):
            trim_log(log, 2)
    assert theirs.read_text() == '{"step": 1, "note": "mine"}\n' and not (tmp_path / "elsewhere.jsonl").exists()


def test_an_epoch_planned_again_after_a_resume_has_one_record_in_the_schedule_log(tmp_path):
    """A run resumed inside an epoch plans it again: its record was appended a second time (hardness.png drew both)."""
    from densepass.training.planner import EpochPlanner

    planner = EpochPlanner.__new__(EpochPlanner)
    planner.log_path = tmp_path / "schedule_log.jsonl"
    planner._log({"epoch": 0, "hardness": 1.0})
    planner._log({"epoch": 1, "hardness": 2.0})
    with open(planner.log_path, "a") as handle:
        handle.write('{"epoch": 2, "hard')  # cut short by the interruption
    planner._log({"epoch": 1, "hardness": 2.0})
    records = [json.loads(line) for line in planner.log_path.read_text().splitlines()]
    assert records == [{"epoch": 0, "hardness": 1.0}, {"epoch": 1, "hardness": 2.0}]
