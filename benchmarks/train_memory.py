"""Resident memory of CPU training steps: padding-free (packed) or padded MiniLM steps in bf16 autocast on batches
of varying length, with and without the engine's release of freed heap memory (``device.release_freed_memory``,
glibc's ``malloc_trim``), and what each release costs.

    OMP_NUM_THREADS=1 python3 benchmarks/train_memory.py --steps 30

Each setting runs in a process of its own (one after another); it prints the resident size every ten steps and the
mean step and release times. The batches: 64 passages of 8 to 120 random words (seeded), cut at 128 tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {"packed": ("packed", False), "packed, released every step": ("packed", True), "padded": ("padded", False)}


def resident_mb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 // 2**20


def one(layout: str, release: bool, steps: int) -> dict:
    import torch

    from densepass.device import release_freed_memory
    from densepass.models.biencoder import BiEncoder
    from densepass.models.packing import enable_packing

    torch.manual_seed(0)
    rng = random.Random(0)
    model = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    if layout == "packed":
        enable_packing(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    words = [f"w{i}" for i in range(3000)]
    resident, step_s, release_s = [], [], []
    for step in range(steps):
        texts = [" ".join(rng.choices(words, k=rng.randint(8, 120))) for _ in range(64)]
        batch = model.tokenizer(texts, padding=True, truncation=True, max_length=128, return_tensors="pt")
        started = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            embeddings = model(batch["input_ids"], batch["attention_mask"], "passage")
        embeddings.float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        stepped = time.perf_counter()
        if release:
            release_freed_memory()
        step_s.append(stepped - started)
        release_s.append(time.perf_counter() - stepped)
        if step % 10 == 9:
            resident.append(resident_mb())
    return {"resident_mb": resident, "step_s": sum(step_s) / steps, "release_ms": 1000 * sum(release_s) / steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--one", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one(*SETTINGS[args.one], args.steps)))
        return
    print("| steps | " + " | ".join(f"resident MB at step {10 * (i + 1)}" for i in range(args.steps // 10)) + " |")
    for name in SETTINGS:
        out = subprocess.run(
            [sys.executable, __file__, "--steps", str(args.steps), "--one", name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        found = json.loads(out.strip().splitlines()[-1])
        cells = " | ".join(str(mb) for mb in found["resident_mb"])
        print(f"| {name} | {cells} | step {found['step_s']:.2f} s, release {found['release_ms']:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
