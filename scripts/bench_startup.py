#!/usr/bin/env python
"""What starting a job's processes costs, with the fork server, without it, and with the fork
server forked from a zygote, in ONE run.

The same job (the demo shape by default: TP2 x PP2 x DP2, 8 workers and one spare, on CPU)
is launched --repeats times in each mode, in turns (so drift on a shared machine hits
each): with the fork server (the default: every worker and spare forked from one process
that imported torch and megatron-core once), with --no-fork-server (each an interpreter
of its own, as torchrun starts them), and with --fork-zygote (the fork server forked ready
from a zygote that this script starts once, before the jobs, and times). Spare 0 is killed
at --kill-spare-at, so the pool's replenishment (a fresh spare started and registered
during training) is timed too.

Per job: the time from the launch to the first iteration's end, the whole job's wall time,
the CPU seconds of every process the launcher started (from its own rusage of waited-for
children), and how long the replenishing spare took from its start to its registration.

Before the jobs, what the fork server (and every process started without it) imports first is
timed in fresh interpreters, --preload-repeats times each way, alternating: megatron-core as
it comes (its fused kernels wrapped in torch.compile as it loads, which imports Inductor's
compiler) and with torch.compile deferred to each kernel's first call
(deadpool_megatron/megatron/core_import.py, what the processes do); both with TorchDynamo and
our worker module.

    python scripts/bench_startup.py                  # 8 workers + 1 spare, 3 repeats
    python scripts/bench_startup.py --nproc 4 --repeats 2

The last line printed is one JSON object: {"first_iteration_s": {"fork": .., "spawn": ..,
"zygote": ..}, "speedup_first_iteration", "job_cpu_s", "spare_ready_s", "wall_s",
"end_s" (from the last iteration's end to the launcher's exit), "zygote_ready_s" (the
zygote's start to listening, paid once per node),
"preload_s": {"eager": .., "deferred": ..}, ...}; it also writes
runs/bench_startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_path import results_file  # noqa: E402 (this folder, as a script)

from deadpool_megatron.agent.zygote import listening  # noqa: E402
from deadpool_megatron.events import read_events  # noqa: E402

MODES = ("fork", "spawn", "zygote")
PRELOADS = {
    "eager": "import torch, megatron.core, torch._dynamo, deadpool_megatron.process.worker",
    "deferred": "import torch\n"
    "from deadpool_megatron.megatron.core_import import import_megatron_core\n"
    "import_megatron_core()\n"
    "import deadpool_megatron.process.worker",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=8, help="workers (default 8: TP2 x PP2 x DP2)")
    p.add_argument("--repeats", type=int, default=3, help="jobs per mode (default 3)")
    p.add_argument("--iters", type=int, default=48,
                   help="iterations per job (default 48: long enough for a spare started as "
                   "its own interpreter to register before the end)")  # fmt: skip
    p.add_argument("--kill-spare-at", type=int, default=3,
                   help="iteration at which spare 0 is killed (default 3; 0: never)")  # fmt: skip
    p.add_argument("--preload-repeats", type=int, default=5,
                   help="fresh interpreters per way of importing (default 5; 0: none)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_startup.json"), type=results_file)
    a = p.parse_args(argv)
    if a.nproc not in (4, 8):
        p.error(f"--nproc {a.nproc}: 4 (TP2 x PP2) or 8 (TP2 x PP2 x DP2)")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats} must be at least 1")
    if a.preload_repeats < 0:
        p.error(f"--preload-repeats {a.preload_repeats} must be 0 or more")
    if not 0 <= a.kill_spare_at < a.iters:
        p.error(f"--kill-spare-at {a.kill_spare_at} must lie in [0, --iters {a.iters} - 1]")
    return a


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def start_zygote(folder: Path) -> tuple[subprocess.Popen, str, float]:
    """The zygote's process, socket and seconds from its start to listening."""
    folder.mkdir(parents=True, exist_ok=True)
    path = str(Path(tempfile.mkdtemp(prefix="deadpool-zygote-")) / "z.sock")  # <= 107 bytes
    start = time.perf_counter()
    with open(folder / "zygote.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "deadpool_megatron.agent.zygote", "--socket", path],
            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    while not listening(path):
        if proc.poll() is not None:
            raise SystemExit(f"the zygote failed; see {folder / 'zygote.log'}")
        time.sleep(0.05)
    return proc, path, time.perf_counter() - start


def reaped_cpu_s(pid: int | None) -> float:
    """CPU seconds of the children that process `pid` has waited for (cutime + cstime)."""
    if pid is None:
        return 0.0
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def job(a: argparse.Namespace, mode: str, workdir: Path, zygote: str = "",
        zygote_pid: int | None = None) -> dict:  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    metrics, events = workdir / "metrics.jsonl", workdir / "events.jsonl"
    metrics.unlink(missing_ok=True)
    events.unlink(missing_ok=True)
    flags = ["--config", str(ROOT / "configs" / "demo.yaml"), "--train-iters", str(a.iters),
             "--log-interval", "4", "--deadpool", "--metrics-jsonl", str(metrics),
             "--deadpool-event-log", str(events)]  # fmt: skip
    if a.kill_spare_at:
        flags += ["--deadpool-inject", f"kill-spare@0:{a.kill_spare_at}"]
    launcher = {"fork": [], "spawn": ["--no-fork-server"], "zygote": ["--fork-zygote", zygote]}[
        mode
    ]
    cmd = [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(a.nproc),
           "--spares", "1", *launcher, str(ROOT / "pretrain_gpt.py"), *flags]  # fmt: skip
    cpu0, start = children_cpu_s() + reaped_cpu_s(zygote_pid), time.time()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    wall = time.time() - start
    # The launcher and everything it waited for, and, for a fork server forked from the
    # zygote, that server and its children, which the zygote waits for instead.
    cpu = children_cpu_s() + reaped_cpu_s(zygote_pid) - cpu0
    (workdir / "job.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the {mode} job failed; see {workdir / 'job.log'}")
    if mode == "zygote" and "forked from the zygote" not in done.stdout + done.stderr:
        raise SystemExit(f"the zygote did not fork the server; see {workdir / 'job.log'}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    first = min(r["time"] for r in records if r.get("iteration") == 1)
    last = max(r["time"] for r in records if "time" in r)  # the last iteration's end
    out = {"first_iteration_s": first - start, "wall_s": wall, "job_cpu_s": cpu,
           "end_s": start + wall - last,
           "digest": next(r for r in records if r.get("event") == "final")["state_digest"]}  # fmt: skip
    evs = read_events(str(events))
    started = {e["spare"]: e["time"] for e in evs if e["event"] == "spare_started"}
    registered = {e["spare"]: e["time"] for e in evs if e["event"] == "spare_registered"}
    fresh = [s for s in started if s in registered and s != 0]
    out["spare_ready_s"] = registered[fresh[0]] - started[fresh[0]] if fresh else None
    return out


def preload_s(way: str) -> float:
    """Seconds a fresh interpreter takes to import what a process of the job imports first."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", PRELOADS[way]], cwd=ROOT, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    return time.perf_counter() - start


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(statistics.median(values), 3) if values else None


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.out).with_suffix("")
    preloads: dict[str, list[float]] = {w: [] for w in PRELOADS}
    for i in range(a.preload_repeats):
        for way in PRELOADS if i % 2 == 0 else list(PRELOADS)[::-1]:
            preloads[way].append(preload_s(way))
    if a.preload_repeats:
        print("importing torch, megatron-core, Dynamo and the worker in a fresh interpreter: "
              + ", ".join(f"{w} {median(v):.2f} s" for w, v in preloads.items())
              + f" (medians of {a.preload_repeats})", flush=True)  # fmt: skip
    zygote, socket_path, zygote_ready = start_zygote(work)
    print(f"zygote listening {zygote_ready:.2f} s after its start (once per node)", flush=True)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        for i in range(a.repeats):
            for mode in MODES[i % len(MODES) :] + MODES[: i % len(MODES)]:
                r = job(a, mode, work / f"{mode}-{i}", socket_path, zygote.pid)
                runs[mode].append(r)
                ready = f"{r['spare_ready_s']:.2f} s" if r["spare_ready_s"] is not None else "-"
                print(f"{mode:>6} #{i}: first iteration done {r['first_iteration_s']:.1f} s after "
                      f"the launch, job {r['wall_s']:.1f} s (its end {r['end_s']:.1f} s after the "
                      f"last iteration's), {r['job_cpu_s']:.1f} CPU s, fresh spare ready in "
                      f"{ready}", flush=True)  # fmt: skip
    finally:
        zygote.terminate()
        zygote.wait()
    digests = {r["digest"] for m in MODES for r in runs[m]}
    summary = {
        key: {m: median([r[key] for r in runs[m]]) for m in MODES}
        for key in ("first_iteration_s", "wall_s", "job_cpu_s", "spare_ready_s", "end_s")
    }
    fork, spawn = summary["first_iteration_s"]["fork"], summary["first_iteration_s"]["spawn"]
    summary["speedup_first_iteration"] = round(spawn / fork, 2)
    summary["zygote_ready_s"] = round(zygote_ready, 3)
    summary["preload_s"] = {w: median(v) for w, v in preloads.items()}
    summary["preload_runs_s"] = {w: [round(x, 3) for x in v] for w, v in preloads.items()}
    summary["bitwise_equal"] = len(digests) == 1
    summary["processes"] = a.nproc + 1
    summary["repeats"] = a.repeats
    summary["runs"] = runs
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(summary, indent=1))
    short = {k: v for k, v in summary.items() if k != "runs"}
    print(json.dumps(short))
    return 0 if summary["bitwise_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
