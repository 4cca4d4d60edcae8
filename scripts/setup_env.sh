#!/usr/bin/env bash
# Create .venv with everything the demo and the tests need. Idempotent.
# torch==2.13.0 is installed explicitly first: it is the CPU wheel; a bare `torch`
# requirement would make pip download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  .venv/bin/pip install --quiet --disable-pip-version-check "torch==2.13.0"
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]"
