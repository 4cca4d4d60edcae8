#!/usr/bin/env bash
# Lint and run the whole test suite (unit tests, then real multi-process jobs on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
.venv/bin/ruff check .
.venv/bin/ruff format --check .
exec .venv/bin/python -m pytest -q "$@"
