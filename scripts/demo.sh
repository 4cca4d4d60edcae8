#!/usr/bin/env bash
# The demo job: a small GPT trained by 8 CPU processes (TP2 x PP2 x DP2) with one spare and
# DeadPool on. Rank 5 is killed in iteration 20; the spare takes its place and the job goes
# on. At the end, the recovery timeline (runs/demo_events.png is its picture).
# Extra arguments go to pretrain_gpt.py (e.g. --deadpool-inject raise@2:30 for a transient).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
mkdir -p runs
rm -f runs/demo_events.jsonl runs/demo.jsonl
.venv/bin/deadpool-launch --nproc-per-node 8 --spares 1 \
  pretrain_gpt.py --config configs/demo.yaml --deadpool --deadpool-inject kill@5:20 \
  --deadpool-event-log runs/demo_events.jsonl --metrics-jsonl runs/demo.jsonl "$@"
echo
.venv/bin/deadpool-report runs/demo_events.jsonl
