#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what the tests need, then runs pytest.
# torch is installed first and pinned so no later step can pull a different (CUDA) build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
"$PY" -c "import torch" >/dev/null 2>&1 || "$PY" -m pip install -q "torch==2.13.0"
"$PY" -c "import transformers, pytest, ruamel.yaml, pandas, matplotlib, safetensors, tokenizers" >/dev/null 2>&1 \
  || "$PY" -m pip install -q -e "$ROOT[test]"
cd "$ROOT"
exec "$PY" -m pytest -q "$@"
