"""Numeric health: training stops at the first non-finite loss or gradient norm (or, on request, skips such
batches), and weights or embeddings holding NaN or infinity are refused when saved and when loaded.

Every training loop (bi-encoder, cross-encoder, phrase, query-side, pre-training) ends its step with
``DivergenceGuard.step``: clip the gradients (``clip_grad_norm_`` returns the norm it clips by, so checking it
costs nothing more), look at the loss and that norm (one read of two numbers per step; under torchrun a
flag reduced over the processes, so that they all stop, or all skip, together), then take the optimiser
step. A non-finite loss or norm is a one-line :class:`Diverged` error naming the step, unless the loop's
``skip_nonfinite`` is on: then the batch is skipped (no optimiser step, its gradients dropped, the learning
rate schedule moves on as for any batch, a warning per batch), and more than ``MAX_SKIPPED_IN_A_ROW`` skipped
in a row stop training anyway. The guard's counts are checkpointed, so a resumed run skips the same batches.
Before every checkpoint ``check_weights`` looks at the weights themselves (an optimiser step with a finite
gradient can still overflow them), so nothing non-finite is ever written.

>>> import torch
>>> first_nonfinite([("a", torch.zeros(2)), ("b", torch.tensor([1.0, float("nan")]))])
('b', 'nan')
>>> nonfinite_row(torch.tensor([[0.0, 1.0], [float("inf"), 0.0]]).numpy())
1
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.distributed as dist

from densepass import distributed
from densepass.errors import DataError, DensepassError

MAX_SKIPPED_IN_A_ROW = 10  # with skip_nonfinite: more non-finite batches in a row than this stop training
BLOCK_BYTES = 1 << 25  # arrays (memory maps too) are checked 32 MiB at a time


class Diverged(DensepassError):
    """Training met a non-finite loss, gradient norm or weight."""


class SkippedBatchWarning(UserWarning):
    """A batch whose loss or gradient was not finite was skipped (``skip_nonfinite``)."""


def first_nonfinite(named: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, str] | None:
    """(name, "nan" or "inf") of the first floating-point tensor holding NaN or infinity; None when all are finite."""
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name, "nan" if bool(torch.isnan(tensor).any()) else "inf"
    return None


def nonfinite_row(array: np.ndarray) -> int | None:
    """The first row of ``array`` (a memory map is read block by block) that holds NaN or infinity; None: none."""
    if not np.issubdtype(array.dtype, np.floating) or array.size == 0:
        return None
    row_bytes = max(1, array[:1].nbytes)
    block = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, len(array), block):
        finite = np.isfinite(np.asarray(array[start : start + block]))
        if not finite.all():
            return start + int(np.argmin(finite.reshape(len(finite), -1).all(axis=1)))
    return None


def refuse_nonfinite_weights(module: torch.nn.Module, where: str, saving: bool) -> None:
    """A one-line DataError when a weight of ``module`` holds NaN or infinity (``where``: the model's path)."""
    found = first_nonfinite(module.named_parameters())
    if found is None:
        return
    name, kind = found
    if saving:
        raise DataError(
            f"refusing to save the model to {where}: its weights hold {kind} (in {name}), as a diverged training "
            "leaves them"
        )
    raise DataError(
        f"{where} is not a usable model: its weights hold {kind} (in {name}), as a diverged training leaves them; "
        "train it again with a lower learning rate"
    )


def refuse_nonfinite_rows(array: np.ndarray, ids, where: str, saving: bool) -> None:
    """A one-line DataError when a row of ``array`` (an index's passage embeddings, ``ids`` their passage ids)
    holds NaN or infinity."""
    row = nonfinite_row(array)
    if row is None:
        return
    kind = "nan" if np.isnan(np.asarray(array[row])).any() else "inf"
    passage = f"passage {ids[row]!r} (row {row})" if ids is not None and row < len(ids) else f"row {row}"
    if saving:
        raise DataError(
            f"refusing to save the index to {where}: the embedding of {passage} holds {kind} (a model with "
            "non-finite weights, or an overflow in its precision, encoded it)"
        )
    raise DataError(f"{where} is not a usable index: the embedding of {passage} holds {kind}; build it again")


def _value(x: torch.Tensor | float) -> float:
    return float(x.detach()) if isinstance(x, torch.Tensor) else float(x)


class DivergenceGuard:
    """The end of every training step: clip, check, then step or skip (see the module docstring).

    ``skip``: the loop's ``skip_nonfinite``; ``section``: where its settings live in the config, for messages
    (``train``, ``reranker.train``, ``query_tuning``)."""

    def __init__(self, skip: bool, section: str = "train", limit: int = MAX_SKIPPED_IN_A_ROW) -> None:
        self.skip, self.section, self.limit = skip, section, limit
        self.skipped = 0  # batches skipped so far in the run
        self.in_a_row = 0  # of them, the latest ones in a row

    def state_dict(self) -> dict:
        """The counts to checkpoint."""
        return {"skipped": self.skipped, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore ``state_dict()`` output (None: a checkpoint written before the guard existed)."""
        state = state or {}
        self.skipped, self.in_a_row = int(state.get("skipped", 0)), int(state.get("in_a_row", 0))

    def step(
        self,
        step: int,
        loss: torch.Tensor | float,
        parameters: Iterable[torch.Tensor],
        optimizer: torch.optim.Optimizer,
        scheduler,
        max_norm: float = 1.0,
        clip: Callable[[list[torch.Tensor], float], torch.Tensor] | None = None,
    ) -> tuple[bool, torch.Tensor]:
        """Clip the gradients of ``parameters`` to ``max_norm``; take the optimiser step unless the loss or the
        gradient norm is not finite (then skip it, or raise :class:`Diverged`); step the schedule; drop the
        gradients. ``step``: the number of the step being taken (1 for the first). Returns (taken, norm).
        ``clip``: what clips and returns the norm (default ``torch.nn.utils.clip_grad_norm_``; FSDP's sharded
        gradients: ``training.sharding.clip_grad_norm``)."""
        norm = (clip or torch.nn.utils.clip_grad_norm_)(list(parameters), max_norm)
        taken = self.check(step, loss, norm)
        if taken:
            optimizer.step()
            scheduler.step()
        else:  # the schedule follows the steps, skipped or not (torch warns when a first step is skipped)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
                scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        return taken, norm

    def check(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> bool:
        """True when the step may be taken; False when its batch is skipped; :class:`Diverged` otherwise."""
        bad = _nonfinite_flags(loss, grad_norm)
        if not any(bad):
            self.in_a_row = 0
            return True
        what = _describe(bad, loss, grad_norm)
        lower = f"lower {self.section}.learning_rate"
        if not self.skip:
            raise Diverged(
                f"training diverged at step {step}: {what}; {lower}, or set {self.section}.skip_nonfinite: true "
                "to skip such batches"
            )
        self.skipped += 1
        self.in_a_row += 1
        if self.in_a_row > self.limit:
            raise Diverged(
                f"training diverged at step {step}: {what}, {self.in_a_row} batches in a row "
                f"({self.section}.skip_nonfinite skips at most {self.limit} in a row); {lower}"
            )
        warnings.warn(
            f"step {step}: {what}; batch skipped ({self.section}.skip_nonfinite; {self.skipped} so far)",
            SkippedBatchWarning,
            stacklevel=2,
        )
        return False

    def finish(self, steps: int) -> None:
        """At the end of a run of ``steps`` steps: a :class:`Diverged` error when every one of them was skipped (no
        batch trained: the model is the one it started from, which would otherwise be saved and reported as
        trained)."""
        if steps > 0 and self.skipped >= steps:
            raise Diverged(
                f"training diverged: every one of its {steps} steps had a non-finite loss or gradient and was "
                f"skipped ({self.section}.skip_nonfinite); nothing was trained; lower {self.section}.learning_rate"
            )

    def check_weights(self, step: int, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        """A :class:`Diverged` error when a weight is not finite after step ``step`` (before a checkpoint)."""
        found = first_nonfinite(named)
        if found is not None:
            raise Diverged(
                f"training diverged at step {step}: its optimiser step left {found[1]} in the weights "
                f"(in {found[0]}); lower {self.section}.learning_rate"
            )


def _nonfinite_flags(loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> list[bool]:
    """[loss not finite, gradient norm not finite], on any process (one read; one all-reduce under torchrun)."""
    device = grad_norm.device if isinstance(grad_norm, torch.Tensor) else torch.device("cpu")
    values = torch.stack(
        [torch.as_tensor(x, dtype=torch.float32, device=device).detach().reshape(()).float() for x in (loss, grad_norm)]
    )
    flags = (~torch.isfinite(values)).to(torch.int32)
    if distributed.world_size() > 1:
        shared = flags.to(distributed.collective_device())
        dist.all_reduce(shared, op=dist.ReduceOp.MAX)
        flags = shared
    return [bool(f) for f in flags.tolist()]


def _describe(bad: list[bool], loss: torch.Tensor | float, grad_norm: torch.Tensor | float) -> str:
    """'the loss is nan', 'the gradient norm is inf', ... (a value another process saw: 'not finite')."""
    parts = []
    for flag, name, x in ((bad[0], "the loss", loss), (bad[1], "the gradient norm", grad_norm)):
        if flag:
            value = _value(x)
            parts.append(
                f"{name} is {value}" if not math.isfinite(value) else f"{name} is not finite on another process"
            )
    return " and ".join(parts)
