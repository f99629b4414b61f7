"""How sparse a fresh SPLADE model starts, by the vocabulary bias of its new MLM head (``models.splade``'s
``FRESH_HEAD_BIAS``): the non-zero term weights per passage before any training.

    PYTHONPATH=src:benchmarks python3 benchmarks/splade_head_bias.py --data-dir /work/shared/data

all-MiniLM-L6-v2 has no MLM head, so ``SpladeEncoder.from_pretrained`` ties a new one to the input embeddings with
an identity transform and a constant vocabulary bias. With a bias of 0 nearly every one of the 30,522 terms comes
out positive; the default bias is meant to start training sparse, so that the FLOPS regulariser has less to undo.
A seeded sample of debian-packages passages, cut at the model's 128 passage tokens.
"""

from __future__ import annotations

import argparse

import numpy as np

from common import markdown_table, output_file, write_json


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--n", type=int, default=500, help="passages in the seeded sample")
    parser.add_argument("--biases", type=float, nargs="+", default=[0.0, -3.0, -6.0, -9.0])
    parser.add_argument("--out", type=output_file, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.n < 1:
        parser.error("--n must be >= 1")

    from densepass.data import load_dataset
    from densepass.errors import DensepassError
    from densepass.models.splade import FRESH_HEAD_BIAS, SpladeEncoder

    try:
        texts = load_dataset(args.dataset, args.data_dir).corpus.passage_inputs(" ")
    except DensepassError as err:
        parser.error(str(err))
    if args.n > len(texts):
        parser.error(f"--n {args.n} is more than the corpus's {len(texts)} passages")
    sample = [texts[i] for i in np.random.default_rng(0).choice(len(texts), args.n, replace=False)]
    rows = []
    for bias in args.biases:
        model = SpladeEncoder.from_pretrained(args.model, head_bias=bias)
        if model.head_source == "checkpoint":  # its own head: the bias would not be used, every row the same
            parser.error(f"--model {args.model} has an MLM head of its own: give a model without one (a fresh head)")
        nonzero = np.diff(model.encode_passages(sample).indptr)
        rows.append({"bias": bias, "mean": float(nonzero.mean()), "median": float(np.median(nonzero)),
                     "vocabulary": model.dim, "default": bias == FRESH_HEAD_BIAS})  # fmt: skip
    print(f"{args.n} {args.dataset} passages, {args.model} with a fresh MLM head")
    print(markdown_table(
        ["vocabulary bias", "non-zero terms per passage: mean", "median", "share of the vocabulary"],
        [[f"{r['bias']:g}" + (" (the default)" if r["default"] else ""), f"{r['mean']:,.1f}", f"{r['median']:,.1f}",
          f"{r['mean'] / r['vocabulary']:.2%}"] for r in rows],
    ))  # fmt: skip
    write_json(args.out, {"model": args.model, "dataset": args.dataset, "n": args.n, "rows": rows})


if __name__ == "__main__":
    main()
