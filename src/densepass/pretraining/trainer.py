"""Pre-training (Condenser, coCondenser, Contriever) as a task of the training engine (``training.engine``:
AdamW with linear warm-up/decay, bf16 autocast, atomic checkpoints with exact resume, the loss log), with
gradient accumulation and the final head-less backbone.

Gradient accumulation splits each step's ``batch_size`` sequences into ``grad_accumulation``
micro-batches. MLM is per-token, so weighting each micro-batch's mean MLM by its share of the step's
masked tokens makes the accumulated gradient equal the whole batch's (condenser A.3: "Condenser is
based on instance-wise MLM loss and can naively use gradient accumulation"). The coCondenser contrastive
loss is not per-instance: plain accumulation would shrink its negative pool to one micro-batch. We keep
the whole batch as the pool with gradient caching instead (as the coCondenser authors do): (1) late CLS
vectors of every micro-batch without a graph, (2) the contrastive loss of the full batch and its gradient
with respect to those vectors, (3) each micro-batch again with a graph (dropout replayed), back-propagating
its MLM share plus the cached CLS gradient. The result equals the full-batch gradient up to float
rounding; it costs one extra backbone forward per micro-batch.

Data, masking and dropout depend only on (seed, step), so a run resumed from a checkpoint continues
exactly as the uninterrupted run would have.

Every mode runs under ``torchrun``; rank 0 locks the run directory and writes every file. Each process holds the
step's whole batch (rank 0's), masked the same way (the masking generator is seeded by (seed, step)), and trains on
its share of the sequences (``training.distributed.shares``): Contriever as ``pretraining.contriever`` says; the MLM
terms weigh each micro-batch by its share of the *global* batch's masked tokens, so the gradients the engine sums
over processes are the whole batch's; coCondenser's contrastive pool stays the whole batch through the gradient
cache above, the late CLS vectors of every process gathered before the loss (under torchrun the cache is used even
without accumulation: one more forward without a graph, and no collective that depends on a process's share).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from typing_extensions import override

from densepass import distributed
from densepass.checkpoints import BOOKKEEPING, DATA_FILES, Checkpoints, without_later_defaults
from densepass.config import save_config
from densepass.data import load_dataset
from densepass.data.dataset import RetrievalDataset
from densepass.device import RandomState, autocast_context, resolve_device, resolved_cpu_bf16, uses_bf16
from densepass.errors import ConfigError
from densepass.models.dropout import use_cpu_dropout
from densepass.models.inputs import check_position_limit
from densepass.pretraining.condenser import Condenser, span_contrastive_loss
from densepass.pretraining.config import PretrainConfig
from densepass.pretraining.contriever import Contriever, contriever_forward_backward
from densepass.pretraining.crops import CropSettings, contriever_batches
from densepass.pretraining.data import Batch, mlm_batches, span_batches, subset_corpus
from densepass.pretraining.masking import Masker
from densepass.training import engine
from densepass.training.distributed import gather_rows, shares, summed

LOG_NAME = engine.LOG_NAME
# What a pre-training run writes in its directory: all that --restart removes; anything else there is kept.
RUN_ENTRIES = ("config.yaml", LOG_NAME, "checkpoints", "backbone", "model", "report.md", "loss.png", "metrics.json")
WEIGHTS = "model.safetensors"  # the whole Condenser (backbone, head, MLM head) of a checkpoint


@dataclass
class PretrainResult:
    """What a pre-training run ends with."""

    steps: int
    final_loss: float
    tokens_per_second: float
    backbone_path: Path


def build_model(config: PretrainConfig) -> Condenser | Contriever:
    """The Condenser (or plain MLM model, or Contriever) of ``config``."""
    m, c = config.model, config.contriever
    if m.mode == "contriever":
        return Contriever.from_pretrained(
            m.name_or_path,
            m.save_pooling,
            c.normalize,
            m.temperature,
            config.train.max_length,
            c.negatives,
            c.queue_size,
            c.momentum,
        )
    return Condenser.from_pretrained(m.name_or_path, m.mode, m.early_layers, m.head_layers, m.temperature)


def crop_settings(config: PretrainConfig) -> CropSettings:
    """How Contriever's pairs are drawn."""
    c = config.contriever
    return CropSettings(
        c.crop_ratio_min, c.crop_ratio_max, c.document_tokens, c.token_deletion, c.ict_probability, c.ict_keep_sentence
    )


def batch_stream(config: PretrainConfig, tokenizer, dataset: RetrievalDataset | None = None) -> Iterator[Batch]:
    """The run's infinite, seeded stream of (unmasked) batches (``dataset``: ``config.data``'s, already read)."""
    d, t = config.data, config.train
    dataset = dataset or load_dataset(d.name, d.data_dir, d.format)
    corpus = subset_corpus(dataset.corpus, d.max_passages, d.seed)
    if config.model.mode == "cocondenser":
        return span_batches(corpus, tokenizer, t.batch_size, t.max_length, t.span_min_tokens, t.span_max_tokens, t.seed)
    if config.model.mode == "contriever":
        return contriever_batches(corpus, tokenizer, t.batch_size // 2, t.max_length, crop_settings(config), t.seed)
    return mlm_batches(corpus, tokenizer, t.batch_size, t.max_length, t.seed)


def _step_seed(seed: int, step: int) -> int:
    return seed * 1_000_003 + step


def _split(batch: Batch, parts: int) -> list[Batch]:
    size = -(-batch["input_ids"].shape[0] // parts)
    return [{k: v[i : i + size] for k, v in batch.items()} for i in range(0, batch["input_ids"].shape[0], size)]


def forward_backward(
    model: Condenser, batch: Batch, accumulation: int, device: torch.device, bf16: bool
) -> dict[str, float]:
    """Accumulate the gradient of one step's loss into ``.grad``; return the loss terms of the step (of the global
    batch under torch.distributed, this process training on its share of the sequences)."""
    parts = shares(batch["input_ids"].shape[0])
    mine = parts[distributed.rank()]
    local = {k: v[mine.start : mine.stop] for k, v in batch.items()}
    chunks = [{k: v.to(device) for k, v in c.items()} for c in _split(local, accumulation)] if len(mine) else []
    total_masked = max(int((batch["labels"] != -100).sum()), 1)  # the global batch's
    autocast = lambda: autocast_context(device, bf16)  # noqa: E731
    co_grads: list[torch.Tensor | None] = [None] * len(chunks)
    states: list[contextlib.AbstractContextManager] = [contextlib.nullcontext()] * len(chunks)
    terms = {"late_mlm": 0.0, "head_mlm": 0.0, "contrastive": 0.0}
    cached = model.mode == "cocondenser" and (accumulation > 1 or distributed.world_size() > 1)
    if cached:  # gradient caching of the contrastive loss over the whole batch
        reps, replays = [], []
        with torch.no_grad():
            for chunk in chunks:
                replays.append(RandomState(device))
                with autocast():
                    reps.append(model.encode(chunk["input_ids"], chunk["attention_mask"])[1][:, 0].float())
        hidden = model.backbone.config.hidden_size
        local_cls = torch.cat(reps) if reps else torch.zeros(0, hidden, device=device)
        cls = gather_rows(local_cls, [len(part) for part in parts]).requires_grad_()  # every process's, rank order
        co = span_contrastive_loss(cls, model.temperature)
        co.backward()
        co_grads = list(cls.grad[mine.start : mine.stop].split([len(r) for r in reps])) if reps else []
        states = [state.replay() for state in replays]
        terms["contrastive"] = co.item()
    for chunk, grad, state in zip(chunks, co_grads, states):
        weight = int((chunk["labels"] != -100).sum()) / total_masked
        with state, autocast():
            out = model(chunk["input_ids"], chunk["attention_mask"], chunk["labels"])
        loss = out.mlm * weight
        if grad is not None:
            loss = loss + torch.dot(out.cls.float().flatten(), grad.flatten())
        elif model.mode == "cocondenser":
            co = span_contrastive_loss(out.cls, model.temperature)
            loss = loss + co
            terms["contrastive"] = co.item()
        loss.backward()
        terms["late_mlm"] += out.late_mlm.item() * weight
        terms["head_mlm"] += out.head_mlm.item() * weight if out.head_mlm is not None else 0.0
    if distributed.world_size() > 1:  # each process's MLM terms weigh its share: their sum is the global batch's
        terms["late_mlm"], terms["head_mlm"] = summed([terms["late_mlm"], terms["head_mlm"]])
    terms["loss"] = terms["late_mlm"] + terms["head_mlm"] + terms["contrastive"]
    return terms


def pretraining_identity(config: PretrainConfig) -> dict:
    """The settings that change the pre-trained model (resuming across a change is refused)."""
    identity = dataclasses.asdict(config)
    for key in ("name", "output_dir", "device"):
        identity.pop(key)
    for key in BOOKKEEPING:
        identity["train"].pop(key, None)  # fine-tuning's bookkeeping may name settings pre-training lacks
    without_later_defaults(identity["train"])
    identity["train"]["max_grad_norm"] = config.train.max_grad_norm  # pre-training always had it in its identity
    identity["train"]["cpu_bf16"] = resolved_cpu_bf16(config.train.cpu_bf16)  # auto: what this CPU does
    if config.model.mode != "contriever":
        identity.pop("contriever")  # unused, and runs written before the section existed still resume
    return identity


def check(config: PretrainConfig) -> torch.device:
    """What can be checked before any work; returns the device."""
    t = config.train
    if t.batch_size % t.grad_accumulation:
        raise ConfigError(
            f"train.batch_size {t.batch_size} is not divisible by grad_accumulation {t.grad_accumulation}"
        )
    if t.span_min_tokens > t.span_max_tokens:
        raise ConfigError(f"train.span_min_tokens {t.span_min_tokens} > span_max_tokens {t.span_max_tokens}")
    if config.masking.mask_fraction + config.masking.random_fraction > 1:
        raise ConfigError("masking.mask_fraction + masking.random_fraction must be <= 1")
    if config.model.mode == "contriever":
        if t.batch_size < 4 or t.batch_size % 2:
            raise ConfigError(f"contriever needs an even batch size >= 4 (two views per document), got {t.batch_size}")
        if config.contriever.negatives == "in-batch" and t.grad_accumulation > 1:
            raise ConfigError("contriever.negatives=in-batch uses the whole batch as its pool: grad_accumulation 1")
        crop_settings(config)  # the crop ratios' order
    return resolve_device(config.device)


def pretrain(config: PretrainConfig, restart: bool = False) -> PretrainResult:
    """Run (or resume) the pre-training of ``config``; writes config, checkpoints, log, backbone, report.
    The run directory is locked while it runs; ``restart`` discards what an earlier run left there, but only once
    the model, the data and the checkpoints have passed their checks (a refused run removes nothing). Under
    torchrun every process trains and rank 0 locks the directory and writes."""
    device = check(config)
    with (
        distributed.process_group(),
        distributed.rank_zero_run_directory(config.run_dir, "pre-training", RUN_ENTRIES, restart) as claim,
    ):
        return _pretrain(config, device, claim, restart)


class PretrainTask(engine.Task):
    """Condenser / coCondenser (MLM on a masked copy of each batch, + the span contrastive loss) or Contriever
    (InfoNCE over two views, with a MoCo queue) on the run's seeded stream of batches: one epoch of
    ``max_steps`` steps. Masking and dropout are seeded by (seed, step). Every mode's step runs under
    torch.distributed, each process training on its share of every step's sequences (module docstring)."""

    throughput = "tokens_per_s"
    distributed = True

    def __init__(self, config: PretrainConfig, model: Condenser | Contriever, dataset: RetrievalDataset) -> None:
        self.config, self.model, self.dataset = config, model, dataset
        self.contriever = isinstance(model, Contriever)
        self.description = f"pretrain {config.model.mode}"
        self.steps_per_epoch, self.epochs = config.train.max_steps, 1
        self.masker = None
        if not self.contriever:
            m = config.masking
            self.masker = Masker.from_tokenizer(
                model.tokenizer,
                probability=m.probability,
                mask_fraction=m.mask_fraction,
                random_fraction=m.random_fraction,
                whole_word=m.whole_word,
            )

    @override
    def setup(self, device: torch.device) -> None:
        use_cpu_dropout(self.model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)

    @override
    def parameter_groups(self) -> list[dict]:
        trainable = self.model.trainable_parameters() if self.contriever else list(self.model.parameters())
        return [{"params": trainable}]

    @override
    def named_weights(self):
        return self.model.named_parameters()

    @override
    def plan(self, epoch: int) -> Iterator[Batch]:
        stream = batch_stream(self.config, self.model.tokenizer, self.dataset)
        return itertools.islice(stream, self.steps_per_epoch)

    @override
    def step(self, batch: Batch, context: engine.StepContext) -> engine.StepOutput:
        t = self.config.train
        seed = _step_seed(t.seed, context.step)
        torch.manual_seed(seed)  # dropout; masking has its own generator
        if self.contriever:
            # a skipped step still moves the MoCo queue and its key encoder (finite: the weights they follow are)
            terms = contriever_forward_backward(self.model, batch, t.grad_accumulation, context.device, context.bf16)
        else:
            generator = torch.Generator().manual_seed(seed)
            batch["input_ids"], batch["labels"] = self.masker(batch["input_ids"], batch["attention_mask"], generator)
            terms = forward_backward(self.model, batch, t.grad_accumulation, context.device, context.bf16)
        loss = torch.tensor(terms.pop("loss"))
        return engine.StepOutput(loss, size=int(batch["attention_mask"].sum()), terms=terms)

    @override
    def save(self, checkpoint: Path) -> None:
        save_model(self.model, str(checkpoint / WEIGHTS))

    @override
    def load(self, checkpoint: Path, device: torch.device) -> None:
        load_model(self.model, str(checkpoint / WEIGHTS))

    @override
    def state_dict(self) -> dict:
        return {"memory": self.model.memory_state()} if self.contriever else {}

    @override
    def load_state_dict(self, state: dict) -> None:
        if self.contriever:
            self.model.load_memory_state(state.get("memory"))


def _pretrain(config: PretrainConfig, device: torch.device, claim: Callable[[], Path], restart: bool) -> PretrainResult:
    t = config.train
    run_dir = config.run_dir
    torch.manual_seed(t.seed)  # new weights (heads, the MoCo queue)
    model = build_model(config)
    backbone = model.backbone_config if isinstance(model, Contriever) else model.backbone.config
    check_position_limit(backbone, {"train.max_length": t.max_length}, "the model")
    dataset = load_dataset(config.data.name, config.data.data_dir, config.data.format)
    data_files = {DATA_FILES: dataset.file_fingerprints()}  # a changed corpus file: its checkpoints are refused
    identity = {**pretraining_identity(config), **data_files}
    if not restart:
        Checkpoints(run_dir, t.keep_checkpoints, identity).latest()  # refuses another run's checkpoints
    task = PretrainTask(config, model, dataset)  # the masking's own checks
    next(iter(task.plan(0)), None)  # the batch stream's (spans that fit, enough documents), on a stream of its own
    claim()  # every check has passed: only now is the directory marked and --restart's removal done
    main = distributed.rank() == 0
    if main:
        save_config(config, run_dir / "config.yaml")
    result = engine.fit(task, t, run_dir, device, total=t.max_steps, identity=identity)
    backbone_dir = run_dir / "backbone"
    if main:  # every process holds the same weights
        model.save_backbone(backbone_dir, config.model.save_pooling, t.max_length)
        from densepass.pretraining.report import write_pretrain_report

        write_pretrain_report(config, result.log_path, device, uses_bf16(device, t.bf16, t.cpu_bf16))
    distributed.barrier()  # the backbone is on disk when pretrain returns, on every process
    return PretrainResult(result.steps, result.final_loss, result.per_second, backbone_dir)
