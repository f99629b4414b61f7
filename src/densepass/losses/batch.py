"""What an objective reads of a training batch besides the representations (``losses.objectives``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class BatchTensors:
    """A batch's tensors, ready to copy: tokens of each side, positive columns, false-negative mask,
    passage content keys, the queries' relevant keys (host-side sets) and objective-specific extras."""

    queries: dict[str, torch.Tensor]
    passages: dict[str, torch.Tensor]
    positive_index: torch.Tensor
    mask: torch.Tensor
    passage_keys: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    relevant_keys: list[set[int]] = field(default_factory=list)
    extras: dict[str, torch.Tensor] = field(default_factory=dict)

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> BatchTensors:
        """The batch with ``fn`` applied to every tensor."""
        return BatchTensors(
            {k: fn(v) for k, v in self.queries.items()},
            {k: fn(v) for k, v in self.passages.items()},
            fn(self.positive_index),
            fn(self.mask),
            fn(self.passage_keys),
            self.relevant_keys,
            {k: fn(v) for k, v in self.extras.items()},
        )

    def to(self, device: torch.device) -> BatchTensors:
        """The tensors on ``device`` (non-blocking from pinned memory)."""
        return self.map(lambda t: t.to(device, non_blocking=t.is_pinned()))
