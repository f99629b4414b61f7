"""Encoding throughput: densepass ``encode_texts`` against ``SentenceTransformer.encode``, same model,
same ``title [SEP] text`` passages of debian-packages, same maximum length, in one run.

    python benchmarks/bench_encode.py --n 2000 --out outputs/bench/encode-cpu.json             # CPU
    python benchmarks/bench_encode.py --model .carry/minilm-l6-fp16 --data-dir .carry/data \
        --save-embeddings outputs/bench/emb --out outputs/bench/encode-h100.json                   # H100

sentence-transformers runs as a user would run it: its default batch size (32) in float32, and, for
fairness, in bfloat16 (``model.to(torch.bfloat16)``) at its default and at densepass's batch size.
On CPU everything runs in float32. Each system first encodes a small warm-up set (not timed).
Agreement = mean cosine between densepass's and sentence-transformers' float32 embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from common import environment, markdown_table, pick_device, rate, timer, write_json
from densepass.data import load_dataset
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.models.encode import encode_texts


def load_st(path: str, device: torch.device, dtype: torch.dtype, max_length: int):
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device=str(device)).to(dtype)
    model.max_seq_length = max_length
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--n", type=int, default=None, help="passages to encode (default: all on GPU, 2000 on CPU)")
    parser.add_argument("--batch-size", type=int, default=512, help="densepass batch size")
    parser.add_argument("--max-length", type=int, default=128, help="passage tokens (densepass's passage_max_length)")
    parser.add_argument(
        "--st-batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="sentence-transformers batch sizes (default: 32, its default, and --batch-size)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--save-embeddings",
        default=None,
        help="directory for densepass's passages.npy and dev queries.npy (for bench_search.py)",
    )
    parser.add_argument("--out", default=None, help="JSON results")
    args = parser.parse_args()
    device = pick_device(args.device)
    gpu = device.type == "cuda"
    env = environment(device)
    print(
        f"device: {env['device']}; torch {env['torch']}, transformers {env['transformers']}, "
        f"sentence-transformers {env['sentence_transformers']}"
    )

    path = resolve_model_path(args.model)
    model = BiEncoder.from_pretrained(path, config=BiEncoderConfig(passage_max_length=args.max_length))
    dataset = load_dataset(args.dataset, args.data_dir)
    texts = dataset.corpus.passage_inputs(model.tokenizer.sep_token)
    n = args.n or (len(texts) if gpu else 2000)
    texts = texts[:n]
    warm = texts[:512]
    print(f"{len(texts):,} {args.dataset} passages, max {args.max_length} tokens\n")

    results, embeddings = [], {}

    def record(system: str, dtype: str, batch: int, seconds: float) -> None:
        results.append(
            {
                "system": system,
                "dtype": dtype,
                "batch_size": batch,
                "seconds": seconds,
                "passages_per_s": len(texts) / seconds,
            }
        )
        print(f"  {system} {dtype} batch {batch}: {seconds:.2f}s, {len(texts) / seconds:,.0f} passages/s", flush=True)

    for bf16 in [True, False] if gpu else [False]:

        def encode(items, bf16=bf16, model=model):
            return encode_texts(
                model,
                items,
                "passage",
                batch_size=args.batch_size,
                device=device,
                precision="bf16" if bf16 else "fp32",
                show_progress=False,
            )

        encode(warm)
        with timer(device) as took:
            emb = encode(texts)
        record("densepass encode_texts", "bf16" if bf16 else "fp32", args.batch_size, took())
        embeddings[f"densepass-{'bf16' if bf16 else 'fp32'}"] = emb
    if args.save_embeddings:
        out_dir = Path(args.save_embeddings)
        out_dir.mkdir(parents=True, exist_ok=True)
        np.save(out_dir / "passages.npy", embeddings["densepass-bf16" if gpu else "densepass-fp32"])
        dev = [dataset.queries[q] for q in sorted(dataset.positives("dev"))]
        np.save(out_dir / "queries.npy", encode_texts(model, dev, "query", device=device, show_progress=False))
        print(f"  saved {len(texts):,} passage and {len(dev):,} dev query embeddings in {out_dir}")
    del model, encode  # free the densepass model before loading sentence-transformers'

    st_batches = args.st_batch_sizes or sorted({32, args.batch_size})
    for name, dtype in [("fp32", torch.float32)] + ([("bf16", torch.bfloat16)] if gpu else []):
        st = load_st(path, device, dtype, args.max_length)
        for batch in st_batches:

            def encode(items, st=st, batch=batch):
                return st.encode(items, batch_size=batch, convert_to_numpy=True, show_progress_bar=False)

            encode(warm)
            with timer(device) as took:
                emb = encode(texts)
            record("SentenceTransformer.encode", name, batch, took())
            embeddings.setdefault(f"st-{name}", np.asarray(emb, dtype=np.float32))
        del st
        if gpu:
            torch.cuda.empty_cache()

    ours = results[0]
    baseline = (
        next(
            r for r in results if r["system"].startswith("Sentence") and r["dtype"] == "fp32" and r["batch_size"] == 32
        )
        if 32 in st_batches
        else results[-1]
    )
    agreement = {k: float(np.mean(np.sum(v * embeddings["st-fp32"], axis=1))) for k, v in embeddings.items()}
    rows = [
        [
            r["system"] + (" **(densepass)**" if r is ours else ""),
            r["dtype"],
            r["batch_size"],
            f"{r['seconds']:.2f}",
            rate(r["passages_per_s"]),
            f"{ours['passages_per_s'] / r['passages_per_s']:.2f}x",
        ]
        for r in results
    ]
    print()
    print(markdown_table(["system", "dtype", "batch", "seconds", "passages/s", "densepass ÷ row"], rows))
    print(
        f"\ndensepass / sentence-transformers default (fp32, batch 32): "
        f"{ours['passages_per_s'] / baseline['passages_per_s']:.2f}x"
    )
    print(
        "agreement with sentence-transformers fp32 (mean cosine): "
        + ", ".join(f"{k} {v:.5f}" for k, v in agreement.items())
    )
    write_json(
        args.out,
        {
            "benchmark": "encode",
            **env,
            "model": args.model,
            "dataset": args.dataset,
            "n_passages": len(texts),
            "max_length": args.max_length,
            "results": results,
            "speedup_vs_st_default": ours["passages_per_s"] / baseline["passages_per_s"],
            "agreement_mean_cosine_vs_st_fp32": agreement,
        },
    )


if __name__ == "__main__":
    main()
