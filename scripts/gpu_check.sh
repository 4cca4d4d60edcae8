#!/usr/bin/env bash
# One prepared check on a machine with a GPU (about 8 minutes on one H200 and 16 cores):
#   1. a CUDA torch (the machine's own, or installed from wheels), megatron-core and, when a
#      wheel is at hand, transformer-engine;
#   2. the tests marked `gpu` (tests/gpu: the CUDA snapshot off the critical path, a transient
#      reset of an NCCL job, bf16 with transformer-engine's layers for 50 iterations);
#   3. the failure-free overhead of protection, on/off in one run (scripts/bench_overhead.py),
#      for the largest model the GPU and the host's pinned snapshot buffers fit in the time
#      (one process: NCCL takes one rank per GPU, so local snapshots only, no ring);
#   4. whether the fork server could fork workers here (the imports leave CUDA uninitialised
#      and the driver unloaded: "fork_server_unfit" null);
# and ends with one JSON line.
#
#   bash scripts/gpu_check.sh                      # on the GPU machine
#   bash scripts/gpu_check.sh --fetch-wheels 3.12  # where pip reaches PyPI: wheels/ for a
#                                                  # GPU machine whose python is 3.12
# Environment: PYTHON (default python3), DEADPOOL_WHEELS (default wheels/), GPU_CHECK_OUT
# (default runs/gpu_check), GPU_CHECK_HIDDEN / GPU_CHECK_LAYERS (the overhead model).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=${DEADPOOL_WHEELS:-wheels}
OUT=${GPU_CHECK_OUT:-runs/gpu_check}

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    version=${2:?usage: gpu_check.sh --fetch-wheels PYTHON_VERSION (e.g. 3.12)}
    mkdir -p "$WHEELS"
    "$PY" -m pip download "megatron-core==0.16.1" --python-version "$version" \
        --only-binary=:all: --no-deps -d "$WHEELS"
    echo "wheels in $WHEELS (add transformer-engine's there to run its test)"
    exit 0
fi

say() { echo "[gpu_check] $(date +%H:%M:%S) $*"; }
if ! command -v nvidia-smi >/dev/null && [[ ! -e /dev/nvidia0 ]]; then
    say "no NVIDIA GPU on this machine: nothing to check (the CPU suite is scripts/test.sh)"
    echo '{"gpu": null}'
    exit 2
fi
mkdir -p "$OUT"
rm -f "$OUT/results.jsonl"
pip_install() {  # from the wheels folder first; the index only where one is reachable
    "$PY" -m pip install -q --no-deps --find-links "$WHEELS" "$@" 2>&1 | tail -3
}

if ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
    say "no CUDA torch in $PY: installing one"
    "$PY" -m pip install -q --find-links "$WHEELS" "torch>=2.4" 2>&1 | tail -3
fi
"$PY" -c "import megatron.core" 2>/dev/null || pip_install "megatron-core>=0.16.1,<0.20"
for dep in xxhash yaml psutil matplotlib pytest pytest_timeout; do
    "$PY" -c "import $dep" 2>/dev/null || pip_install "${dep/_/-}"
done
"$PY" -c "import transformer_engine" 2>/dev/null ||
    pip_install transformer-engine transformer-engine-torch 2>/dev/null ||
    say "transformer-engine not installable here: its test is skipped"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" DEADPOOL_GPU_RESULTS="$PWD/$OUT/results.jsonl"
"$PY" - <<'PYEOF'
import torch, megatron.core
print(f"[gpu_check] torch {torch.__version__}, CUDA {torch.version.cuda}, "
      f"{torch.cuda.get_device_name(0)}, megatron-core {megatron.core.__version__}")
PYEOF

say "tests marked gpu"
timeout 330 "$PY" -m pytest -q -m gpu tests/gpu -p no:cacheprovider \
    --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25

# The overhead model: as large as ~45% of the GPU (18 B/param: bf16 weights, fp32 main,
# Adam moments, fp32 grads) and ~30% of host memory (two pinned slots of 14 B/param) allow.
read -r HIDDEN LAYERS PARAMS < <("$PY" - <<'PYEOF'
import os, torch, psutil
gpu = torch.cuda.get_device_properties(0).total_memory
budget = min(0.45 * gpu / 18, 0.30 * psutil.virtual_memory().total / 28)
hidden = int(os.environ.get("GPU_CHECK_HIDDEN", 4096))
layers = int(os.environ.get("GPU_CHECK_LAYERS", max(2, int(budget // (12 * hidden * hidden)))))
print(hidden, layers, 12 * hidden * hidden * layers)
PYEOF
)
say "overhead: hidden $HIDDEN, $LAYERS layers (~$((PARAMS / 1000000))M parameters), bf16"
timeout 240 "$PY" scripts/bench_overhead.py --nproc 1 --replicas 0 --bf16 \
    --hidden-size "$HIDDEN" --num-layers "$LAYERS" --seq-length 2048 --micro-batch-size 1 \
    --global-batch-size 32 --warmup 3 --window 4 --windows 6 \
    --out "$OUT/bench_overhead.json" 2>&1 | tee "$OUT/bench_overhead.log" | tail -12

say "fork server: does importing torch, megatron-core and the worker leave this process forkable?"
OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 "$PY" - "$OUT" <<'PYEOF' 2>/dev/null
import json, sys
from pathlib import Path
from deadpool_megatron.agent.forkserver import DEFAULT_PRELOAD, preload, unfit_to_fork
done = preload(list(DEFAULT_PRELOAD))
Path(sys.argv[1], "fork_server.json").write_text(
    json.dumps({"fork_server_preloaded": done, "fork_server_unfit": unfit_to_fork()}))
PYEOF

"$PY" - "$OUT" "$PARAMS" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
from pathlib import Path
import torch
out, params = Path(sys.argv[1]), int(sys.argv[2])
result = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
          "overhead_params": params}
try:
    suite = ET.parse(out / "gpu_tests.xml").getroot().iter("testsuite").__next__()
    result["gpu_tests"] = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
except Exception as err:
    result["gpu_tests"] = f"no results: {err}"
if (out / "fork_server.json").exists():  # null unfit: workers fork on this GPU node
    result.update(json.loads((out / "fork_server.json").read_text()))
for line in (out / "results.jsonl").read_text().splitlines() if (out / "results.jsonl").exists() else []:
    result.update(json.loads(line))
try:
    bench = json.loads((out / "bench_overhead.json").read_text())
    result.update({k: bench.get(k) for k in ("ratio", "median_iter_ms_off", "median_iter_ms_on",
                                              "snapshot_copy_ms", "snapshot_checksum_ms",
                                              "snapshot_mb_per_iter_per_rank")})
except Exception as err:
    result["ratio"] = f"no result: {err}"
print(json.dumps(result))
PYEOF
