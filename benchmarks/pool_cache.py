"""Reading a kept pool back against mining it (``negatives.pool_cache``): the hard-negative pool a run's config mines
with fixed models, mined into the cache when the cache holds none (and kept), then read back, as a resumed run or a
study's next run with the same negatives does. Times are wall-clock, one process, on whatever threads it is given.

    OMP_NUM_THREADS=1 python3 benchmarks/pool_cache.py configs/recipe_teacher.yaml

The cache is the config's ``cache_dir`` (``--cache-dir`` to choose another; a fresh folder makes it mine first). The
mining time printed is the one recorded when the pool was kept (the run that mined it may have shared the CPU).
"""

from __future__ import annotations

import argparse
import time

from common import cpu_facts, output_file, write_json
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.device import default_device
from densepass.models.biencoder import BiEncoder
from densepass.negatives.mine import MiningContext, mine_negatives
from densepass.pipelines.training import training_queries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a run's YAML config (its data, negatives and cache_dir)")
    parser.add_argument("--cache-dir", default=None, help="the cache (default: the config's cache_dir)")
    parser.add_argument("--out", type=output_file, default=None, help="write the result as JSON here too")
    args = parser.parse_args()
    config = load_config(args.config, [])
    cache = args.cache_dir or config.cache_dir
    if not cache:
        parser.error(f"{args.config} sets no cache_dir: give --cache-dir")
    data = config.data
    dataset = load_dataset(data.name, data.data_dir, data.format)
    queries = training_queries(dataset, data.train_split, data.max_train_queries, data.seed)
    sep = BiEncoder.from_pretrained(config.model.name_or_path).tokenizer.sep_token or " "  # as the run mines

    def mine():
        context = MiningContext(
            data.train_split,
            default_device(),
            base_model=config.model.name_or_path,
            architecture=config.model.architecture(),
            train_config=config.train,
            seed=data.seed,
            show_progress=False,
            precision=config.eval.precision,
            cache_dir=cache,
        )
        started = time.perf_counter()
        result = mine_negatives(dataset, queries, config.negatives, context, sep)
        return result, time.perf_counter() - started

    first, _ = mine()
    read, read_s = mine()  # read back, timed alone (the first call may have waited for a run mining it)
    assert read.read_from is not None, "the second mining did not read the kept pool"
    result = {
        "config": args.config,
        "queries": len(queries),
        "negatives": sum(map(len, read.pool.values())),
        "mined_s": round(read.seconds, 1),
        "read_s": round(read_s, 2),
        "mined_now": first.read_from is None,
        "speedup": round(read.seconds / read_s, 1),
        "entry": str(read.read_from),
        "cpu": cpu_facts(),
    }
    print(f"{len(queries)} queries: mined in {read.seconds:.1f} s, read back in {read_s:.2f} s ({result['speedup']}x)")
    write_json(args.out, result)


if __name__ == "__main__":
    main()
