#!/usr/bin/env bash
# The GPU runs the docs still owe (../shared/gpu-checklist.md), prepared for a lent GPU machine (the `device`
# tool's `run`: about 15 minutes of GPU time a session, at most 10 a command, files of at most 16 MiB back):
#
#   ../shared/tools/gpu-pack debian-packages    # here, once: .carry/ (MiniLM in fp16 and the data)
#   SMALL=1 bash scripts/gpu_checks.sh          # here: every part at toy sizes on the CPU (a few minutes)
#   bash scripts/gpu_checks.sh teacher          # there (carry .carry, timeout_s 590): about 6 minutes
#   bash scripts/gpu_checks.sh train abs        # there, the next call: about 5 minutes
#
# teacher  issue 55's cross-encoder teacher: configs/recipe_teacher.yaml (its negatives mined there too), one epoch
#          of all training queries at batch 64 (745 steps; an H200 ran 188 queries a second on 2026-11-30), then its
#          reranking of BM25's top 100 on the dev tuning part (the run's report). The model comes back in fp16 as
#          teacher.tar.part-aa, -ab, ...: `cat teacher.tar.part-* | tar -x -C <folder>`.
# train    issue 54: bench_train.py --packing (densepass padded, packed, sentence-transformers) at batch 128 and 512.
# abs      issue 54: bench_abs.py, the 256-slot greedy over 500,000 instances (goal: under 2 minutes).
#
# Each part's log (and JSON) goes to $OUT (the device tool's folder; default outputs/gpu-checks): six files for the
# teacher, six for train and abs (abs-profile.txt: where the 256-slot greedy's time goes), so each call stays within
# the eight files the device tool brings back.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-outputs/gpu-checks}
MODEL=${MODEL:-.carry/minilm-l6-fp16}
DATA=${DATA:-.carry/data}
SMALL=${SMALL:-0}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH}
[ -d "$MODEL" ] && [ -d "$DATA/debian-packages" ] || { echo "no $MODEL or $DATA: run ../shared/tools/gpu-pack debian-packages first" >&2; exit 2; }
device=cuda
if [ "$SMALL" = 1 ]; then device=cpu; fi
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(teacher train abs)

teacher() {
    local run=outputs/gpu-checks-runs
    local size=(--set reranker.train.epochs=1 --set reranker.train.batch_size=64)
    if [ "$SMALL" = 1 ]; then
        size=(--set reranker.train.epochs=1 --set reranker.train.batch_size=4 --set data.max_train_queries=16
              --set data.max_eval_queries=8 --set reranker.depth=5 --set eval.depth=10 --set negatives.pool_depth=8)
    fi
    python3 -m densepass run configs/recipe_teacher.yaml --restart --set output_dir=$run --set cache_dir=$run/cache \
        --set data.data_dir="$DATA" --set model.name_or_path="$MODEL" --set negatives.model="$MODEL" \
        --set reranker.name_or_path="$MODEL" --set device=$device "${size[@]}" 2>&1 | tail -n 60 > "$OUT/teacher.log"
    cp "$run/recipe-teacher/report.md" "$OUT/teacher-report.md"
    # the model in fp16 (the config and tokenizer beside it) in a fresh temporary folder, tarred and cut into parts
    local fp16
    fp16=$(mktemp -d)
    python3 - "$run/recipe-teacher/reranker/model" "$fp16/model" <<'PY'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
source, target = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(source, target)
weights = target / "model.safetensors"
save_file({k: v.half().contiguous() for k, v in load_file(weights).items()}, weights, metadata={"format": "pt"})
PY
    tar -C "$fp16/model" -cf - . | split -b 15M - "$OUT/teacher.tar.part-"
    rm -rf "$fp16"
}

train() {
    local steps=(--steps 30 --warmup 5)
    [ "$SMALL" = 1 ] && steps=(--steps 2 --warmup 1 --batch-size 8)
    python3 benchmarks/bench_train.py --packing --model "$MODEL" --data-dir "$DATA" --device $device "${steps[@]}" \
        --out "$OUT/train-128.json" > "$OUT/train.log" 2>&1
    [ "$SMALL" = 1 ] && steps=(--steps 2 --warmup 1 --batch-size 16) || steps=(--batch-size 512 --steps 10 --warmup 3)
    python3 benchmarks/bench_train.py --packing --model "$MODEL" --data-dir "$DATA" --device $device "${steps[@]}" \
        --out "$OUT/train-512.json" >> "$OUT/train.log" 2>&1
}

abs() {
    local size=(--sizes 500000 --time-limit 125 --profile-seconds 20)
    [ "$SMALL" = 1 ] && size=(--sizes 2000 --time-limit 5 --profile-seconds 2)
    python3 benchmarks/bench_abs.py "${size[@]}" --batch-sizes 64 --concurrent 256 --skip-sequential --skip-clusters \
        --profile "$OUT/abs-profile.txt" > "$OUT/abs.log" 2>&1
}

for part in "${parts[@]}"; do  # every part checked before any runs
    case $part in
        teacher | train | abs) ;;
        *) echo "no such part: $part (teacher, train, abs)" >&2; exit 2 ;;
    esac
done
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/machine.txt" 2>/dev/null || lscpu > "$OUT/machine.txt"
for part in "${parts[@]}"; do
    echo "== $part $(date -u +%T)"; "$part"; echo "== $part done $(date -u +%T)"
done
ls -la "$OUT"
