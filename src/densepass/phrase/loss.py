"""The phrase training losses over token columns: training-inference-gap eq. 1 (original DensePhrases) and
eq. 2 (unified), each computed for start and end tokens separately and averaged (§4.1, footnote 4).

Columns are tokens: every text token of the batch's windows, of the pre-batch memory and of the hard
negative passages. For question i, a column's source is

- in-passage (``INP``): a token of i's own window;
- in-batch (``INB``): a token of another passage of the batch; pre-batch (``PRB``): a memory token;
  hard (``HARD``): a token of a hard-negative passage;

and it is masked when it comes from i's passage but not from i's window (the overlap of another window,
or an earlier batch's copy of the passage: it may hold i's gold token). Eq. 2 (``loss="unified"``) is one
softmax over every column, weighted by λ_inp, λ_inb (in- and pre-batch) and λ_hard (§4.2, all tokens of the
other passages). Eq. 1 (``loss="separate"``) is a softmax over the in-passage tokens plus λ times a softmax
over the other passages' *gold* tokens (the original |N_inb| = B - 1, |N_prb| = B x T). With every λ = 1 and
in-passage columns only, both are the reading-comprehension loss: a softmax over the passage's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from densepass.errors import ConfigError
from densepass.losses.unified import separate_terms_loss, unified_loss

INP, INB, PRB, HARD = 0, 1, 2, 3


@dataclass
class Columns:
    """Token columns: ``start`` / ``end`` vectors [P, dim], the passage row and the window id (unique in the
    step; -1 for memory and hard tokens) of each, whether it comes from the batch, the memory or a hard
    negative (``origin``: 0, 1, 2), and whether it is the gold start / end token of a question of its batch."""

    start: torch.Tensor
    end: torch.Tensor
    passage: torch.Tensor
    window: torch.Tensor
    origin: torch.Tensor
    gold_start: torch.Tensor
    gold_end: torch.Tensor

    @staticmethod
    def cat(parts: list[Columns]) -> Columns:
        """The columns of ``parts`` side by side."""
        return Columns(*(torch.cat([getattr(p, f) for p in parts]) for f in Columns.__dataclass_fields__))


def column_sources(
    columns: Columns, row_passage: torch.Tensor, row_window: torch.Tensor, in_batch: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sources [B, P], mask [B, P]) of every question-column pair (see the module docstring)."""
    own_passage = row_passage[:, None] == columns.passage[None, :]
    own_window = own_passage & (row_window[:, None] == columns.window[None, :]) & (columns.origin == 0)[None, :]
    origin = columns.origin[None, :].expand(len(row_passage), -1)
    sources = torch.where(origin == 1, PRB, torch.where(origin == 2, HARD, INB))
    sources = torch.where(own_window, INP, sources)
    mask = own_passage & ~own_window
    if not in_batch:
        mask = mask | (sources == INB)
    return sources, mask


def phrase_loss(
    q_start: torch.Tensor,
    q_end: torch.Tensor,
    columns: Columns,
    row_passage: torch.Tensor,
    row_window: torch.Tensor,
    positive_start: torch.Tensor,
    positive_end: torch.Tensor,
    loss: str = "unified",
    lambdas: tuple[float, float, float] = (1.0, 256.0, 1.0),
    separate_weight: float = 1.0,
    in_batch: bool = True,
) -> torch.Tensor:
    """Mean of the start and end losses (eq. 2 or eq. 1) of questions [B] against token columns [P];
    ``positive_start`` / ``positive_end`` [B] are the gold columns, ``lambdas`` = (λ_inp, λ_inb, λ_hard)."""
    sources, mask = column_sources(columns, row_passage, row_window, in_batch)
    total = q_start.new_zeros(())
    for query, vectors, positive, gold in (
        (q_start, columns.start, positive_start, columns.gold_start),
        (q_end, columns.end, positive_end, columns.gold_end),
    ):
        scores = query.float() @ vectors.float().T
        if loss == "unified":
            lam_inp, lam_inb, lam_hard = lambdas
            total = total + unified_loss(scores, positive, sources, [lam_inp, lam_inb, lam_inb, lam_hard], mask)
        elif loss == "separate":
            if bool((sources == HARD).any()):
                raise ConfigError("hard negatives need the unified loss (eq. 1 has no term for them)")
            other_non_gold = (sources != INP) & ~gold[None, :]  # eq. 1 contrasts with the other questions' gold tokens
            total = total + separate_terms_loss(
                scores, positive, sources, [[INP], [INB, PRB]], [1.0, separate_weight], mask | other_non_gold
            )
        else:
            raise ConfigError(f"unknown phrase loss {loss!r} (use unified or separate)")
    return total / 2
