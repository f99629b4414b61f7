"""Training: gradient caching equals the plain large batch, two gloo processes equal one process of
twice the batch, checkpoints resume exactly, and training lowers the loss."""

from __future__ import annotations

import collections
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import interrupted_at_step
from densepass.config import TrainConfig
from densepass.data import load_dataset
from densepass.errors import ConfigError, DataError
from densepass.losses.objectives import InfoNCE
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.training.batches import TrainingData
from densepass.training.step import forward_backward
from densepass.training.trainer import train

CPU = torch.device("cpu")


def make_data(beir_dir, per_query=1):
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    return TrainingData(dataset, "train", "[SEP]", negatives, per_query)


def grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def step_grads(model_dir, data, batch, chunk, bidirectional=True):
    model = BiEncoder.from_pretrained(str(model_dir), config=BiEncoderConfig(pooling="cls", temperature=0.1))
    b = data.collate(batch, seed=(1, 0, 0))
    loss = forward_backward(model, b, CPU, InfoNCE(bidirectional), chunk_size=chunk).loss
    return loss, grads_of(model)


@pytest.mark.parametrize("chunk", [1, 3, 5])
def test_grad_cache_equals_full_batch(tiny_model_dir, tiny_beir, chunk):
    data = make_data(tiny_beir)
    batch = list(range(10))
    loss_full, grads_full = step_grads(tiny_model_dir, data, batch, None)
    loss_gc, grads_gc = step_grads(tiny_model_dir, data, batch, chunk)
    assert abs(loss_full - loss_gc) < 1e-5
    assert grads_full.keys() == grads_gc.keys()
    for name in grads_full:
        torch.testing.assert_close(grads_gc[name], grads_full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_grad_cache_replays_dropout(tiny_model_dir, tiny_beir):
    """With dropout on, GradCache's second (graph) pass must reuse the dropout masks of its first
    pass: its gradient equals that of a loss built from the same chunked forwards with a graph."""
    from densepass.losses.contrastive import contrastive_loss

    data = make_data(tiny_beir)
    batch = data.collate(list(range(8)), seed=(1, 0, 0))
    model = BiEncoder.from_pretrained(str(tiny_model_dir), hidden_dropout_prob=0.3)
    model.train()
    torch.manual_seed(5)
    loss_gc = forward_backward(model, batch, CPU, chunk_size=3).loss
    grads_gc = grads_of(model)

    model.zero_grad()
    torch.manual_seed(5)
    embed = []
    for side, texts in (("query", batch.query_texts), ("passage", batch.passage_texts)):
        tokens = model.tokenize(texts, side)
        embed.append(
            torch.cat(
                [
                    model(tokens["input_ids"][i : i + 3], tokens["attention_mask"][i : i + 3], side=side)
                    for i in range(0, len(texts), 3)
                ]
            )
        )
    loss = contrastive_loss(embed[0], embed[1], batch.positive_index, model.config.temperature, batch.mask)
    loss.backward()
    assert abs(loss.item() - loss_gc) < 1e-5
    for name, grad in grads_of(model).items():
        torch.testing.assert_close(grads_gc[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, model_dir, beir_dir, batch, chunk, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        data = make_data(beir_dir)
        model = BiEncoder.from_pretrained(str(model_dir), config=BiEncoderConfig(pooling="cls", temperature=0.1))
        b = data.collate(batch, seed=(1, 0, 0), rank=rank, world=world)
        loss = forward_backward(model, b, CPU, InfoNCE(bidirectional=True), chunk_size=chunk).loss
        from densepass.training.distributed import sum_gradients

        sum_gradients(model.parameters())
        torch.save({"loss": loss, "grads": grads_of(model)}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunk", [None, 2])
def test_two_gloo_processes_equal_one_process_of_double_batch(tiny_model_dir, tiny_beir, tmp_path, chunk):
    batch = list(range(8))  # global batch 2b = 8, b = 4 per process
    mp.spawn(_worker, args=(2, _free_port(), tiny_model_dir, tiny_beir, batch, chunk, str(tmp_path)), nprocs=2)
    single_loss, single_grads = step_grads(tiny_model_dir, make_data(tiny_beir), batch, None)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert abs(got["loss"] - single_loss) < 1e-5
        for name, grad in single_grads.items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_collate_never_uses_relevant_passages_as_hard_negatives(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    negatives = {q: list(dataset.corpus.ids) for q in dataset.queries}  # pool includes the positives
    data = TrainingData(dataset, "train", "[SEP]", negatives, 3)
    relevant = dataset.relevant_sets()
    for i, qid in enumerate(data.query_ids):
        pool_ids = {dataset.corpus.ids[r] for r in data.negative_rows[i]}
        assert not pool_ids & relevant[qid]


def test_shared_positive_queries_are_masked(tiny_beir):
    """q0 and q40 share positive p0: in one batch neither counts the other's positive as a negative."""
    data = make_data(tiny_beir, per_query=0)
    i, j = data.query_ids.index("q0"), data.query_ids.index("q40")
    batch = data.collate([i, j, 1 if i != 1 else 2], seed=(0, 0, 0))
    assert batch.mask[0, 1] and batch.mask[1, 0]
    assert not batch.mask[0, 0] and not batch.mask[1, 1]


def test_training_data_bad_inputs(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    with pytest.raises(ConfigError, match="no negative pool"):
        TrainingData(dataset, "train", "[SEP]", None, 1)
    with pytest.raises(DataError, match="no split"):
        TrainingData(dataset, "nosuch", "[SEP]")
    with pytest.raises(DataError, match="no positive"):
        TrainingData(dataset, "train", "[SEP]", query_ids=["q39"])


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


def _fp32_config(**kw):
    """``_config`` trained in fp32 on every CPU: for comparisons of two ways to compute the same steps, which bf16
    rounding (the default on a CPU with bf16 instructions) would blur beyond their tolerance."""
    return _config(cpu_bf16=False, **kw)


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_training_lowers_loss_and_resume_is_exact(tiny_model_dir, tiny_beir, tmp_path):
    data = make_data(tiny_beir)
    full = BiEncoder.from_pretrained(str(tiny_model_dir))
    result = train(full, data, _config(), tmp_path / "full", CPU)
    assert result.steps == 10  # 2 epochs x floor(31 / 6) batches
    losses = [float(line.split('"loss": ')[1].split(",")[0]) for line in result.log_path.read_text().splitlines()]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3

    # Interrupted during step 5 (last checkpoint at step 3), then resumed: identical final weights.
    with interrupted_at_step(5):
        train(BiEncoder.from_pretrained(str(tiny_model_dir)), data, _config(), tmp_path / "resumed", CPU)
    ckpts = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert ckpts == ["step-3"]
    resumed = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(resumed, data, _config(), tmp_path / "resumed", CPU)
    torch.testing.assert_close(_params(resumed), _params(full), rtol=1e-5, atol=1e-6)


def test_logged_loss_is_the_mean_since_the_previous_record(tiny_model_dir, tiny_beir, tmp_path):
    import json

    data = make_data(tiny_beir)

    def logged(log_every):
        result = train(
            BiEncoder.from_pretrained(str(tiny_model_dir)),
            data,
            _config(log_every=log_every),
            tmp_path / f"every-{log_every}",
            CPU,
        )
        return [json.loads(line) for line in result.log_path.read_text().splitlines()]

    per_step = [r["loss"] for r in logged(1)]
    coarse = logged(4)
    assert [r["step"] for r in coarse] == [4, 8, 10]
    expected = [sum(per_step[0:4]) / 4, sum(per_step[4:8]) / 4, sum(per_step[8:10]) / 2]
    assert [r["loss"] for r in coarse] == pytest.approx(expected, rel=1e-5)


def _train_worker(rank, world, port, model_dir, beir_dir, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = BiEncoder.from_pretrained(str(model_dir))
        train(model, make_data(beir_dir), _fp32_config(epochs=1, checkpoint_every=100), Path(out_dir) / "dist", CPU)
        if rank == 0:
            torch.save(_params(model), Path(out_dir) / "dist.pt")
    finally:
        dist.destroy_process_group()


def test_distributed_training_matches_single_process(tiny_model_dir, tiny_beir, tmp_path):
    """train() under 2 gloo processes (batch 6 = 2 x 3) ends with the same weights as 1 process."""
    mp.spawn(_train_worker, args=(2, _free_port(), tiny_model_dir, tiny_beir, str(tmp_path)), nprocs=2)
    single = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(single, make_data(tiny_beir), _fp32_config(epochs=1, checkpoint_every=100), tmp_path / "single", CPU)
    torch.testing.assert_close(torch.load(tmp_path / "dist.pt"), _params(single), rtol=1e-4, atol=1e-5)


def test_fast_bf16_detection_reads_the_cpu_vendor_and_flags(tmp_path, monkeypatch):
    from densepass.device import cpu_has_fast_bf16

    monkeypatch.delenv("DENSEPASS_FAST_BF16", raising=False)

    def cpuinfo(vendor, flags):
        path = tmp_path / f"cpuinfo-{vendor}-{len(flags)}"
        path.write_text(f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: fpu sse2 avx2 {' '.join(flags)}\n")
        return str(path)

    assert cpu_has_fast_bf16(cpuinfo("AuthenticAMD", ["avx512f", "avx512_bf16"]))  # Zen 4
    assert cpu_has_fast_bf16(cpuinfo("GenuineIntel", ["avx512_bf16", "amx_tile", "amx_bf16"]))  # Sapphire Rapids
    assert not cpu_has_fast_bf16(cpuinfo("GenuineIntel", ["avx512f", "avx512_bf16"]))  # no AMX: slower than fp32
    assert not cpu_has_fast_bf16(cpuinfo("AuthenticAMD", ["avx512f"]))
    assert not cpu_has_fast_bf16(str(tmp_path / "missing"))


def test_cpu_bf16_auto_follows_the_cpu_and_forcing_it_without_native_support_warns(monkeypatch):
    import densepass.device as step

    assert step.uses_bf16(torch.device("cuda"), True, False)
    assert not step.uses_bf16(torch.device("cuda"), False, True)
    assert not step.uses_bf16(CPU, True, False)  # GPU's default does not switch CPU runs to bf16
    monkeypatch.setattr(step, "cpu_has_fast_bf16", lambda: True)
    assert step.uses_bf16(CPU, False, True) and step.uses_bf16(CPU, False, "auto")
    assert not step.uses_bf16(CPU, True, False)
    monkeypatch.setattr(step, "cpu_has_fast_bf16", lambda: False)
    assert not step.uses_bf16(CPU, True, "auto")
    with pytest.warns(UserWarning, match="no fast bfloat16"):
        assert step.uses_bf16(CPU, True, True)


def test_fast_bf16_detection_can_be_overridden_by_the_environment(monkeypatch):
    from densepass.device import FAST_BF16_ENV, cpu_has_fast_bf16

    for value, expected in (("0", False), ("1", True)):
        monkeypatch.setenv(FAST_BF16_ENV, value)
        assert cpu_has_fast_bf16("/nonexistent") is expected
    monkeypatch.setenv(FAST_BF16_ENV, "yes")
    with pytest.raises(ConfigError, match="must be 0 or 1") as err:
        cpu_has_fast_bf16()
    assert "\n" not in str(err.value)


def test_a_bf16_step_casts_each_weight_once_for_both_sides(tiny_model_dir, tiny_beir):
    """The query and passage towers share weights: one autocast region over both casts each weight to bf16 once
    a step (autocast's cache), and its gradient back once, not once a side (on a GPU each cast is a kernel)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    data = make_data(tiny_beir)
    batch = data.collate(list(range(8)), seed=(1, 0, 0))
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(temperature=0.1))
    weights = {p.data_ptr(): n for n, p in model.named_parameters() if p.dim() == 2 and "embeddings" not in n}

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.forward = collections.Counter()
            self.backward = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if str(func) == "aten._to_copy.default" and args[0].dim() == 2:
                if args[0].data_ptr() in weights and out.dtype == torch.bfloat16:
                    self.forward[weights[args[0].data_ptr()]] += 1
                elif args[0].dtype == torch.bfloat16 and out.dtype == torch.float32 and args[0].shape in shapes:
                    self.backward += 1
            return out

    shapes = {p.shape for n, p in model.named_parameters() if n in weights.values()}
    with Casts() as casts:
        forward_backward(model, batch, CPU, bf16=True)
    assert set(casts.forward) == set(weights.values()) and set(casts.forward.values()) == {1}
    trained = [n for n, p in model.named_parameters() if n in weights.values() and p.grad is not None]
    assert casts.backward == len(trained) > 0  # (BERT's pooler runs, but nothing reads its output)


def test_cpu_bf16_step_autocasts_and_stays_close_to_float32(tiny_model_dir, tiny_beir):
    data = make_data(tiny_beir)
    batch = data.collate(list(range(8)), seed=(1, 0, 0))
    losses, grads = {}, {}
    for bf16 in (False, True):
        model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(temperature=0.1))
        losses[bf16] = float(forward_backward(model, batch, CPU, bf16=bf16).loss)
        grads[bf16] = torch.cat([g.flatten() for g in grads_of(model).values()])
    assert losses[True] != losses[False]  # bf16 matmuls ran
    assert losses[True] == pytest.approx(losses[False], rel=2e-2)
    cosine = torch.nn.functional.cosine_similarity(grads[True], grads[False], dim=0)
    assert cosine > 0.99


def test_trainer_passes_the_resolved_precision_to_each_step(tiny_model_dir, tiny_beir, tmp_path, monkeypatch):
    import densepass.training.trainer as trainer_module

    seen = []
    real_step = trainer_module.forward_backward
    monkeypatch.setattr("densepass.device.cpu_has_fast_bf16", lambda: True)
    monkeypatch.setattr(
        trainer_module,
        "forward_backward",
        lambda model, batch, device, objective, chunk, bf16, tensors: (
            seen.append(bf16) or real_step(model, batch, device, objective, chunk, bf16, tensors)
        ),
    )
    data = make_data(tiny_beir)
    for cpu_bf16 in (False, "auto"):
        train(
            BiEncoder.from_pretrained(str(tiny_model_dir)),
            data,
            _config(epochs=1, checkpoint_every=100, cpu_bf16=cpu_bf16),
            tmp_path / str(cpu_bf16),
            CPU,
        )
    assert seen and set(seen[: len(seen) // 2]) == {False} and set(seen[len(seen) // 2 :]) == {True}


def test_forward_in_pieces_gives_the_whole_batch_gradient(tiny_model_dir, tiny_beir, monkeypatch):
    """On the CPU a pooled encoder's forward runs in length-sorted pieces (training.step._embed): pieces of
    at most 40 tokens give the loss and gradient of one whole forward, with one token-embedding lookup per side
    for all its pieces (each lookup's backward writes a gradient of the whole vocabulary table)."""
    import densepass.training.step as step_module

    data = make_data(tiny_beir, per_query=2)
    batch = list(range(10))
    monkeypatch.setattr(step_module, "piece_tokens", lambda device, **options: None)
    loss_whole, grads_whole = step_grads(tiny_model_dir, data, batch, None)
    calls, lookups = [], []
    real = step_module.forward_in_pieces

    def spy(fn, tokens, max_tokens, embed=None, packed=False):
        assert not packed  # train.packing off
        calls.append(max_tokens)
        rows, width = tokens["input_ids"].shape
        assert rows * width > max_tokens  # more than one piece

        def counted(ids):
            lookups.append(ids.shape)
            return embed(ids)

        return real(fn, tokens, max_tokens, counted, packed)

    monkeypatch.setattr(step_module, "piece_tokens", lambda device, **options: 40)
    monkeypatch.setattr(step_module, "forward_in_pieces", spy)
    loss_pieces, grads_pieces = step_grads(tiny_model_dir, data, batch, None)
    assert calls == [40, 40]
    assert len(lookups) == 2 and all(len(shape) == 1 for shape in lookups)  # one flat lookup per side
    assert abs(loss_whole - loss_pieces) < 1e-5
    for name in grads_whole:
        torch.testing.assert_close(grads_pieces[name], grads_whole[name], rtol=1e-4, atol=1e-6, msg=name)
