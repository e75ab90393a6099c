#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what the tests need, checks style with
# ruff (format + lint, configured in pyproject.toml), then runs pytest on min(cores, 4) workers
# (pytest-xdist, one test file per worker at a time so module fixtures are built once), or
# $CANN_RECIPES_TEST_WORKERS; arguments after the command go to pytest (`-n 0`: one process).
# Why workers: a test spends much of its time in one thread (Python start-up, tracing, C++ builds),
# so on the 2-core reference machine the suite ran 26 min in one process and 19.5 in two.
# torch is installed first and pinned so no later step can pull a different (CUDA) build.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
# What is installed is found without importing it (infer.sh's `have`: importing torch alone takes ~3 s).
have() { "$PY" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' "$@" >/dev/null 2>&1; }
have torch || "$PY" -m pip install -q "torch==2.13.0"
{ have transformers pytest xdist ruamel.yaml pandas matplotlib safetensors tokenizers google.protobuf packaging \
  && "$PY" -m ruff --version; } >/dev/null 2>&1 || "$PY" -m pip install -q -e "$ROOT[test]"
cd "$ROOT"
"$PY" -m ruff format --check --quiet . || { echo "ruff format: run 'ruff format .' to fix" >&2; exit 1; }
"$PY" -m ruff check --quiet .
CORES="$(nproc 2>/dev/null || echo 1)"
WORKERS="${CANN_RECIPES_TEST_WORKERS:-$(( CORES < 4 ? CORES : 4 ))}"
PARALLEL=()
if [ "$WORKERS" -gt 1 ]; then PARALLEL=(-n "$WORKERS" --dist loadfile); fi
exec "$PY" -m pytest -q "${PARALLEL[@]}" "$@"
