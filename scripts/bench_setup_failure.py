#!/usr/bin/env python
"""Time lost to a failure during the set-up: hot-swap versus checkpoint-restart, same job, same
failure, one run.

A rank killed during its set-up (`kill@RANK:0:setup`: its groups up and its model built; or
`--phase groups`: as its groups are about to be created, its peers waiting for it in their
rendezvous) is recovered by hot-swap as every failure before anything is trained is: every
rank sets up again in the next generation, a spare in the dead rank's seat (README, "A
failure before anything is trained"). With `--phase launch` the rank dies before it
registers with the job, and its seat starts again instead (no recovery). The baseline, `deadpool-launch --restart-policy full`, stops every
process and starts the job again. Each strategy runs the job without and with the failure,
`--repeats` times, in turns. The figure compared is the time from the failure (the injection's
event) to the first iteration done after it (its metrics record): a failure in the set-up
comes before any iteration, so the span of the iterations that bench_recovery.py measures
would not see it, and whole jobs' wall times swing by seconds between runs here (they are
reported too: time lost = the median failure run minus the median failure-free run, per
strategy). Writes JSON; the last line printed is one JSON object: {"hotswap_to_training_s",
"ckpt_restart_to_training_s", "ratio" (of those two medians), "hotswap_recovery_s" (the
recovery's own account: failure to first resumed iteration; null with --phase launch),
"hotswap_lost_s",
"ckpt_restart_lost_s" (by wall times), "bitwise" (every run's final state digest equal)}.

    python scripts/bench_setup_failure.py                  # PP2 x DP2, hidden 512, 3 repeats
    python scripts/bench_setup_failure.py --hidden-size 128 --repeats 1   # a quick look
    python scripts/bench_setup_failure.py --phase groups
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_path import results_file  # noqa: E402 (this folder, as a script)

from deadpool_megatron.events import read_events  # noqa: E402
from deadpool_megatron.metrics import read_metrics  # noqa: E402

STRATEGIES = ("hotswap", "ckpt_restart")
PHASES = ("setup", "groups", "launch")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (default 2; TP is 1)")
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=10, help="iterations per job (default 10)")
    p.add_argument("--victim", type=int, default=1, help="rank killed (default 1)")
    p.add_argument("--phase", choices=PHASES, default="setup",
                   help="where it is killed: kill@VICTIM:0:PHASE (default setup)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3,
                   help="runs of each job; figures are medians (default 3)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_setup_failure.json"),
                   type=results_file)  # fmt: skip
    a = p.parse_args(argv)
    if a.nproc < 2 or a.nproc % a.pp:
        p.error(f"--nproc {a.nproc} must be 2 or more and divisible by --pp {a.pp}")
    if not 0 <= a.victim < a.nproc:
        p.error(f"--victim {a.victim} must be a rank in [0, {a.nproc - 1}]")
    if a.repeats < 1 or a.iters < 1:
        p.error(f"--repeats {a.repeats} and --iters {a.iters} must be 1 or more")
    return a


def _command(a: argparse.Namespace, strategy: str, fail: bool, work: Path) -> list[str]:
    job = [
        "--config", str(ROOT / "configs" / "demo.yaml"), "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", str(a.pp), "--hidden-size", str(a.hidden_size),
        "--num-layers", str(a.num_layers), "--train-iters", str(a.iters),
        "--metrics-jsonl", str(work / "metrics.jsonl"),
        "--deadpool-event-log", str(work / "events.jsonl"),
    ]  # fmt: skip
    if fail:
        job += ["--deadpool-inject", f"kill@{a.victim}:0:{a.phase}"]
    launcher = [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(a.nproc)]
    if strategy == "hotswap":
        return [*launcher, "--spares", "1", "pretrain_gpt.py", *job, "--deadpool"]
    # nothing is saved before the first iteration: the restart starts from scratch, as a
    # restart from the newest checkpoint would start from its --load
    save = ["--save", str(work / "ckpt"), "--save-interval", str(a.iters)]
    return [*launcher, "--restart-policy", "full", "pretrain_gpt.py", *job, *save]


def run_job(a: argparse.Namespace, strategy: str, fail: bool, work: Path) -> dict:
    shutil.rmtree(work, ignore_errors=True)  # a previous run's checkpoint would be loaded
    work.mkdir(parents=True)
    started = time.perf_counter()
    done = subprocess.run(_command(a, strategy, fail, work), cwd=ROOT, capture_output=True,
                          text=True, timeout=900)  # fmt: skip
    wall = time.perf_counter() - started
    (work / "job.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{strategy} ({'failure' if fail else 'failure-free'}) exited "
                         f"{done.returncode}; see {work / 'job.log'}")  # fmt: skip
    _, final = read_metrics(str(work / "metrics.jsonl"))
    events = read_events(str(work / "events.jsonl"))
    injected = [e["time"] for e in events if e["event"] == "fault_injected"]
    with open(work / "metrics.jsonl") as fh:
        done_at = [r["time"] for r in map(json.loads, fh) if "iteration" in r and "time" in r]
    to_training = None
    if injected:
        to_training = min(t for t in done_at if t > injected[0]) - injected[0]
    recovered = [e["total_s"] for e in events if e["event"] == "recovery_done"]
    relaunched = [e for e in events if e["event"] == "rank_relaunched"]
    restarted = [e for e in events if e["event"] == "job_restart"]
    if fail and strategy == "hotswap" and not (relaunched if a.phase == "launch" else recovered):
        raise SystemExit(f"the hot-swap run recovered nothing; see {work / 'job.log'}")
    if fail and strategy == "ckpt_restart" and not restarted:
        raise SystemExit(f"the checkpoint-restart run did not restart; see {work / 'job.log'}")
    return {"wall_s": wall, "digest": final["state_digest"], "to_training_s": to_training,
            "recovery_s": recovered[0] if recovered else None}  # fmt: skip


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    work = out.parent / (out.stem + "_jobs")
    runs: dict[str, list[dict]] = {}
    for repeat in range(a.repeats):
        for strategy in STRATEGIES:
            for fail in (False, True):
                name = f"{strategy}_{'failure' if fail else 'free'}"
                got = run_job(a, strategy, fail, work / f"{name}_{repeat}")
                runs.setdefault(name, []).append(got)
                after = got["to_training_s"]
                print(f"{name} #{repeat + 1}: {got['wall_s']:.2f} s" + (
                    f", failure to training {after:.2f} s" if after is not None else ""),
                    flush=True)  # fmt: skip
    wall = {name: statistics.median(r["wall_s"] for r in rs) for name, rs in runs.items()}
    lost = {s: wall[f"{s}_failure"] - wall[f"{s}_free"] for s in STRATEGIES}
    recovery = [r["recovery_s"] for r in runs["hotswap_failure"] if r["recovery_s"] is not None]
    to_training = {s: statistics.median(r["to_training_s"] for r in runs[f"{s}_failure"])
                   for s in STRATEGIES}  # fmt: skip
    digests = {r["digest"] for rs in runs.values() for r in rs}
    summary = {
        "hotswap_to_training_s": round(to_training["hotswap"], 3),
        "ckpt_restart_to_training_s": round(to_training["ckpt_restart"], 3),
        "ratio": round(to_training["ckpt_restart"] / to_training["hotswap"], 2),
        "hotswap_recovery_s": round(statistics.median(recovery), 3) if recovery else None,
        "hotswap_lost_s": round(lost["hotswap"], 3),
        "ckpt_restart_lost_s": round(lost["ckpt_restart"], 3),
        "bitwise": len(digests) == 1,
        "wall_s": {name: round(w, 3) for name, w in wall.items()},
        "phase": a.phase,
        "shape": {"nproc": a.nproc, "pp": a.pp, "hidden_size": a.hidden_size,
                  "num_layers": a.num_layers, "iters": a.iters, "repeats": a.repeats},
    }  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(json.dumps(summary))
    return 0 if summary["bitwise"] else 1


if __name__ == "__main__":
    sys.exit(main())
