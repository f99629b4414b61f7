"""Validation during training on a subcorpus, keeping the best checkpoint by a chosen metric.

Only the subcorpus is encoded at each validation (training-inference-gap §3): C0, a random R_r or
a hard H_k built once at the start. Each validation appends to ``validation_log.jsonl``; a new best
replaces ``best-model/`` atomically and ``best.json`` records its step and score.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from pathlib import Path

import torch

from densepass.config import ModelConfig, ValidationConfig
from densepass.data.dataset import Corpus, RetrievalDataset
from densepass.errors import ConfigError, DataError
from densepass.evaluation.metrics import depth_for, evaluate_run, refuse_answer_metrics
from densepass.evaluation.subcorpus import Retriever, Subcorpus, gold_subcorpus, hard_subcorpus, random_subcorpus
from densepass.index.bm25 import BM25Index
from densepass.index.exact import exact_search
from densepass.io import atomic_write_text
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts
from densepass.pipelines.retrievers import index_for_model
from densepass.plots import read_log


def bm25_retriever(corpus: Corpus) -> Retriever:
    """BM25 over the whole corpus as an H_k retriever."""
    index = BM25Index.build(corpus.passage_inputs(" "))
    return lambda queries, k: index.search_rows(queries, k)[1]


def dense_retriever(corpus: Corpus, model_path: str, batch_size: int = 256) -> Retriever:
    """Any saved bi-encoder checkpoint as an H_k retriever."""
    model = BiEncoder.from_pretrained(model_path)
    passages = encode_texts(
        model, corpus.passage_inputs(model.tokenizer.sep_token or " "), "passage", batch_size=batch_size
    )
    return lambda queries, k: exact_search(encode_texts(model, queries, "query", batch_size=batch_size), passages, k)[1]


def check_retriever(config: ValidationConfig) -> None:
    """Before any work: a hard subcorpus's ``retriever`` is bm25 or a model that resolves (it was first loaded after
    mining, once training had started)."""
    name = config.retriever
    if config.subcorpus != "hard" or name == "bm25":
        return
    if name.strip().lower() == "bm25":
        raise ConfigError(f"validation.retriever {name!r}: write bm25 (lower case) for BM25, or give a saved model")
    from densepass.models.biencoder import resolve_model_path

    try:
        resolve_model_path(name)
    except (ConfigError, DataError) as err:  # a missing folder, a Hub model not found, files that do not load
        raise type(err)(f"validation.retriever {name!r} (bm25 or a saved model): {err}") from None


def build_subcorpus(
    dataset: RetrievalDataset, config: ValidationConfig, exclude: Collection[str] = ()
) -> tuple[Subcorpus, dict, list[str]]:
    """The validation subcorpus, the qrels of the validation queries (none of ``exclude``), and their texts."""
    qrels = dataset.sample(config.split, config.max_queries, config.seed, exclude)
    texts = [dataset.queries[q] for q in qrels]
    corpus = dataset.corpus
    if config.subcorpus == "gold":
        sub = gold_subcorpus(corpus, qrels)
    elif config.subcorpus == "random":
        sub = random_subcorpus(corpus, qrels, config.r, config.seed)
    elif config.subcorpus == "hard":
        retriever = bm25_retriever(corpus) if config.retriever == "bm25" else dense_retriever(corpus, config.retriever)
        sub = hard_subcorpus(corpus, qrels, texts, config.k, retriever, config.retriever)
    elif config.subcorpus == "full":
        sub = Subcorpus("full", list(corpus.ids), {})
    else:
        raise ConfigError(f"unknown subcorpus {config.subcorpus!r}")
    return sub, qrels, texts


class Validator:
    """Callable(step): validates every ``every_steps`` steps and keeps the best model."""

    def __init__(
        self,
        config: ValidationConfig,
        dataset: RetrievalDataset,
        model: BiEncoder,
        device: torch.device,
        run_dir: Path,
        metrics: list[str],
        exclude: Collection[str] = (),
        model_config: ModelConfig | None = None,
        precision: str = "auto",
        batch_size: int = 64,
    ) -> None:
        if config.every_steps < 1:
            raise ConfigError(f"validation.every_steps must be >= 1, got {config.every_steps}")
        refuse_answer_metrics([config.metric], "validation")
        # accuracy@k needs answer strings, which validation does not read: its evaluation's other metrics are logged
        metrics = [m for m in metrics if not m.startswith("accuracy@")]
        if config.metric not in metrics:
            metrics = [*metrics, config.metric]
        self.config, self.model, self.device, self.run_dir, self.metrics = config, model, device, run_dir, metrics
        # the final evaluation's index settings (SPLADE pruning, ColBERT storage and search), precision and batch:
        # the checkpoint kept is the best on the searches the evaluation will run, not on other ones
        self.model_config, self.precision, self.batch_size = model_config, precision, batch_size
        # deep enough for every cutoff (recall@1000 of a top 100 was recall@100), and at least the top 100
        self.depth = depth_for(metrics)
        self.subcorpus, self.qrels, self.query_texts = build_subcorpus(dataset, config, exclude)
        corpus = dataset.corpus
        self.passages = corpus.subset([corpus.position(p) for p in self.subcorpus.ids])
        self.subcorpus.save(run_dir / f"subcorpus-{self.subcorpus.label}.json")
        self.log_path = run_dir / "validation_log.jsonl"
        best = run_dir / "best.json"
        kept = json.loads(best.read_text()) if best.is_file() else None
        # a resumed run's best so far, if it was chosen by the same metric on the same subcorpus (a score of another
        # metric, recall@100's 0.9, would never be beaten by mrr@10's, and its model would be restored)
        same = (
            kept is not None
            and kept.get("metric") == config.metric
            and kept.get("subcorpus") in (None, self.subcorpus.label)
        )
        self.best = float(kept["score"]) if same else float("-inf")

    def evaluate(self) -> dict[str, float]:
        """The metrics of the model as it is now, on the subcorpus (its top 100 per query, or as deep as the
        deepest cutoff)."""
        index = index_for_model(  # any retriever kind
            self.model, self.passages, self.model_config, self.batch_size, self.device, precision=self.precision
        )
        run = index.search(self.query_texts, min(self.depth, len(self.passages))).as_run(list(self.qrels))
        return evaluate_run(self.qrels, run, self.metrics)

    def __call__(self, step: int) -> None:
        """Validate after step ``step`` when it is due; keep the model when it is the best so far."""
        if step % self.config.every_steps == 0:
            self.validate(step)

    def best_after(self, last_step: int) -> dict:
        """Validate the last step unless that was due anyway or is in the log already (a finished run run again),
        then return ``best.json`` (step, metric, score)."""
        if last_step % self.config.every_steps and last_step not in self.logged_steps():
            self.validate(last_step)
        return json.loads((self.run_dir / "best.json").read_text())

    def logged_steps(self) -> set[int]:
        """The steps ``validation_log.jsonl`` has a record of."""
        return {record["step"] for record in read_log(self.log_path) if isinstance(record.get("step"), int)}

    def validate(self, step: int) -> None:
        """Validate the model as it is after step ``step``; keep it when it is the best so far."""
        started = time.perf_counter()
        metrics = self.evaluate()
        self.model.train()
        record = {
            "step": step,
            "subcorpus": self.subcorpus.label,
            "size": len(self.subcorpus),
            "seconds": time.perf_counter() - started,
            **metrics,
        }
        with open(self.log_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")
        score = metrics[self.config.metric]
        if score > self.best:
            self.best = score
            self.model.save(self.run_dir / "best-model")
            atomic_write_text(
                self.run_dir / "best.json",
                json.dumps(
                    {"step": step, "metric": self.config.metric, "score": score, "subcorpus": self.subcorpus.label}
                ),
            )
