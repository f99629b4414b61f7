#!/usr/bin/env bash
# Install densepass on a fresh machine. Installs the CPU build of torch 2.13.0 first when torch is
# missing (an unpinned torch would pull a multi-GB CUDA build); keeps an existing torch (e.g. CUDA). Then Chromium.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
# Chromium from Debian's packages for the search page's headless-browser test (playwright drives it; it never
# downloads a browser). Installed only where it is missing and apt-get can run (as root, e.g. CI).
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null
fi
