"""Pre-batch negatives for phrases (DensePhrases; training-inference-gap §4.1-4.2): the token columns of the
last T batches, detached, used as extra negatives (N_prb, |N_prb| = B x T x L with all tokens).

The memory is part of the trainer's checkpoint (``state_dict`` / ``load_state_dict``: plain tensors), so a
resumed run sees the same negatives as one that never stopped.

>>> import torch
>>> memory = PrebatchMemory(batches=1)
>>> cols = Columns(torch.ones(2, 4), torch.ones(2, 4), torch.tensor([7, 7]), torch.tensor([0, 0]),
...                torch.zeros(2, dtype=torch.long), torch.tensor([True, False]), torch.tensor([False, True]))
>>> memory.push(cols); memory.push(cols)
>>> memory.columns().origin.tolist(), memory.columns().window.tolist()   # one batch kept, marked as memory
([1, 1], [-1, -1])
"""

from __future__ import annotations

from collections import deque

import torch

from densepass.phrase.loss import Columns

FIELDS = tuple(Columns.__dataclass_fields__)


class PrebatchMemory:
    """The token columns of the last ``batches`` steps (nothing when ``batches`` is 0)."""

    def __init__(self, batches: int) -> None:
        self.batches = batches
        self.entries: deque[Columns] = deque(maxlen=max(1, batches))

    def __len__(self) -> int:
        return sum(len(entry.passage) for entry in self.entries) if self.batches else 0

    def push(self, columns: Columns) -> None:
        """Remember a step's batch columns (detached, on the CPU-independent device they came from)."""
        if not self.batches:
            return
        kept = columns.origin == 0
        self.entries.append(
            Columns(
                columns.start[kept].detach().clone(),
                columns.end[kept].detach().clone(),
                columns.passage[kept].clone(),
                torch.full_like(columns.window[kept], -1),
                torch.ones_like(columns.origin[kept]),
                columns.gold_start[kept].clone(),
                columns.gold_end[kept].clone(),
            )
        )

    def columns(self, device: torch.device | None = None) -> Columns | None:
        """The remembered columns, oldest first (None when empty)."""
        if not self.batches or not self.entries:
            return None
        merged = Columns.cat(list(self.entries))
        return Columns(*(getattr(merged, f).to(device) if device else getattr(merged, f) for f in FIELDS))

    def state_dict(self) -> dict:
        """The memory as plain tensors."""
        return {"batches": self.batches, "entries": [{f: getattr(e, f).cpu() for f in FIELDS} for e in self.entries]}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output."""
        self.entries.clear()
        for entry in state["entries"]:
            self.entries.append(Columns(*(entry[f] for f in FIELDS)))
