#!/usr/bin/env python
"""Soak: one job, many failures of every kind, ending bitwise identical to its failure-free twin.

The fault plan is drawn from a seed (the same seed, the same plan): process kills in every
phase, hangs, transient errors, idle spares killed, a spare killed while it recovers, and
replicas corrupted in flight, spaced so that no recovery loses two adjacent ring ranks at
once. The job runs with spares and replenishment on (the pool refills as processes are lost);
a failure-free twin of the same flags runs first. While the soak job runs, each recovery's
time is read from the event log and every live process that holds a rank is sampled from /proc
(open file descriptors, threads, anonymous RSS) while each generation trains, once it has collected the
generation before; a generation's last sample before the next fault counts. Growth is
measured per process, as the rise of its floor across the generations it was sampled in
(`growth`).

    python scripts/soak.py                       # 8 workers, 2 spares, 30 faults, ~10 min
    python scripts/soak.py --failures 6 --iters-per-failure 6   # the short form (the suite)

The last line printed is one JSON object: failures, recovered, bitwise_equal, fd_growth,
thread_growth, rss_growth_mb, rss_growth_pct, false_accusations, models_outlived (a left
generation's model still alive after its recovery's collection), and the run's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deadpool_megatron.agent.local import FORK_SERVER_READY  # noqa: E402
from deadpool_megatron.events import read_events  # noqa: E402
from deadpool_megatron.metrics import (  # noqa: E402
    every_execution_equal,
    read_executions,
    read_metrics,
)

PHASES = ("forward", "backward", "optimizer", "snapshot", "replicate")
KINDS = ("kill", "hang", "raise", "kill-spare", "kill-in-recovery", "corrupt")
JOB_TIMEOUT_S = 3600


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=8, help="worker processes (default 8)")
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    p.add_argument("--pp", type=int, default=2, help="pipeline-parallel size (default 2)")
    p.add_argument("--spares", type=int, default=2, help="spare processes (default 2)")
    p.add_argument("--failures", type=int, default=30, help="faults to inject (default 30)")
    p.add_argument("--iters-per-failure", type=int, default=25,
                   help="iterations between two faults (default 25)")  # fmt: skip
    p.add_argument("--seed", type=int, default=7, help="seed of the fault plan (default 7)")
    p.add_argument("--out", default="runs/soak", help="directory for logs and results")
    a = p.parse_args(argv)
    for name in ("nproc", "failures", "iters_per_failure"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)} must be at least 1")
    if a.iters_per_failure < 3:
        p.error(f"--iters-per-failure={a.iters_per_failure} must be at least 3 (a recovery "
                "replays one iteration and its first snapshot must be replicated)")  # fmt: skip
    if a.spares < 1:
        p.error(f"--spares={a.spares} must be at least 1 (permanent failures need a spare)")
    if a.nproc % (a.tp * a.pp) or a.nproc // (a.tp * a.pp) < 2:
        p.error(f"--nproc {a.nproc} must be a multiple of --tp x --pp = {a.tp * a.pp} with a "
                "data-parallel size of at least 2")  # fmt: skip
    return a


def fault_plan(a: argparse.Namespace) -> list[str]:
    """Seeded faults, one every --iters-per-failure iterations from iteration 4, each kind in
    turn in a shuffled order, on a random rank. Spares are killed only while the initial ones
    are surely idle (before the first permanent failure)."""
    rng = random.Random(a.seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(a.failures)]
    rng.shuffle(kinds)
    if "kill-spare" in kinds:  # first, while the initial spares are idle
        kinds.remove("kill-spare")
        kinds.insert(0, "kill-spare")
    specs = []
    for i, kind in enumerate(kinds):
        it = 4 + i * a.iters_per_failure
        rank = rng.randrange(a.nproc)
        phase = rng.choice(PHASES)
        if kind == "kill":
            specs.append(f"kill@{rank}:{it}:{phase}")
        elif kind == "hang":
            specs.append(f"hang@{rank}:{it}:{rng.choice(('forward', 'backward'))}")
        elif kind == "raise":
            specs.append(f"raise@{rank}:{it}:{phase}")
        elif kind == "kill-spare":
            specs.append(f"kill-spare@{rng.randrange(a.spares)}:{it}")
        elif kind == "kill-in-recovery":  # rank dies; whoever takes it over dies recovering
            specs += [f"kill@{rank}:{it}:{phase}", f"kill@{rank}:{it}:recovery"]
        else:  # a corrupt replica, then its owner dies: the recovery must roll back past it
            specs += [f"corrupt@{rank}:{it}", f"kill@{rank}:{it + 1}:optimizer"]
    return specs


def job_args(a: argparse.Namespace, iters: int) -> list[str]:
    return [
        "--config", str(ROOT / "configs" / "demo.yaml"),
        "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
        "--train-iters", str(iters), "--log-interval", "10", "--deadpool",
        "--deadpool-heartbeat-interval", "0.5", "--deadpool-heartbeat-timeout", "2.0",
    ]  # fmt: skip


def launch(a: argparse.Namespace, args: list[str], log: Path, spares: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(a.nproc),
           "--spares", str(spares), str(ROOT / "pretrain_gpt.py"), *args]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT)


# -- sampling /proc ------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    pid: int
    fds: int
    threads: int
    rss_mb: float


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                kids = [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def sample(pid: int) -> Sample | None:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith(("Z", "T")):  # dead, or hung on purpose
            return None
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = int(fields["Threads"])
        # Anonymous memory only: what a leak grows. File-backed pages are the libraries'
        # code, which a child forked from the fork server maps page by page as it first runs
        # it (a recovery's code paths, late), so they grow without anything leaking.
        rss_mb = int(fields["RssAnon"].split()[0]) / 1024
    except (OSError, KeyError, ValueError):
        return None
    return Sample(pid, fds, threads, rss_mb)


# A process that holds a rank, as the launcher's log names it: started as a worker, or a spare
# that took one over (an idle spare's memory is not a training process's).
PROCESS_PID = re.compile(
    r"started worker rank (\d+) \(pid (\d+)\)|spare (\d+) \(pid (\d+)\) takes over"
)
FREED = re.compile(r"^\[(worker|spare) (\d+)\] .* generation (\d+): freed the previous generation")


def collected(text: str) -> dict[int, set[int]]:
    """pid of each process that holds a rank -> the generations in which it has finished
    collecting the generation before (its "freed the previous generation" line): until then
    the left generation's groups are still being released one by one, and a sample would
    count them."""
    pids: dict[tuple[str, int], int] = {}
    for m in PROCESS_PID.finditer(text):
        label = ("worker", int(m[1])) if m[1] else ("spare", int(m[3]))
        pids[label] = int(m[2] or m[4])
    out: dict[int, set[int]] = {}
    for line in text.splitlines():
        m = FREED.match(line)
        if m and (m[1], int(m[2])) in pids:
            out.setdefault(pids[(m[1], int(m[2]))], set()).add(int(m[3]))
    return out


def watch(proc: subprocess.Popen, events_path: Path, log: Path, interval_s: float = 0.2
          ) -> dict[int, dict]:  # fmt: skip
    """Per generation that resumed: its recovery record and its last steady sample of every
    live process that holds a rank, taken while it trained, after the process finished
    collecting the generation before and before the next fault was injected (so a recovery's
    teardown and rebuild, or its collection of the generation before, is never what is
    measured: sampled during it, a process showed up to +60 descriptors and +40 threads that
    were gone a generation later)."""
    generations: dict[int, dict] = {}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while proc.poll() is None:
        if time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"the soak job did not finish within {JOB_TIMEOUT_S} s")
        time.sleep(interval_s)
        if not events_path.exists():
            continue
        events = read_events(str(events_path))
        for e in events:
            if e["event"] == "recovery_done" and e["generation"] not in generations:
                generations[e["generation"]] = {"recovery": e, "samples": [], "taken": []}
                _print_generation(generations, e["generation"] - 1)
        if not generations:
            continue
        g = max(generations)
        disturbed = any(e["event"] in ("fault_injected", "failure_detected")
                        and e.get("generation") == g for e in events)  # fmt: skip
        text = log.read_text(errors="replace")
        if disturbed or "training finished" in text:
            continue
        # A fork server forked from a zygote (--fork-zygote) is outside the launcher's tree.
        servers = [int(pid) for pid in FORK_SERVER_READY.findall(text)]
        live = {pid for root in (proc.pid, *servers) for pid in descendants(root)}
        workers = {pid for pid, done in collected(text).items() if g in done and pid in live}
        samples = [s for s in map(sample, sorted(workers)) if s is not None]
        if samples:
            taken = generations[g]["taken"]
            taken[:] = [*taken[-1:], samples]
            # The newest sample may have caught the next fault as it struck (it lands between
            # two looks at the event log): the one before it is the steady one.
            generations[g]["samples"] = taken[0]
    if generations:
        _print_generation(generations, max(generations))
    return generations


def _print_generation(generations: dict[int, dict], g: int) -> None:
    if g not in generations:
        return
    samples = generations[g]["samples"]
    print(f"generation {g:3d}: recovered in {generations[g]['recovery']['total_s']:6.2f} s; "
          f"{len(samples)} processes: fds {sum(s.fds for s in samples)}, threads "
          f"{sum(s.threads for s in samples)}, anonymous RSS {sum(s.rss_mb for s in samples):.0f} MB "
          f"(pid fds/threads/MB: {' '.join(f'{s.pid} {s.fds}/{s.threads}/{s.rss_mb:.0f}' for s in samples)})",
          flush=True)  # fmt: skip


NO_GROWTH = {"fd_growth": 0, "thread_growth": 0, "rss_growth_mb": 0.0, "rss_growth_pct": 0.0}


def growth(generations: dict[int, dict]) -> dict[str, float]:
    """The largest growth of any process holding a rank across the generations it was sampled
    in. Descriptors and threads: the floor of its later half of samples over the floor of its
    earlier half, for a process sampled in 3 generations or more. A leak stays and adds up, so
    it raises the later floor; a sample that caught a left generation still being released (up
    to +60 descriptors and +42 threads in the short soak, gone a generation later) does not.
    A process sampled twice cannot tell the two apart and is left out. RSS: its last sample
    over its first (anonymous memory: `sample`), for every process sampled at least twice."""
    per_pid: dict[int, list] = {}
    for g in sorted(generations):
        for s in generations[g]["samples"]:
            per_pid.setdefault(s.pid, []).append(s)
    twice = {pid: ss for pid, ss in per_pid.items() if len(ss) >= 2}
    followed = {pid: ss for pid, ss in per_pid.items() if len(ss) >= 3}
    if not twice:
        return dict(NO_GROWTH)
    rss = [(ss[-1].rss_mb - ss[0].rss_mb, ss[0].rss_mb) for ss in twice.values()]
    worst_mb, base = max(rss)

    def floor_growth(values: list[int]) -> int:
        half = (len(values) + 1) // 2
        return min(values[half:]) - min(values[:half])

    return {
        "fd_growth": max(
            (floor_growth([s.fds for s in ss]) for ss in followed.values()), default=0
        ),
        "thread_growth": max(
            (floor_growth([s.threads for s in ss]) for ss in followed.values()), default=0
        ),
        "rss_growth_mb": round(worst_mb, 1),
        "rss_growth_pct": round(100 * worst_mb / base, 2),
        "processes_followed": len(followed),
        "generations": len([g for g in generations if generations[g]["samples"]]),
    }


def false_accusations(events: list[dict], window_s: float = 120.0) -> list[dict]:
    """Failures detected on, or fencings of, a rank no fault was injected into shortly before
    (a fault on a rank includes one fired in the process that took it over)."""
    injected = [(e["time"], e.get("rank")) for e in events if e["event"] == "fault_injected"]
    wrong = []
    for e in events:
        if e["event"] not in ("failure_detected", "fenced"):
            continue
        if not any(r == e["rank"] and 0 <= e["time"] - t <= window_s for t, r in injected):
            wrong.append(e)
    return wrong


def main(argv=None) -> int:
    a = parse_args(argv)
    out = ROOT / a.out
    out.mkdir(parents=True, exist_ok=True)
    specs = fault_plan(a)
    iters = 4 + a.failures * a.iters_per_failure + 4
    print(f"soak: {a.nproc} workers (TP{a.tp} x PP{a.pp}), {a.spares} spares, {iters} "
          f"iterations, {a.failures} faults (seed {a.seed}): {','.join(specs)}", flush=True)  # fmt: skip
    base_metrics = out / "baseline.jsonl"
    base_metrics.unlink(missing_ok=True)
    t = time.monotonic()
    base = launch(a, [*job_args(a, iters), "--metrics-jsonl", str(base_metrics)],
                  out / "baseline.log", spares=0)  # fmt: skip
    if base.wait(timeout=JOB_TIMEOUT_S) != 0:
        raise SystemExit(f"the failure-free run failed; see {out / 'baseline.log'}")
    baseline_s = time.monotonic() - t
    print(f"failure-free run: {baseline_s:.0f} s", flush=True)
    metrics, events_path = out / "soak.jsonl", out / "events.jsonl"
    for stale in (metrics, events_path):
        stale.unlink(missing_ok=True)
    t = time.monotonic()
    proc = launch(a, [*job_args(a, iters), "--metrics-jsonl", str(metrics),
                      "--deadpool-inject", ",".join(specs),
                      "--deadpool-event-log", str(events_path)], out / "soak.log", a.spares)  # fmt: skip
    generations = watch(proc, events_path, out / "soak.log")
    soak_s = time.monotonic() - t
    events = read_events(str(events_path)) if events_path.exists() else []
    base_losses, base_final = read_metrics(str(base_metrics))
    losses, final = read_metrics(str(metrics)) if metrics.exists() else ({}, None)
    runs = read_executions(str(metrics)) if metrics.exists() else {}
    equal = (
        proc.returncode == 0 and final is not None and losses == base_losses
        and final["state_digest"] == base_final["state_digest"]
        and every_execution_equal(runs, base_losses)
    )  # fmt: skip
    done = [e for e in events if e["event"] == "recovery_done"]
    fired = [e for e in events if e["event"] == "fault_injected"]
    wrong = false_accusations(events)
    pool = [e["size"] for e in events if e["event"] == "spare_pool"]
    totals = [d["total_s"] for d in done]
    result = {
        "failures": len(fired),
        "faults_planned": len(specs),
        "recoveries": len(done),
        "recovered": proc.returncode == 0,
        "bitwise_equal": equal,
        **growth(generations),
        "false_accusations": len(wrong),
        # a generation's model alive after its recovery's collection (logged with its holder)
        "models_outlived": (out / "soak.log")
        .read_text(errors="replace")
        .count("outlived its collection"),
        "recovery_s_median": round(statistics.median(totals), 2) if totals else None,
        "recovery_s_max": round(max(totals), 2) if totals else None,
        "spares_started": sum(1 for e in events if e["event"] == "spare_started"),
        "spare_pool_min": min(pool) if pool else None,
        "soak_s": round(soak_s, 1),
        "baseline_s": round(baseline_s, 1),
        "iterations": iters,
        "seed": a.seed,
    }
    for e in wrong:
        print(f"false accusation: {e}", flush=True)
    (out / "soak_result.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)
    return 0 if result["recovered"] and equal and not wrong else 1


if __name__ == "__main__":
    sys.exit(main())
