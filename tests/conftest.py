"""Shared fixtures: a tiny random BERT with MiniLM's tokenizer, a tiny BEIR dataset on disk, and the command
line run in a subprocess (under torchrun for several processes)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

transformers.logging.set_verbosity_error()

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: the cores shared among the workers, none oversubscribed
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


def tiny_bert_config(vocab_size: int, dropout: float = 0.0, attention_dropout: float | None = None):
    """A 2-layer, 32-dim BERT config; ``attention_dropout`` defaults to ``dropout``."""
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout if attention_dropout is None else attention_dropout,
    )


def save_tiny_bert(path: Path, seed: int = 0, dropout: float = 0.0) -> Path:
    """Save a 2-layer, 32-dim random BERT (weights drawn under torch seed ``seed``, dropout ``dropout``) with
    the all-MiniLM-L6-v2 tokenizer in ``path``."""
    from transformers import AutoTokenizer, BertModel

    from densepass.models.biencoder import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2"))
    config = tiny_bert_config(tokenizer.vocab_size, dropout)
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer, 32-dim random BERT saved with the all-MiniLM-L6-v2 tokenizer (no dropout)."""
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


WORDS = (
    "audio video editor library game network terminal python font image mail server kernel driver "
    "printer music player browser database compiler shell backup archive viewer"
).split()


def write_tiny_beir(root: Path, n_passages: int = 40, seed: int = 0) -> Path:
    """A small synthetic BEIR dataset: passages grouped in documents, one query per passage,
    train/dev qrels, and one duplicate pair (two queries with the same positive)."""
    import random

    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "corpus.jsonl", "w") as f:
        for i in range(n_passages):
            text = " ".join(rng.choice(WORDS) for _ in range(12))
            f.write(json.dumps({"_id": f"p{i}", "title": f"pkg{i}", "text": text, "doc_id": f"d{i // 2}"}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for i in range(n_passages + 1):
            f.write(json.dumps({"_id": f"q{i}", "text": " ".join(rng.choice(WORDS) for _ in range(3))}) + "\n")
    (root / "qrels").mkdir(exist_ok=True)
    split = int(n_passages * 0.75)
    with open(root / "qrels" / "train.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for i in range(split):
            f.write(f"q{i}\tp{i}\t1\n")
        f.write(f"q{n_passages}\tp0\t1\n")  # a second query whose positive is p0
    with open(root / "qrels" / "dev.tsv", "w") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for i in range(split, n_passages):
            f.write(f"q{i}\tp{i}\t1\n")
    return root


@pytest.fixture
def tiny_beir(tmp_path) -> Path:
    return write_tiny_beir(tmp_path / "tiny")


@pytest.fixture
def distillation_setup(tiny_beir, tiny_model_dir):
    """Six training queries of the tiny dataset, their distillation pairs (positives, then three pool candidates
    each) and a random tiny teacher: (dataset, pairs, teacher)."""
    from densepass.data import load_dataset
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.negatives.pool import Candidate
    from densepass.training.teacher_scores import distillation_pairs

    dataset = load_dataset(str(tiny_beir))
    qids = sorted(dataset.positives("train"))[:6]
    pool = {q: [Candidate(f"p{(i * 7 + j) % 40}", "bm25", 1.0) for j in range(3)] for i, q in enumerate(qids)}
    pool = {q: [c for c in cands if c.passage_id not in dataset.relevant_sets()[q]] for q, cands in pool.items()}
    teacher = CrossEncoder.new(str(tiny_model_dir), seed=1, max_length=32, batch_size=4, device=torch.device("cpu"))
    return dataset, distillation_pairs(dataset, "train", qids, pool), teacher


def small_run_overrides(dataset: Path, model_dir: Path, output_dir: Path, name: str) -> list[str]:
    """Config overrides of a quick ``run_experiment`` on the tiny dataset: small pools and passages, no
    baselines, MRR@10 of the top 10 (each test adds the settings it exercises)."""
    return [
        f"data.name={dataset}",
        f"model.name_or_path={model_dir}",
        f"output_dir={output_dir}",
        f"name={name}",
        "negatives.pool_depth=5",
        "model.passage_max_length=32",
        "eval.metrics=[mrr@10]",
        "eval.depth=10",
        "eval.baselines=[]",
    ]


def run_densepass(*args: str, cwd: Path, processes: int = 1) -> subprocess.CompletedProcess:
    """``python -m densepass ARGS`` in a subprocess of this checkout's package, one thread per process; under
    torchrun (gloo on the CPU) when ``processes`` > 1."""
    import densepass

    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] if processes > 1 else []
    env = {**os.environ, "PYTHONPATH": str(Path(densepass.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, *launcher, "-m", "densepass", *args], cwd=cwd, env=env, capture_output=True, text=True
    )


def densepass_here(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """``densepass ARGS`` run from ``cwd`` in this process, on one torch thread as :func:`run_densepass`'s processes:
    its exit code and what it printed. For the runs of a test whose point is not a process of their own (a killed
    one, a real exit, torchrun): it saves each the imports of a new Python process (seconds on a 2-core CPU)."""
    from densepass.cli import main

    threads, where = torch.get_num_threads(), os.getcwd()
    torch.set_num_threads(1)
    os.chdir(cwd)
    try:
        return _captured(args, lambda: main(list(args)))
    finally:
        os.chdir(where)
        torch.set_num_threads(threads)


def _captured(args, call) -> subprocess.CompletedProcess:
    """``call()`` in this process as a program's run: its exit code (argparse's usage errors' too) and what it
    printed, as a ``CompletedProcess`` of ``args``."""
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = call()
        except SystemExit as exit:  # argparse's usage errors
            code = exit.code
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


@functools.cache
def script_module(script: Path):
    """A script of ``experiments/`` (or ``benchmarks/``) loaded as a module, once a process: its ``main`` then runs
    in this process (:func:`script_here`)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{script.stem}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_here(script: Path, *args: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` run in this process as the script runs itself (``run_guarded(main)``, ``main`` reading
    ``sys.argv``): its exit code and what it printed. For the tests whose point is not a process of their own: a new
    process pays the imports again (ranx's fusion alone compiles for seconds in each)."""
    from densepass.cli import run_guarded

    argv = sys.argv
    sys.argv = [str(script), *args]
    try:
        return _captured(sys.argv, lambda: run_guarded(script_module(script).main, script.name))
    finally:
        sys.argv = argv


@contextlib.contextmanager
def interrupted_at_step(n: int) -> Iterator[None]:
    """Training in the block is killed during its step ``n``, for the tests that resume an interrupted run: the
    trainer's ``forward_backward`` (called once a step) raises ``KeyboardInterrupt`` on its ``n``-th call, so the
    run directory holds what the steps before it wrote (their checkpoints, their log) as after a Ctrl-C or a kill,
    and resuming it must end with an uninterrupted run's weights. The block must end in this interruption (no
    interruption, or another error, fails the test); the real step is restored whatever happens."""
    import densepass.training.trainer as trainer_module

    real_step, calls = trainer_module.forward_backward, []
    message = f"simulated interruption during step {n}"

    def crashing_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt(message)
        return real_step(*args, **kwargs)

    trainer_module.forward_backward = crashing_step
    try:
        with pytest.raises(KeyboardInterrupt, match=message):
            yield
    finally:
        trainer_module.forward_backward = real_step


def assert_same_ranking_up_to_ties(rows, scores, ref_rows, ref_scores, atol: float) -> None:
    """Top-k ``rows`` with ``scores`` equal the reference's, except that rows whose reference scores are within
    ``atol`` of each other (near-ties, which float rounding in another matrix-product blocking may swap) may
    change places, or trade the last places with a row just outside the reference's top k."""
    rows, ref_rows = np.asarray(rows), np.asarray(ref_rows)
    np.testing.assert_allclose(scores, ref_scores, rtol=0, atol=atol)
    for q, j in zip(*np.nonzero(rows != ref_rows)):
        where = np.flatnonzero(ref_rows[q] == rows[q, j])
        partner = ref_scores[q, where[0]] if len(where) else ref_scores[q, -1]
        assert abs(partner - ref_scores[q, j]) <= atol, f"query {q}, rank {j}: row {rows[q, j]} is not a near-tie"


def hub_cache_without_network(tmp_path: Path, monkeypatch) -> Path:
    """An empty hub cache (returned) for huggingface_hub, the Hub online as far as densepass can tell, and no
    network connection possible: any attempt fails the test."""
    import socket

    from huggingface_hub import constants

    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    root = tmp_path / "hub"
    root.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(root))
    return root


def http_client_connection_errors() -> list[BaseException]:
    """A connection failure ('name or service not known') of each HTTP client huggingface_hub may talk through
    (``hub_snapshots.HTTP_CLIENT_ERRORS``) that is installed here: what reaches densepass when the Hub's host does
    not resolve."""
    import importlib

    from densepass.hub_snapshots import HTTP_CLIENT_ERRORS

    errors = []
    for module, _ in HTTP_CLIENT_ERRORS:
        try:
            client = importlib.import_module(module)
        except ImportError:
            continue
        connect = getattr(client, "ConnectError", None) or client.ConnectionError
        errors.append(connect("[Errno -2] Name or service not known"))
    assert errors, "no HTTP client of huggingface_hub's is installed"
    return errors


ONEDNN_BF16 = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
"""Whether this CPU runs oneDNN's bf16 products (AVX-512 or AVX-NE-CONVERT): the fused layers run bf16 encoders there
only (``models.fused.fusable``); an AVX2-only CPU runs bf16 models as ``transformers`` computes them."""
needs_onednn_bf16 = pytest.mark.skipif(not ONEDNN_BF16, reason="oneDNN has no bf16 products on this CPU (AVX2 only)")
