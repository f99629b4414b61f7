"""``densepass mine``: a hard-negatives file for a config's training queries.

The queries are the ones ``densepass run`` trains on for the same config (``RetrievalDataset.sample``);
dense miners are trained (or reused, keyed by content) beside the output in ``<output>.miners/``, which
is locked while mining runs. That folder is made only where a dense strategy trains a miner, used only where it
is a private directory of this user (not a link, nor another user's, nor writable by anyone: its name is
predictable), and removed at the end when it holds no miner. The file is written atomically.

Under torchrun (``torchrun --nproc_per_node N -m densepass mine ...``) every process loads the dataset and
mines together: dense strategies encode and search the corpus in shards (``index.sharded``), so the file
equals one process's; rank 0 holds the lock and writes the file. A BEIR corpus's titles and texts stay in
``corpus.jsonl`` (``data.beir.PassageFile``), read a block at a time to encode and a passage at a time by the
filters, so what a process holds grows with its shard's embeddings and the corpus's ids, not its text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

from densepass import distributed
from densepass.config import ExperimentConfig
from densepass.data import hub_options, load_dataset
from densepass.device import resolve_device, resolve_precision
from densepass.errors import ConfigError, DataError
from densepass.io import check_output_file, every_line
from densepass.negatives.filters import bi_encoder_teacher, check_denoising
from densepass.negatives.mine import (
    MiningContext,
    MiningResult,
    check_strategies,
    dense_specs,
    given_candidates,
    mine_negatives,
    mines_with_a_model,
    strategy_specs,
)
from densepass.negatives.pool import is_pool_line, save_pool
from densepass.pipelines.indexing import check_private_work_dir
from densepass.pipelines.retrievers import with_saved_architecture
from densepass.training.dense_miners import prepare_miners


def mine_training_negatives(config: ExperimentConfig, output: str | Path, precision: str | None = None) -> MiningResult:
    """Mine ``config.negatives`` for the training queries of ``config.data`` and write them to ``output``;
    ``precision`` (given: in place of ``config.eval.precision``) is how a model encodes, refused where none does (no
    strategy mines with one, no bi-encoder relative-margin teacher scores). ``output`` is checked before any work: a
    file path densepass may write (missing, empty, or a hard-negatives file it wrote: ``io.check_output_file``), in a
    place where a file can be made."""
    output = Path(output)
    check_strategies(config.negatives)
    if dense_specs(config.negatives):  # its miners start from the model as densepass run would (its saved settings)
        config = with_saved_architecture(config)
    if output.is_dir():
        raise ConfigError(f"--output {output} is a directory; give the path of the hard-negatives file to write")
    inputs = [
        s.partition(":")[2] or config.negatives.file for s in strategy_specs(config.negatives) if s.startswith("file")
    ]
    if any(path and Path(path).resolve() == output.resolve() for path in inputs):
        raise ConfigError(f"--output {output} is the pool this mining reads: write the new pool to another file")
    check_output_file(output, "hard-negatives file", every_line(is_pool_line))
    if precision is not None:
        negatives = config.negatives
        if strategy_specs(negatives) and not (mines_with_a_model(negatives) or bi_encoder_teacher(negatives)):
            raise ConfigError(
                f"--precision sets how a model encodes; the {negatives.source} strategy mines with no model"
            )
        config = dataclasses.replace(config, eval=dataclasses.replace(config.eval, precision=precision))
    check_denoising(config.negatives, config.model.name_or_path)  # before the dataset loads
    sep_token = run_sep_token(config)
    work_dir = output.with_name(output.name + ".miners") if dense_specs(config.negatives) else None
    if work_dir is not None:
        check_private_work_dir(work_dir, f"where the miners of {output} are kept")
    device = resolve_device(config.device)
    resolve_precision(config.eval.precision, device)  # int8 on a GPU fails before the dataset loads
    data = config.data
    dataset = load_dataset(
        data.name, data.data_dir, data.format, passages_on_disk=True, columns=asdict(data.columns), **hub_options(data)
    )
    query_ids = sorted(dataset.sample(data.train_split, data.max_train_queries, data.seed))
    if "given" in strategy_specs(config.negatives):
        given_candidates(dataset, query_ids)  # rows that give no negatives: one line before any work
    ctx = MiningContext(
        data.train_split,
        device,
        work_dir=work_dir,
        base_model=config.model.name_or_path,
        architecture=config.model.architecture(),
        train_config=config.train,
        seed=data.seed,
        precision=config.eval.precision,
    )
    main = distributed.rank() == 0
    ctx.show_progress = main
    if main:
        processes = f" in {distributed.world_size()} processes" if distributed.world_size() > 1 else ""
        print(
            f"mining {config.negatives.source} negatives for {len(query_ids)} {data.train_split} queries of "
            f"{data.name} on {device.type}{processes}",
            file=sys.stderr,
        )
    with _miners_dir(work_dir, output) if work_dir is not None else contextlib.nullcontext():
        prepare_miners(dataset, query_ids, config.negatives, ctx)
        result = mine_negatives(dataset, query_ids, config.negatives, ctx, sep_token)
        if not any(result.pool.values()):  # a file no run could read (load_pool refuses it): nothing written
            raise DataError(
                f"no negative is left for any of the {len(result.pool)} queries (skip_top, depth and filters "
                f"removed every candidate): nothing written to {output}"
            )
        if main:
            save_pool(result.pool, output)
    return result


def run_sep_token(config: ExperimentConfig) -> str:
    """What ``densepass run`` gives the filters between a passage's title and text, so that both mine one pool: its
    model's separator (``" "`` for a tokenizer with none). The model's tokenizer is read only where a filter reads
    the separator (the duplicates filter, a bi-encoder relative-margin teacher); the pool is the same whatever it is
    elsewhere."""
    negatives = config.negatives
    if "duplicates" not in negatives.filters and not bi_encoder_teacher(negatives):
        return "[SEP]"  # mine_negatives' default: read by no filter
    from transformers import AutoTokenizer

    from densepass.models.biencoder import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path(config.model.name_or_path)).sep_token or " "


@contextlib.contextmanager
def _miners_dir(work_dir: Path, output: Path) -> Iterator[None]:
    """``work_dir`` locked for mining (checked again once made: it must be this user's private directory), and
    removed at the end, however mining ends, where it holds nothing but the lock (no miner was trained there)."""
    with distributed.rank_zero_lock(work_dir, "mining"):
        try:
            if distributed.rank() == 0:
                check_private_work_dir(work_dir, f"where the miners of {output} are kept")
            yield
        finally:
            if distributed.rank() == 0 and _holds_no_miner(work_dir):
                shutil.rmtree(work_dir, ignore_errors=True)  # while locked: a waiting process starts afresh


def _holds_no_miner(work_dir: Path) -> bool:
    """Whether ``work_dir`` is a directory holding nothing but its ``.lock`` and empty folders (a miner whose
    training failed before it wrote anything); a link anywhere counts as something."""
    if work_dir.is_symlink() or not work_dir.is_dir():
        return False
    for root, folders, files in os.walk(work_dir):
        if any(os.path.islink(os.path.join(root, f)) for f in folders):
            return False
        if any(not (f == ".lock" and Path(root) == work_dir) for f in files):
            return False
    return True
