"""``densepass mine``: a hard-negatives file for a config's training queries.

The queries are the ones ``densepass run`` trains on for the same config (``RetrievalDataset.sample``);
dense miners are trained (or reused, keyed by content) beside the output in ``<output>.miners/``, which
is locked while mining runs. The file is written atomically.
"""

from __future__ import annotations

import sys
from pathlib import Path

from densepass.config import ExperimentConfig
from densepass.data import load_dataset
from densepass.device import resolve_device
from densepass.io import exclusive_lock
from densepass.negatives.mine import MiningContext, MiningResult, mine_negatives
from densepass.negatives.pool import save_pool
from densepass.training.miner import prepare_miners


def mine_training_negatives(config: ExperimentConfig, output: str | Path) -> MiningResult:
    """Mine ``config.negatives`` for the training queries of ``config.data`` and write them to ``output``."""
    output = Path(output)
    device = resolve_device(config.device)
    data = config.data
    dataset = load_dataset(data.name, data.data_dir, data.format)
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
    print(
        f"mining {config.negatives.source} negatives for {len(query_ids)} {data.train_split} queries of "
        f"{data.name} on {device.type}",
        file=sys.stderr,
    )
    with exclusive_lock(work_dir, "mining"):
        prepare_miners(dataset, query_ids, config.negatives, ctx)
        result = mine_negatives(dataset, query_ids, config.negatives, ctx)
        save_pool(result.pool, output)
    return result
