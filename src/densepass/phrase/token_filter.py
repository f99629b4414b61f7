"""The token filter, trained after the encoder (training-inference-gap §5.2: two stages).

With the phrase encoder frozen, every token of the training passages gets its start and end vectors;
a token is a positive start (end) when some question's answer span starts (ends) on it. Two logistic
regressions (``model.TokenFilter``: one linear logit on the start vectors, one on the end vectors) are
trained with binary cross-entropy; after each epoch the filter is validated by AUC-PR (average precision
over every threshold, ``metrics.average_precision``) on the evaluation passages' tokens, and the epoch
with the best mean AUC-PR is kept. The index then keeps a token's start (end) vector only when its logit
is above a threshold, chosen by the size / accuracy sweep (Figure 2).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import torch

from densepass.data.dataset import Corpus
from densepass.data.squad import SquadSpans
from densepass.phrase.config import FilterConfig
from densepass.phrase.encode import TokenVectors, encode_corpus
from densepass.phrase.metrics import average_precision
from densepass.phrase.model import PhraseEncoder, TokenFilter
from densepass.phrase.windows import char_span_to_tokens


def token_labels(vectors: TokenVectors, corpus: Corpus, data: SquadSpans, qids: Sequence[str]) -> np.ndarray:
    """[N, 2] booleans: is the row the first (column 0) / last (column 1) token of an answer of ``qids``
    (``vectors`` being the token table of ``corpus``)."""
    labels = np.zeros((len(vectors), 2), dtype=bool)
    for qid in qids:
        pid = data.passage.get(qid)
        if pid is None or pid not in corpus:
            continue
        p = corpus.position(pid)
        lo, hi = vectors.bounds[p], vectors.bounds[p + 1]
        for span in data.spans[qid]:
            tokens = char_span_to_tokens(vectors.offsets[lo:hi], span.start, span.end)
            if tokens is not None:
                labels[lo + tokens[0], 0] = labels[lo + tokens[1], 1] = True
    return labels


def filter_auc_pr(token_filter: TokenFilter, vectors: TokenVectors, labels: np.ndarray) -> dict[str, float]:
    """AUC-PR of the start and end logits against the labels, and their mean."""
    start, end = filter_logits(token_filter, vectors)
    out = {"auc_pr_start": average_precision(start, labels[:, 0]), "auc_pr_end": average_precision(end, labels[:, 1])}
    out["auc_pr"] = (out["auc_pr_start"] + out["auc_pr_end"]) / 2
    return out


@torch.no_grad()
def filter_logits(
    token_filter: TokenFilter, vectors: TokenVectors, chunk: int = 1 << 15
) -> tuple[np.ndarray, np.ndarray]:
    """Start and end logits [N] of a token table."""
    starts, ends = [], []
    for lo in range(0, len(vectors), chunk):
        s, e = token_filter(
            torch.from_numpy(np.asarray(vectors.start[lo : lo + chunk], dtype=np.float32)),
            torch.from_numpy(np.asarray(vectors.end[lo : lo + chunk], dtype=np.float32)),
        )
        starts.append(s.numpy())
        ends.append(e.numpy())
    return np.concatenate(starts), np.concatenate(ends)


def fit_filter(
    train: TokenVectors,
    train_labels: np.ndarray,
    valid: TokenVectors,
    valid_labels: np.ndarray,
    config: FilterConfig,
    seed: int = 13,
) -> tuple[TokenFilter, list[dict]]:
    """The filter with the best validation AUC-PR over ``config.epochs`` epochs, and the per-epoch log."""
    torch.manual_seed(seed)
    token_filter = TokenFilter(train.start.shape[1])
    optimizer = torch.optim.Adam(token_filter.parameters(), lr=config.learning_rate)
    rng = np.random.default_rng(seed)
    start = torch.from_numpy(np.asarray(train.start, dtype=np.float32))
    end = torch.from_numpy(np.asarray(train.end, dtype=np.float32))
    targets = torch.from_numpy(train_labels.astype(np.float32))
    best, best_state, log = -1.0, None, []
    for epoch in range(config.epochs):
        total = 0.0
        for batch in np.array_split(rng.permutation(len(train)), max(1, -(-len(train) // config.batch_size))):
            rows = torch.from_numpy(batch)
            s, e = token_filter(start[rows], end[rows])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(
                s, targets[rows, 0]
            ) + torch.nn.functional.binary_cross_entropy_with_logits(e, targets[rows, 1])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(batch)
        metrics = filter_auc_pr(token_filter, valid, valid_labels)
        log.append({"epoch": epoch + 1, "loss": total / len(train), **metrics})
        if metrics["auc_pr"] > best:
            best, best_state = metrics["auc_pr"], copy.deepcopy(token_filter.state_dict())
    token_filter.load_state_dict(best_state)
    return token_filter, log


def train_token_filter(
    model: PhraseEncoder,
    data: SquadSpans,
    train_rows: Sequence[int],
    train_qids: Sequence[str],
    valid_rows: Sequence[int],
    valid_qids: Sequence[str],
    config: FilterConfig,
    device: torch.device,
    batch_size: int = 32,
    seed: int = 13,
) -> list[dict]:
    """Fit ``model.filter`` on the training passages' tokens (encoder frozen), validated on the evaluation
    passages' tokens; returns the per-epoch log."""
    corpus = data.dataset.corpus
    model.filter = None
    sets = []
    for rows, qids in ((train_rows, train_qids), (valid_rows, valid_qids)):
        passages = corpus.subset(list(rows))
        vectors = encode_corpus(model, passages, batch_size, device)
        sets.append((vectors, token_labels(vectors, passages, data, qids)))
    (train, train_labels), (valid, valid_labels) = sets
    token_filter, log = fit_filter(train, train_labels, valid, valid_labels, config, seed)
    model.filter = token_filter.to(device)
    return log
