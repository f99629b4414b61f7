"""Streamed pre-training batches from any densepass corpus.

MLM and Condenser train on *packed* sequences: passages in a seeded random order per epoch, tokenised
block by block as the stream advances, joined by [SEP] and cut into ``max_length - 2`` token chunks
framed by [CLS] ... [SEP] (no padding except at the very end of an epoch). coCondenser trains on span
pairs: each batch takes ``batch_size / 2`` documents (passages grouped by ``doc_id``) and yields their
two spans as rows 2i and 2i + 1. Both streams are infinite and depend only on the seed, so a resumed
run skips the batches it already trained on and continues with identical data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import torch
from transformers import PreTrainedTokenizerBase

from densepass.data.dataset import Corpus
from densepass.errors import ConfigError, DataError
from densepass.pretraining.spans import group_documents, span_pair

Batch = dict[str, torch.Tensor]
BLOCK = 512  # passages tokenised at a time


def subset_corpus(corpus: Corpus, limit: int | None, seed: int) -> Corpus:
    """A seeded subset of ``limit`` passages (whole corpus when None), kept in corpus order."""
    if limit is None or limit >= len(corpus):
        return corpus
    if limit < 1:
        raise ConfigError(f"data.max_passages must be >= 1, got {limit}")
    return corpus.subset(sorted(random.Random(seed).sample(range(len(corpus)), limit)))


def _tokenize(tokenizer: PreTrainedTokenizerBase, corpus: Corpus, positions: list[int]) -> list[list[int]]:
    texts = corpus.passage_inputs(tokenizer.sep_token or " ", positions)
    return tokenizer(texts, add_special_tokens=False, truncation=False, verbose=False)["input_ids"]


def collate(sequences: list[list[int]], pad_id: int) -> Batch:
    """Right-pad token id lists to the longest into input_ids / attention_mask tensors."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def _frame(tokenizer: PreTrainedTokenizerBase, body: list[int]) -> list[int]:
    return [tokenizer.cls_token_id, *body, tokenizer.sep_token_id]


def packed_sequences(
    corpus: Corpus, tokenizer: PreTrainedTokenizerBase, max_length: int, seed: int, epoch: int
) -> Iterator[list[int]]:
    """One epoch of packed sequences: [CLS] p_a [SEP] p_b [SEP] ... cut to ``max_length``."""
    if max_length < 3:
        raise ConfigError(f"max_length must be >= 3, got {max_length}")
    order = list(range(len(corpus)))
    random.Random(f"{seed}-{epoch}").shuffle(order)
    body = max_length - 2
    buffer: list[int] = []
    for start in range(0, len(order), BLOCK):
        for tokens in _tokenize(tokenizer, corpus, order[start : start + BLOCK]):
            buffer.extend(tokens)
            buffer.append(tokenizer.sep_token_id)
            while len(buffer) >= body:
                yield _frame(tokenizer, buffer[:body])
                buffer = buffer[body:]
    if buffer[:-1]:
        yield _frame(tokenizer, buffer[:-1])


def mlm_batches(
    corpus: Corpus, tokenizer: PreTrainedTokenizerBase, batch_size: int, max_length: int, seed: int
) -> Iterator[Batch]:
    """Infinite stream of packed batches (an epoch's remainder joins the next epoch's first batch)."""
    rows: list[list[int]] = []
    epoch = 0
    while True:
        produced = False
        for sequence in packed_sequences(corpus, tokenizer, max_length, seed, epoch):
            produced = True
            rows.append(sequence)
            if len(rows) == batch_size:
                yield collate(rows, tokenizer.pad_token_id)
                rows = []
        if not produced:
            raise DataError("the pre-training corpus has no tokens")
        epoch += 1


def span_batches(
    corpus: Corpus,
    tokenizer: PreTrainedTokenizerBase,
    batch_size: int,
    max_length: int,
    min_tokens: int,
    max_tokens: int,
    seed: int,
) -> Iterator[Batch]:
    """Infinite stream of coCondenser batches: rows 2i, 2i + 1 are two spans of document i."""
    if batch_size < 4 or batch_size % 2:
        raise ConfigError(f"coCondenser needs an even batch size >= 4 (two spans per document), got {batch_size}")
    max_tokens = min(max_tokens, max_length - 2)
    if min_tokens > max_tokens:
        raise ConfigError(
            f"span_min_tokens {min_tokens} exceeds the longest span that fits max_length {max_length} ({max_tokens})"
        )
    documents = group_documents(corpus)
    per_batch = batch_size // 2
    if len(documents) < per_batch:
        raise DataError(f"{len(documents)} documents cannot fill a batch of {per_batch} span pairs")
    epoch = 0
    while True:
        rng = random.Random(f"{seed}-{epoch}")
        order = list(range(len(documents)))
        rng.shuffle(order)
        for start in range(0, len(order) - per_batch + 1, per_batch):
            rows = []
            for doc in order[start : start + per_batch]:
                tokens: list[int] = []
                for passage in _tokenize(tokenizer, corpus, documents[doc]):
                    tokens.extend([*passage, tokenizer.sep_token_id])
                tokens = tokens[:-1] or [tokenizer.unk_token_id]
                for begin, end in span_pair(len(tokens), min_tokens, max_tokens, rng):
                    rows.append(_frame(tokenizer, tokens[begin:end]))
            yield collate(rows, tokenizer.pad_token_id)
        epoch += 1
