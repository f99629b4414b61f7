r"""A model soup (weight-space average) of two bi-encoders fine-tuned from the same start: ``(1 - alpha) x A + alpha
x B``, the interpolation wise-ft makes with the starting weights (``densepass.models.interpolate``), here between
two fine-tuned models (two recipes of issue 55's study), as one model with one model's cost at search time.

    python3 experiments/soup.py outputs/recommended/model \
        outputs/recipe/runs/<the corpus-pretrained variant>/model --alpha 0.5 --out outputs/soup/model-ab

Both models must share an architecture (the same weight names and shapes) and what their weights mean (one tower or
two, pooling, normalisation, projection, prompts): a one-line error otherwise, before anything is written; the soup
is saved as A's kind of model (its settings and tokenizer). Evaluate
it as any saved model: ``densepass run configs/recommended.yaml --set model.name_or_path=<out> --set
train.enabled=false --set "eval.baselines=[zero-shot]" ...`` (docs/experiments.md gives the full command).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from densepass.cli import run_guarded
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder
from densepass.models.interpolate import interpolate_weights, snapshot


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="a saved bi-encoder (its settings are the soup's)")
    parser.add_argument("b", help="a saved bi-encoder of the same architecture")
    parser.add_argument("--alpha", type=float, default=0.5, help="B's weight (A's is 1 - alpha)")
    parser.add_argument("--out", required=True, help="a new folder for the soup")
    args = parser.parse_args()
    if not 0 <= args.alpha <= 1:  # (NaN too)
        parser.error(f"--alpha must be from 0 to 1, got {args.alpha}")
    out = Path(args.out)
    if out.exists():
        raise ConfigError(f"--out {out} exists; give a new folder (densepass writes over nothing it did not make)")
    first, second = BiEncoder.from_pretrained(args.a), BiEncoder.from_pretrained(args.b)
    meaning = ("shared", "pooling", "normalize", "projection_dim", "query_prompt", "passage_prompt")
    differ = [key for key in meaning if getattr(first.config, key) != getattr(second.config, key)]
    if differ:  # (a shared model and two towers have the same weight names: B's passage tower would be dropped)
        raise ConfigError(f"{args.a} and {args.b} differ in {', '.join(differ)}: their weights mean other things")
    soup = interpolate_weights(first, snapshot(second), 1 - args.alpha)  # (1 - alpha) A + alpha B
    soup.save(out)
    print(f"{out}: {1 - args.alpha:g} x {args.a} + {args.alpha:g} x {args.b}")


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
