"""Vocabulary-table gradients added row by row (``densepass.training.embedding_grads``): the same gradients as the
dense backward pass, step after step, in one kept buffer; tables too small or frozen left alone; the engine's CPU
runs train to the same weights with and without them, and hand the model back switched off."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from densepass.training import engine
from densepass.training.embedding_grads import MIN_ROWS, SparseEmbeddingGradients

CPU = torch.device("cpu")


def _steps(table: nn.Embedding, steps: list[list[torch.Tensor]], tied: bool) -> list[torch.Tensor]:
    """Each step's gradient of the table: every lookup of the step (ids [batch, length]) weighted by a fixed random
    tensor, plus a dense product with the table when ``tied`` (an MLM head sharing it); ``.grad`` dropped between
    steps as the optimiser's ``zero_grad`` drops it."""
    grads = []
    for n, lookups in enumerate(steps):
        g = torch.Generator().manual_seed(n)
        for ids in lookups:
            out = table(ids)
            (out * torch.randn(out.shape, generator=g)).sum().backward()
        if tied:
            (F.linear(torch.randn(3, table.embedding_dim, generator=g), table.weight) ** 2).sum().backward()
        grads.append(table.weight.grad.clone())
        table.weight.grad = None
    return grads


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_row_by_row_gradients_equal_the_dense_backward_pass_step_after_step(seed, tied):
    g = torch.Generator().manual_seed(seed)
    rows = MIN_ROWS + 17
    # ids repeat within a lookup and across lookups; a step reads its rows in two forward passes (queries, passages)
    steps = [
        [torch.randint(0, 64, (4, 9), generator=g), torch.randint(0, rows, (6, 31), generator=g)] for _ in range(3)
    ]
    torch.manual_seed(seed)
    dense = nn.Embedding(rows, 12, padding_idx=0)
    sparse = nn.Embedding(rows, 12, padding_idx=0)
    sparse.load_state_dict(dense.state_dict())
    expected = _steps(dense, steps, tied)

    switched = SparseEmbeddingGradients(sparse)
    assert sparse.sparse
    got = _steps(sparse, steps, tied)
    for want, have in zip(expected, got):
        assert not have.is_sparse
        torch.testing.assert_close(have, want, rtol=1e-6, atol=1e-6)
        assert have[0].abs().sum() == 0  # the padding row, as the dense pass leaves it
    # the steps after the first find the kept buffer, zeroed: nothing of a step leaks into the next
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[torch.cat([ids.flatten() for ids in steps[-1]])] = False
    if not tied:
        assert got[-1][untouched].abs().sum() == 0

    switched.remove()
    assert not sparse.sparse
    (sparse(steps[0][0]).sum()).backward()
    assert not sparse.weight.grad.is_sparse


def test_the_buffer_is_kept_across_steps_and_follows_the_weight():
    table = nn.Embedding(MIN_ROWS, 4)
    SparseEmbeddingGradients(table)
    ids = torch.tensor([[3, 4]])
    table(ids).sum().backward()
    first = table.weight.grad.data_ptr()
    table.weight.grad = None
    table(ids).sum().backward()
    assert table.weight.grad.data_ptr() == first  # no new table-sized allocation a step
    assert table.weight.grad[3].tolist() == [1.0] * 4  # zeroed before the step's gradient, not added to the last
    table.to(torch.float64)
    table.weight.grad = None
    table(ids).sum().backward()
    assert table.weight.grad.dtype == torch.float64 and table.weight.grad[4].tolist() == [1.0] * 4


def test_small_frozen_and_renormalising_tables_keep_dense_gradients():
    positions = nn.Embedding(MIN_ROWS - 1, 4)
    frozen = nn.Embedding(MIN_ROWS, 4)
    frozen.weight.requires_grad_(False)
    renormalised = nn.Embedding(MIN_ROWS, 4, max_norm=1.0)
    vocabulary = nn.Embedding(MIN_ROWS, 4)
    switched = SparseEmbeddingGradients(nn.ModuleList([positions, frozen, renormalised, vocabulary]))
    assert switched.tables == [vocabulary]
    assert [m.sparse for m in (positions, frozen, renormalised, vocabulary)] == [False, False, False, True]


def test_engine_runs_on_the_cpu_train_the_same_weights_with_row_by_row_gradients(tmp_path, tiny_beir, monkeypatch):
    from conftest import save_tiny_bert
    from densepass.models.biencoder import BiEncoder
    from densepass.training.trainer import train
    from test_training import _fp32_config, make_data

    model_dir = save_tiny_bert(tmp_path / "bert", seed=1)
    switched: list[SparseEmbeddingGradients] = []

    class Recorded(SparseEmbeddingGradients):
        def __init__(self, model):
            super().__init__(model)
            self.switched = len(self.tables)
            switched.append(self)

    class Off:
        def __init__(self, model):
            pass

        def remove(self):
            pass

    trained = {}
    for name, kind in (("row by row", Recorded), ("dense", Off)):
        monkeypatch.setattr(engine, "SparseEmbeddingGradients", kind)
        model = BiEncoder.from_pretrained(str(model_dir))
        train(model, make_data(tiny_beir), _fp32_config(), tmp_path / name, CPU)
        trained[name] = torch.cat([p.detach().flatten() for p in model.parameters()])
        tables = [m for m in model.modules() if isinstance(m, nn.Embedding)]
        assert not any(m.sparse for m in tables)  # handed back as it came
    # the run switched the tiny BERT's vocabulary table (MiniLM's 30,522 rows), not its positions, then back
    assert len(switched) == 1 and switched[0].switched == 1 and not switched[0].handles
    torch.testing.assert_close(trained["row by row"], trained["dense"], rtol=1e-5, atol=1e-6)


class _Lookup(engine.Task):
    """A vocabulary table and a linear head on fixed random ids; ``fail_at``: the step that raises."""

    throughput = None
    steps_per_epoch, epochs = 3, 1

    def __init__(self, fail_at=None):
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Embedding(MIN_ROWS, 4), nn.Flatten(), nn.Linear(12, 1))
        self.ids = torch.randint(0, MIN_ROWS, (6, 3), generator=torch.Generator().manual_seed(0))
        self.fail_at, self.sparse_seen = fail_at, []

    def setup(self, device):
        self.model.train()

    def parameter_groups(self):
        return [{"params": list(self.model.parameters())}]

    def named_weights(self):
        return self.model.named_parameters()

    def plan(self, epoch):
        return [[0, 1], [2, 3], [4, 5]]

    def step(self, rows, context):
        if context.step + 1 == self.fail_at:
            raise KeyboardInterrupt
        self.sparse_seen.append(self.model[0].sparse)
        loss = self.model(self.ids[rows]).pow(2).mean()
        loss.backward()
        assert not self.model[0].weight.grad.is_sparse  # what the optimiser steps on
        return engine.StepOutput(loss, size=len(rows))

    def save(self, checkpoint):
        pass

    def load(self, checkpoint, device):
        pass


class _FailsToBegin(engine.Callback):
    def on_train_begin(self, state):
        raise KeyboardInterrupt


@pytest.mark.parametrize("fail_at", [None, 2, "begin"])
def test_a_run_hands_its_model_back_switched_off_however_it_ends(tmp_path, fail_at):
    from densepass.checkpoints import training_identity
    from densepass.config import OptimConfig

    task = _Lookup(fail_at)
    config = OptimConfig(learning_rate=0.01, checkpoint_every=100)
    callbacks = [_FailsToBegin()] if fail_at == "begin" else []
    run = lambda: engine.fit(  # noqa: E731
        task, config, tmp_path, CPU, total=3, identity={"optim": training_identity(config)}, callbacks=callbacks,
        show_progress=False,
    )  # fmt: skip
    if fail_at is None:
        run()
    else:
        with pytest.raises(KeyboardInterrupt):
            run()
    assert all(task.sparse_seen) and len(task.sparse_seen) == {None: 3, 2: 1, "begin": 0}[fail_at]
    table = task.model[0]
    assert not table.sparse and not table.weight._backward_hooks  # and back, with its hook gone
    table.weight.grad = None
    table(task.ids).sum().backward()
    assert not table.weight.grad.is_sparse
