"""Step time and peak memory of each way of adding negatives: in-batch only, pre-batch T, MoCo K, the
unified λ loss (eq. 2), the separate terms (eq. 1) and LTR, with all-MiniLM-L6-v2 on debian-packages.

    python benchmarks/bench_negatives.py --steps 2 --warmup 1 --batch-size 8 --only in-batch "MoCo K=4096"  # smoke
    python benchmarks/bench_negatives.py --out outputs/bench/negatives-cpu.json          # CPU, batch 32 (quiet!)
    python benchmarks/bench_negatives.py --device cuda --out outputs/bench/negatives-gpu.json

Every variant trains with ``train()`` and its objective (``training.more_negatives``) on the same queries, batch
and lengths (in-batch negatives, no mined hard negatives, as in experiments/more_negatives.py). The memory starts
full (T batches, or K keys, of random unit vectors with keys no passage has), so that the timed steps pay the
steady-state cost: the extra negatives scored, MoCo's momentum update and key encoding. Only optimisation steps are
timed: the clock starts after ``--warmup`` steps and stops after ``--steps`` more. Peak memory: the device's peak
allocation on CUDA; on CPU the process's peak resident set during training (VmHWM, reset before each variant
through /proc/self/clear_refs), which includes the model, optimiser and data; each variant runs in a fresh
process on CPU so that memory one variant freed does not count for the next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from common import StepClock, environment, markdown_table, output_file, pick_device, write_json
from densepass.config import LossConfig, TrainConfig
from densepass.data import load_dataset
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.training.batches import TrainingData
from densepass.training.more_negatives import MultiSource, objective_from_config
from densepass.training.trainer import train

VARIANTS: dict[str, dict] = {
    "in-batch": {},
    "pre-batch T=1": {"memory": "pre-batch", "pre_batches": 1},
    "pre-batch T=4": {"memory": "pre-batch", "pre_batches": 4},
    "pre-batch T=16": {"memory": "pre-batch", "pre_batches": 16},
    "MoCo K=4096": {"memory": "moco", "queue_size": 4096, "momentum": 0.99},
    "MoCo K=16384": {"memory": "moco", "queue_size": 16384, "momentum": 0.99},
    "pre-batch T=4, λ=16 (eq. 2)": {
        "memory": "pre-batch",
        "pre_batches": 4,
        "lambda_in_batch": 16,
        "lambda_memory": 16,
    },
    "pre-batch T=4, eq. 1": {"memory": "pre-batch", "pre_batches": 4, "combine": "separate"},
    "LTR": {"kind": "ltr"},
}


def reset_peak(device: torch.device) -> None:
    """Start measuring the peak from now."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set


def peak_gib(device: torch.device) -> float:
    """The peak since ``reset_peak``, GiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError("no VmHWM in /proc/self/status")


def prefill(objective, batch_size: int, dim: int) -> int:
    """Fill the objective's memory with random unit vectors under keys no passage has; the number of entries."""
    if not isinstance(objective, MultiSource) or objective.memory is None:
        return 0
    memory = objective.memory.memory
    generator = torch.Generator().manual_seed(0)
    bound = memory.max_batches or -(-memory.max_entries // batch_size)
    for push in range(bound):
        reps = F.normalize(torch.randn(batch_size, dim, generator=generator), dim=-1)
        memory.push(reps, -1 - torch.arange(batch_size) - push * batch_size)  # content keys are >= 0 here
    return len(memory)


def run_variant(name: str, args: argparse.Namespace, device: torch.device) -> dict:
    path = resolve_model_path(args.model)
    dataset = load_dataset(args.dataset, args.data_dir)
    total = args.warmup + args.steps + 1  # the last step writes the final checkpoint: not timed
    positives = dataset.positives("train")
    qids = sorted(np.random.default_rng(13).choice(sorted(positives), total * args.batch_size, replace=False).tolist())
    config = BiEncoderConfig(query_max_length=args.query_max_length, passage_max_length=args.passage_max_length)
    torch.manual_seed(13)
    model = BiEncoder.from_pretrained(path, config=config)
    data = TrainingData(dataset, "train", model.tokenizer.sep_token, query_ids=qids)
    train_config = TrainConfig(
        max_steps=total,
        batch_size=args.batch_size,
        learning_rate=5e-5,
        warmup_ratio=0.1,
        bf16=True,
        cpu_bf16=args.cpu_bf16,
        checkpoint_every=10**9,
        log_every=10**9,
        seed=13,
    )
    objective = objective_from_config(LossConfig(**VARIANTS[name]), train_config, model)
    entries = prefill(objective, args.batch_size, model.dim)
    clock = StepClock(device, args.warmup, args.warmup + args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        reset_peak(device)
        train(model, data, train_config, Path(tmp), device, on_step_end=clock, objective=objective)
        peak = peak_gib(device)
    return {
        "variant": name,
        "memory_entries": entries,
        "step_s": clock.seconds / args.steps,
        "queries_per_s": args.steps * args.batch_size / clock.seconds,
        "peak_gib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20, help="timed optimisation steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--query-max-length", type=int, default=32)
    parser.add_argument("--passage-max-length", type=int, default=64)
    parser.add_argument("--device", default=None)
    parser.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on CPU too")
    parser.add_argument("--only", nargs="*", default=None, choices=list(VARIANTS), metavar="VARIANT")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # one variant, JSON on stdout
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    device = pick_device(args.device)
    names = args.only or list(VARIANTS)
    if args.child:
        print(json.dumps(run_variant(names[0], args, device)))
        return
    env = environment(device)
    print(f"device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}")
    rows = []
    for name in names:
        if device.type == "cuda":
            result = run_variant(name, args, device)
        else:  # a fresh process: its resident-set peak is this variant's alone
            argv = [a for a in sys.argv[1:] if a != "--child"]
            command = [sys.executable, __file__, *argv, "--child", "--only", name]
            result = json.loads(
                subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
        rows.append(result)
        print(f"{name}: {result['step_s']:.3f} s/step, peak {result['peak_gib']:.2f} GiB", flush=True)
    base = next((r for r in rows if r["variant"] == "in-batch"), rows[0])
    table = markdown_table(
        ["variant", "memory entries", "s / step", "x in-batch", "peak GiB", "+ GiB"],
        [
            [
                r["variant"],
                f"{r['memory_entries']:,}",
                f"{r['step_s']:.3f}",
                f"{r['step_s'] / base['step_s']:.2f}",
                f"{r['peak_gib']:.3f}",
                f"{r['peak_gib'] - base['peak_gib']:+.3f}",
            ]
            for r in rows
        ],
    )
    print(
        f"\nbatch {args.batch_size}, {args.steps} timed steps after {args.warmup}, passages <= "
        f"{args.passage_max_length} tokens, {args.model}\n\n{table}"
    )
    write_json(args.out, {"environment": env, "args": vars(args), "results": rows, "table": table})


if __name__ == "__main__":
    main()
