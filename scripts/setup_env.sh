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
# torch's TCPStore looks up the name of every connection's peer (client and host alike). On
# one machine that peer is the v4-mapped loopback ::ffff:127.0.0.1, which /etc/hosts does not
# list, so each lookup goes to the DNS resolver; one that drops a query costs 5 s, in the
# store host's only event-loop thread. Where we may, list it as localhost (README: Known
# limitations).
if ! grep -qE '^::ffff:127\.0\.0\.1[[:space:]]' /etc/hosts 2>/dev/null; then
  if [ -w /etc/hosts ]; then
    echo "::ffff:127.0.0.1 localhost" >> /etc/hosts
    echo "setup_env: listed ::ffff:127.0.0.1 as localhost in /etc/hosts (torch's TCPStore looks up every connection's peer)"
  else
    echo "setup_env: /etc/hosts does not list ::ffff:127.0.0.1 and is not writable here: each store connection asks the DNS resolver for its name (README: Known limitations)" >&2
  fi
fi
