"""Dense miners (negative-contrast §4.2): dual encoders with a DIM-d projection ("coarse" 25-d, "fine"
512-d) trained on the training pairs with random batches and in-batch negatives only, for the
``dense:DIM`` mining strategy (``negatives.mine``).

A miner is saved under ``<work_dir>/miner-<DIM>d-<key>/`` where the key fingerprints everything that
determines it: the base model's weights, the architecture, the training settings and the training
pairs. Changing any of them trains a new miner instead of reusing a stale one.
"""

from __future__ import annotations

import dataclasses
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch

from densepass import distributed
from densepass.config import DEFAULT_MODEL, NegativesConfig, TrainConfig
from densepass.data.dataset import RetrievalDataset
from densepass.errors import ConfigError, DataError, DataWarning
from densepass.fingerprints import fingerprint_corpus, fingerprint_json, fingerprint_tokenizer, fingerprint_weights
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.negatives.mine import MiningContext, dense_dim, dense_specs
from densepass.negatives.pool_cache import qrels_in_order
from densepass.training.batches import TrainingData
from densepass.training.trainer import train


def train_miner(
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    projection_dim: int,
    train_config: TrainConfig,
    work_dir: str | Path,
    device: torch.device,
    base_model: str = DEFAULT_MODEL,
    architecture: BiEncoderConfig | None = None,
    split: str = "train",
) -> BiEncoder:
    """A dual encoder with a ``projection_dim`` projection trained on the (query, positive) pairs of
    ``query_ids``; reused from ``work_dir`` when one with the same content key was trained before (the starting
    weights and tokenizer, the settings, the pairs, the corpus and every split's judgements)."""
    arch = dataclasses.replace(architecture or BiEncoderConfig(), projection_dim=projection_dim)
    torch.manual_seed(train_config.seed)  # the new projection's initial weights
    model = BiEncoder.from_pretrained(base_model, config=arch)
    positives = dataset.positives(split)
    key = fingerprint_json(
        {
            "base_weights": fingerprint_weights(model),
            "architecture": dataclasses.asdict(arch),
            "train": dataclasses.asdict(train_config),
            "tokenizer": fingerprint_tokenizer(model.tokenizer),
            "split": split,
            "pairs": [[q, dataset.queries[q], positives.get(q, [])] for q in query_ids],
            # what training reads besides the pairs: the passages (positives' texts, random draws) and every
            # split's judgements (which passages are masked as relevant)
            "corpus": fingerprint_corpus(dataset.corpus),
            "qrels": qrels_in_order(dataset),
        }
    )[:16]
    run_dir = Path(work_dir) / f"miner-{projection_dim}d-{key}"
    saved = run_dir / "model"
    if (saved / "config.json").is_file():
        try:
            return BiEncoder.from_pretrained(str(saved))
        except DataError as err:  # damaged on disk: train it again
            warnings.warn(f"{err}; training the miner again", DataWarning, stacklevel=2)
            shutil.rmtree(run_dir)
    data = TrainingData(dataset, split, model.tokenizer.sep_token or " ", query_ids=query_ids)
    train(model, data, train_config, run_dir, device)
    if distributed.rank() == 0:  # under torchrun every process trained the same model; one saves it
        model.save(saved)
    distributed.barrier()
    return model


def prepare_miners(
    dataset: RetrievalDataset,
    query_ids: Sequence[str],
    config: NegativesConfig,
    ctx: MiningContext,
    strategy: str | None = None,
) -> None:
    """Train (or reuse) the miner of every ``dense[:DIM]`` strategy that mining ``strategy`` (default:
    ``config.source``) will run, into ``ctx.miners``: one epoch over the pairs, or ``config.miner_steps``."""
    specs = dense_specs(config, strategy)
    if specs and ctx.work_dir is None:
        raise ConfigError("dense mining trains a miner and needs a work directory (MiningContext.work_dir)")
    for spec in specs:
        dim = dense_dim(spec, config)
        if dim in ctx.miners:
            continue
        base = ctx.train_config or TrainConfig()
        miner_config = dataclasses.replace(
            base, epochs=1, max_steps=config.miner_steps, checkpoint_every=10**9, keep_checkpoints=1
        )
        ctx.miners[dim] = train_miner(
            dataset,
            query_ids,
            dim,
            miner_config,
            ctx.work_dir,
            ctx.device or torch.device("cpu"),
            ctx.base_model,
            ctx.architecture,
            ctx.split,
        )
