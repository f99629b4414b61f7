"""``densepass mine``: a hard-negatives file for a config's training queries.

The queries are the ones ``densepass run`` trains on for the same config (``RetrievalDataset.sample``);
dense miners are trained (or reused, keyed by content) beside the output in ``<output>.miners/``, which
is locked while mining runs. The file is written atomically.

Under torchrun (``torchrun --nproc_per_node N -m densepass mine ...``) every process loads the dataset and
mines together: dense strategies encode and search the corpus in shards (``index.sharded``), so the file
equals one process's; rank 0 holds the lock and writes the file. A BEIR corpus's titles and texts stay in
``corpus.jsonl`` (``data.beir.PassageFile``), read a block at a time to encode and a passage at a time by the
filters, so what a process holds grows with its shard's embeddings and the corpus's ids, not its text.
"""

from __future__ import annotations

import sys
from pathlib import Path

from densepass import distributed
from densepass.config import ExperimentConfig
from densepass.data import load_dataset
from densepass.device import resolve_device, resolve_precision
from densepass.negatives.mine import MiningContext, MiningResult, mine_negatives
from densepass.negatives.pool import save_pool
from densepass.training.miner import prepare_miners


def mine_training_negatives(config: ExperimentConfig, output: str | Path) -> MiningResult:
    """Mine ``config.negatives`` for the training queries of ``config.data`` and write them to ``output``."""
    output = Path(output)
    device = resolve_device(config.device)
    resolve_precision(config.eval.precision, device)  # int8 on a GPU fails before the dataset loads
    data = config.data
    dataset = load_dataset(data.name, data.data_dir, data.format, passages_on_disk=True)
    query_ids = sorted(dataset.sample(data.train_split, data.max_train_queries, data.seed))
    work_dir = output.with_name(output.name + ".miners")
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
    with distributed.rank_zero_lock(work_dir, "mining"):
        prepare_miners(dataset, query_ids, config.negatives, ctx)
        result = mine_negatives(dataset, query_ids, config.negatives, ctx)
        if main:
            save_pool(result.pool, output)
    return result
