#!/usr/bin/env bash
# The demo job: a small GPT trained by 8 CPU processes (TP2 x PP2 x DP2) with one idle spare,
# with DeadPool's in-memory checkpoint (snapshots + DP-ring replicas) on.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
mkdir -p runs
exec .venv/bin/deadpool-launch --nproc-per-node 8 --spares 1 \
  pretrain_gpt.py --config configs/demo.yaml --deadpool --metrics-jsonl runs/demo.jsonl "$@"
