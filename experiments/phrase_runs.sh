#!/usr/bin/env bash
# Phrase retrieval experiment (docs/experiments.md, "Phrase retrieval"): the original and unified
# losses side by side (one thread each), then the hard-negative row (+ filter sweep + query-side
# fine-tuning) and its more-steps control, then the passage-level baselines and the table.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
run() { OMP_NUM_THREADS=$1 nice -n 10 python3 -m densepass phrase "configs/phrase_$2.yaml" > "outputs/phrase_$2.log" 2>&1; }
mkdir -p outputs
run 1 original & run 1 unified & wait
run 1 unified_hn & run 1 unified_more & wait
nice -n 10 python3 experiments/phrase_table.py --runs outputs/phrase-original outputs/phrase-unified \
    outputs/phrase-unified-more outputs/phrase-unified-hn --out outputs/phrase-table.json \
    --baselines outputs/phrase-baselines.json
