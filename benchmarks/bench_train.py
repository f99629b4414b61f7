r"""Training throughput: densepass ``train`` against sentence-transformers' ``SentenceTransformerTrainer``
with ``MultipleNegativesRankingLoss``, same model, same debian-packages (query, positive, BM25 hard
negative) triplets, same batch size, bf16 autocast on GPU (and on CPU with --cpu-bf16), in one run; plus
peak GPU memory, and densepass with gradient caching.

    python benchmarks/bench_train.py --steps 2 --warmup 1 --batch-size 8 --out outputs/bench/train-cpu.json   # CPU
    python benchmarks/bench_train.py --model .carry/minilm-l6-fp16 --data-dir .carry/data \
        --out outputs/bench/train-h100.json                                                               # H100

Both sides: AdamW (fused on GPU), lr 2e-5 with linear warm-up, gradient clipping at 1.0, temperature
0.05 = MNRL's scale 20, float32 weights under bf16 autocast. Only optimisation steps are timed: the
clock starts after ``--warmup`` steps and stops after ``--steps`` more (the device is synchronised at
both ends), so model loading, dataset preparation and the final checkpoint are excluded. Tokenisation
is inside the steps for both (sentence-transformers tokenises in its collator; densepass one step
ahead in a worker thread). sentence-transformers has one max_seq_length, set to the passage length;
queries are shorter than --query-max-length anyway (printed below). ``--profile`` prints, instead of the
comparison, where densepass's step time goes (``torch.profiler``, ops by self CPU time).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import StepClock, environment, markdown_table, pick_device, print_profile, rate, write_json
from densepass.config import TrainConfig
from densepass.data import load_dataset
from densepass.device import uses_bf16
from densepass.index.bm25 import BM25Index
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.negatives.bm25 import mine_bm25_negatives
from densepass.negatives.pool import passage_ids
from densepass.training.batches import TrainingData
from densepass.training.trainer import train


def peak_memory(device: torch.device, fn):
    """(result of fn(), peak allocated GiB during it or None on CPU)."""
    if device.type != "cuda":
        return fn(), None
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    return out, torch.cuda.max_memory_allocated(device) / 2**30


def run_densepass(path, data, args, device, grad_cache_chunk):
    config = BiEncoderConfig(query_max_length=args.query_max_length, passage_max_length=args.passage_max_length)
    model = BiEncoder.from_pretrained(path, config=config)
    total = args.warmup + args.steps + 1  # the last step (it writes the final checkpoint) is not timed
    train_config = TrainConfig(
        max_steps=total,
        batch_size=args.batch_size,
        learning_rate=2e-5,
        warmup_ratio=0.1,
        grad_cache_chunk=grad_cache_chunk,
        bf16=True,
        cpu_bf16=args.cpu_bf16,
        checkpoint_every=10**9,
        log_every=10**9,
        seed=13,
    )
    clock = StepClock(device, args.warmup, args.warmup + args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        _, peak = peak_memory(device, lambda: train(model, data, train_config, Path(tmp), device, on_step_end=clock))
    return clock.seconds, peak


def profile_densepass(path, data, args, device, rows: int = 15) -> None:
    """densepass's warm-up and timed steps under ``torch.profiler``: the ``rows`` ops with the most self CPU time
    (where a step's time goes: matrix products, dropout's random masks, copies, ...)."""
    print_profile(lambda: run_densepass(path, data, args, device, None), device, rows)


def run_sentence_transformers(path, triplets, args, device, bf16):
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from transformers import TrainerCallback

    model = SentenceTransformer(path, device=str(device)).float()
    model.max_seq_length = args.passage_max_length
    clock = StepClock(device, args.warmup, args.warmup + args.steps)

    class Timing(TrainerCallback):
        def on_step_end(self, _args, state, control, **kwargs):
            clock(state.global_step)

    total = args.warmup + args.steps + 1
    with tempfile.TemporaryDirectory() as tmp:
        training_args = SentenceTransformerTrainingArguments(
            output_dir=tmp,
            per_device_train_batch_size=args.batch_size,
            max_steps=total,
            learning_rate=2e-5,
            warmup_steps=int(0.1 * total),
            bf16=bf16,
            use_cpu=device.type == "cpu",
            save_strategy="no",
            report_to="none",
            logging_steps=10**9,
            dataloader_drop_last=True,
            seed=13,
            disable_tqdm=True,
        )
        trainer = SentenceTransformerTrainer(
            model=model,
            args=training_args,
            train_dataset=Dataset.from_dict(triplets),
            loss=MultipleNegativesRankingLoss(model, scale=20.0),
            callbacks=[Timing()],
        )
        _, peak = peak_memory(device, trainer.train)
    return clock.seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=30, help="timed optimisation steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--query-max-length", type=int, default=32)
    parser.add_argument("--passage-max-length", type=int, default=128)
    parser.add_argument("--grad-cache-chunk", type=int, default=32)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--cpu-bf16",
        action="store_true",
        help="bf16 autocast on CPU too (both systems; fast with AMX, or AVX512-BF16 on AMD)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of the comparison: densepass's steps under torch.profiler, the ops by self CPU time",
    )
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args()
    device = pick_device(args.device)
    bf16 = uses_bf16(device, True, args.cpu_bf16)  # both systems train in the same precision
    env = environment(device)
    print(
        f"device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"sentence-transformers {env['sentence_transformers']}"
    )

    path = resolve_model_path(args.model)
    dataset = load_dataset(args.dataset, args.data_dir)
    n = (args.warmup + args.steps + 1) * args.batch_size
    positives = dataset.positives("train")
    qids = sorted(np.random.default_rng(13).choice(sorted(positives), size=n, replace=False).tolist())
    started = time.perf_counter()
    negatives = passage_ids(
        mine_bm25_negatives(dataset, BM25Index.build(dataset.corpus.passage_inputs(" ")), qids, depth=20)
    )
    print(
        f"BM25 over {len(dataset.corpus):,} passages and negatives for {n:,} train queries: "
        f"{time.perf_counter() - started:.0f}s (not timed)"
    )
    sep = BiEncoder.from_pretrained(path).tokenizer.sep_token
    data = TrainingData(dataset, "train", sep, negatives, 1, query_ids=qids)

    # the same triplets for sentence-transformers: each query, its positive, one of its BM25 negatives
    rng = np.random.default_rng(13)
    triplets = {
        "anchor": data.query_texts,
        "positive": [data.passage_inputs[rows[0]] for rows in data.positive_rows],
        "negative": [
            data.passage_inputs[int(rng.choice(pool))]
            if len(pool)
            else data.passage_inputs[int(rng.integers(len(data.passage_inputs)))]
            for pool in data.negative_rows
        ],
    }
    from transformers import AutoTokenizer

    query_lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(path)(data.query_texts)["input_ids"]]
    print(
        f"{n:,} train queries: longest {max(query_lengths)} tokens, "
        f"{np.mean(np.array(query_lengths) > args.query_max_length):.2%} above {args.query_max_length}\n"
    )

    if args.profile:
        profile_densepass(path, data, args, device)
        return
    results = []

    def record(system: str, seconds: float, peak: float | None) -> None:
        results.append(
            {
                "system": system,
                "seconds": seconds,
                "steps": args.steps,
                "examples_per_s": args.steps * args.batch_size / seconds,
                "peak_gib": peak,
            }
        )
        mem = f", peak {peak:.2f} GiB" if peak is not None else ""
        print(
            f"  {system}: {seconds:.2f}s for {args.steps} steps, "
            f"{args.steps * args.batch_size / seconds:,.0f} examples/s{mem}",
            flush=True,
        )

    record("densepass train", *run_densepass(path, data, args, device, None))
    record("SentenceTransformerTrainer + MNRL", *run_sentence_transformers(path, triplets, args, device, bf16))
    record(
        f"densepass train, GradCache chunk {args.grad_cache_chunk}",
        *run_densepass(path, data, args, device, args.grad_cache_chunk),
    )

    ours, st = results[0], results[1]
    rows = [
        [
            r["system"] + (" **(densepass)**" if r is ours else ""),
            f"{r['seconds']:.2f}",
            rate(r["examples_per_s"]),
            f"{ours['examples_per_s'] / r['examples_per_s']:.2f}x",
            "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
        ]
        for r in results
    ]
    print(
        f"\nbatch {args.batch_size} queries + 1 BM25 hard negative each, query {args.query_max_length} / passage "
        f"{args.passage_max_length} tokens, {args.steps} timed steps after {args.warmup}, "
        f"{'bf16 autocast' if bf16 else 'fp32'}"
    )
    print(markdown_table(["system", "seconds", "examples/s", "densepass ÷ row", "peak GPU GiB"], rows))
    print(f"\ndensepass / sentence-transformers: {ours['examples_per_s'] / st['examples_per_s']:.2f}x")
    write_json(
        args.out,
        {
            "benchmark": "train",
            **env,
            "model": args.model,
            "dataset": args.dataset,
            "batch_size": args.batch_size,
            "hard_negatives": 1,
            "warmup_steps": args.warmup,
            "cpu_bf16": args.cpu_bf16,
            "query_max_length": args.query_max_length,
            "passage_max_length": args.passage_max_length,
            "results": results,
            "speedup_vs_st": ours["examples_per_s"] / st["examples_per_s"],
        },
    )


if __name__ == "__main__":
    main()
