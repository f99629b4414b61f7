#!/bin/bash
# Memory of `densepass serve --workers N` (N = 1, 2 by default): the proportional set size (PSS: pages shared
# between processes, such as torch's libraries, counted once in all) of the supervisor and of each worker, after
# 20 POST /v1/embeddings requests, then SIGTERM.
#   bash benchmarks/serve_memory.sh INDEX_DIR [WORKERS...]
set -euo pipefail
index=${1:?usage: serve_memory.sh INDEX_DIR [WORKERS...]}
shift
flags=$(grep -m1 '^flags' /proc/cpuinfo | grep -o -w -E 'avx512_bf16|amx_bf16|avx2' | sort -u | xargs)
echo "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs) ($flags), $(getconf _NPROCESSORS_ONLN) cores, $(date -u +%F)"
for workers in "${@:-1 2}"; do
  for n in $workers; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m densepass serve "$index" --port "$port" --workers "$n" --access-log off 2>/dev/null &
    pid=$!
    for _ in $(seq 600); do curl -sf "localhost:$port/health" >/dev/null && break; sleep 0.2; done
    for _ in $(seq 20); do
      curl -sf "localhost:$port/v1/embeddings" -H 'content-type: application/json' \
        -d '{"input": ["fast audio editor", "a mail server for small sites"]}' >/dev/null
    done
    total=0
    for p in $pid $(cat "/proc/$pid/task/$pid/children"); do
      kb=$(awk '/^Pss:/{print $2}' "/proc/$p/smaps_rollup")
      what=$([ "$p" = "$pid" ] && echo supervisor || echo child)
      [ "$n" = 1 ] && what=server
      echo "workers=$n $what pid=$p pss_mb=$((kb / 1024))"
      total=$((total + kb))
    done
    echo "workers=$n total_pss_mb=$((total / 1024))"
    kill -TERM "$pid"
    wait "$pid" || true
  done
done
