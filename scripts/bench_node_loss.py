#!/usr/bin/env python
"""A whole node lost: time from the loss to the first resumed iteration, one run beside its
failure-free twin.

Two multi-node jobs run back to back on this machine, one agent per node as under Slurm
(deadpool_megatron/agent/local.py; scripts/slurm/pretrain_gpt.sbatch starts the same agents):
NNODES worker nodes of NPROC processes in DP (two DP peers per node by default) and one spare
node. In the second, node --victim-node (its agent and every process on it) is SIGKILLed once
iteration --fail-at is logged. Reported from the event log and the metrics: the time from the
kill to the end of the first resumed iteration, its phases, how much of it is the agents' own
work (noticing the lapsed lease, planning) rather than the processes' (rebuilding, restoring,
the first iteration), iterations re-executed, the time lost against the failure-free twin
(unexplained time, as scripts/bench_recovery.py measures it), and whether the two runs are
bitwise equal. The last line printed is one JSON object; the goal is kill_to_resumed_s <= 5
with replayed_iterations <= 1.

    python scripts/bench_node_loss.py                     # 3 worker nodes x 2 + 1 spare node
    python scripts/bench_node_loss.py --node-timeout 1.0  # a shorter lease timeout
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_path import results_file  # noqa: E402 (this folder, as a script)

from deadpool_megatron.agent.local import start_local_nodes  # noqa: E402
from deadpool_megatron.events import read_events  # noqa: E402

AGENT_PHASES = ("detect", "plan")
PROCESS_PHASES = ("rebuild_communicators", "rebuild_model", "transfer_state", "verify",
                  "rebuild_pipeline", "first_iteration")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nnodes", type=int, default=3, help="worker nodes (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes per node (default 2)")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--fail-at", type=int, default=12, help="kill once this iteration is logged")
    p.add_argument("--victim-node", type=int, default=1, help="node to lose (not 0: its agent "
                   "hosts the store)")  # fmt: skip
    p.add_argument("--node-timeout", type=float, default=2.0,
                   help="--deadpool-node-timeout (default 2.0 s)")  # fmt: skip
    p.add_argument("--out", default="runs/bench_node_loss.json", type=results_file)
    a = p.parse_args(argv)
    if not 0 < a.victim_node < a.nnodes:
        p.error(f"--victim-node {a.victim_node} must be a worker node other than 0 "
                f"(1 to {a.nnodes - 1})")  # fmt: skip
    if not 1 < a.fail_at < a.iters:
        p.error(f"--fail-at {a.fail_at} must lie between 2 and --iters - 1 ({a.iters - 1})")
    return a


def run(a, workdir: Path, kill: bool) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    events = workdir / "events.jsonl"
    events.unlink(missing_ok=True)
    (workdir / "metrics.jsonl").unlink(missing_ok=True)
    dp = a.nnodes * a.nproc
    job = ["--config", str(ROOT / "configs" / "demo.yaml"), "--tensor-model-parallel-size", "1",
           "--pipeline-model-parallel-size", "1", "--global-batch-size", str(2 * dp),
           "--train-iters", str(a.iters), "--log-interval", "10", "--deadpool",
           "--deadpool-node-timeout", str(a.node_timeout),
           "--deadpool-event-log", str(events)]  # fmt: skip
    nodes = start_local_nodes(workdir, str(ROOT / "pretrain_gpt.py"), a.nnodes, 1, a.nproc, job,
                              cwd=str(ROOT))  # fmt: skip
    killed_at = None
    try:
        if kill:
            nodes.wait_for_iteration(a.fail_at, 600)
            killed_at = nodes.kill_node(a.victim_node)
        rcs = nodes.wait(1800)
    finally:
        nodes.stop()
    expected = [None if n == a.victim_node and kill else 0 for n in range(a.nnodes + 1)]
    got = [None if n == a.victim_node and kill else rc for n, rc in enumerate(rcs)]
    if got != expected:
        raise SystemExit(f"job failed (agent exit statuses {rcs}); see {workdir}/node*.log")
    records = [json.loads(x) for x in nodes.metrics.read_text().splitlines() if x.strip()]
    its = [r for r in records if "iteration" in r and "lm_loss" in r]
    last = {r["iteration"]: r for r in its}  # a re-executed iteration's last run counts
    span = max(r["time"] for r in its) - min(r["time"] for r in its if r["iteration"] == 1)
    useful = sum(r["iteration_ms"] for i, r in last.items() if i > 1) / 1000.0
    return {
        "unexplained_s": span - useful,
        "iteration_s": statistics.median(r["iteration_ms"] for r in last.values()) / 1000.0,
        "losses": {i: r["lm_loss_hex"] for i, r in last.items()},
        "digest": next(r for r in records if r.get("event") == "final")["state_digest"],
        "events": read_events(str(events)),
        "killed_at": killed_at,
    }


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    work = out.parent / "bench_node_loss"
    free = run(a, work / "free", kill=False)
    lost = run(a, work / "node_lost", kill=True)
    ev = lost["events"]
    done = next(e for e in ev if e["event"] == "recovery_done")
    started = next(e for e in ev if e["event"] == "recovery_started")
    phases = {e["phase"]: e["duration_s"] for e in ev if e["event"] == "recovery_phase"}
    # recovery_done's total_s runs from the lost node's last lease renewal (before the kill);
    # the first resumed iteration finished at that renewal + total_s.
    node_lost = next(e for e in ev if e["event"] == "node_lost")
    resumed_at = node_lost["last_lease"] + done["total_s"]
    failed_at = lost["killed_at"]
    summary = {
        "kill_to_resumed_s": resumed_at - failed_at,
        "agents_s": {k: phases.get(k, 0.0) for k in AGENT_PHASES},
        "processes_s": {k: phases.get(k, 0.0) for k in PROCESS_PHASES},
        "kill_to_order_s": started["time"] - failed_at,
        "replayed_iterations": done["replayed_iterations"],
        "replaced": done["replaced"],
        "lost_s": lost["unexplained_s"] - free["unexplained_s"],
        "iteration_s": free["iteration_s"],
        "node_timeout_s": a.node_timeout,
        "bitwise_equal": lost["losses"] == free["losses"] and lost["digest"] == free["digest"],
        "shape": f"{a.nnodes} worker nodes x {a.nproc} (DP{a.nnodes * a.nproc}) + 1 spare node",
    }
    print(
        f"node {a.victim_node} lost: first resumed iteration {summary['kill_to_resumed_s']:.2f} s "
        f"after the kill (recovery ordered after {summary['kill_to_order_s']:.2f} s); agents: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in summary["agents_s"].items())
        + "; processes: "
        + ", ".join(f"{k} {v:.3f} s" for k, v in summary["processes_s"].items())
        + f"; {summary['replayed_iterations']} iteration(s) re-executed; time lost against the "
        f"failure-free run {summary['lost_s']:.2f} s ({summary['iteration_s'] * 1000:.0f} ms per "
        f"iteration); bitwise equal: {summary['bitwise_equal']}",
        flush=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
