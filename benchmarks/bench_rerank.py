r"""Cross-encoder speed: densepass against sentence-transformers at equal settings, in one run, as ratios.

1. **Training** examples (pairs) per second: densepass ``train_cross_encoder`` against sentence-transformers'
   ``CrossEncoderTrainer``, the same listwise loss (softmax cross-entropy over 1 positive + n BM25 hard
   negatives: ``MultipleNegativesRankingLoss`` with no in-batch negatives, scale 1, no activation = LCE),
   or ``--loss pointwise`` (``BinaryCrossEntropyLoss`` on the same pairs); same model (all-MiniLM-L6-v2 +
   a new one-logit head), queries per step, negatives, max_length, AdamW lr 2e-5 with linear warm-up,
   gradient clipping at 1.0, float32 weights under bf16 autocast on GPU (and on CPU with --cpu-bf16).
   Only optimisation steps are timed: after ``--warmup`` untimed steps, ``--steps`` more (device
   synchronised at both ends); loading, data preparation and the final checkpoint are not timed.
2. **Reranking** pairs per second: ``CrossEncoder.score_pairs`` against ``sentence_transformers.CrossEncoder.
   predict`` on the same (dev query, BM25 top-``--depth`` passage) pairs, same batch size and max_length, best
   of ``--repeats`` taken in turns, after one untimed pass of each; by default in the same precision (both
   under the same bf16 autocast where it applies). A third row times densepass with its last layer on every
   position (``models.cross_encoder.first_position_logits`` switched off), to show what that shortcut is worth;
   in bf16 on the CPU, where densepass scores with a fused bf16 copy, another times it under bf16 autocast of
   the float32 model instead (unfused), and sentence-transformers also runs with its model cast to bfloat16:
   the ratio is taken against the faster of its two bf16 settings.
   ``--precision int8`` (or fp32, bf16) times densepass in that precision against sentence-transformers in
   its own and, on a device with fast bf16, in its bf16 settings too (the ratio is against its fastest), and
   reports how far densepass' scores moved from its scores in sentence-transformers' precision
   on the same pairs (``evaluation.agreement``): mean and largest absolute difference, Spearman over all pairs
   and per query, and the share of queries whose top-10 order (and top 1) is unchanged. ``--no-train`` skips
   part 1; ``--rerank-model`` reranks with a trained cross-encoder instead of a new head (same speed, a
   meaningful agreement: a new head's scores are near zero, so int8's error looks larger against them).

    python benchmarks/bench_rerank.py --steps 2 --warmup 1 --batch-size 2 --negatives 3 --max-length 64 \
        --rerank-queries 4 --depth 8 --repeats 1 --out outputs/bench/rerank-smoke.json               # a smoke run
    python benchmarks/bench_rerank.py --out outputs/bench/rerank-cpu.json                          # CPU
    python benchmarks/bench_rerank.py --no-train --precision int8 --out outputs/bench/rerank-cpu-int8.json  # int8
    python benchmarks/bench_rerank.py --batch-size 64 --rerank-queries 500 --out outputs/bench/rerank-gpu.json  # GPU
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import StepClock, environment, markdown_table, output_file, pick_device, rate, timer, write_json
from densepass.config import RerankerTrainConfig
from densepass.data import load_dataset
from densepass.device import autocast_context, fast_bf16, resolve_precision, uses_bf16
from densepass.evaluation.agreement import score_agreement
from densepass.index.bm25 import BM25Index
from densepass.models.biencoder import resolve_model_path
from densepass.models.cross_encoder import PASSAGE_SEP, CrossEncoder
from densepass.negatives.bm25 import mine_bm25_negatives
from densepass.negatives.pool import passage_ids
from densepass.training.batches import TrainingData
from densepass.training.cross_encoder import group_pairs, train_cross_encoder


def train_densepass(path: str, data: TrainingData, args, device: torch.device, bf16: bool) -> float:
    model = CrossEncoder.new(path, seed=13, max_length=args.max_length, device=device)
    config = RerankerTrainConfig(
        loss=args.loss,
        negatives_per_query=args.negatives,
        max_steps=args.warmup + args.steps + 1,  # the last step (it writes the final checkpoint) is not timed
        batch_size=args.batch_size,
        learning_rate=2e-5,
        warmup_ratio=0.1,
        checkpoint_every=10**9,
        log_every=10**9,
    )
    clock = StepClock(device, args.warmup, args.warmup + args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        train_cross_encoder(model, data, config, Path(tmp), device, bf16, on_step_end=clock)
    return clock.seconds


def lce_loss(model):
    """sentence-transformers' ``MultipleNegativesRankingLoss`` without in-batch negatives (its num_negatives=0
    is refused): the softmax over each query's positive and hard negatives, scale 1, raw logits = LCE."""
    from sentence_transformers.cross_encoder.losses import MultipleNegativesRankingLoss

    class HardNegativesOnly(MultipleNegativesRankingLoss):
        def get_in_batch_negatives(self, anchors, candidates):
            return iter(())

    return HardNegativesOnly(model, num_negatives=None, scale=1.0, activation_fn=None)


def train_sentence_transformers(path: str, groups: dict, args, device: torch.device, bf16: bool) -> float:
    from datasets import Dataset
    from sentence_transformers.cross_encoder import CrossEncoder as STCrossEncoder
    from sentence_transformers.cross_encoder import CrossEncoderTrainer, CrossEncoderTrainingArguments
    from sentence_transformers.cross_encoder.losses import BinaryCrossEntropyLoss
    from transformers import TrainerCallback

    torch.manual_seed(13)
    model = STCrossEncoder(path, num_labels=1, max_length=args.max_length, device=str(device))
    clock = StepClock(device, args.warmup, args.warmup + args.steps)

    class Timing(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            clock(state.global_step)

    total = args.warmup + args.steps + 1
    if args.loss == "listwise":
        dataset, batch = Dataset.from_dict(groups), args.batch_size
        loss = lce_loss(model)
    else:  # the same pairs, one row each: a step is batch_size queries x (1 + n) pairs
        n = args.negatives
        rows = {"query": [], "passage": [], "label": []}
        for i, query in enumerate(groups["query"]):
            for j, column in enumerate(["positive", *(f"negative_{k}" for k in range(1, n + 1))]):
                rows["query"].append(query)
                rows["passage"].append(groups[column][i])
                rows["label"].append(1.0 if j == 0 else 0.0)
        dataset, batch = Dataset.from_dict(rows), args.batch_size * (n + 1)
        loss = BinaryCrossEntropyLoss(model)
    with tempfile.TemporaryDirectory() as tmp:
        training_args = CrossEncoderTrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=batch,
            max_steps=total,
            learning_rate=2e-5,
            warmup_steps=int(0.1 * total),
            max_grad_norm=1.0,
            bf16=bf16,
            use_cpu=device.type == "cpu",
            save_strategy="no",
            report_to="none",
            logging_steps=10**9,
            dataloader_drop_last=True,
            seed=13,
            disable_tqdm=True,
        )
        CrossEncoderTrainer(
            model=model, args=training_args, train_dataset=dataset, loss=loss, callbacks=[Timing()]
        ).train()
    return clock.seconds


def best_of_interleaved(repeats: int, device: torch.device, fns: dict) -> dict[str, float]:
    """For each named ``fn``, the fastest of ``repeats`` timed calls (device synchronised), the systems taking
    turns within each repeat so that none gets only the machine's earlier or later state."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            with timer(device) as took:
                fn()
            times[name].append(took())
    return {name: min(seconds) for name, seconds in times.items()}


def main_rows(results: dict) -> dict[str, str]:
    """task -> the name of densepass' main row for it (its first row of that task)."""
    rows: dict[str, str] = {}
    for name, r in results.items():
        if name.startswith("densepass"):
            rows.setdefault(r["task"], name)
    return rows


def full_last_layer(ours: CrossEncoder, queries: list[str], passages: list[str]) -> np.ndarray:
    """densepass' scores with the last layer run on every position (without ``first_position_logits``): the
    row that shows what that shortcut is worth."""
    from unittest import mock

    with mock.patch("densepass.models.cross_encoder.reads_first_position", return_value=False):
        return ours.score_pairs(queries, passages)


def unfused(ours: CrossEncoder, queries: list[str], passages: list[str]) -> np.ndarray:
    """densepass' bf16 scores under autocast of the float32 model, as before the fused bf16 copy (CPU)."""
    from unittest import mock

    with mock.patch("densepass.models.cross_encoder.fusable_base", return_value=None):
        return ours.score_pairs(queries, passages)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="encoder the cross-encoders start from")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--loss", default="listwise", choices=["listwise", "pointwise"])
    parser.add_argument("--batch-size", type=int, default=16, help="training queries per step")
    parser.add_argument("--negatives", type=int, default=7, help="hard negatives per query (n)")
    parser.add_argument("--steps", type=int, default=20, help="timed optimisation steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--rerank-queries", type=int, default=100, help="dev queries whose candidates are scored")
    parser.add_argument("--depth", type=int, default=100, help="BM25 candidates per dev query")
    parser.add_argument("--rerank-batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="reranking: best of this many runs")
    parser.add_argument("--device", default=None)
    parser.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on CPU too (both systems)")
    parser.add_argument(
        "--precision",
        default=None,
        choices=["fp32", "bf16", "int8"],
        help="densepass' reranking precision (int8: CPU only); default: sentence-transformers' (fp32 on CPU)",
    )
    parser.add_argument("--no-train", action="store_true", help="time reranking only")
    parser.add_argument(
        "--rerank-model",
        default=None,
        help="a trained cross-encoder to rerank with (default: --model with a new seeded head, whose near-zero "
        "scores make --precision's agreement look worse than a trained model's)",
    )
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    device = pick_device(args.device)
    bf16 = uses_bf16(device, True, args.cpu_bf16)  # both systems in the same precision
    baseline = "bf16" if bf16 else "fp32"  # sentence-transformers' reranking precision
    precision = args.precision or baseline
    resolve_precision(precision, device)  # int8 on a GPU fails before any work
    env = environment(device)
    print(
        f"device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"sentence-transformers {env['sentence_transformers']}; {'bf16 autocast' if bf16 else 'fp32'}"
        + (f"; densepass reranks in {precision}" if precision != baseline else "")
    )
    path = resolve_model_path(args.model)
    dataset = load_dataset(args.dataset, args.data_dir)
    started = time.perf_counter()
    bm25 = BM25Index.build(dataset.corpus)
    n_train = (args.warmup + args.steps + 1) * args.batch_size
    positives = dataset.positives("train")
    qids = sorted(np.random.default_rng(13).choice(sorted(positives), size=n_train, replace=False).tolist())
    negatives = passage_ids(mine_bm25_negatives(dataset, bm25, qids, depth=max(20, 2 * args.negatives)))
    data = TrainingData(dataset, "train", PASSAGE_SEP, negatives, args.negatives, query_ids=qids)
    # the same groups for sentence-transformers: each query, its positive, n negatives drawn from its pool
    first = data.collate(list(range(len(data))), seed=(13, 0, 0))
    queries, passages = group_pairs(first, args.negatives)
    width = args.negatives + 1
    groups = {"query": queries[::width], "positive": passages[::width]}
    for k in range(1, width):
        groups[f"negative_{k}"] = passages[k::width]
    dev = dataset.sample("dev", args.rerank_queries, 13)
    dev_texts = [dataset.queries[q] for q in sorted(dev)]
    _, rows = bm25.search_rows(dev_texts, args.depth)
    texts = dataset.corpus.passage_inputs(PASSAGE_SEP)
    pair_queries = [q for q, row in zip(dev_texts, rows) for _ in row]
    pair_passages = [texts[r] for row in rows for r in row]
    print(
        f"BM25, {n_train} training groups of 1 + {args.negatives} and {len(pair_queries):,} dev pairs: "
        f"{time.perf_counter() - started:.0f}s (not timed)\n"
    )

    results = {}
    pairs_per_step = args.batch_size * (args.negatives + 1)
    training = (
        ("densepass train_cross_encoder", lambda: train_densepass(path, data, args, device, bf16)),
        (
            "sentence-transformers CrossEncoderTrainer",
            lambda: train_sentence_transformers(path, groups, args, device, bf16),
        ),
    )
    for system, fn in training if not args.no_train else ():
        seconds = fn()
        results[system] = {"task": "train", "seconds": seconds, "pairs_per_s": args.steps * pairs_per_step / seconds}
        print(f"  {system}: {results[system]['pairs_per_s']:,.1f} pairs/s", flush=True)

    from sentence_transformers.cross_encoder import CrossEncoder as STCrossEncoder

    options = {"max_length": args.max_length, "batch_size": args.rerank_batch_size, "device": device}
    if args.rerank_model:
        ours = CrossEncoder.from_pretrained(args.rerank_model, precision=precision, **options)
    else:
        ours = CrossEncoder.new(path, seed=13, precision=precision, **options)
    with tempfile.TemporaryDirectory() as tmp:
        ours.save(Path(tmp) / "ce")
        theirs = STCrossEncoder(str(Path(tmp) / "ce"), device=str(device))

    def st_predict(model=theirs, autocast: bool = bf16):
        with autocast_context(device, autocast):
            return model.predict(
                list(zip(pair_queries, pair_passages)), batch_size=args.rerank_batch_size, show_progress_bar=False
            )

    # untimed: the warm-up, and densepass in sentence-transformers' precision, to check both score alike
    low = ours.score_pairs(pair_queries, pair_passages)
    reference = ours.score_pairs(pair_queries, pair_passages, baseline) if precision != baseline else low
    difference = float(np.max(np.abs(reference - np.asarray(st_predict()))))
    quality = score_agreement(low, reference, args.depth) if precision != baseline else None
    ours_name = "densepass CrossEncoder.score_pairs" + (f" ({precision})" if precision != baseline else "")
    scorers = {ours_name: lambda: ours.score_pairs(pair_queries, pair_passages)}
    shortcut = None  # largest score difference between the shortcut and the full last layer
    if precision != "int8":  # int8 runs the full last layer anyway
        shortcut = float(np.max(np.abs(full_last_layer(ours, pair_queries, pair_passages) - low)))
        scorers["densepass CrossEncoder.score_pairs, full last layer"] = lambda: full_last_layer(
            ours, pair_queries, pair_passages
        )
    if precision == "bf16" and device.type == "cpu":  # what the fused bf16 copy is worth against autocast
        scorers["densepass CrossEncoder.score_pairs, bf16 autocast (unfused)"] = lambda: unfused(
            ours, pair_queries, pair_passages
        )
    scorers["sentence-transformers CrossEncoder.predict"] = st_predict
    # densepass in a reduced precision on a device with fast bf16 meets sentence-transformers' fastest setting
    # there, its bf16 ones included (not its fp32 alone: that ratio would be the precision's, not the library's)
    st_bf16 = bf16 or (precision in ("int8", "bf16") and fast_bf16(device))
    if st_bf16 and not bf16:
        scorers["sentence-transformers CrossEncoder.predict, bf16 autocast"] = lambda: st_predict(theirs, True)
    if st_bf16:  # its other bf16 setting: the model cast to bfloat16 (the fastest of them is the comparison)
        with tempfile.TemporaryDirectory() as tmp:
            ours.save(Path(tmp) / "ce")
            half = STCrossEncoder(str(Path(tmp) / "ce"), device=str(device))
        half.model.to(torch.bfloat16)
        half_scores = np.asarray(st_predict(half, False), dtype=np.float32)
        print(
            f"  sentence-transformers bf16 weights: largest difference to its autocast scores "
            f"{np.max(np.abs(half_scores - np.asarray(st_predict(), dtype=np.float32))):.4f}"
        )
        scorers["sentence-transformers CrossEncoder.predict, bf16 weights"] = lambda: st_predict(half, False)
    for system, seconds in best_of_interleaved(args.repeats, device, scorers).items():
        results[system] = {"task": "rerank", "seconds": seconds, "pairs_per_s": len(pair_queries) / seconds}
        print(f"  {system}: {results[system]['pairs_per_s']:,.1f} pairs/s", flush=True)

    theirs_of: dict[str, float] = {}  # task -> sentence-transformers' fastest setting
    for name, r in results.items():
        if name.startswith("sentence"):
            theirs_of[r["task"]] = max(theirs_of.get(r["task"], 0.0), r["pairs_per_s"])
    table = [
        [name, r["task"], f"{r['seconds']:.2f}", rate(r["pairs_per_s"])]
        + [f"{r['pairs_per_s'] / theirs_of[r['task']]:.2f}x" if name.startswith("densepass") else ""]
        for name, r in results.items()
    ]
    ratios = {task: results[name]["pairs_per_s"] / theirs_of[task] for task, name in main_rows(results).items()}
    trained = (
        "no training"
        if args.no_train
        else f"training: {args.loss}, {args.batch_size} queries x (1 + {args.negatives}) pairs per step, "
        f"{args.steps} timed steps after {args.warmup}"
    )
    print(
        f"\n{trained}; reranking: {len(pair_queries):,} pairs (BM25 top-{args.depth} of "
        f"{len(dev_texts)} dev queries), batch {args.rerank_batch_size}, best of {args.repeats}; max_length "
        f"{args.max_length}; largest score difference between the two rerankers in {baseline} {difference:.2e}"
        + ("" if shortcut is None else f"; between densepass' shortcut and its full last layer {shortcut:.2e}")
    )
    if quality is not None:
        print(
            f"densepass {precision} scores against its {baseline} scores: "
            + ", ".join(f"{key} {value:.4g}" for key, value in quality.items())
        )
    print(markdown_table(["system", "task", "seconds", "pairs/s", "densepass ÷ sentence-transformers"], table))
    write_json(
        args.out,
        {
            "benchmark": "rerank",
            **env,
            "model": args.model,
            "rerank_model": args.rerank_model,
            "dataset": args.dataset,
            "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "bf16": bf16,
            "precision": precision,
            "results": results,
            "train_speedup_vs_st": ratios.get("train"),
            "rerank_speedup_vs_st": ratios["rerank"],
            "max_score_difference": difference,
            "max_shortcut_difference": shortcut,
            "agreement_with_" + baseline: quality,
        },
    )


if __name__ == "__main__":
    main()
