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
comparison, where densepass's step time goes (``torch.profiler``, ops by self CPU time; on a GPU also by the call
sites that launch them, and where the host waited for the device: ``common.print_profile``). ``--rounds N`` runs
densepass and sentence-transformers alternately N times and prints each round's ratio, the table showing the
median round (a shared or virtual machine's speed drifts from minute to minute; one run of each can land on either
side of a goal); with ``--fresh`` each of those runs starts in a process of its own, as a user's run does (runs one
after another in one process inherit the state earlier ones left: its heap, oneDNN's kernel cache).

``--processes N`` (CPU) adds both systems again as N processes of one thread each (``torch.distributed.run``,
gloo) at the same global batch: densepass splits each step's queries over the processes, every query seeing the
whole batch as in-batch negatives; sentence-transformers runs ``per_device_train_batch_size`` = batch / N with MNRL's
``gather_across_devices=True``, the same loss. The rows tell whether, on a small CPU, one thread per process beats
every thread in one process (whose matrix products may be too small to keep the threads busy), for both systems.

``--packing`` (issue 54) compares densepass padded, densepass packed (``train.packing``: padding-free,
``models.packing``) and sentence-transformers, and adds per row the real (non-padding) tokens per second, the peak
memory (GPU: allocated; CPU: the process's resident high-water mark, reset before each system through
``/proc/self/clear_refs``) and the model FLOPs utilisation: real tokens/s x training FLOPs per token (6 x the
encoder's non-embedding parameters + 12 x layers x width x mean sequence length, attention over real tokens only)
/ the device's peak (``--peak-tflops``, else a table of GPUs, else on the CPU the rate of a loop of bf16 (on AMX
tiles where the CPU has them) or float32 multiply-adds on torch's threads, measured by ``cpu_peak.py``; where that
loop does not build, an estimate printed
with its terms: threads x clock x FLOPs per cycle per core). Real tokens per example are those of the run's triplets
(query + positive + one negative, each truncated as the step truncates it); densepass draws its negatives from the
same pools, so the figure is the same mean for both. ``--attention-variants`` instead times, forward and
backward, the ways to run attention over packed sequences (``models.packing``'s choice); ``--padding-share``
prints how many positions a step computes per real token, padded and in densepass's length-sorted CPU pieces:

    python benchmarks/bench_train.py --packing --steps 10 --warmup 2 --batch-size 32 --data-dir ../shared/data \
        --out outputs/bench/train-packing-cpu.json
    python benchmarks/bench_train.py --attention-variants
    python benchmarks/bench_train.py --padding-share --batch-size 32 --steps 30 --data-dir ../shared/data
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import (
    StepClock,
    encoder_flops_per_token,
    environment,
    markdown_table,
    median_round,
    output_file,
    pick_device,
    print_profile,
    rate,
    write_json,
)
from densepass.config import TrainConfig
from densepass.data import load_dataset
from densepass.device import uses_bf16
from densepass.index.bm25 import BM25Index
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.negatives.bm25 import mine_bm25_negatives
from densepass.negatives.pool import passage_ids
from densepass.training.batches import TrainingData
from densepass.training.trainer import train


def peak_memory(device: torch.device, fn, cpu: bool = False):
    """(result of fn(), peak allocated GiB during it; on the CPU, with ``cpu``, the process's peak resident GiB
    during it, else None)."""
    if device.type != "cuda":
        if not cpu:
            return fn(), None
        with contextlib.suppress(OSError):  # resets VmHWM, the resident high-water mark (Linux)
            Path("/proc/self/clear_refs").write_text("5")
        out = fn()
        return out, _resident_peak_gib()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    out = fn()
    return out, torch.cuda.max_memory_allocated(device) / 2**30


def _resident_peak_gib() -> float:
    """The process's resident high-water mark (VmHWM) in GiB; ``ru_maxrss`` where /proc is not there."""
    with contextlib.suppress(OSError, StopIteration):
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


GPU_PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0}
"""Dense bf16 tensor-core peaks (the vendors' data sheets, without sparsity; SXM parts)."""


def peak_tflops(args, device: torch.device, bf16: bool) -> tuple[float | None, str]:
    """The device's peak (TFLOPS) that MFU divides by, and how it was had."""
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value, f"{key} dense bf16 data sheet"
        return None, f"unknown GPU {name}: pass --peak-tflops"
    import cpu_peak

    measured = cpu_peak.peak_tflops(bf16)
    if measured[0] is not None:
        return measured
    from densepass.device import cpuinfo_words

    words, ghz = cpuinfo_words(), None
    with contextlib.suppress(OSError, ValueError):
        ghz = int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text()) / 1e6
    if ghz is None:
        with contextlib.suppress(OSError, StopIteration, ValueError):
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            ghz = float(next(x for x in lines if x.startswith("cpu MHz")).split(":")[1]) / 1e3
    if ghz is None:
        return None, "no clock found: pass --peak-tflops"
    # where the loop of cpu_peak.py does not build: two FMA pipes of 256 bits (AVX2, and Zen 4's AVX-512): 32
    # float32 FLOPs a cycle; bf16 dot products (vdpbf16ps) twice that; AMX, far above either, is measured by the
    # loop where it builds. /proc/cpuinfo's clock is not the boosted one under load, so this overstates MFU
    per_cycle = 32 * (2 if bf16 and "avx512_bf16" in words else 1)
    threads = torch.get_num_threads()
    return threads * ghz * per_cycle / 1e3, f"estimate: {threads} threads x {ghz:.2f} GHz x {per_cycle} FLOPs/cycle"


def attention_variants(repeats: int = 5) -> None:
    """Forward + backward of attention over 96 packed sequences of 8-128 tokens (MiniLM's 12 heads of 32, float32):
    SDPA on the padded grid with a key mask (``models.packing``), per group of equal lengths, per sequence, and
    with nested jagged tensors; the error against a float64 per-sequence reference."""
    import torch.nn.functional as F

    from densepass.models.packing import Packing

    torch.manual_seed(0)
    heads, size = 12, 32
    lengths = torch.randint(8, 129, (96,))
    mask = (torch.arange(128)[None, :] < lengths[:, None]).long()
    packing, tokens = Packing.of(mask), int(lengths.sum())
    q, k, v = (torch.randn(tokens, heads, size, requires_grad=True) for _ in range(3))
    offsets = packing.offsets

    def grid(q, k, v):
        up = (packing.to_grid(x).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(*up, attn_mask=packing.keep)
        return out.transpose(1, 2).flatten(0, 1)[packing.grid]

    def groups(q, k, v):
        order = torch.argsort(lengths, stable=True)
        values, counts = torch.unique_consecutive(lengths[order], return_counts=True)
        outs, rows, start = [], [], 0
        for n, c in zip(values.tolist(), counts.tolist()):
            members = order[start : start + c]
            start += c
            index = (offsets[members][:, None] + torch.arange(n)).reshape(-1)
            part = (x[index].view(c, n, heads, size).transpose(1, 2) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(*part).transpose(1, 2).reshape(-1, heads, size))
            rows.append(index)
        return torch.zeros_like(q).index_copy(0, torch.cat(rows), torch.cat(outs))

    def per_sequence(q, k, v, dtype=None):
        outs = []
        for b in range(len(lengths)):
            part = (x[offsets[b] : offsets[b + 1]].transpose(0, 1)[None].to(dtype or x.dtype) for x in (q, k, v))
            outs.append(F.scaled_dot_product_attention(*part)[0].transpose(0, 1))
        return torch.cat(outs)

    def nested(q, k, v):
        jagged = (torch.nested.nested_tensor_from_jagged(x, offsets=offsets).transpose(1, 2) for x in (q, k, v))
        return F.scaled_dot_product_attention(*jagged).transpose(1, 2).values()

    reference = per_sequence(q, k, v, torch.float64)
    rows = []
    for name, fn in [("padded grid, key mask", grid), ("groups of equal length", groups),
                     ("per sequence", per_sequence), ("nested jagged tensors", nested)]:  # fmt: skip
        try:
            out = fn(q, k, v)
            error = float((out.detach().double() - reference.detach()).abs().max())
            seconds = []
            for _ in range(repeats + 1):
                started = time.perf_counter()
                fn(q, k, v).sum().backward()
                seconds.append(time.perf_counter() - started)
            rows.append([name, f"{1e3 * float(np.median(seconds[1:])):.0f}", f"{error:.1e}"])
        except (RuntimeError, NotImplementedError) as err:
            rows.append([name, f"fails: {str(err).splitlines()[0][:60]}", "-"])
    print(f"{tokens:,} tokens in {len(lengths)} sequences, {heads} heads of {size}, {torch.get_num_threads()} threads")
    print(markdown_table(["attention", "forward + backward, ms (median)", "max error vs float64"], rows))


def run_densepass(path, data, args, device, grad_cache_chunk, packing: bool = False):
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
        packing=packing,
    )
    clock = StepClock(device, args.warmup, args.warmup + args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        run = lambda: train(model, data, train_config, Path(tmp), device, on_step_end=clock)  # noqa: E731
        _, peak = peak_memory(device, run, cpu=args.packing)
    return clock.seconds, peak


def profile_densepass(path, data, args, device, rows: int = 15) -> None:
    """densepass's warm-up and timed steps under ``torch.profiler``: the ``rows`` ops with the most self CPU time
    (where a step's time goes: matrix products, dropout's random masks, copies, ...); packed steps with
    ``--packing``."""
    run = lambda: run_densepass(path, data, args, device, None, packing=args.packing)  # noqa: E731
    print_profile(run, device, rows, shapes=args.profile_shapes)


def run_sentence_transformers(path, triplets, args, device, bf16):
    from datasets import Dataset
    from sentence_transformers import (
        SentenceTransformer,
        SentenceTransformerTrainer,
        SentenceTransformerTrainingArguments,
    )
    from sentence_transformers.losses import MultipleNegativesRankingLoss
    from transformers import TrainerCallback

    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torch.distributed.run (--processes): a share each
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
            per_device_train_batch_size=args.batch_size // world,
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
            **({"ddp_backend": "gloo"} if world > 1 else {}),
        )
        trainer = SentenceTransformerTrainer(
            model=model,
            args=training_args,
            train_dataset=Dataset.from_dict(triplets),
            loss=MultipleNegativesRankingLoss(model, scale=20.0, gather_across_devices=world > 1),
            callbacks=[Timing()],
        )
        _, peak = peak_memory(device, trainer.train, cpu=args.packing)
    return clock.seconds, peak


def _in_worker(system: str, drop: set[str], launcher: tuple[str, ...] = (), env: dict | None = None) -> dict | None:
    """This script run again as ``--worker SYSTEM`` (after ``launcher``'s arguments to Python, ``env`` its
    environment), without the options in ``drop`` and ``--fresh``: the JSON its rank 0 wrote, or None where it
    failed (its output printed)."""
    argv = sys.argv[1:]
    argv = [
        a
        for i, a in enumerate(argv)
        if a != "--fresh" and a not in drop and a.split("=")[0] not in drop and (i == 0 or argv[i - 1] not in drop)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, *launcher, str(Path(__file__).resolve()), *argv, "--worker", system,
                   "--worker-out", str(out)]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True)
        if done.returncode != 0 or not out.exists():
            print(f"  {system} failed:\n{done.stdout[-2000:]}{done.stderr[-4000:]}")
            return None
        return json.loads(out.read_text())


def in_processes(args, system: str) -> tuple[float | None, None]:
    """``system`` (densepass or sentence-transformers) trained by ``args.processes`` processes of one thread each
    under ``torch.distributed.run`` (this script again, as ``--worker SYSTEM``): rank 0's clock, since every step
    ends with the processes' gradients summed. None where the run failed (its output is printed)."""
    launcher = ("-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.processes}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    result = _in_worker(system, {"--out", "--processes", "--rounds"}, launcher, env)
    return (None if result is None else result["seconds"]), None


def in_fresh_process(system: str) -> tuple[float, float | None]:
    """(seconds, peak) of ``system`` (``densepass``, ``densepass-packed``, ``densepass-gradcache`` or
    ``sentence-transformers``) trained in a process of its own (this script again, as ``--worker SYSTEM``), as a
    user starts a run: with ``--fresh``, each run of ``--rounds`` starts from a new process instead of the state
    earlier runs left in this one. Its peak resident memory counts the data the process prepares before the run."""
    result = _in_worker(system, {"--out", "--rounds"})
    if result is None:
        raise SystemExit(f"{system} in a fresh process failed (its output above)")
    return result["seconds"], result["peak"]


def worker(path, data, triplets, args, device, bf16) -> None:
    """One process of ``in_processes`` (its share of every step, rank 0 writing the timed seconds), or of
    ``in_fresh_process`` (the whole run, on torch's threads)."""
    from densepass import distributed

    if "WORLD_SIZE" in os.environ:  # one of --processes' one-thread processes
        torch.set_num_threads(1)
    if args.worker.startswith("densepass"):
        distributed.init_from_environment()
        chunk = args.grad_cache_chunk if args.worker == "densepass-gradcache" else None
        seconds, peak = run_densepass(path, data, args, device, chunk, packing=args.worker == "densepass-packed")
    else:  # the Trainer joins the process group itself (ddp_backend gloo)
        seconds, peak = run_sentence_transformers(path, triplets, args, device, bf16)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker_out).write_text(json.dumps({"seconds": seconds, "peak": peak}))


def real_tokens(path: str, triplets: dict, args) -> tuple[float, float]:
    """(mean real tokens per example: query + positive + negative, each cut as a step cuts it; the tokens' mean
    sequence length, sum(n^2) / sum(n), what attention's FLOPs per token grow with)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    lengths = []
    for column, limit in (("anchor", args.query_max_length), ("positive", args.passage_max_length),
                          ("negative", args.passage_max_length)):  # fmt: skip
        lengths.append(
            np.array([len(x) for x in tokenizer(triplets[column], truncation=True, max_length=limit)["input_ids"]])
        )
    every = np.concatenate(lengths)
    steps = len(lengths[0]) // args.batch_size
    computed = {"real": 0, "padded (each side to its longest, x8)": 0, "length-sorted pieces of 2,048": 0}
    for step in range(steps):
        rows = slice(step * args.batch_size, (step + 1) * args.batch_size)
        for side in (lengths[0][rows], np.concatenate([lengths[1][rows], lengths[2][rows]])):
            for name, count in zip(computed, computed_tokens(side)):
                computed[name] += count
    shares = ", ".join(f"{name} {count / computed['real']:.2f}" for name, count in computed.items())
    print(f"tokens computed per real token, {steps} batches of the triplets: {shares}")
    return float(sum(x.mean() for x in lengths)), float((every**2).sum() / every.sum())


def computed_tokens(lengths: np.ndarray, piece: int = 2048) -> tuple[int, int, int]:
    """Positions one side of a step computes: its real tokens (packed); padded to the longest, a multiple of 8
    (``models.inputs.tokenize``; a GPU step, and sentence-transformers); in length-sorted pieces of ``piece``
    tokens, each cut to its longest (``models.inputs.forward_in_pieces``, densepass's CPU step)."""
    padded = len(lengths) * int(-(-lengths.max() // 8) * 8)
    if padded <= piece:  # one piece: the batch as tokenised
        return int(lengths.sum()), padded, padded
    ordered = np.sort(lengths)[::-1]
    pieces, start = 0, 0
    while start < len(ordered):
        rows = max(1, piece // int(ordered[start]))
        pieces += int(ordered[start]) * len(ordered[start : start + rows])
        start += rows
    return int(lengths.sum()), padded, pieces


def packing_comparison(path, data, triplets, args, device, bf16: bool, env: dict) -> None:
    """densepass padded, densepass packed and sentence-transformers in one run: examples/s, real tokens/s, peak
    memory, MFU (the module docstring)."""
    per_example, mean_length = real_tokens(path, triplets, args)
    flops = encoder_flops_per_token(path, mean_length, backward=True)
    peak, peak_how = peak_tflops(args, device, bf16)
    print(
        f"real tokens per example {per_example:.1f} (mean sequence length {mean_length:.1f}); "
        f"{flops / 1e6:.1f} MFLOPs per token; peak {peak if peak is None else f'{peak:.2f}'} TFLOPS ({peak_how})"
    )
    systems = (
        ("densepass train (padded)", lambda: run_densepass(path, data, args, device, None)),
        ("densepass train --packing", lambda: run_densepass(path, data, args, device, None, packing=True)),
        ("SentenceTransformerTrainer + MNRL", lambda: run_sentence_transformers(path, triplets, args, device, bf16)),
    )
    if args.fresh:
        systems = tuple(
            (name, lambda worker=worker: in_fresh_process(worker))
            for (name, _), worker in zip(systems, ("densepass", "densepass-packed", "sentence-transformers"))
        )
    rounds = []  # the three systems in turn, --rounds times
    for number in range(args.rounds):
        results = []
        for system, run in systems:
            seconds, memory = run()
            examples = args.steps * args.batch_size / seconds
            tokens = examples * per_example
            mfu = tokens * flops / (peak * 1e12) if peak else None
            results.append({"system": system, "seconds": seconds, "steps": args.steps, "examples_per_s": examples,
                            "real_tokens_per_s": tokens, "mfu": mfu, "peak_gib": memory})  # fmt: skip
            print(f"  {system}: {seconds:.2f}s, {examples:,.1f} examples/s, {tokens:,.0f} real tokens/s", flush=True)
        rounds.append(results)
        if args.rounds > 1:
            padded, packed, st = (r["seconds"] for r in results)
            print(f"  round {number + 1}: packed / padded {padded / packed:.2f}x, padded / sentence-transformers "
                  f"{st / padded:.2f}x, packed / sentence-transformers {st / packed:.2f}x", flush=True)  # fmt: skip
    results = median_round(rounds, lambda r: r[2]["seconds"] / r[1]["seconds"])  # by packed / sentence-transformers
    packed = results[1]
    rows = [
        [
            r["system"],
            f"{r['seconds']:.2f}",
            rate(r["examples_per_s"]),
            rate(r["real_tokens_per_s"]),
            "-" if r["mfu"] is None else f"{100 * r['mfu']:.2f}%",
            "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}",
            f"{packed['examples_per_s'] / r['examples_per_s']:.2f}x",
        ]
        for r in results
    ]
    memory = "peak GPU GiB (allocated)" if device.type == "cuda" else "peak resident GiB"
    print(
        f"\nbatch {args.batch_size} queries + 1 BM25 hard negative each, query {args.query_max_length} / passage "
        f"{args.passage_max_length} tokens, {args.steps} timed steps after {args.warmup}, "
        f"{'bf16 autocast' if bf16 else 'fp32'}; MFU against {peak_how}"
    )
    headers = ["system", "seconds", "examples/s", "real tokens/s", "MFU", memory, "packed ÷ row"]
    print(markdown_table(headers, rows))
    if args.rounds > 1:
        each = ", ".join(f"{r[2]['seconds'] / r[1]['seconds']:.2f}x" for r in rounds)
        print(f"each round's packed / sentence-transformers: {each} (the table: the median round)")
    write_json(
        args.out,
        {
            "benchmark": "train-packing",
            **env,
            "model": args.model,
            "dataset": args.dataset,
            "batch_size": args.batch_size,
            "cpu_bf16": args.cpu_bf16,
            "query_max_length": args.query_max_length,
            "passage_max_length": args.passage_max_length,
            "real_tokens_per_example": per_example,
            "flops_per_token": flops,
            "peak_tflops": peak,
            "peak_source": peak_how,
            "results": results,
            "rounds": rounds,
            "fresh_processes": args.fresh,
        },
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
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
        help="instead of the comparison: densepass's steps under torch.profiler, the ops by self CPU time (on a GPU "
        "also by call site, and the host's waits for it; its packed steps with --packing)",
    )
    parser.add_argument(
        "--profile-shapes",
        action="store_true",
        help="with --profile: also the ops grouped by their input shapes (which tensors the time goes to)",
    )
    parser.add_argument(
        "--packing",
        action="store_true",
        help="densepass padded, densepass packed (train.packing) and sentence-transformers, with real tokens/s, "
        "peak memory and MFU (no GradCache row)",
    )
    parser.add_argument("--peak-tflops", type=float, default=None, help="the device's peak for MFU (TFLOPS)")
    parser.add_argument(
        "--attention-variants",
        action="store_true",
        help="instead of the comparison: time the ways to run attention over packed sequences",
    )
    parser.add_argument(
        "--padding-share",
        action="store_true",
        help="instead of the comparison: the positions a step computes per real token, padded, in densepass's "
        "length-sorted pieces and packed (the most packing can gain)",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=None,
        help="CPU: also both systems as this many processes of one thread each (torch.distributed.run, gloo), same "
        "global batch",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the comparison's systems in turn this many times (densepass and sentence-transformers, the GradCache "
        "row once; with --packing, padded, packed and sentence-transformers): each round's ratios, and the table from "
        "the median round",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="run each system of each round in a process of its own (as a user starts a run), not one after another "
        "in this one",
    )
    parser.add_argument(
        "--worker",
        choices=["densepass", "densepass-packed", "densepass-gradcache", "sentence-transformers"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--worker-out", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    if args.processes is not None and (args.processes < 2 or args.batch_size % args.processes):
        parser.error("--processes must be at least 2 and divide --batch-size")
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.warmup < 1 or args.steps < 1:  # the clock starts at the end of the last warm-up step
        parser.error(f"--warmup and --steps must be at least 1, got {args.warmup} and {args.steps}")
    if args.profile_shapes and not args.profile:
        parser.error("--profile-shapes adds a table to --profile: give both")
    if args.rounds > 1 and (args.profile or args.padding_share or args.attention_variants):
        parser.error("--rounds repeats a comparison (the plain one, or --packing): run it without --profile, ...")
    if args.processes and (args.packing or args.profile or args.padding_share or args.attention_variants):
        parser.error("--processes adds rows to the plain comparison: run it without --packing, --profile, ...")
    if args.attention_variants:
        attention_variants()
        return
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

    if args.worker:
        worker(path, data, triplets, args, device, bf16)
        return
    if args.profile:
        profile_densepass(path, data, args, device)
        return
    if args.padding_share:
        real_tokens(path, triplets, args)
        return
    if args.packing:
        packing_comparison(path, data, triplets, args, device, bf16, env)
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

    rounds = []  # densepass and sentence-transformers alternately, --rounds times
    for number in range(args.rounds):
        if args.fresh:
            ours_run, st_run = in_fresh_process("densepass"), in_fresh_process("sentence-transformers")
        else:
            ours_run = run_densepass(path, data, args, device, None)
            st_run = run_sentence_transformers(path, triplets, args, device, bf16)
        rounds.append({"densepass": ours_run, "st": st_run, "ratio": st_run[0] / ours_run[0]})
        if args.rounds > 1:
            print(f"  round {number + 1}: densepass {ours_run[0]:.2f}s, sentence-transformers {st_run[0]:.2f}s: "
                  f"{rounds[-1]['ratio']:.2f}x", flush=True)  # fmt: skip
    middle = median_round(rounds, lambda r: r["ratio"])
    record("densepass train", *middle["densepass"])
    record("SentenceTransformerTrainer + MNRL", *middle["st"])
    record(
        f"densepass train, GradCache chunk {args.grad_cache_chunk}",
        *(
            in_fresh_process("densepass-gradcache")
            if args.fresh
            else run_densepass(path, data, args, device, args.grad_cache_chunk)
        ),
    )
    if args.processes:
        for system, name in (
            ("densepass", "densepass train"),
            ("sentence-transformers", "SentenceTransformerTrainer + MNRL"),
        ):
            seconds, peak = in_processes(args, system)
            if seconds is not None:
                record(f"{name}, {args.processes} processes x 1 thread", seconds, peak)

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
    if args.rounds > 1:
        ratios = ", ".join(f"{r['ratio']:.2f}x" for r in rounds)
        print(f"each round's densepass / sentence-transformers: {ratios} (the table: the median round)")
    fastest = {
        key: max((r for r in results if r["system"].startswith(prefix)), key=lambda r: r["examples_per_s"])
        for key, prefix in (("densepass", "densepass"), ("st", "SentenceTransformer"))
    }
    best_ratio = fastest["densepass"]["examples_per_s"] / fastest["st"]["examples_per_s"]
    print(f"fastest against fastest ({fastest['densepass']['system']} / {fastest['st']['system']}): {best_ratio:.2f}x")
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
            "processes": args.processes,
            "fastest_vs_fastest": best_ratio,
            "round_ratios": [r["ratio"] for r in rounds],
            "fresh_processes": args.fresh,
        },
    )


if __name__ == "__main__":
    main()
