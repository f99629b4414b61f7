"""Contriever positive pairs (neural-retrieval-lecture, on Contriever): two independent random crops of one document,
or the inverse cloze task.

Contriever: "random cropping data augmentation, with documents of 256 tokens and span sizes sampled between 5% and
50% of the document length ... We also apply token deletion with a probability of 10%." A document here is a
source package's passages (grouped by ``doc_id``) joined by [SEP]; a random window of ``document_tokens`` of it
plays Contriever's 256-token document. Each crop takes a share of the window drawn uniformly from
[ratio_min, ratio_max] at a uniformly random start, independently of the other crop (so the two may overlap or
not), and then loses each token with probability ``deletion`` (never all of them).

The inverse cloze task (ICT; Lee et al. 2019, which Contriever compares with cropping): one sentence of the
window is the query and the rest of the window its positive; with probability ``keep_sentence`` the sentence
stays in the context too (ORQA's 10%). Sentences end at ., ! or ? followed by white space, and at line breaks.

Batches hold ``batch_size`` documents: rows 2i and 2i + 1 are the query view and the key view of document i,
and ``documents`` holds each pair's document number (memory entries of the same document are masked). The stream
is infinite and depends only on the seed, so a resumed run continues with identical data.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.pretraining.data import Batch, collate
from densepass.pretraining.spans import Span, group_documents

SENTENCE_END = re.compile(r"(?<=[.!?])\s+|\n+")


@dataclass(frozen=True)
class CropSettings:
    """How pairs are drawn (``ContrieverConfig`` holds the same fields)."""

    ratio_min: float = 0.05
    ratio_max: float = 0.5
    document_tokens: int = 256
    deletion: float = 0.1
    ict_probability: float = 0.0
    keep_sentence: float = 0.1

    def __post_init__(self) -> None:
        if not 0 < self.ratio_min <= self.ratio_max <= 1:
            raise ConfigError(f"crop ratios need 0 < min <= max <= 1, got {self.ratio_min} and {self.ratio_max}")
        if self.document_tokens < 2:
            raise ConfigError(f"document_tokens must be >= 2, got {self.document_tokens}")
        for name in ("deletion", "ict_probability", "keep_sentence"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.deletion == 1:
            raise ConfigError("token deletion 1 would delete every token")


def random_crop(length: int, ratio_min: float, ratio_max: float, rng: random.Random) -> Span:
    """A crop of ``round(r * length)`` tokens (at least 1), r ~ U[ratio_min, ratio_max], at a random start."""
    if length < 1:
        raise ConfigError("cannot crop an empty document")
    size = min(length, max(1, round(rng.uniform(ratio_min, ratio_max) * length)))
    start = rng.randint(0, length - size)
    return start, start + size


def delete_tokens(tokens: list[int], probability: float, rng: random.Random) -> list[int]:
    """``tokens`` with each one dropped with ``probability``; one survivor is kept if all would go."""
    kept = [t for t in tokens if rng.random() >= probability]
    return kept or [tokens[rng.randrange(len(tokens))]]


def window(length: int, size: int, rng: random.Random) -> Span:
    """A random window of ``size`` tokens (the whole document when it is shorter)."""
    size = min(size, length)
    start = rng.randint(0, length - size)
    return start, start + size


def crop_pair(tokens: list[int], settings: CropSettings, rng: random.Random) -> tuple[list[int], list[int]]:
    """Two independent crops of a window of the document, each with token deletion."""
    begin, end = window(len(tokens), settings.document_tokens, rng)
    views = []
    for _ in range(2):
        start, stop = random_crop(end - begin, settings.ratio_min, settings.ratio_max, rng)
        views.append(delete_tokens(tokens[begin + start : begin + stop], settings.deletion, rng))
    return views[0], views[1]


def ict_pair(sentences: list[list[int]], settings: CropSettings, rng: random.Random) -> tuple[list[int], list[int]]:
    """(one sentence, the rest of a window of sentences around it) of a document's tokenised sentences, each with
    token deletion; a document of one sentence gives a crop pair instead."""
    sentences = [s for s in sentences if s]
    if len(sentences) < 2:
        return crop_pair([t for s in sentences for t in s], settings, rng)
    pick = rng.randrange(len(sentences))
    lengths = [len(s) for s in sentences]
    first, last, total = pick, pick + 1, lengths[pick]
    while total < settings.document_tokens and (first > 0 or last < len(sentences)):  # grow the window around it
        if last < len(sentences) and (first == 0 or rng.random() < 0.5):
            total, last = total + lengths[last], last + 1
        else:
            first, total = first - 1, total + lengths[first - 1]
    keep = rng.random() < settings.keep_sentence
    context = [t for i in range(first, last) if keep or i != pick for t in sentences[i]][: settings.document_tokens]
    query = sentences[pick][: settings.document_tokens]
    if not context:
        return crop_pair(query, settings, rng)
    return delete_tokens(query, settings.deletion, rng), delete_tokens(context, settings.deletion, rng)


def document_sentences(corpus: Corpus, positions: list[int], tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    """The tokenised sentences of a document's passages (``title [SEP] text`` each), passages joined by [SEP]."""
    sentences: list[str] = []
    bounds = []
    for text in corpus.passage_inputs(tokenizer.sep_token or " ", positions):
        parts = [p for p in SENTENCE_END.split(text) if p.strip()]
        if parts:  # an empty passage ends no sentence: no [SEP] of its own (a doubled one, or one at the end)
            sentences.extend(parts)
            bounds.append(len(sentences))
    ids = (
        tokenizer(sentences, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]
        if sentences
        else []
    )
    for end in bounds[:-1]:  # a [SEP] after each passage's last sentence but the document's last
        ids[end - 1] = [*ids[end - 1], tokenizer.sep_token_id]
    return [s for s in ids if s] or [[tokenizer.unk_token_id]]


def contriever_batches(
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_length: int,
    settings: CropSettings,
    seed: int,
) -> Iterator[Batch]:
    """Infinite stream of pair batches: rows 2i, 2i + 1 are the two views of document ``documents[i]``, each
    cut to ``max_length`` tokens with [CLS] ... [SEP]."""
    if batch_size < 2:
        raise ConfigError(f"Contriever pairs need a batch of at least 2 documents, got {batch_size}")
    if max_length < 3:
        raise ConfigError(f"max_length must be >= 3, got {max_length}")
    documents = group_documents(corpus)
    if len(documents) < batch_size:
        raise DataError(f"{len(documents)} documents cannot fill a batch of {batch_size} pairs")
    epoch = 0
    while True:
        rng = random.Random(f"{seed}-{epoch}")
        order = list(range(len(documents)))
        rng.shuffle(order)
        for start in range(0, len(order) - batch_size + 1, batch_size):
            rows = []
            chosen = order[start : start + batch_size]
            for doc in chosen:
                sentences = document_sentences(corpus, documents[doc], tokenizer)
                if rng.random() < settings.ict_probability:
                    views = ict_pair(sentences, settings, rng)
                else:
                    views = crop_pair([t for s in sentences for t in s], settings, rng)
                rows.extend([tokenizer.cls_token_id, *view[: max_length - 2], tokenizer.sep_token_id] for view in views)
            batch = collate(rows, tokenizer.pad_token_id)
            batch["documents"] = torch.tensor(chosen, dtype=torch.long)
            yield batch
        epoch += 1
