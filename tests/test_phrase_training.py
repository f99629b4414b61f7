"""Phrase training: the losses over token columns against literal softmaxes (the reading-comprehension
softmax, eq. 1 with gold tokens only, eq. 2 over every token), the pre-batch memory, exact resume, and two gloo
processes on shares of each step ending with the weights of one process on the whole step."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from densepass.data.squad import load_squad_spans
from densepass.errors import ConfigError
from densepass.phrase.batches import plan_epoch
from densepass.phrase.config import PhraseTrainConfig
from densepass.phrase.memory import PrebatchMemory
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.train import build_phrase_data, step_columns, step_loss, train_phrases
from phrase_fixtures import SMALL, tiny_phrase_model, write_phrase_squad

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("phrase-data")
    data = load_squad_spans(write_phrase_squad(root / "squad"))
    model = tiny_phrase_model(root / "bert")
    hard = {
        q: [r for r in range(len(data.dataset.corpus)) if data.dataset.corpus.ids[r].startswith("train")][:3]
        for q in data.spans
    }
    return data, model, root, hard


def first_step(model, phrase_data, config):
    groups = plan_epoch(phrase_data.examples, config.passages_per_batch, config.questions_per_passage, config.seed, 0)[
        0
    ]
    return phrase_data.step(config, 0, 0, groups)


def window_logits(model, phrase_data, step):
    """Per question: start and end scores over its own window's text tokens, the gold indices among them,
    and the same over every text token of the other windows of the step (by window)."""
    windows = [phrase_data.tokenized[p].windows[w] for p, w in step.windows]
    start, end = model.phrase_vectors(model.collate_windows(windows))
    q = model.tokenize_questions([e.question for e in step.examples])
    q_start, q_end = model.question_vectors(q)
    out = []
    for i, e in enumerate(step.examples):
        w = step.windows.index((e.passage, e.window))
        per_window = []
        for v, window in enumerate(windows):
            positions = torch.arange(window.first, window.first + window.length)
            per_window.append((step.windows[v][0], q_start[i] @ start[v, positions].T, q_end[i] @ end[v, positions].T))
        window = windows[w]
        out.append((e, w, e.start - window.first, e.end - window.first, per_window))
    return out


def test_unified_loss_with_lambdas_one_and_in_passage_negatives_only_is_the_reading_comprehension_softmax(setup):
    data, model, _, _ = setup
    config = PhraseTrainConfig(
        loss="unified",
        lambda_inp=1,
        lambda_inb=1,
        lambda_hard=1,
        in_batch=False,
        prebatch=0,
        passages_per_batch=4,
        questions_per_passage=3,
    )
    phrase_data = build_phrase_data(model, data, "train")
    step = first_step(model, phrase_data, config)
    assert len(step.windows) > 1 and len(step.examples) > len(step.windows)  # other passages are there, masked
    with torch.no_grad():
        got, _ = step_loss(model, phrase_data, step, config, PrebatchMemory(0), False, CPU)
        rc = []
        for _, w, s, t, per_window in window_logits(model, phrase_data, step):
            _, start_logits, end_logits = per_window[w]
            rc.append(
                (
                    torch.nn.functional.cross_entropy(start_logits[None], torch.tensor([s]))
                    + torch.nn.functional.cross_entropy(end_logits[None], torch.tensor([t]))
                )
                / 2
            )
        want = torch.stack(rc).mean()
        separate, _ = step_loss(
            model, phrase_data, step, dataclasses.replace(config, loss="separate"), PrebatchMemory(0), False, CPU
        )
    assert float(got) == pytest.approx(float(want), rel=1e-5)
    assert float(separate) == pytest.approx(float(want), rel=1e-5)  # eq. 1 without in-batch terms: the same


def test_the_unified_loss_weighs_every_token_of_the_other_passages_by_lambda_inb(setup):
    data, model, _, _ = setup
    config = PhraseTrainConfig(
        loss="unified", lambda_inp=2.0, lambda_inb=256.0, prebatch=0, passages_per_batch=4, questions_per_passage=3
    )
    phrase_data = build_phrase_data(model, data, "train")
    step = first_step(model, phrase_data, config)
    with torch.no_grad():
        got, _ = step_loss(model, phrase_data, step, config, PrebatchMemory(0), False, CPU)
        total = 0.0
        for e, w, s, t, per_window in window_logits(model, phrase_data, step):
            for side, gold in ((1, s), (2, t)):
                own = per_window[w][side].double()
                denominator = math.exp(own[gold]) + 2.0 * sum(
                    math.exp(x) for j, x in enumerate(own.tolist()) if j != gold
                )
                for window_scores in per_window:
                    if window_scores[0] != e.passage:
                        denominator += 256.0 * float(window_scores[side].double().exp().sum())
                total += -(float(own[gold]) - math.log(denominator)) / 2
    assert float(got) == pytest.approx(total / len(step.examples), rel=1e-5)


def test_eq1_contrasts_with_the_in_passage_tokens_and_the_other_questions_gold_tokens(setup):
    data, model, _, _ = setup
    config = PhraseTrainConfig(
        loss="separate", separate_weight=3.0, prebatch=0, passages_per_batch=4, questions_per_passage=3
    )
    phrase_data = build_phrase_data(model, data, "train")
    step = first_step(model, phrase_data, config)
    with torch.no_grad():
        got, _ = step_loss(model, phrase_data, step, config, PrebatchMemory(0), False, CPU)
        rows = window_logits(model, phrase_data, step)
        total = 0.0
        for e, w, s, t, per_window in rows:
            for side, gold in ((1, s), (2, t)):
                own = per_window[w][side].double()
                term1 = -(float(own[gold]) - float(torch.logsumexp(own, 0)))
                others = [
                    float(per_window[w2][side][g2 if side == 1 else t2])
                    for e2, w2, g2, t2, _ in rows
                    if e2.passage != e.passage
                ]
                others = list(dict.fromkeys(others))  # a gold token shared by two questions is one column
                term2 = -(float(own[gold]) - math.log(math.exp(own[gold]) + sum(math.exp(x) for x in others)))
                total += (term1 + 3.0 * term2) / 2
    assert float(got) == pytest.approx(total / len(rows), rel=1e-5)


def test_pre_batch_tokens_of_the_questions_own_passage_are_masked(setup):
    data, model, _, _ = setup
    config = PhraseTrainConfig(prebatch=1, passages_per_batch=2, questions_per_passage=3)
    phrase_data = build_phrase_data(model, data, "train")
    step = first_step(model, phrase_data, config)
    memory = PrebatchMemory(1)
    with torch.no_grad():
        columns, *_ = step_columns(model, phrase_data, step, CPU)
        memory.push(columns)  # the same passages again: every memory token is the question's own passage or masked
        alone, _ = step_loss(model, phrase_data, step, config, PrebatchMemory(0), False, CPU)
        with_memory, _ = step_loss(model, phrase_data, step, config, memory, True, CPU)
    assert len(memory) == len(columns.passage)
    assert float(with_memory) > float(alone)  # another passage's memory tokens are negatives...
    own_only = [e.passage for e in step.examples]
    assert len(set(own_only)) > 1  # ...and each question's own passage is masked (else the gold would be a negative)
    state = memory.state_dict()
    again = PrebatchMemory(1)
    again.load_state_dict(state)
    assert torch.equal(again.columns().start, memory.columns().start)


def test_hard_negatives_with_the_separate_loss_are_a_one_line_error(setup, tmp_path):
    data, model, _, hard = setup
    config = PhraseTrainConfig(loss="separate", hard_negatives=1)
    with pytest.raises(ConfigError, match="unified"):
        train_phrases(
            model, build_phrase_data(model, data, "train", hard=hard), config, tmp_path, CPU, show_progress=False
        )


def weights(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


class Interrupted(Exception):
    pass


def test_an_interrupted_run_resumes_to_the_same_weights_memory_and_best_model(setup, tmp_path):
    data, _, root, hard = setup
    config = PhraseTrainConfig(
        prebatch=2,
        hard_negatives=1,
        passages_per_batch=2,
        questions_per_passage=2,
        epochs=2,
        max_steps=6,
        checkpoint_every=2,
        keep_checkpoints=3,
        log_every=1,
        learning_rate=1e-3,
    )

    def validate(model):  # a deterministic function of the weights
        return {"em@1": float(model.start.weight.detach().sum())}

    def interrupt_at_step_3(model):
        raise Interrupted

    straight = tiny_phrase_model(root / "bert-a", dropout=0.1)
    phrase_data = build_phrase_data(straight, data, "train", hard=hard)
    assert 2 * len(plan_epoch(phrase_data.examples, 2, 2, 0, 0)) >= 6
    train_phrases(
        straight, phrase_data, config, tmp_path / "a", CPU, validate=validate, validate_every=3, show_progress=False
    )
    interrupted = tiny_phrase_model(root / "bert-b", dropout=0.1)
    with pytest.raises(Interrupted):
        train_phrases(
            interrupted,
            phrase_data,
            config,
            tmp_path / "b",
            CPU,
            validate=interrupt_at_step_3,
            validate_every=3,
            show_progress=False,
        )
    again = tiny_phrase_model(root / "bert-c", dropout=0.1)
    result = train_phrases(
        again, phrase_data, config, tmp_path / "b", CPU, validate=validate, validate_every=3, show_progress=False
    )
    assert result.steps == 6
    a, b = weights(straight), weights(again)
    assert all(torch.equal(a[k], b[k]) for k in a)
    for name in ("train_log.jsonl", "eval_log.jsonl", "best.json"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()
    best_a = PhraseEncoder.from_pretrained(str(tmp_path / "a" / "best-model"))
    best_b = PhraseEncoder.from_pretrained(str(tmp_path / "b" / "best-model"))
    assert all(torch.equal(x, y) for x, y in zip(best_a.state_dict().values(), best_b.state_dict().values()))
    with pytest.raises(ConfigError, match="other settings"):
        train_phrases(
            again, phrase_data, dataclasses.replace(config, lambda_inb=2.0), tmp_path / "b", CPU, show_progress=False
        )


# ---- torch.distributed ---------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phrase_setup(root: Path, settings: dict):
    """A fresh tiny model, the training data with hard negatives, and a float32 config (bf16 rounding would blur
    the comparisons) of ``settings``."""
    data = load_squad_spans(root / "squad")
    model = PhraseEncoder.from_pretrained(str(root / "bert"), SMALL)
    corpus = data.dataset.corpus
    hard = {q: [r for r in range(len(corpus)) if corpus.ids[r].startswith("train")][:3] for q in data.spans}
    config = PhraseTrainConfig(
        **settings, epochs=1, max_steps=4, checkpoint_every=2, log_every=1, learning_rate=1e-3, cpu_bf16=False
    )
    return model, build_phrase_data(model, data, "train", hard=hard), config


def _step_gradients(root: Path, settings: dict) -> tuple[float, dict]:
    """The loss of the first step (the pre-batch memory holding the second's columns) and the gradients it leaves,
    summed over processes."""
    from densepass.training.distributed import sum_gradients

    model, phrase_data, config = _phrase_setup(root, settings)
    c = config
    first, second = plan_epoch(phrase_data.examples, c.passages_per_batch, c.questions_per_passage, c.seed, 0)[:2]
    memory = PrebatchMemory(config.prebatch)
    with torch.no_grad():
        memory.push(step_columns(model, phrase_data, phrase_data.step(config, 0, 1, second), CPU)[0])
    loss, _ = step_loss(model, phrase_data, phrase_data.step(config, 0, 0, first), config, memory, True, CPU)
    if loss.requires_grad:
        loss.backward()
    sum_gradients(model.parameters())
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _train_for_comparison(root: Path, run_dir: Path, settings: dict) -> dict:
    """Phrase training of a fresh tiny model, validated every 2 steps by a deterministic function of the weights;
    its final weights."""
    model, phrase_data, config = _phrase_setup(root, settings)

    def validate(model):
        return {"em@1": float(model.start.weight.detach().sum())}

    train_phrases(model, phrase_data, config, run_dir, CPU, validate=validate, validate_every=2, show_progress=False)
    return weights(model)


def _phrase_worker(rank, world, port, root, out_dir, settings):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        step = _step_gradients(Path(root), settings)
        trained = _train_for_comparison(Path(root), Path(out_dir) / "dist", settings)
        torch.save({"step": step, "trained": trained}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "settings",
    [
        # 3 groups and their hard negatives: windows and questions split unevenly over the two processes
        dict(passages_per_batch=3, questions_per_passage=2, hard_negatives=1, prebatch=2),
        # one window and one question a step: the second process encodes nothing
        dict(passages_per_batch=1, questions_per_passage=1, hard_negatives=0, prebatch=1),
    ],
)
def test_two_gloo_processes_end_with_the_weights_of_one_process_on_the_whole_step(setup, tmp_path, settings):
    _, _, root, _ = setup
    mp.spawn(_phrase_worker, args=(2, _free_port(), str(root), str(tmp_path), settings), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the workers: the same reduction order in every product, whatever the machine
    try:
        loss, grads = _step_gradients(root, settings)
        single = _train_for_comparison(root, tmp_path / "single", settings)
    finally:
        torch.set_num_threads(threads)
    for got in ranks:  # one step: the global step's loss, and its gradient once (not once per process)
        assert got["step"][0] == pytest.approx(loss, rel=1e-5)
        assert got["step"][1].keys() == grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(got["step"][1][name], grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(torch.equal(ranks[0]["trained"][k], ranks[1]["trained"][k]) for k in single)  # the same steps
    for name, value in single.items():
        torch.testing.assert_close(ranks[0]["trained"][name], value, rtol=1e-4, atol=1e-5, msg=name)

    def records(run: str, log: str) -> list[dict]:
        return [json.loads(line) for line in (tmp_path / run / log).read_text().splitlines()]

    for log in ("train_log.jsonl", "eval_log.jsonl"):  # written once (by rank 0), with the global step's loss
        got, expected = records("dist", log), records("single", log)
        assert [r["step"] for r in got] == [r["step"] for r in expected] == ([1, 2, 3, 4] if "train" in log else [2, 4])
        for key in ("loss", "em@1"):
            assert [r.get(key) for r in got] == pytest.approx([r.get(key) for r in expected], rel=1e-4)
    assert (tmp_path / "dist" / "best-model").is_dir() and (tmp_path / "dist" / "best.json").is_file()


# ---- query-side fine-tuning under torch.distributed ---------------------------------------------------------------


def _query_tuning(root: Path, run_dir: Path) -> dict:
    """Query-side fine-tuning of a fresh tiny model against an index of its training passages (5 questions a step,
    so that two processes encode 3 and 2); its final weights."""
    from densepass.phrase.config import QueryTuningConfig
    from densepass.phrase.index import PhraseIndex
    from densepass.phrase.query_tuning import gold_rows, tune_question_encoder
    from densepass.phrase.train import split_rows

    data = load_squad_spans(root / "squad")
    model = PhraseEncoder.from_pretrained(str(root / "bert"), SMALL)
    phrase_data = build_phrase_data(model, data, "train")
    corpus = data.dataset.corpus
    index = PhraseIndex.build(model, corpus.subset(split_rows(data, "train")), vector_dtype="float32")
    gold = gold_rows(index, data, [e.qid for e in phrase_data.examples])
    config = QueryTuningConfig(
        enabled=True, epochs=1, batch_size=5, top_k=3, learning_rate=1e-3, checkpoint_every=2, cpu_bf16=False
    )
    tune_question_encoder(model, index, phrase_data.examples, gold, config, run_dir, CPU, show_progress=False)
    return weights(model)


def _query_tuning_worker(rank, world, port, root, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        torch.save(_query_tuning(Path(root), Path(out_dir) / "dist"), Path(out_dir) / f"qsft-rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_query_tuning_on_two_gloo_processes_ends_with_the_weights_of_one_process(setup, tmp_path):
    """Each process encodes its share of a step's questions and the vectors are gathered: every process retrieves
    the same candidates and computes the global step's loss, and the summed gradient is the whole step's; the weights
    equal one process's up to float rounding (one thread each, as in the reference: only the order of sums
    differs)."""
    _, _, root, _ = setup
    mp.spawn(_query_tuning_worker, args=(2, _free_port(), str(root), str(tmp_path)), nprocs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = _query_tuning(root, tmp_path / "single")
    finally:
        torch.set_num_threads(threads)
    ranks = [torch.load(tmp_path / f"qsft-rank{rank}.pt") for rank in range(2)]
    start = weights(PhraseEncoder.from_pretrained(str(root / "bert"), SMALL))
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in single)  # the same updates on every process
    assert any(not torch.equal(single[k], start[k]) for k in single)  # it trained
    for name, value in single.items():
        torch.testing.assert_close(ranks[0][name], value, rtol=1e-4, atol=1e-5, msg=name)

    def losses(run: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]

    assert len(losses("dist")) == len(losses("single")) > 1  # written once, by rank 0, with the global step's loss
    assert losses("dist") == pytest.approx(losses("single"), rel=1e-4)


def test_query_tuning_counts_a_retrieved_gold_phrase_once(setup):
    """The candidates are the top-k phrases plus the gold one: a gold phrase also retrieved was a second positive
    column, doubling its weight in the marginal likelihood."""
    from densepass.phrase.config import QueryTuningConfig
    from densepass.phrase.index import PhraseIndex
    from densepass.phrase.query_tuning import QueryTuningTask, gold_rows
    from densepass.phrase.train import split_rows

    data, model, _, _ = setup
    phrase_data = build_phrase_data(model, data, "train")
    index = PhraseIndex.build(model, data.dataset.corpus.subset(split_rows(data, "train")), vector_dtype="float32")
    gold = gold_rows(index, data, [e.qid for e in phrase_data.examples])
    task = QueryTuningTask(model, index, phrase_data.examples, gold, QueryTuningConfig(top_k=3000, batch_size=8))
    task.setup(CPU)
    batch = phrase_data.examples[:8]
    with torch.no_grad():
        q_start, q_end = model.question_vectors(model.tokenize_questions([e.question for e in batch]))
    starts, ends, positive = task.candidates(batch, q_start, q_end)
    for i, example in enumerate(batch):
        spans = [(int(s), int(t)) for s, t in zip(starts[i], ends[i]) if s >= 0]
        assert spans[0] == gold[example.qid] and len(spans) == len(set(spans)), example.qid
    assert bool(positive[:, 0].all())
    task.finish()
