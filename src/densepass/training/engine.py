"""The training engine: one loop for every model kind.

A :class:`Task` says what one model kind trains on and how: its trainable parameters, each epoch's batches,
the forward and backward pass of one step (and the state a step leaves besides the weights, e.g. a pre-batch
memory or a MoCo queue), and how its model is written to and read from a checkpoint. :func:`fit` does the rest,
the same way for all of them:

- seeding, AdamW with a linear warm-up and decay (parameter groups from the task), gradient clipping;
- the divergence guard (``densepass.numerics``): a non-finite loss, gradient or weight stops the run in one line,
  or skips the batch with ``skip_nonfinite``;
- bf16 autocast where ``uses_bf16`` says so, handed to the task's step;
- atomic, verified checkpoints (``densepass.checkpoints``) holding the model, optimiser, schedule, random states,
  the task's and the callbacks' state, so that a run killed at any point resumes to the same weights, bit for
  bit, as one that never stopped; a checkpoint of other settings (the run's *identity*) is refused;
- a JSONL log of the mean of every logged term since the previous record, and a progress bar;
- L2-SP (``l2sp``, ``training.l2sp``): a penalty toward the starting weights, its gradient added after each
  backward pass, its value logged as ``l2sp``, its w₀ in every checkpoint;
- on the CPU, vocabulary tables' gradients added row by row into a buffer kept across steps
  (``training.embedding_grads``) instead of a zero-filled copy of the table per backward pass;
- gradient checkpointing (``gradient_checkpointing``) and LoRA adapters (``lora_rank``, ``training.adapters``) for
  any task whose model holds a Hugging Face transformer;
- torch.distributed: every process trains on rank 0's batch plan and gradients are summed across processes
  (every task's step gathers what it contrasts across processes, each process computing its share); rank 0 writes;
- FSDP (``fsdp``, ``training.sharding``) for tasks that declare ``shardable``: the weights, gradients and AdamW
  state sharded over the processes, checkpoints written by every process (its shards) with
  torch.distributed.checkpoint, and the whole model gathered on every process at the end.

Tasks: ``training.trainer`` (bi-encoders: dense, SPLADE, ColBERT), ``training.cross_encoder``, ``phrase.train``,
``phrase.query_tuning`` and ``pretraining.trainer`` (Condenser, coCondenser, Contriever).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup
from typing_extensions import override

from densepass import distributed
from densepass.checkpoints import Checkpoints, capture_rng, restore_rng, trim_log
from densepass.config import OptimConfig
from densepass.device import release_freed_memory, uses_bf16
from densepass.errors import ConfigError, DataError
from densepass.numerics import DivergenceGuard
from densepass.prefetch import prefetched
from densepass.training import sharding
from densepass.training.adapters import Adapters
from densepass.training.distributed import sum_gradients
from densepass.training.embedding_grads import SparseEmbeddingGradients
from densepass.training.l2sp import L2SP, anchored_parameters, check_l2sp

LOG_NAME = "train_log.jsonl"
RELEASE_EVERY = 8  # CPU steps between two releases of freed heap memory (what a release costs, and why every 8
# steps: docs/benchmarks.md, "Resident memory of CPU training")


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's global generators."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class StepContext:
    """Where a step stands: ``step`` steps were taken before it; its place in the epoch; how it computes."""

    step: int
    epoch: int
    index: int
    device: torch.device
    bf16: bool


@dataclass
class StepOutput:
    """What a task's step returns, its backward pass done: the loss, how many examples (or tokens: the task's
    ``throughput``) it trained on, more terms to log (each logged as its mean since the previous record), and
    what the task's ``after_step`` needs (representations for a memory, say)."""

    loss: torch.Tensor
    size: int = 0
    terms: dict[str, torch.Tensor | float] = field(default_factory=dict)
    outputs: Any = None


class Task:
    """One model kind's part of training (see the module docstring); subclasses override what they need.

    ``section``: where the task's settings live in its config, for messages; ``description``: the progress bar's
    label; ``throughput``: the log key of examples (or tokens) per second, None for no timing in the log (a log
    that must be byte-identical across a resume); ``prefetch``: ``prepare`` runs one batch ahead in a worker
    thread; ``distributed``: whether ``step`` is written for several processes (it gathers across them what it
    contrasts, and the engine sums the gradients); ``shardable``: whether it trains under FSDP (``network()``
    holds Hugging Face transformers, every process runs a forward of each of them in every step, and nothing
    reads the weights outside a forward)."""

    section = "train"
    description = "train"
    throughput: str | None = "examples_per_s"
    prefetch = False
    distributed = False
    shardable = False
    steps_per_epoch: int
    epochs: int

    def setup(self, device: torch.device) -> None:
        """Move the model to ``device`` and into training mode (after the engine seeded the generators)."""

    def network(self) -> torch.nn.Module:
        """The module holding every network the task trains (where gradient checkpointing is switched on)."""
        return self.model

    def parameter_groups(self) -> list[dict]:
        """AdamW's parameter groups: the trainable parameters (a group may set its own ``lr``)."""
        raise NotImplementedError

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights checked for non-finite values before a checkpoint or a validation."""
        raise NotImplementedError

    def plan(self, epoch: int) -> Iterable[Any]:
        """The batches of ``epoch`` (cheap descriptions, e.g. instance indices): at least ``steps_per_epoch``;
        those past it are drawn (so that a planner ends its epoch) and not trained on."""
        raise NotImplementedError

    def prepare(self, epoch: int, index: int, item: Any) -> Any:
        """The batch ``index`` of ``epoch`` ready for ``step`` (collated, tokenised); no shared mutable state."""
        return item

    def step(self, batch: Any, context: StepContext) -> StepOutput:
        """Forward and backward pass of one batch (gradients accumulated in the parameters)."""
        raise NotImplementedError

    def after_step(self, output: StepOutput, batch: Any) -> None:
        """Update the task's own state after a step that was taken (not after a skipped one)."""

    def save(self, checkpoint: Path) -> None:
        """Write the model into the checkpoint directory being written (as ``model/``, or a file of its own)."""
        raise NotImplementedError

    def load(self, checkpoint: Path, device: torch.device) -> None:
        """Load the weights ``save`` wrote into ``checkpoint``, in place, on ``device``."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        """The task's state besides the weights (tensors and JSON values), stored in every checkpoint."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output (the checkpoint's extras: other keys may be present)."""

    def finish(self) -> None:
        """After the last step."""


class Callback:
    """Something that happens during training besides the steps (validation, re-mining, a hook of the caller)."""

    def on_train_begin(self, engine: Engine) -> None:
        """After the run's checkpoint (if any) was accepted and restored, before the first step."""

    def on_step_end(self, engine: Engine) -> None:
        """After every step, on every process, before that step's checkpoint (so a resume never skips it)."""

    def on_epoch_end(self, engine: Engine, epoch: int) -> None:
        """After the last step of ``epoch``, on rank 0."""

    def state_dict(self) -> dict:
        """State stored in every checkpoint (its keys must not collide with the task's)."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()`` output from a checkpoint's extras."""


class Hooks(Callback):
    """The caller's plain functions: ``on_step_end(step)`` (every process) and ``on_epoch_end(epoch)`` (rank 0)."""

    def __init__(
        self, on_step_end: Callable[[int], None] | None = None, on_epoch_end: Callable[[int], None] | None = None
    ) -> None:
        self.step_end, self.epoch_end = on_step_end, on_epoch_end

    @override
    def on_step_end(self, engine: Engine) -> None:
        if self.step_end is not None:
            self.step_end(engine.step)

    @override
    def on_epoch_end(self, engine: Engine, epoch: int) -> None:
        if self.epoch_end is not None:
            self.epoch_end(epoch)


@dataclass
class FitResult:
    """What a run ends with: steps, the last taken step's loss, throughput (the task's unit), wall time.

    A run trained in pieces (resumed from its checkpoints) reports its whole: the loss of its last step, whichever
    piece took it (also on a resume that finds nothing left to train), and its units over the pieces' training time
    up to each one's last checkpoint; ``seconds`` is this piece's, ``earlier_seconds`` the pieces' before it."""

    steps: int
    final_loss: float
    per_second: float
    seconds: float
    log_path: Path
    earlier_seconds: float = 0.0


class Engine:
    """The state of one run while it trains (what callbacks see): ``step`` (steps taken), ``epoch``, ``total``,
    ``epoch_end`` (the step just taken ended its epoch), ``task``, ``run_dir``, ``guard``."""

    def __init__(self, task: Task, run_dir: Path, total: int, guard: DivergenceGuard, sharded: bool = False) -> None:
        self.task, self.run_dir, self.total, self.guard, self.sharded = task, run_dir, total, guard, sharded
        self.step, self.epoch, self.epoch_end = 0, 0, False

    def check_weights(self) -> None:
        """A one-line ``Diverged`` error when a weight is not finite (before using or saving the model); under FSDP
        every weight is gathered whole, so that every process reaches the same verdict."""
        named = self.task.named_weights()
        self.guard.check_weights(self.step, sharding.full_weights(named) if self.sharded else named)


def enable_gradient_checkpointing(network: torch.nn.Module) -> int:
    """Switch on activation recomputation in every Hugging Face transformer inside ``network`` (the random state
    of each recomputed layer is replayed, so dropout stays exact); returns how many; none is a one-line error."""
    from transformers import PreTrainedModel

    found = [m for m in network.modules() if isinstance(m, PreTrainedModel) and m.supports_gradient_checkpointing]
    if not found:
        raise ConfigError("gradient_checkpointing: the model holds no transformer that supports it")
    for model in found:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return len(found)


def check_fsdp_combinations(optim: OptimConfig, section: str) -> None:
    """What ``fsdp: true`` does not combine with yet (``section``: the setting named, e.g. ``train.fsdp``):
    LoRA, gradient checkpointing and packed steps (``packing: auto`` resolves to padded under FSDP)."""
    if optim.lora_rank or optim.gradient_checkpointing or getattr(optim, "packing", False) is True:
        raise ConfigError(f"{section} does not combine with lora_rank, gradient_checkpointing or packing yet")


def check_sharding(task: Task, optim: OptimConfig, world: int, callbacks: Sequence[Callback] = ()) -> None:
    """The one-line errors of ``fsdp: true`` that need no work: FSDP shards over the ``world`` processes of
    torchrun, for a task that declares ``shardable``, without what it does not combine with yet."""
    section = f"{task.section}.fsdp"
    if world < 2:
        raise ConfigError(
            f"{section} shards the model over torchrun's processes: run under torchrun --nproc_per_node N"
        )
    if not task.shardable:
        raise ConfigError(f"{section}: {task.description} does not train with FSDP yet")
    check_fsdp_combinations(optim, section)
    if callbacks:
        raise ConfigError(
            f"{section} does not combine yet with what uses the model during training (validation each epoch, "
            "re-mining, step hooks)"
        )


def planned_steps(steps_per_epoch: int, epochs: int, max_steps: int | None) -> int:
    """Training steps of a run: every epoch's batches, capped by ``max_steps``."""
    total = steps_per_epoch * epochs
    return total if max_steps is None else min(total, max_steps)


class _Interval:
    """The sums of the logged terms since the last log record, on the device (no synchronisation per step)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.sums, self.steps = device, {}, 0

    def add(self, terms: dict[str, torch.Tensor | float]) -> None:
        for key, value in terms.items():
            value = value.detach().float() if isinstance(value, torch.Tensor) else torch.tensor(float(value))
            self.sums[key] = self.sums.get(key, torch.zeros((), device=self.device)) + value.to(self.device)
        self.steps += 1

    def means(self) -> dict[str, float]:
        out = {key: value.item() / self.steps for key, value in self.sums.items()}
        self.sums, self.steps = {}, 0
        return out

    def state(self) -> dict:
        sums = {key: value.item() for key, value in self.sums.items()}
        return {"interval": [sums.pop("loss", 0.0), self.steps], "interval_terms": sums}

    def restore(self, extra: dict) -> None:
        loss, self.steps = extra.get("interval", [0.0, 0])
        sums = {"loss": loss, **extra.get("interval_terms", {})} if self.steps else {}
        self.sums = {key: torch.tensor(value, dtype=torch.float32, device=self.device) for key, value in sums.items()}


def fit(
    task: Task,
    optim: OptimConfig,
    run_dir: Path,
    device: torch.device,
    *,
    total: int,
    identity: dict,
    bf16: bool | None = None,
    callbacks: Sequence[Callback] = (),
    show_progress: bool = True,
) -> FitResult:
    """Train ``task`` for ``total`` steps with the settings of ``optim``; resumes from the newest intact checkpoint
    in ``run_dir`` whose identity is ``identity`` (a checkpoint of other settings is a one-line error).

    ``bf16``: whether steps autocast to bfloat16 (None: from ``optim``'s ``bf16`` / ``cpu_bf16`` where it has
    them, else float32)."""
    world = distributed.world_size()
    if world > 1 and not task.distributed:
        raise ConfigError(f"{task.description} does not run under torch.distributed yet: run it in one process")
    sharded = bool(getattr(optim, "fsdp", False))
    if sharded:
        check_sharding(task, optim, world, callbacks)
    check_l2sp(optim, task.section)
    seed_everything(optim.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    task.setup(device)
    if optim.gradient_checkpointing:
        enable_gradient_checkpointing(task.network())
    adapters = Adapters(task.network(), optim) if optim.lora_rank else None  # freezes what the adapters replace
    try:
        return _train(task, optim, run_dir, device, total, identity, bf16, callbacks, show_progress, adapters)
    except BaseException:
        if adapters is not None:  # the caller's model as it was: a rerun's adapters go into it, not on top of these
            adapters.remove()
        raise


def device_faults() -> tuple[type[BaseException], ...]:
    """The RuntimeErrors of a device or a process group (out of memory, a CUDA fault, a collective that failed):
    never blamed on a checkpoint being restored."""
    faults: list[type[BaseException]] = [torch.OutOfMemoryError]
    faults += [cls for cls in (getattr(torch, "AcceleratorError", None),) if cls is not None]
    faults += [cls for cls in (getattr(torch.distributed, "DistError", None),) if cls is not None]
    return tuple(faults)


def _train(
    task: Task,
    optim: OptimConfig,
    run_dir: Path,
    device: torch.device,
    total: int,
    identity: dict,
    bf16: bool | None,
    callbacks: Sequence[Callback],
    show_progress: bool,
    adapters: Adapters | None,
) -> FitResult:
    """``fit``'s steps, once the task is set up and its adapters are in."""
    world, rank = distributed.world_size(), distributed.rank()
    sharded = bool(getattr(optim, "fsdp", False))
    if sharded:  # before the parameter groups: their parameters are the shards from here on
        sharding.shard(task.network(), device)
    l2sp = None
    if getattr(optim, "l2sp", None):  # w₀: the weights as the task set them up (a checkpoint's replace them below)
        l2sp = L2SP(optim.l2sp, anchored_parameters(task.network(), optim.l2sp_scope))
    plain = adapters.plain if adapters is not None else contextlib.nullcontext  # the model as the task wrote it
    merged = adapters.merged if adapters is not None and callbacks else contextlib.nullcontext
    if bf16 is None:
        bf16 = hasattr(optim, "cpu_bf16") and uses_bf16(device, optim.bf16, optim.cpu_bf16)
    groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in task.parameter_groups()]
    groups = [g for g in groups if g["params"]]
    trainable = [p for group in groups for p in group["params"]]
    optimizer = torch.optim.AdamW(groups, lr=optim.learning_rate, weight_decay=optim.weight_decay, fused=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(optim.warmup_ratio * total), total)
    checkpoints = Checkpoints(run_dir, optim.keep_checkpoints, identity)
    guard = DivergenceGuard(optim.skip_nonfinite, task.section)
    engine = Engine(task, run_dir, total, guard, sharded)
    interval = _Interval(device)
    # the pieces' before this one (a resume): their last step's loss, units seen and training seconds
    earlier = {"loss": float("nan"), "units": 0, "seconds": 0.0}
    resumed = checkpoints.latest()
    if resumed is not None:
        if not 0 < resumed.step <= total:
            raise DataError(
                f"checkpoint {resumed.path} is of step {resumed.step}, outside this run's 1-{total}: remove it, or "
                "run with --restart"
            )
        try:  # a state that verifies but was edited by hand (under a manifest rewritten to match): one line
            if sharded:  # every process reads its shards of the weights and of the optimiser's state
                sharding.load(task.network(), optimizer, resumed.path, resumed.optimizer)
            else:
                with plain():
                    task.load(resumed.path, device)
                optimizer.load_state_dict(resumed.optimizer)
            if adapters is not None:
                adapters.load_state_dict(resumed.extra["lora"])
            scheduler.load_state_dict(resumed.scheduler)
            restore_rng(resumed.rng_of(rank, distributed.world_size()))
            task.load_state_dict(resumed.extra)
            for callback in callbacks:
                callback.load_state_dict(resumed.extra)
            guard.load_state_dict(resumed.extra.get("nonfinite"))
            if l2sp is not None:
                l2sp.load_state_dict(resumed.extra)
            interval.restore(resumed.extra)
            earlier = resumed.extra.get("totals", earlier)
            engine.step = resumed.step
        except (TypeError, ValueError, KeyError, IndexError, AttributeError, RuntimeError) as err:
            if isinstance(err, device_faults()):  # the device's or the process group's, not the checkpoint's
                raise
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            raise DataError(
                f"checkpoint {resumed.path} does not restore ({type(err).__name__}: {first}): it may be damaged; "
                "remove it, or run with --restart"
            ) from err
    log_path = run_dir / LOG_NAME
    distributed.on_rank_zero(lambda: trim_log(log_path, engine.step))  # its refusal reaches every process
    for callback in callbacks:
        callback.on_train_begin(engine)

    def save_checkpoint() -> None:
        engine.check_weights()  # every process: the same weights, the same verdict
        # each process's own random states (its dropout masks are its own): a resumed run draws what it would have
        rngs = distributed.all_gather_objects(capture_rng()) if distributed.world_size() > 1 else None
        if rank == 0 or sharded:
            extra: dict = {**interval.state(), "nonfinite": guard.state_dict(), **task.state_dict()}
            extra["totals"] = totals()
            if adapters is not None:
                extra["lora"] = adapters.state_dict()
            if l2sp is not None:
                extra.update(l2sp.state_dict())
            for callback in callbacks:
                extra.update(callback.state_dict())
        if sharded:  # every process writes its shards; rank 0 the rest

            def write_shards(directory: Path) -> dict:
                return sharding.save(task.network(), optimizer, directory)

            checkpoints.save(engine.step, lambda _: None, optimizer, scheduler, extra, write_shards, rngs)
        elif rank == 0:
            with plain():
                checkpoints.save(engine.step, task.save, optimizer, scheduler, extra, rngs=rngs)
        distributed.barrier()

    def totals() -> dict:
        """The run's so far, over its pieces: its last step's loss, units seen, training seconds."""
        last = loss.item()  # NaN until this piece takes a step (a skipped step's loss is never kept)
        return {
            "loss": earlier["loss"] if math.isnan(last) else last,
            "units": earlier["units"] + seen,
            "seconds": earlier["seconds"] + time.perf_counter() - started,
        }

    def epoch_batches(epoch: int) -> Iterator[tuple[int, int, Any]]:
        """(epoch, index, item) of the batches still to train on in ``epoch``."""
        done_in_epoch, remaining = engine.step - epoch * task.steps_per_epoch, total - engine.step
        for index, item in enumerate(task.plan(epoch)):
            if index >= task.steps_per_epoch:
                continue  # a partial batch past the epoch's steps, drawn so that the planner ends its epoch
            if remaining == 0:
                break  # max_steps ends training inside the epoch
            if index < done_in_epoch:
                continue  # trained on before a resume
            if world > 1:  # every process trains on rank 0's batch (plans may differ in the last bits)
                item = distributed.broadcast_object(item)
            remaining -= 1
            yield epoch, index, item

    def prepare(entry: tuple[int, int, Any]) -> tuple[int, int, Any]:
        epoch, index, item = entry
        return epoch, index, task.prepare(epoch, index, item)

    def prepared(epoch: int) -> Iterator[tuple[int, int, Any]]:
        batches = epoch_batches(epoch)
        return prefetched(batches, prepare) if task.prefetch else map(prepare, batches)

    progress = tqdm(
        total=total,
        initial=engine.step,
        desc=task.description,
        disable=rank != 0 or not show_progress,
        dynamic_ncols=True,
    )
    loss, seen, started = torch.tensor(float("nan")), 0, time.perf_counter()
    # on the CPU, vocabulary tables' gradients row by row instead of a zero-filled table per backward pass; switched
    # back in the ``finally`` below, whatever ends the steps
    tables = SparseEmbeddingGradients(task.network()) if device.type == "cpu" and not sharded else None
    try:
        for epoch in range(engine.step // task.steps_per_epoch, task.epochs):
            engine.epoch = epoch
            trained = False  # a step of this epoch taken here (max_steps may end training epochs early)
            for _, index, batch in prepared(epoch):
                trained = True
                context = StepContext(engine.step, epoch, index, device, bf16)
                out = task.step(batch, context)
                if l2sp is not None:  # its gradient once: the processes' gradients are summed next
                    out.terms = {**out.terms, "l2sp": l2sp.add_gradient(apply=rank == 0)}
                if world > 1:  # under FSDP its reduce-scatter summed the sharded ones in the backward pass
                    sum_gradients(sharding.whole_parameters(trainable) if sharded else trainable)
                clip = sharding.clip_grad_norm if sharded else None
                step_lr = scheduler.get_last_lr()[0]  # the rate this step's update uses (the scheduler steps after)
                taken, norm = guard.step(
                    engine.step + 1, out.loss, trainable, optimizer, scheduler, optim.max_grad_norm, clip
                )
                if taken:  # a skipped batch's outputs may hold NaN: kept out of the task's state and the log
                    loss = out.loss
                    task.after_step(out, batch)
                    interval.add({"loss": out.loss, **out.terms, "grad_norm": norm})
                engine.step += 1
                engine.epoch_end = index == task.steps_per_epoch - 1 or engine.step == total
                seen += out.size
                progress.update(1)
                if device.type == "cpu" and engine.step % RELEASE_EVERY == 0:
                    release_freed_memory()  # glibc keeps what varying shapes fragment (device.release_freed_memory)
                if (engine.step % optim.log_every == 0 or engine.step == total) and interval.steps:
                    record = {"step": engine.step, "epoch": epoch, **interval.means()}
                    record["lr"] = step_lr  # the logged step's (it was the next step's)
                    if task.throughput:
                        record[task.throughput] = seen / (time.perf_counter() - started)
                    if guard.skipped:
                        record["skipped"] = guard.skipped
                    progress.set_postfix(loss=f"{record['loss']:.4f}")
                    if rank == 0:
                        with open(log_path, "a") as handle:
                            handle.write(json.dumps(record) + "\n")
                with merged():  # callbacks see the trained model: adapters folded in
                    for callback in callbacks:
                        callback.on_step_end(engine)
                if engine.step % optim.checkpoint_every == 0 or engine.step == total:
                    save_checkpoint()
            # an epoch's end once, after its last step (or the run's last, under max_steps): not again for the
            # epochs max_steps left untrained, nor on a resume of a finished run
            if rank == 0 and trained and engine.step == min(total, (epoch + 1) * task.steps_per_epoch):
                with merged():
                    for callback in callbacks:
                        callback.on_epoch_end(engine, epoch)
    except BaseException:
        progress.leave = False  # the error is the last line, not a progress bar
        progress.close()
        raise
    finally:
        if tables is not None:
            tables.remove()
    progress.close()
    if sharded:
        sharding.unshard(task.network())  # the whole trained model on every process, a plain module again
    if adapters is not None:
        adapters.merge()  # the trained model is a plain one of its architecture
    task.finish()
    guard.finish(engine.step)
    elapsed, whole = time.perf_counter() - started, totals()
    per_second = whole["units"] / whole["seconds"] if whole["seconds"] > 0 else 0.0
    return FitResult(engine.step, whole["loss"], per_second, elapsed, log_path, earlier["seconds"])
