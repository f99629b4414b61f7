#!/usr/bin/env bash
# Install densepass on a fresh machine. Installs the CPU build of torch 2.13.0 first when torch is
# missing (an unpinned torch would pull a multi-GB CUDA build); keeps an existing torch (e.g. CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
