"""FSDP (``train.fsdp``, ``training.sharding``): two gloo processes holding half of every weight, gradient and AdamW
moment train a bi-encoder (and a cross-encoder) to the weights of one process on the whole batch; a run stopped
after a checkpoint resumes from its shards to the uninterrupted run's weights; the trained model is a plain module
again; the settings FSDP does not combine with are one-line errors."""

from __future__ import annotations

import copy
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import run_densepass, small_run_overrides
from densepass.config import RerankerTrainConfig, TrainConfig
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder
from densepass.models.cross_encoder import CrossEncoder
from densepass.training import engine
from densepass.training.batches import TrainingData
from densepass.training.cross_encoder import train_cross_encoder
from densepass.training.trainer import BiEncoderTask, train

CPU = torch.device("cpu")


def _data(beir_dir) -> TrainingData:
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    return TrainingData(dataset, "train", "[SEP]", negatives, 1)


def _config(**kw) -> TrainConfig:
    """4 steps of 6 queries (3 a process), float32 (bf16 rounding would blur the comparisons), padded, a checkpoint
    every 2."""
    base = dict(epochs=1, max_steps=4, batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, seed=3, cpu_bf16=False)
    base.update(checkpoint_every=2, log_every=1, keep_checkpoints=5, packing=False)  # padded, as FSDP's steps
    base.update(kw)
    return TrainConfig(**base)


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cross_encoder(model_dir) -> CrossEncoder:
    return CrossEncoder.new(str(model_dir), seed=5, max_length=48, device=CPU)


def _reranker_data(beir_dir) -> TrainingData:
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::2]) for q in dataset.queries}
    return TrainingData(dataset, "train", " ", negatives, 3)


def _reranker_config(**kw) -> RerankerTrainConfig:
    """4 steps of 4 query groups (2 a process); pointwise: under the listwise softmax the head's bias has no gradient
    but float noise, which Adam scales up to a full step in either run."""
    base = dict(negatives_per_query=3, epochs=1, batch_size=4, learning_rate=2e-3, warmup_ratio=0.0, loss="pointwise")
    base.update(checkpoint_every=2, log_every=1, keep_checkpoints=5)  # float32: train_cross_encoder's bf16 is off
    base.update(kw)
    return RerankerTrainConfig(**base)


class Stop(Exception):
    """The interruption of a run (raised by both processes at the same step)."""


def stopped_in_fourth_step(run) -> None:
    """``run()`` stopped in its fourth step, as a kill would stop it (every process at the same step)."""
    from densepass.training import trainer

    real, calls = trainer.forward_backward, []

    def stop_in_fourth_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 4:
            raise Stop
        return real(*args, **kwargs)

    trainer.forward_backward = stop_in_fourth_step
    try:
        run()
    except Stop:
        pass
    finally:
        trainer.forward_backward = real


def _worker(rank, world, port, model_dir, beir_dir, out_dir):
    from torch.distributed.tensor import DTensor

    from densepass.training import trainer

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out_dir)
    try:
        model = BiEncoder.from_pretrained(str(model_dir))
        train(model, _data(beir_dir), _config(fsdp=True), out / "fsdp", CPU)
        plain = not any(isinstance(p, DTensor) for p in model.parameters()) and type(model) is BiEncoder
        copy.deepcopy(model).encode_queries(["a plain module again"])  # copies and runs in one process
        torch.save({"weights": _weights(model), "plain": plain}, out / f"fsdp-rank{rank}.pt")

        # the same run stopped in its fourth step (after the checkpoint of step 2), then run again: it resumes
        real, calls = trainer.forward_backward, []
        stopped_in_fourth_step(
            lambda: train(
                BiEncoder.from_pretrained(str(model_dir)), _data(beir_dir), _config(fsdp=True), out / "stopped", CPU
            )
        )
        steps = sorted(p.name for p in (out / "stopped" / "checkpoints").glob("step-*"))
        resumed = BiEncoder.from_pretrained(str(model_dir))
        calls.clear()
        trainer.forward_backward = lambda *a, **k: calls.append(1) or real(*a, **k)
        try:
            train(resumed, _data(beir_dir), _config(fsdp=True), out / "stopped", CPU)
        finally:
            trainer.forward_backward = real
        torch.save({"weights": _weights(resumed), "steps": steps, "calls": len(calls)}, out / f"resumed-rank{rank}.pt")

        reranker = _cross_encoder(model_dir)
        train_cross_encoder(reranker, _reranker_data(beir_dir), _reranker_config(fsdp=True), out / "ce-fsdp", CPU)
        torch.save(_weights(reranker.model), out / f"ce-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_fsdp_on_two_gloo_processes_trains_like_one_process_and_resumes_exactly(tiny_model_dir, tiny_beir, tmp_path):
    """A bi-encoder, then a cross-encoder. Each process embeds 3 of a step's 6 queries (the global batch contrasted)
    with half of every weight; FSDP's summed reduce-scatter gives each its half of the whole batch's gradient, clipped
    by the norm of both halves. The weights equal one process's (one thread, as the workers: the two runs differ only
    in the order of sums) within float tolerance. A run stopped in its fourth step resumes from the shards of step 2
    (both processes' files) and ends with the uninterrupted run's weights bit for bit (the same processes, the same
    sums). The cross-encoder: each process scores 2 of a step's 4 query groups."""
    mp.spawn(_worker, args=(2, _free_port(), tiny_model_dir, tiny_beir, str(tmp_path)), nprocs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = BiEncoder.from_pretrained(str(tiny_model_dir))
        train(single, _data(tiny_beir), _config(), tmp_path / "single", CPU)
        reranker = _cross_encoder(tiny_model_dir)
        train_cross_encoder(reranker, _reranker_data(tiny_beir), _reranker_config(), tmp_path / "ce-single", CPU)
    finally:
        torch.set_num_threads(threads)
    fsdp = [torch.load(tmp_path / f"fsdp-rank{rank}.pt") for rank in range(2)]
    resumed = [torch.load(tmp_path / f"resumed-rank{rank}.pt") for rank in range(2)]
    expected, start = _weights(single), _weights(BiEncoder.from_pretrained(str(tiny_model_dir)))
    assert any(not torch.equal(expected[k], start[k]) for k in expected)  # it trained
    for got in fsdp:
        assert got["plain"]  # the whole model on every process, a plain BiEncoder
        assert got["weights"].keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-4, atol=1e-5, msg=name)
    for rank, got in enumerate(resumed):
        assert got["steps"] == ["step-2"] and got["calls"] == 2  # stopped after step 2's checkpoint; resumed there
        assert all(torch.equal(got["weights"][k], fsdp[rank]["weights"][k]) for k in expected)

    checkpoint = tmp_path / "fsdp" / "checkpoints" / "step-4"
    shards = sorted(p.name for p in (checkpoint / "sharded").iterdir())
    assert len(shards) == 2 and all(name.endswith(".safetensors") for name in shards)  # one file per process
    assert not (checkpoint / "model").exists()  # the weights are the shards
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    assert any("sharded" in name for name in json.dumps(manifest).split('"'))  # rank 0's manifest covers them

    def losses(run: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]

    assert losses("fsdp") == pytest.approx(losses("single"), rel=1e-4) and len(losses("fsdp")) == 4
    assert losses("stopped") == losses("fsdp")  # the resumed run's log, trimmed and continued

    # the cross-encoder: each process scores 2 of a step's 4 query groups with half of every weight
    expected, start = _weights(reranker.model), _weights(_cross_encoder(tiny_model_dir).model)
    assert any(not torch.equal(expected[k], start[k]) for k in expected)
    for rank in range(2):
        got = torch.load(tmp_path / f"ce-rank{rank}.pt")
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=f"cross-encoder {name}")


def test_what_fsdp_does_not_do_is_a_one_line_error(tiny_model_dir, tiny_beir, tmp_path, monkeypatch):
    from densepass import distributed

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    task = BiEncoderTask(model, _data(tiny_beir), _config(fsdp=True), tmp_path)
    cases = [
        (1, _config(fsdp=True), (), "train.fsdp shards the model over torchrun's processes"),
        (2, _config(fsdp=True, lora_rank=4), (), "does not combine with lora_rank, gradient_checkpointing or packing"),
        (2, _config(fsdp=True), [engine.Hooks(lambda step: None)], "does not combine yet with what uses the model"),
    ]
    for world, config, callbacks, message in cases:
        with pytest.raises(ConfigError) as error:
            engine.check_sharding(task, config, world, callbacks)
        assert message in str(error.value) and "\n" not in str(error.value)

    class Other(engine.Task):
        description = "a task of the caller's"

    with pytest.raises(ConfigError, match="a task of the caller's does not train with FSDP yet"):
        engine.check_sharding(Other(), _config(fsdp=True), 2)
    monkeypatch.setattr(distributed, "world_size", lambda: 1)
    with pytest.raises(ConfigError, match="train.fsdp shards the model"):  # fit checks before any work
        train(model, _data(tiny_beir), _config(fsdp=True), tmp_path / "run", CPU)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("overrides", "torchrun", "message"),
    [
        (["train.fsdp=true"], False, "train.fsdp shards the model over torchrun's processes"),
        (["train.fsdp=true", "model.kind=splade"], True, "train.fsdp trains dense bi-encoders"),
        (["train.fsdp=true", "train.gradient_checkpointing=true"], True, "does not combine with lora_rank"),
        (["reranker.enabled=true", "reranker.train.fsdp=true"], False, "reranker.train.fsdp shards the model over"),
        (["reranker.enabled=true", "reranker.train.fsdp=true", "reranker.train.batch_size=5"], True, "split evenly"),
        (["train.fsdp=true", "eval.each_epoch=true"], True, "does not combine yet with what uses the model"),
    ],
)
def test_a_run_with_fsdp_it_cannot_do_is_refused_before_any_work(tmp_path, monkeypatch, overrides, torchrun, message):
    from conftest import small_run_overrides
    from densepass.config import ExperimentConfig, load_config
    from densepass.pipelines.experiment import check

    if torchrun:
        monkeypatch.setenv("WORLD_SIZE", "2")
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    settings = small_run_overrides(tmp_path / "data", tmp_path / "model", tmp_path / "out", "fsdp")
    with pytest.raises(ConfigError) as error:
        check(load_config(None, [*settings, *overrides], ExperimentConfig))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_densepass_run_under_torchrun_trains_both_models_with_fsdp(tiny_model_dir, tiny_beir, tmp_path):
    """``torchrun -m densepass run`` with ``train.fsdp`` and ``reranker.train.fsdp``: every process trains the
    cross-encoder (rank 0 saves it) and then the bi-encoder, each sharded; the checkpoints hold both processes' shards
    and the saved models are whole, loadable ones."""
    settings = [
        *small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "out", "f"),
        "train.batch_size=8",
        "train.max_steps=2",
        "train.fsdp=true",
        "negatives.per_query=1",
        "reranker.enabled=true",
        f"reranker.name_or_path={tiny_model_dir}",
        "reranker.max_length=48",
        "reranker.depth=10",
        "reranker.first_stages=[fine-tuned]",
        "reranker.train.batch_size=4",
        "reranker.train.negatives_per_query=3",
        "reranker.train.fsdp=true",
    ]
    done = run_densepass("run", *(a for s in settings for a in ("--set", s)), cwd=tmp_path, processes=2)
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "out" / "f"
    for checkpoints in (run / "checkpoints", run / "reranker" / "checkpoints"):
        newest = sorted(checkpoints.glob("step-*"), key=lambda p: int(p.name[5:]))[-1]
        assert len(list((newest / "sharded").glob("*.safetensors"))) == 2
    assert BiEncoder.from_pretrained(str(run / "model")).config.shared
    CrossEncoder.from_pretrained(str(run / "reranker" / "model"))
    assert "fine-tuned → cross-encoder@10" in json.loads((run / "metrics.json").read_text())["results"]
    assert not list(run.rglob("*.tmp"))  # no partial file of a second writer


def _ragged_beir(root: Path) -> Path:
    """96 passages of 3 or 100 words: each process's share of a batch splits into its own number of CPU pieces,
    so the processes draw their dropout seeds a different number of times."""
    import random

    rng = random.Random(0)
    words = "audio video editor library game network terminal python font image mail server kernel driver".split()
    (root / "qrels").mkdir(parents=True)
    texts = [" ".join(rng.choice(words) for _ in range(rng.choice([3, 100]))) for _ in range(96)]
    passages = [{"_id": f"p{i}", "title": f"t{i}", "text": text} for i, text in enumerate(texts)]
    (root / "corpus.jsonl").write_text("".join(json.dumps(p) + "\n" for p in passages))
    queries = [{"_id": f"q{i}", "text": " ".join(rng.choice(words) for _ in range(3))} for i in range(96)]
    (root / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "qrels" / "train.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{i}\tp{i}\t1\n" for i in range(96))
    )
    return root


def _dropout_worker(rank, world, port, model_dir, beir_dir, out_dir):
    from densepass.models.biencoder import BiEncoderConfig

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = Path(out_dir)
    config = _config(max_steps=None, epochs=2, batch_size=32, packing=True)
    try:
        model = lambda: BiEncoder.from_pretrained(str(model_dir), config=BiEncoderConfig(passage_max_length=128))  # noqa: E731
        full = model()
        train(full, _data(beir_dir), config, out / "full", CPU)
        stopped_in_fourth_step(lambda: train(model(), _data(beir_dir), config, out / "stopped", CPU))
        resumed = model()
        train(resumed, _data(beir_dir), config, out / "stopped", CPU)
        torch.save({"full": _weights(full), "resumed": _weights(resumed)}, out / f"dropout-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_a_run_of_two_processes_with_dropout_resumes_each_process_s_random_draws(tmp_path):
    """Only rank 0's random states were checkpointed and every process resumed with them: rank 1 then drew other
    dropout masks than the uninterrupted run's, and the resumed weights differed (by 1e-3). Each process's are
    saved now, and the resumed run ends with the uninterrupted run's weights exactly."""
    from conftest import save_tiny_bert

    model_dir = save_tiny_bert(tmp_path / "dropout-bert", dropout=0.1)
    beir = _ragged_beir(tmp_path / "ragged")
    mp.spawn(_dropout_worker, args=(2, _free_port(), model_dir, beir, tmp_path), nprocs=2)
    state = torch.load(tmp_path / "dropout-rank0.pt")
    assert all(torch.equal(state["full"][k], state["resumed"][k]) for k in state["full"])
    checkpoint = sorted((tmp_path / "stopped" / "checkpoints").glob("step-*"))[0]
    from densepass.checkpoints import load_tree

    assert len(load_tree(checkpoint)["rngs"]) == 2
