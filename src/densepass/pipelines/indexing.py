"""``densepass index``: a dataset's corpus into a saved index, resumably (a phrase index is encoded in one go).

Dense kinds encode the corpus shard by shard into a memory-mapped file (``index.embeddings``) kept
beside the output while it is being built, named by the fingerprint of the model's weights and
architecture and of the corpus: an interrupted run resumes at the first unfinished shard, and a run
with another model or corpus never reuses those rows. SPLADE and ColBERT kinds (``pipelines.retrievers``)
encode the corpus in one go (not resumable). The index is then saved atomically; the encoding files are
removed. Two processes building the same output are refused. ``hybrid`` fuses a dense index with BM25,
or with a SPLADE index when ``sparse_model`` is given.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import torch

from densepass.config import DENSE_INDEX_KINDS, ModelConfig
from densepass.data.dataset import Corpus
from densepass.device import default_device, resolve_precision
from densepass.errors import ConfigError
from densepass.fingerprints import fingerprint_corpus, fingerprint_json, fingerprint_weights
from densepass.index.base import Index
from densepass.index.bm25 import BM25Index
from densepass.index.dense import DenseIndex
from densepass.index.embeddings import encode_to_memmap
from densepass.index.hybrid import HybridIndex
from densepass.io import exclusive_lock
from densepass.models.biencoder import BiEncoder
from densepass.models.colbert import ColBERT
from densepass.models.splade import SpladeEncoder
from densepass.phrase.index import PhraseIndex
from densepass.phrase.model import PhraseEncoder
from densepass.pipelines.retrievers import index_for_model

INDEX_KINDS = (*DENSE_INDEX_KINDS, "bm25", "hybrid", "splade", "colbert", "phrase")


@dataclasses.dataclass
class IndexSettings:
    """How ``build_index`` indexes a corpus."""

    kind: str = "exact"  # one of INDEX_KINDS
    model: str | None = None  # dense and hybrid kinds: the bi-encoder (a saved model or a name)
    dense_kind: str = "exact"  # hybrid: the dense part's kind
    fusion: str = "rrf"  # hybrid: rrf or linear
    fusion_weight: float = 0.5  # hybrid, linear: weight of the dense scores
    batch_size: int = 256
    shard_size: int = 100_000  # passages encoded between resumable save points
    device: torch.device | None = None
    show_progress: bool = True
    sparse_model: str | None = None  # hybrid: a SPLADE model for the second part instead of BM25
    retriever: ModelConfig = dataclasses.field(default_factory=ModelConfig)  # splade pruning, colbert storage
    threshold: float | None = None  # phrase: the token filter's threshold (None: keep every vector)
    precision: str = "auto"  # dense kinds: encoding precision (auto, fp32, bf16, int8; models.encode)

    def __post_init__(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise ConfigError(f"unknown index kind {self.kind!r} (known: {', '.join(INDEX_KINDS)})")
        if self.dense_kind not in DENSE_INDEX_KINDS:
            raise ConfigError(f"unknown dense index kind {self.dense_kind!r} (known: {', '.join(DENSE_INDEX_KINDS)})")
        if self.batch_size < 1 or self.shard_size < 1:
            raise ConfigError("batch size and shard size must be >= 1")
        if self.kind != "bm25" and not self.model:
            raise ConfigError(f"a {self.kind} index needs a model")
        resolve_precision(self.precision, self.device or default_device())
        if self.precision not in ("auto", "fp32") and self.kind in ("bm25", "splade", "colbert", "phrase"):
            raise ConfigError(f"precision {self.precision} applies to bi-encoder indexes, not to a {self.kind} index")


def encode_corpus(model: BiEncoder, corpus: Corpus, work_dir: Path, settings: IndexSettings):
    """The corpus's passage embeddings, through a resumable memory map named by content."""
    key = fingerprint_json(
        {
            "weights": fingerprint_weights(model),
            "architecture": dataclasses.asdict(model.config),
            "corpus": fingerprint_corpus(corpus),
            "precision": resolve_precision(settings.precision, settings.device or default_device()),
        }
    )[:20]
    path = work_dir / f"passages-{key}.npy"
    for stale in work_dir.glob("passages-*"):
        if not stale.name.startswith(path.name):
            stale.unlink()  # another model's or corpus's rows: never reused
    return encode_to_memmap(
        model,
        corpus.passage_inputs(model.tokenizer.sep_token or " "),
        "passage",
        path,
        shard_size=settings.shard_size,
        batch_size=settings.batch_size,
        device=settings.device,
        show_progress=settings.show_progress,
        precision=settings.precision,
    )


def dense_index(model: BiEncoder, corpus: Corpus, kind: str, work_dir: Path, settings: IndexSettings) -> DenseIndex:
    """A dense index of ``corpus``, its embeddings encoded resumably under ``work_dir``."""
    index = DenseIndex(
        model,
        kind,
        batch_size=settings.batch_size,
        device=settings.device,
        show_progress=False,
        precision=settings.precision,
    )
    index.add_embeddings(corpus, encode_corpus(model, corpus, work_dir, settings))
    return index


def build_index(corpus: Corpus, output: str | Path, settings: IndexSettings) -> Index:
    """Index ``corpus`` as ``settings`` say and save it atomically to ``output``."""
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise ConfigError(f"--output {output} exists and is not a directory")
    work_dir = output.with_name(f".{output.name}.encoding")
    with exclusive_lock(work_dir, "index build"):
        if settings.kind == "bm25":
            index: Index = BM25Index.build(corpus, show_progress=settings.show_progress)
        elif settings.kind in ("splade", "colbert"):
            model = (SpladeEncoder if settings.kind == "splade" else ColBERT).from_pretrained(settings.model)
            index = index_for_model(model, corpus, settings.retriever, settings.batch_size, settings.device)
        elif settings.kind == "phrase":
            model = PhraseEncoder.from_pretrained(settings.model)
            index = PhraseIndex.build(
                model,
                corpus,
                device=settings.device,
                threshold=settings.threshold,
                show_progress=settings.show_progress,
            )
        else:
            model = BiEncoder.from_pretrained(settings.model)
            kind = settings.dense_kind if settings.kind == "hybrid" else settings.kind
            index = dense_index(model, corpus, kind, work_dir, settings)
            if settings.kind == "hybrid":
                second: Index = (
                    index_for_model(SpladeEncoder.from_pretrained(settings.sparse_model), corpus, settings.retriever)
                    if settings.sparse_model
                    else BM25Index.build(corpus)
                )
                index = HybridIndex(index, second, settings.fusion, settings.fusion_weight)
        index.save(output)
    shutil.rmtree(work_dir, ignore_errors=True)
    return index
