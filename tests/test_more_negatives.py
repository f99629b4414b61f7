"""More negatives per step: pre-batch negatives, the MoCo queue, λ per source and the LTR loss, each against a
literal implementation, with gradient caching, two gloo processes, exact resume and one-line errors."""

from __future__ import annotations

import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import interrupted_at_step
from densepass.config import LossConfig, TrainConfig, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.losses.batch import BatchTensors
from densepass.losses.ltr import ltr_loss, ltr_scores
from densepass.losses.memory import NegativeMemory, memory_mask
from densepass.losses.objectives import InfoNCE
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.momentum import MomentumEncoder, passage_parameters
from densepass.training.batches import TrainingData
from densepass.training.more_negatives import MoCoQueue, MultiSource, PreBatch, ltr_head, objective_from_config
from densepass.training.step import batch_tensors, forward_backward
from densepass.training.trainer import train

CPU = torch.device("cpu")


def make_data(beir_dir, per_query=1):
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    return TrainingData(dataset, "train", "[SEP]", negatives, per_query)


def tiny(model_dir, **config):
    return BiEncoder.from_pretrained(str(model_dir), config=BiEncoderConfig(pooling="cls", temperature=0.1, **config))


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _batch(reps_q, reps_p, positive, mask, keys, relevant):
    return BatchTensors({}, {}, torch.tensor(positive), mask, torch.tensor(keys), relevant)


class Dot(torch.nn.Module):
    """similarity = dot product, temperature 1."""

    class config:
        temperature = 1.0

    def similarity(self, q, p):
        return q @ p.T


# ---- the memory -------------------------------------------------------------------------------------------


def test_a_pre_batch_memory_holds_exactly_the_previous_t_batches_oldest_first():
    memory = NegativeMemory(max_batches=3)
    for step in range(5):
        memory.push(torch.full((step + 1, 2), float(step)), torch.arange(step + 1) + 100 * step)
    assert memory.sizes == [3, 4, 5]
    assert memory.reps[:, 0].tolist() == [2.0] * 3 + [3.0] * 4 + [4.0] * 5
    assert memory.keys[:3].tolist() == [200, 201, 202]


def test_a_queue_keeps_the_newest_k_entries_across_batch_boundaries():
    memory = NegativeMemory(max_entries=5)
    for step in range(3):
        memory.push(torch.full((3, 2), float(step)), torch.arange(3) + 10 * step)
    assert memory.keys.tolist() == [11, 12, 20, 21, 22]
    assert memory.sizes == [2, 3] and len(memory) == 5


def test_memory_entries_are_masked_by_key_relevant_in_batch_or_older_duplicate():
    keys = torch.tensor([1, 2, 3, 2, 4])  # key 2 twice: the older copy (column 1) is masked for everyone
    mask = memory_mask(keys, batch_keys=torch.tensor([4, 9]), relevant_keys=[{3}, set()])
    assert mask.tolist() == [[False, True, True, False, True], [False, True, False, False, True]]


# ---- the objective against literal equations --------------------------------------------------------------


def literal_loss(scores, positive, sources, weights, mask, separate=False):
    """Eq. 2 (or eq. 1 with a term per source) written out, row by row."""
    total = 0.0
    for i, row in enumerate(scores.tolist()):
        pos = row[positive[i]]
        negatives = [(v, int(sources[j])) for j, v in enumerate(row) if j != positive[i] and not mask[i][j]]
        if separate:
            for s in sorted(set(int(x) for x in sources)):
                denominator = math.exp(pos) + sum(math.exp(v) for v, src in negatives if src == s)
                total += weights[s] * -(pos - math.log(denominator))
        else:
            denominator = math.exp(pos) + sum(weights[src] * math.exp(v) for v, src in negatives)
            total += -(pos - math.log(denominator))
    return total / len(scores)


def _random_step(seed=0, b=4, hard=1, dim=6):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, dim, generator=g)
    p = torch.randn(b * (1 + hard), dim, generator=g)
    keys = list(range(100 + seed * 10, 100 + seed * 10 + len(p)))
    mask = torch.zeros(b, len(p), dtype=torch.bool)
    mask[0, b] = True  # a false negative
    relevant = [{keys[i]} for i in range(b)]
    return q, p, _batch(q, p, list(range(b)), mask, keys, relevant)


def test_every_lambda_one_without_memory_is_exactly_todays_contrastive_loss():
    q, p, batch = _random_step()
    for bidirectional in (False, True):
        today = InfoNCE(bidirectional)(Dot(), q, p, batch)
        assert torch.equal(MultiSource(bidirectional=bidirectional)(Dot(), q, p, batch), today)


@pytest.mark.parametrize("combine", ["unified", "separate"])
@pytest.mark.parametrize("weights", [(1.0, 1.0, 1.0), (2.0, 16.0, 0.5), (1.0, 256.0, 1.0)])
def test_the_objective_with_a_pre_batch_memory_equals_the_literal_equation(combine, weights):
    objective = MultiSource(weights, combine, PreBatch(2))
    steps = [_random_step(seed) for seed in range(3)]
    for q, p, batch in steps[:2]:
        objective.after_step(Dot(), q, p, batch)
    q, p, batch = steps[2]
    # a stale copy of this step's positive 0 (key 120) and of a key relevant to query 1 in the memory
    objective.memory.memory.keys[0] = 120
    batch.relevant_keys[1].add(int(objective.memory.memory.keys[3]))
    got = objective(Dot(), q, p, batch)
    memory = objective.memory.memory
    candidates = torch.cat([p, memory.reps])
    sources = [0] * 4 + [2] * 4 + [1] * len(memory)
    mask = torch.cat([batch.mask, torch.zeros(4, len(memory), dtype=torch.bool)], 1)
    mask[:, 8 + 0] = True  # key 120 is in the current batch
    mask[1, 8 + 3] = True  # relevant to query 1
    expected = literal_loss(q @ candidates.T, list(range(4)), sources, weights, mask.tolist(), combine == "separate")
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_the_memory_joins_the_negatives_from_the_second_step_on():
    objective = MultiSource(memory=PreBatch(1))
    q, p, batch = _random_step(0)
    first = objective(Dot(), q, p, batch)
    assert torch.equal(first, InfoNCE()(Dot(), q, p, batch))
    objective.after_step(Dot(), q, p, _random_step(1)[2])  # other keys: nothing masked
    assert objective(Dot(), q, p, batch) > first  # more negatives, the same positives


# ---- the LTR loss -----------------------------------------------------------------------------------------


def literal_ltr(queries, passages, positive, head):
    """Eq. 14 written out: σ(W{q, d} + b) of each concatenated pair, -log softmax of the positive."""
    total = 0.0
    for i, q in enumerate(queries):
        scores = [float(torch.sigmoid(head(torch.cat([q, d])))) for d in passages]
        total += -(scores[positive[i]] - math.log(sum(math.exp(s) for s in scores)))
    return total / len(queries)


def test_the_ltr_loss_equals_a_literal_eq_14():
    torch.manual_seed(0)
    q, p = torch.randn(3, 5), torch.randn(7, 5)
    head = torch.nn.Linear(10, 1)
    with torch.no_grad():
        expected = literal_ltr(q, p, [0, 1, 2], head)
        assert float(ltr_loss(q, p, torch.tensor([0, 1, 2]), head.weight, head.bias)) == pytest.approx(expected, 1e-6)
        batch = _batch(q, p, [0, 1, 2], torch.zeros(3, 7, dtype=torch.bool), list(range(7)), [set()] * 3)
        assert float(MultiSource(head=head)(Dot(), q, p, batch)) == pytest.approx(expected, rel=1e-6)


def test_the_ltr_head_ranks_every_querys_passages_in_the_same_order():
    """The documented property of the literal eq. 14: W{q, d} = W_q q + W_d d and σ is monotone."""
    torch.manual_seed(1)
    head = torch.nn.Linear(8, 1)
    scores = ltr_scores(torch.randn(5, 4), torch.randn(9, 4), head.weight.detach(), head.bias.detach())
    orders = {tuple(row.argsort().tolist()) for row in scores}
    assert len(orders) == 1


def test_a_wrongly_sized_ltr_head_is_a_one_line_error():
    with pytest.raises(ConfigError, match="LTR head"):
        ltr_scores(torch.randn(2, 4), torch.randn(3, 4), torch.randn(1, 6), torch.zeros(1))


# ---- the momentum encoder ---------------------------------------------------------------------------------


def test_the_momentum_encoder_follows_the_ema_rule(tiny_model_dir):
    model = tiny(tiny_model_dir)
    momentum = MomentumEncoder(model, 0.9)
    before = [w.clone() for w in momentum.weights()]
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    momentum.update(model)
    for old, new, current in zip(before, momentum.weights(), passage_parameters(model)):
        torch.testing.assert_close(new, 0.9 * old + 0.1 * current)
    assert not any(p.requires_grad for p in momentum.parameters())


def test_momentum_zero_keys_are_the_models_own_passage_embeddings(tiny_model_dir, tiny_beir):
    model = tiny(tiny_model_dir)
    data = make_data(tiny_beir)
    tensors = batch_tensors(model, data.collate(list(range(6)), seed=(1, 0, 0)))
    queue = MoCoQueue(model, 64, momentum=0.0)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.1)
        model.eval()
        expected = model(tensors.passages["input_ids"], tensors.passages["attention_mask"], "passage")
    queue.update(model, expected, tensors)
    torch.testing.assert_close(queue.memory.reps, expected)
    assert torch.equal(queue.memory.keys, tensors.passage_keys)


# ---- gradient caching and torch.distributed -----------------------------------------------------------------


def _two_steps(model_dir, data, objective_of, chunk):
    """Step 1 fills the memory; returns step 2's loss and gradients."""
    model = tiny(model_dir)
    objective = objective_of(model)
    out = forward_backward(model, data.collate(list(range(8)), seed=(1, 0, 0)), CPU, objective, chunk_size=chunk)
    objective.after_step(model, out.queries, out.passages, out.batch)
    model.zero_grad()
    loss = forward_backward(model, data.collate(list(range(8, 16)), seed=(1, 0, 1)), CPU, objective, chunk_size=chunk)
    return loss.loss, grads_of(model)


OBJECTIVES = {
    "pre-batch": lambda model: MultiSource((1.0, 16.0, 1.0), memory=PreBatch(2), bidirectional=True),
    "moco": lambda model: MultiSource(memory=MoCoQueue(model, 20, 0.5)),
    "ltr": lambda model: MultiSource(memory=PreBatch(1), head=_seeded_head(model.dim)),
}


def _seeded_head(dim):
    torch.manual_seed(7)
    return ltr_head(dim)


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_gradient_caching_with_a_memory_equals_the_plain_step(tiny_model_dir, tiny_beir, name):
    data = make_data(tiny_beir)
    loss_full, grads_full = _two_steps(tiny_model_dir, data, OBJECTIVES[name], None)
    loss_gc, grads_gc = _two_steps(tiny_model_dir, data, OBJECTIVES[name], 3)
    assert abs(loss_full - loss_gc) < 1e-5
    for key in grads_full:
        torch.testing.assert_close(grads_gc[key], grads_full[key], rtol=1e-4, atol=1e-6, msg=key)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(**kw):
    base = dict(
        epochs=2,
        batch_size=6,
        learning_rate=1e-3,
        warmup_ratio=0.0,
        checkpoint_every=3,
        log_every=1,
        seed=3,
        keep_checkpoints=5,
    )
    base.update(kw)
    return TrainConfig(**base)


def _train_worker(rank, world, port, model_dir, beir_dir, name, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = BiEncoder.from_pretrained(str(model_dir))
        objective = OBJECTIVES[name](model)
        # with the token cache, in a run directory per process (each builds its own cache); fp32 on every CPU, as
        # below: bf16 rounding would blur the comparison of the two ways to compute the same steps
        config = _config(epochs=1, token_cache=True, cpu_bf16=False)
        train(model, make_data(beir_dir), config, Path(out_dir) / f"dist{rank}", CPU, objective=objective)
        if rank == 0:
            torch.save({"params": _params(model), "memory": objective.memory.memory.reps}, Path(out_dir) / "dist.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["pre-batch", "moco", "ltr"])
def test_two_gloo_processes_with_a_memory_train_like_one_process(tiny_model_dir, tiny_beir, tmp_path, name):
    """The memory holds the gathered global batches: batch 6 = 2 x 3 under two processes ends where one
    process of batch 6 does (weights and memory)."""
    mp.spawn(_train_worker, args=(2, _free_port(), tiny_model_dir, tiny_beir, name, str(tmp_path)), nprocs=2)
    single = BiEncoder.from_pretrained(str(tiny_model_dir))
    objective = OBJECTIVES[name](single)
    train(
        single, make_data(tiny_beir), _config(epochs=1, cpu_bf16=False), tmp_path / "single", CPU, objective=objective
    )
    got = torch.load(tmp_path / "dist.pt")
    torch.testing.assert_close(got["params"], _params(single), rtol=1e-4, atol=1e-4)  # Adam: rounding of ~0 grads
    torch.testing.assert_close(got["memory"], objective.memory.memory.reps, rtol=1e-4, atol=1e-5)


# ---- checkpoints and resume --------------------------------------------------------------------------------


def _interrupt(model_dir, data, objective_of, run_dir, crash_at=5):
    """Train until step ``crash_at`` fails (the last checkpoint is step 3)."""
    with interrupted_at_step(crash_at):
        model = BiEncoder.from_pretrained(str(model_dir))
        train(model, data, _config(), run_dir, CPU, objective=objective_of(model))


def _interrupted_then_resumed(model_dir, data, objective_of, run_dir):
    _interrupt(model_dir, data, objective_of, run_dir)
    model = BiEncoder.from_pretrained(str(model_dir))
    objective = objective_of(model)
    train(model, data, _config(), run_dir, CPU, objective=objective)
    return model, objective


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_an_interrupted_run_resumes_to_bitwise_equal_weights_and_memory(tiny_model_dir, tiny_beir, tmp_path, name):
    data = make_data(tiny_beir)
    full = BiEncoder.from_pretrained(str(tiny_model_dir))
    full_objective = OBJECTIVES[name](full)
    train(full, data, _config(), tmp_path / "full", CPU, objective=full_objective)
    resumed, objective = _interrupted_then_resumed(tiny_model_dir, data, OBJECTIVES[name], tmp_path / "resumed")
    assert torch.equal(_params(resumed), _params(full))
    saved, expected = objective.state_dict(), full_objective.state_dict()
    assert torch.equal(saved["memory"]["memory"]["reps"], expected["memory"]["memory"]["reps"])
    assert torch.equal(saved["memory"]["memory"]["keys"], expected["memory"]["memory"]["keys"])
    if name == "moco":
        for a, b in zip(saved["memory"]["momentum_encoder"], expected["memory"]["momentum_encoder"]):
            assert torch.equal(a, b)
    if name == "ltr":
        assert torch.equal(objective.head.weight, full_objective.head.weight)
        assert not torch.equal(objective.head.weight, _seeded_head(full.dim).weight)  # the head was trained


def test_resuming_with_a_memory_from_a_checkpoint_without_one_is_a_one_line_error(tiny_model_dir, tiny_beir, tmp_path):
    data = make_data(tiny_beir)
    _interrupt(tiny_model_dir, data, lambda model: InfoNCE(), tmp_path)
    for objective_of, what in ((OBJECTIVES["pre-batch"], "pre-batch memory"), (OBJECTIVES["moco"], "MoCo queue")):
        model = BiEncoder.from_pretrained(str(tiny_model_dir))
        with pytest.raises(ConfigError, match=f"no saved {what}") as error:
            train(model, data, _config(), tmp_path, CPU, objective=objective_of(model))
        assert "\n" not in str(error.value)


def test_a_saved_queue_of_another_dimension_is_a_one_line_error(tiny_model_dir):
    small = tiny(tiny_model_dir, projection_dim=8)
    queue = MoCoQueue(small, 16, 0.9)
    queue.memory.push(torch.randn(4, 8), torch.arange(4))
    state = queue.state_dict()
    with pytest.raises(ConfigError, match="8-d entries but the momentum encoder's keys are 32-d"):
        MoCoQueue(tiny(tiny_model_dir), 16, 0.9).load_state_dict(state)
    prebatch = MultiSource(memory=PreBatch(2))
    prebatch.memory.load_state_dict({"memory": state["memory"]})
    q, p, batch = _random_step(dim=32)
    with pytest.raises(ConfigError, match="holds 8-d entries but the model's embeddings are 32-d"):
        prebatch(Dot(), q, p, batch)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("loss.pre_batches=0", "loss.pre_batches: must be >= 1, got 0"),
        ("loss.queue_size=-5", "loss.queue_size: must be >= 1, got -5"),
        ("loss.lambda_memory=0", "loss.lambda_memory: must be > 0, got 0.0"),
        ("loss.lambda_in_batch=-1", "loss.lambda_in_batch: must be > 0, got -1.0"),
        ("loss.momentum=1.5", "loss.momentum: must be <= 1, got 1.5"),
        ("loss.memory=queue", "loss.memory: 'queue' is not one of 'none', 'pre-batch', 'moco'"),
    ],
)
def test_bad_loss_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [override])
    assert message in str(error.value) and "\n" not in str(error.value)


def test_bad_objective_arguments_are_one_line_errors(tiny_model_dir):
    model = tiny(tiny_model_dir)
    for make, message in (
        (lambda: PreBatch(0), "T >= 1"),
        (lambda: MoCoQueue(model, 0, 0.9), "K >= 1"),
        (lambda: MoCoQueue(model, 8, 1.5), "momentum must be in"),
        (lambda: MultiSource((1.0, 0.0, 1.0)), "λ must be three positive numbers"),
        (lambda: MultiSource(head=ltr_head(4), bidirectional=True), "cannot be bidirectional"),
        (lambda: objective_from_config(LossConfig(kind="ltr"), TrainConfig(bidirectional=True), model), "ltr"),
    ):
        with pytest.raises(ConfigError, match=message):
            make()


def test_the_default_loss_config_builds_todays_objective(tiny_model_dir):
    model = tiny(tiny_model_dir)
    assert objective_from_config(LossConfig(), TrainConfig(), model) == InfoNCE(False)
    built = objective_from_config(LossConfig(memory="moco", queue_size=32, lambda_memory=16), TrainConfig(), model)
    assert isinstance(built.memory, MoCoQueue) and built.weights == (1.0, 16.0, 1.0)
    assert "MoCo queue (K = 32" in built.describe()


def test_densepass_run_trains_with_a_memory_and_reports_it(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.pipelines.experiment import run_experiment

    overrides = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        "name=pb",
        "train.batch_size=8",
        "negatives.source=none",
        "eval.baselines=[]",
        "eval.metrics=[mrr@10]",
        "eval.depth=10",
        "loss.memory=pre-batch",
        "loss.pre_batches=2",
        "loss.lambda_memory=4",
    ]
    assert set(run_experiment(load_config(None, overrides))) == {"fine-tuned"}
    assert "pre-batch negatives (T = 2); λ in-batch 1, memory 4, hard 1" in (tmp_path / "pb" / "report.md").read_text()
    changed = load_config(None, [*overrides, "loss.pre_batches=3"])
    with pytest.raises(ConfigError, match="loss.pre_batches"):  # the loss is part of the run's identity
        run_experiment(changed)
