"""A corpus's token table and start/end vectors, encoded window by window (DensePhrases' phrase dump).

Passage p owns rows ``bounds[p]:bounds[p + 1]`` of the table; row r holds the character span of one text
token (``offsets[r]``), its start and end vectors (from the window where it has the most context,
``phrase.windows``) and, when the model has a token filter, its start and end logits. Windows are encoded
longest first in batches, without gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from tqdm.auto import tqdm

from densepass.data.dataset import Corpus
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.windows import TokenizedPassage


@dataclass
class TokenVectors:
    """The token table of a corpus: ``bounds`` [P + 1], ``offsets`` [N, 2], ``start`` / ``end`` [N, dim], and
    filter logits ``start_logits`` / ``end_logits`` [N] (None without a filter)."""

    bounds: np.ndarray
    offsets: np.ndarray
    start: np.ndarray
    end: np.ndarray
    start_logits: np.ndarray | None = None
    end_logits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def passage_of_row(self) -> np.ndarray:
        """The passage of every row [N]."""
        return np.repeat(np.arange(len(self.bounds) - 1), np.diff(self.bounds)).astype(np.int64)


@torch.no_grad()
def encode_tokenized(
    model: PhraseEncoder,
    passages: list[TokenizedPassage],
    batch_size: int = 32,
    device: torch.device | None = None,
    dtype: np.dtype | str = np.float32,
    show_progress: bool = False,
) -> TokenVectors:
    """The token table of already tokenised passages (see ``PhraseEncoder.tokenize_passages``)."""
    device = device or next(model.parameters()).device
    lengths = np.array([len(p) for p in passages], dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    n = int(bounds[-1])
    start = np.zeros((n, model.dim), dtype=dtype)
    end = np.zeros((n, model.dim), dtype=dtype)
    logits = model.filter is not None
    start_logits = np.zeros(n, dtype=np.float32) if logits else None
    end_logits = np.zeros(n, dtype=np.float32) if logits else None
    offsets = np.concatenate([p.offsets for p in passages]) if n else np.zeros((0, 2), dtype=np.int64)
    jobs = [(p, w) for p, passage in enumerate(passages) for w in range(len(passage.windows)) if len(passage)]
    jobs.sort(key=lambda job: -len(passages[job[0]].windows[job[1]].input_ids))
    was_training = model.training
    model.eval()
    for lo in tqdm(range(0, len(jobs), batch_size), desc="encode phrases", disable=not show_progress):
        chunk = jobs[lo : lo + batch_size]
        batch = model.collate_windows([passages[p].windows[w] for p, w in chunk])
        s, e = model.phrase_vectors({k: v.to(device) for k, v in batch.items()})
        ls, le = model.filter(s, e) if logits else (None, None)
        for i, (p, w) in enumerate(chunk):
            passage, window = passages[p], passages[p].windows[w]
            rows = np.flatnonzero(passage.owner == w)
            positions = torch.as_tensor(window.first + rows - window.start, device=device)
            target = bounds[p] + rows
            start[target] = s[i, positions].float().cpu().numpy()
            end[target] = e[i, positions].float().cpu().numpy()
            if logits:
                start_logits[target] = ls[i, positions].float().cpu().numpy()
                end_logits[target] = le[i, positions].float().cpu().numpy()
    model.train(was_training)
    return TokenVectors(bounds, offsets, start, end, start_logits, end_logits)


def encode_corpus(
    model: PhraseEncoder,
    corpus: Corpus,
    batch_size: int = 32,
    device: torch.device | None = None,
    dtype: np.dtype | str = np.float32,
    show_progress: bool = False,
) -> TokenVectors:
    """The token table of every passage of ``corpus`` (an empty passage has no rows)."""
    passages = model.tokenize_passages(corpus.titles, corpus.texts)
    return encode_tokenized(model, passages, batch_size, device, dtype, show_progress)
