#!/usr/bin/env bash
# Phrase retrieval experiment (docs/experiments.md, "Phrase retrieval"): the original and unified
# losses side by side (one thread each), then the hard-negative row (+ filter sweep + query-side
# fine-tuning) and its more-steps control, then the passage-level baselines and the table.
#
#   bash experiments/phrase_runs.sh                 # the CPU-sized run: the configs' step budgets
#   EPOCHS=3 bash experiments/phrase_runs.sh        # the configs with EPOCHS epochs of the first two
#                                                   # runs and one of the continuations, written
#                                                   # under outputs/phrase-${EPOCHS}ep/
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src
out=outputs
first=() more=()
if [[ -n "${EPOCHS:-}" && ! "$EPOCHS" =~ ^[1-9][0-9]*$ ]]; then
    echo "phrase_runs.sh: EPOCHS must be a positive whole number, got '$EPOCHS'" >&2
    exit 2
fi
if [[ -n "${EPOCHS:-}" ]]; then
    out=outputs/phrase-${EPOCHS}ep
    every=(--set train.checkpoint_every=48 --set validation.every_steps=48)
    first=(--set output_dir="$out" --set train.max_steps=null --set train.epochs="$EPOCHS" "${every[@]}")
    more=(--set output_dir="$out" --set train.init="$out/phrase-unified/model" --set train.max_steps=null
          --set train.epochs=1 "${every[@]}")
fi
run() {
    local threads=$1 config=$2; shift 2
    OMP_NUM_THREADS=$threads nice -n 10 python3 -m densepass phrase "configs/phrase_$config.yaml" "$@" \
        > "$out/phrase_$config.log" 2>&1
}
both() {  # two runs side by side, one thread each; fails (naming the logs) when either does
    run 1 "$1" "${@:3}" & local a=$!
    run 1 "$2" "${@:3}" & local b=$!
    local failed=0
    wait "$a" || failed=1
    wait "$b" || failed=1
    if (( failed )); then
        echo "phrase_runs.sh: a run failed: see $out/phrase_$1.log and $out/phrase_$2.log" >&2
        exit 1
    fi
}
mkdir -p "$out"
both original unified "${first[@]}"
both unified_hn unified_more "${more[@]}"
nice -n 10 python3 experiments/phrase_table.py --runs "$out/phrase-original" "$out/phrase-unified" \
    "$out/phrase-unified-more" "$out/phrase-unified-hn" --out "$out/phrase-table.json" \
    --baselines "$out/phrase-baselines.json"
