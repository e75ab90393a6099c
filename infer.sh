#!/usr/bin/env bash
# Run a model recipe. Installs what it needs on first use (torch pinned first, so nothing
# pulls a different torch build), then runs `python -m executor.cli run "$@"`.
# Usage: bash infer.sh [--model qwen] [--config FILE] [--set key=value ...] [--out DIR] [--help]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "[infer.sh] installing torch==2.13.0 (CPU build) ..." >&2
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! "$PY" -c "import yaml, ruamel.yaml, safetensors, tokenizers, pandas, matplotlib" >/dev/null 2>&1; then
  echo "[infer.sh] installing the project (pip install -e $ROOT) ..." >&2
  "$PY" -m pip install -q -e "$ROOT"
fi
cd "$ROOT"
exec "$PY" -m executor.cli run "$@"
