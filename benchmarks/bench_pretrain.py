r"""Pre-training throughput (non-padding tokens/s): densepass MLM / Condenser / coCondenser against plain
MLM through transformers' ``BertForMaskedLM`` on the same backbone, data, batch and sequence length.

    python benchmarks/bench_pretrain.py --batch-size 4 --max-length 32 --steps 3 --warmup 1 \
        --out outputs/bench_pretrain_cpu.json                                      # CPU smoke
    python benchmarks/bench_pretrain.py --model .carry/minilm-l6-fp16 --data-dir .carry/data \
        --batch-size 64 --max-length 128 --steps 50 --out outputs/bench_pretrain.json   # H100, bf16

Every system trains the same packed, masked batches (15% BERT masking) with AdamW under bf16 autocast on
GPU (fp32 on CPU unless --cpu-bf16): forward, backward and optimiser step are timed after --warmup
untimed steps. coCondenser pairs rows 2i and 2i + 1 of the packed batch as its "spans" (the cost is
the same as for real spans).
densepass applies the MLM prediction head to the masked positions only; BertForMaskedLM computes vocabulary
logits at every position, which is part of the difference measured in the "densepass mlm" row.
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import time
from pathlib import Path

import torch
from transformers import BertForMaskedLM

from common import output_file
from densepass.data import load_dataset
from densepass.device import autocast_context, default_device, uses_bf16
from densepass.models.biencoder import resolve_model_path
from densepass.pretraining.condenser import Condenser
from densepass.pretraining.data import mlm_batches, subset_corpus
from densepass.pretraining.masking import Masker


def make_batches(model_path: str, data_dir: str | None, dataset: str, batch_size: int, max_length: int, n: int):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    corpus = subset_corpus(load_dataset(dataset, data_dir).corpus, max(20 * batch_size, 2000), 0)
    masker = Masker.from_tokenizer(tokenizer)
    batches = []
    for i, batch in enumerate(itertools.islice(mlm_batches(corpus, tokenizer, batch_size, max_length, 0), n)):
        batch["input_ids"], batch["labels"] = masker(
            batch["input_ids"], batch["attention_mask"], torch.Generator().manual_seed(i)
        )
        batches.append(batch)
    return batches


def time_system(name: str, model_path: str, batches, warmup: int, device: torch.device, bf16: bool) -> dict:
    torch.manual_seed(0)
    if name == "BertForMaskedLM":
        model = BertForMaskedLM.from_pretrained(model_path, dtype=torch.float32)

        def loss_of(b):
            return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
    else:
        model = Condenser.from_pretrained(model_path, mode=name.split()[-1])

        def loss_of(b):
            return model.loss(model(b["input_ids"], b["attention_mask"], b["labels"]))

    model.to(device).train()
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tokens, started = 0, 0.0
    for i, batch in enumerate(batches):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
        b = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast_context(device, bf16):
            loss = loss_of(b)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if i >= warmup:
            tokens += int(batch["attention_mask"].sum())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - started
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
    return {
        "system": name,
        "tokens_per_s": tokens / elapsed,
        "step_s": elapsed / (len(batches) - warmup),
        "parameters": params,
        "peak_gib": peak,
        "final_loss": float(loss.detach()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=50, help="timed steps per system")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--out", type=output_file, default="outputs/bench_pretrain.json")
    parser.add_argument("--cpu-bf16", action="store_true", help="bf16 autocast on CPU too (all systems)")
    args = parser.parse_args()
    device = default_device()
    path = resolve_model_path(args.model)
    batches = make_batches(
        path, args.data_dir, args.dataset, args.batch_size, args.max_length, args.steps + args.warmup
    )
    systems = ["BertForMaskedLM", "densepass mlm", "densepass condenser", "densepass cocondenser"]
    bf16 = uses_bf16(device, True, args.cpu_bf16)
    rows = [time_system(s, path, batches, args.warmup, device, bf16) for s in systems]
    base = rows[0]["tokens_per_s"]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(
        f"device: {where} ({'bf16 autocast' if bf16 else 'fp32'}); torch {torch.__version__}; "
        f"batch {args.batch_size} x {args.max_length}, {args.steps} timed steps\n"
    )
    print("| system | tokens/s | s/step | vs BertForMaskedLM | parameters | peak GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['system']} | {r['tokens_per_s']:,.0f} | {r['step_s']:.3f} | {r['tokens_per_s'] / base:.2f} "
            f"| {r['parameters'] / 1e6:.1f} M | {r['peak_gib']:.2f} |"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "device": where,
                "torch": torch.__version__,
                "batch_size": args.batch_size,
                "max_length": args.max_length,
                "steps": args.steps,
                "bf16": bf16,
                "results": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
