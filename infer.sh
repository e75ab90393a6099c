#!/usr/bin/env bash
# Run a model recipe. Installs what it needs on first use (torch pinned first, so nothing
# pulls a different torch build), then runs `python -m executor.cli run "$@"`.
# Usage: bash infer.sh [--model qwen] [--config FILE] [--set key=value ...] [--out DIR] [--help]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
# Whether a module is installed, found without importing it: `import torch` alone took ~3 s, the
# rest ~1 s, of every run (BENCHMARKS.md, thirty-third pass).
have() { "$PY" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' "$@" >/dev/null 2>&1; }
if ! have torch; then
  echo "[infer.sh] installing torch==2.13.0 (CPU build) ..." >&2
  "$PY" -m pip install -q "torch==2.13.0"
fi
if ! have yaml ruamel.yaml safetensors tokenizers pandas matplotlib; then
  echo "[infer.sh] installing the project (pip install -e $ROOT) ..." >&2
  "$PY" -m pip install -q -e "$ROOT"
fi
cd "$ROOT"
exec "$PY" -m executor.cli run "$@"
