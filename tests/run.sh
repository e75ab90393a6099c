#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what the tests need, checks style with
# ruff (format + lint, configured in pyproject.toml), then runs pytest.
# torch is installed first and pinned so no later step can pull a different (CUDA) build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
"$PY" -c "import torch" >/dev/null 2>&1 || "$PY" -m pip install -q "torch==2.13.0"
{ "$PY" -c "import transformers, pytest, ruamel.yaml, pandas, matplotlib, safetensors, tokenizers, google.protobuf, packaging" \
  && "$PY" -m ruff --version; } >/dev/null 2>&1 || "$PY" -m pip install -q -e "$ROOT[test]"
cd "$ROOT"
"$PY" -m ruff format --check --quiet . || { echo "ruff format: run 'ruff format .' to fix" >&2; exit 1; }
"$PY" -m ruff check --quiet .
exec "$PY" -m pytest -q "$@"
