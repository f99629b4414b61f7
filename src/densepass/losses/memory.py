"""A memory of negatives from earlier steps: a FIFO of detached representations with their content keys.

Pre-batch negatives (training-inference-gap §4.1, N_prb) keep the passage representations of the previous
T batches; a MoCo queue (neural-retrieval-lecture, on Contriever: "store representations from last N previous
batches in a queue") keeps the newest K keys of a momentum encoder. Both are this FIFO, bounded by batches
(``max_batches``) or by entries (``max_entries``); entries carry the content key of their passage
(``data.keys.content_key``) so that ``memory_mask`` can keep false negatives out of the loss:
an entry is not a negative of query i when its key is relevant to i (or is i's positive), when the current
batch holds the same passage (its fresh copy already counts), or when a newer entry holds it.

>>> import torch
>>> memory = NegativeMemory(max_batches=2)
>>> for step in range(3):
...     memory.push(torch.full((2, 4), float(step)), torch.tensor([10 * step, 10 * step + 1]))
>>> memory.keys.tolist()  # the last two batches
[10, 11, 20, 21]
>>> memory_mask(memory.keys, batch_keys=torch.tensor([11]), relevant_keys=[{20}]).tolist()
[[False, True, True, False]]
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from densepass.errors import ConfigError


class NegativeMemory:
    """FIFO of representations [M, d] with keys [M]: the newest ``max_batches`` pushes, or the newest
    ``max_entries`` rows (exactly one bound is given)."""

    def __init__(self, max_batches: int | None = None, max_entries: int | None = None) -> None:
        if (max_batches is None) == (max_entries is None):
            raise ConfigError("a negative memory is bounded by batches or by entries (exactly one)")
        for name, bound in (("batches", max_batches), ("entries", max_entries)):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
                raise ConfigError(f"a negative memory needs a positive whole number of {name}, got {bound!r}")
        self.max_batches, self.max_entries = max_batches, max_entries
        self.reps: torch.Tensor | None = None  # [M, d], oldest first
        self.keys = torch.zeros(0, dtype=torch.long)
        self.sizes: list[int] = []  # rows of each push still held, oldest first

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def dim(self) -> int | None:
        """The entries' dimension (None while empty and never filled)."""
        return None if self.reps is None else self.reps.shape[1]

    def push(self, reps: torch.Tensor, keys: torch.Tensor) -> None:
        """Append one batch's rows (detached) and drop the oldest beyond the bound."""
        if reps.dim() != 2 or keys.shape != (reps.shape[0],):
            raise ConfigError(f"memory rows [n, d] and keys [n] do not fit: {list(reps.shape)}, {list(keys.shape)}")
        self.check_dim(reps.shape[1], "the pushed rows")
        reps, keys = reps.detach().float(), keys.to(reps.device, torch.long)
        self.reps = reps.clone() if self.reps is None else torch.cat([self.reps.to(reps.device), reps])
        self.keys = torch.cat([self.keys.to(reps.device), keys])
        self.sizes.append(len(keys))
        if self.max_batches is not None:
            self.sizes = self.sizes[-self.max_batches :]
            keep = sum(self.sizes)
        else:
            keep = min(len(self.keys), self.max_entries)
            excess = sum(self.sizes) - keep
            while excess > 0:  # trim the oldest pushes, the last one partially
                dropped = min(self.sizes[0], excess)
                self.sizes[0] -= dropped
                excess -= dropped
                if self.sizes[0] == 0:
                    self.sizes.pop(0)
        self.reps, self.keys = self.reps[len(self.keys) - keep :], self.keys[len(self.keys) - keep :]

    def check_dim(self, dim: int, what: str = "the model's embeddings") -> None:
        """A one-line ConfigError when ``dim`` is not the dimension of the entries held."""
        if self.dim is not None and dim != self.dim:
            raise ConfigError(
                f"the negative memory holds {self.dim}-d entries but {what} are {dim}-d: "
                "a memory (or a saved queue) cannot change dimension; start the run over"
            )

    def entries(self, device: torch.device, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(representations [M, dim], keys [M]) on ``device``; M = 0 while empty."""
        self.check_dim(dim)
        if self.reps is None:
            return torch.zeros(0, dim, device=device), torch.zeros(0, dtype=torch.long, device=device)
        return self.reps.to(device), self.keys.to(device)

    def state_dict(self) -> dict:
        """The entries, keys and push sizes (copies, for a checkpoint)."""
        return {
            "reps": None if self.reps is None else self.reps.clone(),
            "keys": self.keys.clone(),
            "sizes": list(self.sizes),
        }

    def load_state_dict(self, state: dict, what: str = "negative memory") -> None:
        """Restore ``state_dict()`` output; a state without entries is a one-line ConfigError."""
        if not isinstance(state, dict) or not {"reps", "keys", "sizes"} <= set(state):
            raise ConfigError(
                f"the checkpoint holds no saved {what} (it was written by a run without one); "
                "resume with the objective it was trained with, or start over (--restart)"
            )
        reps, keys = state["reps"], torch.as_tensor(state["keys"], dtype=torch.long)
        sizes = [int(s) for s in state["sizes"]]
        rows = 0 if reps is None else reps.shape[0]
        if sum(sizes) != len(keys) or rows != len(keys):
            raise ConfigError(f"the saved {what} is inconsistent ({rows} entries, {len(keys)} keys, pushes of {sizes})")
        if reps is not None:
            self.check_dim(reps.shape[1], f"the saved {what}'s entries")
        self.reps, self.keys, self.sizes = (None if reps is None else reps.float()), keys, sizes


def memory_mask(memory_keys: torch.Tensor, batch_keys: torch.Tensor, relevant_keys: Sequence[set[int]]) -> torch.Tensor:
    """Mask [B, M] of memory entries that must not be negatives of the batch's B queries.

    Entry j is masked for query i when its key is in ``relevant_keys[i]`` (which holds i's positive), for every
    query when ``batch_keys`` (the current batch's passages) holds its key or when a newer entry (higher j)
    holds it."""
    device = memory_keys.device
    n = len(memory_keys)
    mask = torch.zeros(len(relevant_keys), n, dtype=torch.bool, device=device)
    if n == 0:
        return mask
    columns = torch.isin(memory_keys, batch_keys.to(device))
    _, inverse = torch.unique(memory_keys, return_inverse=True)
    position = torch.arange(n, device=device)
    newest = torch.zeros(int(inverse.max()) + 1, dtype=torch.long, device=device)
    newest = newest.scatter_reduce(0, inverse, position, reduce="amax")  # the newest entry of each key
    older = newest[inverse] != position
    mask |= (columns | older).unsqueeze(0)
    for i, keys in enumerate(relevant_keys):
        if keys:
            mask[i] |= torch.isin(memory_keys, torch.tensor(sorted(keys), dtype=torch.long, device=device))
    return mask
