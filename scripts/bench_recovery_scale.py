#!/usr/bin/env python
"""How hot-swap recovery grows with the number of processes, measured in ONE run.

The same tiny GPT (so that 32 processes fit this machine) trains in TP1 x PP2 x DP(N/2) with
one spare for each N of --nprocs; rank N/2 - 1 (the first pipeline stage's last DP rank) is
killed in iteration --fail-at and hot-swapped. For each N the event log gives the recovery
(failure to first resumed iteration) and its phases; the metrics give the normal iteration
time, so the first resumed iteration (from the last rank's resume to its end everywhere; how
far apart the ranks resumed is `resume_skew_s`) is also a ratio to it. Each job's final state
digest is compared with a failure-free twin of the same N (--no-twins skips them). The same
failure is run again with --deadpool-keep-model, where survivors keep their model and
optimizer and only swap their process groups (--no-keep-model-run skips it; a run of it that
fails is recorded, not fatal), and once more with the spare's model also built while it was
idle (--deadpool-spare-prebuild: nobody builds during the recovery; --no-prebuilt-run skips
it), and once with the ring's replicas over gloo groups instead of TCP connections
(--deadpool-transport gloo, the way before 2026-12-03; --no-gloo-run skips it), and once
with a gloo group for every megatron-core role (DEADPOOL_GROUP_PER_ROLE=1, the way before
2026-12-05: roles of one rank list no longer share one; --no-per-role-run skips it). A
least-squares line per phase (seconds = a + b x processes) says what grows.

    python scripts/bench_recovery_scale.py                   # 4, 8, 16, 32 processes
    python scripts/bench_recovery_scale.py --nprocs 4,8      # a quick look

Writes JSON and a PNG; the last line printed is one JSON object: {"recovery_s": {N: s},
"growth_8_to_32", "first_iteration_ratio", "recovery_cpu_s" (the busiest process's CPU seconds
over the recovery, which oversubscription does not inflate), "recovery_cpu_busiest_rank"
(which process that was), "cpu_growth_8_to_32",
"cpu_bound_s" (every rank's CPU over the recovery divided by --cores: the shortest it could
take here), "recovery_over_cpu_bound", "cpu_bound_growth_8_to_32", "phase_cpu_s_mean" (each
phase's CPU seconds per process), "phase_cpu_growth_8_to_32",
"phase_slope_ms_per_process", "recovery_s_keep_model", "recovery_s_prebuilt",
"recovery_s_gloo", "recovery_s_group_per_role", ...}.
`python scripts/simulate_job.py --costs bench` reads the JSON to project 512 and 16K GPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_recovery import HOTSWAP_PHASES as PHASES  # noqa: E402 (this folder, as a script)
from results_path import pyplot, results_file  # noqa: E402 (this folder, as a script)

from deadpool_megatron.events import read_events  # noqa: E402
from deadpool_megatron.runtime import ENV_GROUP_PER_ROLE  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nprocs", default="4,8,16,32", help="process counts (default 4,8,16,32)")
    p.add_argument("--hidden-size", type=int, default=32)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--global-batch-size", type=int, default=32)
    p.add_argument("--iters", type=int, default=12, help="iterations per job (default 12)")
    p.add_argument("--fail-at", type=int, default=8, help="iteration of the kill (default 8)")
    p.add_argument("--no-twins", action="store_true", help="skip the failure-free twins")
    p.add_argument("--no-keep-model-run", action="store_true",
                   help="skip the jobs whose survivors keep their model")  # fmt: skip
    p.add_argument("--no-prebuilt-run", action="store_true",
                   help="skip the jobs in which nobody builds (models kept and prebuilt)")  # fmt: skip
    p.add_argument("--no-gloo-run", action="store_true",
                   help="skip the jobs whose replicas go over gloo groups")  # fmt: skip
    p.add_argument("--no-per-role-run", action="store_true",
                   help="skip the jobs with a gloo group for every megatron-core role")  # fmt: skip
    p.add_argument(
        "--out", default=str(ROOT / "runs" / "bench_recovery_scale.json"), type=results_file
    )
    p.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)),
                   help="cores the jobs share, for the CPU bound (default: this process's)")  # fmt: skip
    p.add_argument("--reuse", action="store_true",
                   help="summarize the jobs a previous run recorded in --out again")  # fmt: skip
    a = p.parse_args(argv)
    try:
        a.counts = sorted({int(n) for n in a.nprocs.split(",")})
    except ValueError:
        p.error(f"--nprocs {a.nprocs!r}: give even process counts separated by commas, e.g. 4,8")
    bad = [n for n in a.counts if n < 4 or n % 2 or a.global_batch_size % (n // 2)]
    if bad:
        p.error(f"--nprocs {bad}: each count must be even, at least 4, and its DP size (count/2) "
                f"must divide --global-batch-size {a.global_batch_size}")  # fmt: skip
    if not 2 < a.fail_at < a.iters:
        p.error(f"--fail-at {a.fail_at} must lie in [3, --iters {a.iters} - 1]")
    return a


def job(
    a: argparse.Namespace,
    n: int,
    workdir: Path,
    failure: bool,
    keep: bool = False,
    prebuilt: bool = False,
    transport: str | None = None,
    per_role: bool = False,
) -> dict:
    """One job of n processes (+1 spare); returns its phases, iteration time and digest.
    With `keep`, survivors keep their model through the recovery; with `prebuilt`, the spare
    also built every rank's while idle; `transport`: --deadpool-transport (None: default);
    `per_role`: a gloo group for every megatron-core role."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics, events = workdir / "metrics.jsonl", workdir / "events.jsonl"
    metrics.unlink(missing_ok=True)
    events.unlink(missing_ok=True)
    flags = ["--config", str(ROOT / "configs" / "demo.yaml"),
             "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
             "--hidden-size", str(a.hidden_size), "--num-layers", str(a.num_layers),
             "--micro-batch-size", "1", "--global-batch-size", str(a.global_batch_size),
             "--train-iters", str(a.iters), "--log-interval", "4", "--deadpool",
             "--metrics-jsonl", str(metrics), "--deadpool-event-log", str(events)]  # fmt: skip
    victim = n // 2 - 1  # the last DP rank of the first pipeline stage
    if failure:
        flags += ["--deadpool-inject", f"kill@{victim}:{a.fail_at}"]
    if keep:
        flags.append("--deadpool-keep-model")
    if prebuilt:
        flags += ["--deadpool-spare-prebuild", str(n)]
    if transport:
        flags += ["--deadpool-transport", transport]
    cmd = [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(n),
           "--spares", "1", str(ROOT / "pretrain_gpt.py"), *flags]  # fmt: skip
    start = time.time()
    env = {**os.environ, ENV_GROUP_PER_ROLE: "1"} if per_role else None
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600, env=env)
    (workdir / "job.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"the {n}-process job failed; see {workdir / 'job.log'}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    iters = [r["iteration_ms"] / 1000 for r in records
             if "iteration_ms" in r and r.get("iteration", 0) > 2]  # fmt: skip
    final = next(r for r in records if r.get("event") == "final")
    out = {"iteration_s": statistics.median(iters), "digest": final["state_digest"],
           "wall_s": time.time() - start}  # fmt: skip
    if failure:
        evs = read_events(str(events))
        phases = {e["phase"]: e["duration_s"] for e in evs if e["event"] == "recovery_phase"}
        done_ev = next(e for e in evs if e["event"] == "recovery_done")
        out["phases"] = {k: phases.get(k, 0.0) for k in PHASES}
        out["recovery_s"] = done_ev["total_s"]
        out["cpu_s_max"] = done_ev.get("cpu_s_max")  # the busiest process's CPU seconds
        out["cpu_s_mean"] = done_ev.get("cpu_s_mean")
        out["cpu_s_busiest_rank"] = done_ev.get("cpu_s_busiest_rank")
        out["phase_cpu_s_mean"] = done_ev.get("phase_cpu_s_mean")  # per process, by phase
        out["victim"] = victim
        # how far apart the ranks resumed (the first iteration is counted from the last)
        out["resume_skew_s"] = phases.get("resume_skew")
    return out


def keep_model_run(
    a: argparse.Namespace, n: int, work: Path, digest: str | None, prebuilt: bool = False,
    transport: str | None = None, per_role: bool = False,
) -> dict:  # fmt: skip
    """The same failure with --deadpool-keep-model (and with `prebuilt`, the spare's model
    built while idle), or else (`transport`) every process building with the ring's replicas
    over that transport; a job that fails is recorded as such."""
    if per_role:
        what, folder, keep = "a group for every role", "per_role", False
    elif transport:
        what, folder, keep = f"replicas over {transport}", transport, False
    else:
        what = "nobody building" if prebuilt else "survivors keeping their model"
        folder, keep = ("prebuilt" if prebuilt else "keep"), True
    try:
        kept = job(a, n, work / f"n{n}" / folder, failure=True, keep=keep, prebuilt=prebuilt,
                   transport=transport, per_role=per_role)  # fmt: skip
    except SystemExit as why:
        print(f"{n:>3} processes, {what}: FAILED ({why})", flush=True)
        return {"failed": str(why)}
    out = {k: kept[k] for k in ("recovery_s", "phases", "iteration_s", "cpu_s_mean",
                                "phase_cpu_s_mean")}  # fmt: skip
    out["bitwise_equal"] = kept["digest"] == digest if digest else None
    print(f"{n:>3} processes, {what}: recovery {kept['recovery_s']:.2f} s "
          f"(rebuild_model {kept['phases']['rebuild_model']:.2f}, first_iteration "
          f"{kept['phases']['first_iteration']:.2f}), bitwise equal to the twin: "
          f"{out['bitwise_equal']}", flush=True)  # fmt: skip
    return out


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares y = a + b x; (a, b)."""
    if len(xs) < 2:
        return (ys[0] if ys else 0.0), 0.0
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return my - b * mx, b


def summarize(a: argparse.Namespace, runs: dict[int, dict]) -> dict:
    counts = sorted(runs)
    recovery = {n: runs[n]["recovery_s"] for n in counts}
    slopes = {}
    for phase in PHASES:
        _, b = fit([float(n) for n in counts], [runs[n]["phases"][phase] for n in counts])
        slopes[phase] = round(1000 * b, 2)
    intercept, slope = fit([float(n) for n in counts], [recovery[n] for n in counts])
    ratios = [runs[n]["phases"]["first_iteration"] / runs[n]["iteration_s"] for n in counts]
    # On a machine with fewer cores than processes every phase that runs on all processes at
    # once slows with N for want of CPU, and so does a normal iteration: recovery measured in
    # normal iterations is the growth that oversubscription does not explain.
    in_iters = {n: recovery[n] / runs[n]["iteration_s"] for n in counts}
    lo, hi = (8, 32) if {8, 32} <= set(counts) else (counts[0], counts[-1])
    cpu = {n: runs[n].get("cpu_s_max") for n in counts}
    cpu_growth = round(cpu[hi] / cpu[lo], 3) if cpu[lo] and cpu[hi] else None
    bound = cpu_bound(runs, counts, a.cores)
    return {
        "recovery_s": {str(n): round(recovery[n], 3) for n in counts},
        "phases_s": {
            str(n): {k: round(v, 3) for k, v in runs[n]["phases"].items()} for n in counts
        },
        "iteration_s": {str(n): round(runs[n]["iteration_s"], 3) for n in counts},
        "recovery_in_iterations": {str(n): round(in_iters[n], 3) for n in counts},
        f"growth_{lo}_to_{hi}": round(recovery[hi] / recovery[lo], 3),
        "growth_8_to_32": round(recovery[32] / recovery[8], 3) if {8, 32} <= set(counts) else None,
        f"growth_{lo}_to_{hi}_in_iterations": round(in_iters[hi] / in_iters[lo], 3),
        "first_iteration_ratio": {str(n): round(r, 3) for n, r in zip(counts, ratios, strict=True)},
        "resume_skew_s": {str(n): runs[n].get("resume_skew_s") for n in counts},
        # CPU seconds of the busiest process over the recovery: what it would take where every
        # process has cores of its own, the growth that more cores would not remove.
        "recovery_cpu_s": {str(n): cpu[n] for n in counts},
        "recovery_cpu_s_mean": {str(n): runs[n].get("cpu_s_mean") for n in counts},
        "recovery_cpu_busiest_rank": {str(n): runs[n].get("cpu_s_busiest_rank") for n in counts},
        f"cpu_growth_{lo}_to_{hi}": cpu_growth,
        # Every rank's CPU over the recovery, spread over the machine's cores: no schedule can
        # finish sooner. Where it grows as fast as the recovery, the recovery is bound by the
        # cores, and its growth by the number of processes sharing them.
        "cores": a.cores,
        "cpu_bound_s": {str(n): round(b, 3) for n, b in bound.items()} or None,
        "recovery_over_cpu_bound": {str(n): round(recovery[n] / b, 3) for n, b in bound.items()}
        or None,
        f"cpu_bound_growth_{lo}_to_{hi}": round(bound[hi] / bound[lo], 3)
        if lo in bound and hi in bound
        else None,
        # What each phase costs one process (CPU seconds, the mean over ranks): the part of
        # the recovery's work per process that grows with the job, phase by phase.
        "phase_cpu_s_mean": {str(n): runs[n].get("phase_cpu_s_mean") for n in counts},
        f"phase_cpu_growth_{lo}_to_{hi}": _phase_growth(runs, lo, hi),
        "phase_slope_ms_per_process": slopes,
        "recovery_fit": {
            "intercept_s": round(intercept, 4),
            "s_per_process": round(slope, 6),
            "processes": counts,
        },
        "bitwise_equal": {str(n): runs[n].get("bitwise_equal") for n in counts},
        # The same failure with survivors keeping their model (None: that job failed), and
        # with the spare's model also built while it was idle: nobody builds.
        **_variant(runs, counts, "keep", "keep_model"),
        **_variant(runs, counts, "prebuilt", "prebuilt"),
        **_variant(runs, counts, "gloo", "gloo"),
        **_variant(runs, counts, "per_role", "group_per_role"),
        "shape": "TP1xPP2xDP(N/2), 1 spare",
        "hidden_size": a.hidden_size,
        "num_layers": a.num_layers,
    }


def cpu_bound(runs: dict[int, dict], counts: list[int], cores: int) -> dict[int, float]:
    """The shortest wall time the recovery's CPU allows on `cores`: every rank's CPU seconds
    over it (mean x ranks) divided by the cores, by process count (where the mean is known)."""
    return {n: runs[n]["cpu_s_mean"] * n / cores for n in counts if runs[n].get("cpu_s_mean")}


def _phase_growth(runs: dict[int, dict], lo: int, hi: int) -> dict[str, float] | None:
    """Each phase's CPU per process at `hi` processes over that at `lo`."""
    a, b = runs[lo].get("phase_cpu_s_mean"), runs[hi].get("phase_cpu_s_mean")
    if not a or not b:
        return None
    return {k: round(b[k] / a[k], 3) for k in a if k in b and a[k] > 0}


def _variant(runs: dict[int, dict], counts: list[int], key: str, name: str) -> dict:
    """A variant run's recoveries and phases by process count (None where none ran)."""
    return {
        f"recovery_s_{name}": {
            str(n): runs[n][key].get("recovery_s") for n in counts if key in runs[n]
        }
        or None,
        f"phase_cpu_s_mean_{name}": {
            str(n): runs[n][key].get("phase_cpu_s_mean") for n in counts if key in runs[n]
        }
        or None,
        f"phases_s_{name}": {
            str(n): {k: round(v, 3) for k, v in runs[n][key]["phases"].items()}
            for n in counts
            if "phases" in runs[n].get(key, {})
        }
        or None,
    }


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    counts = [int(n) for n in summary["recovery_s"]]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    bottom = [0.0] * len(counts)
    for phase in PHASES:
        vals = [summary["phases_s"][str(n)][phase] for n in counts]
        ax.bar([str(n) for n in counts], vals, bottom=bottom, label=phase)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, n in enumerate(counts):
        ax.annotate(f"{summary['recovery_s'][str(n)]:.2f} s", (i, bottom[i]), ha="center",
                    va="bottom", fontsize=8)  # fmt: skip
    for key, style, label in (
        ("recovery_s_keep_model", "kx--", "--deadpool-keep-model: survivors keep their model"),
        ("recovery_s_prebuilt", "r^:", "... and the spare's model built while idle"),
        ("recovery_s_gloo", "bs-.", "every process builds, replicas over gloo groups"),
        ("recovery_s_group_per_role", "mv-", "a gloo group for every megatron-core role"),
    ):
        line = {n: s for n, s in (summary.get(key) or {}).items() if s}
        if line:
            xs = [i for i, n in enumerate(counts) if str(n) in line]
            ax.plot(xs, [line[str(counts[i])] for i in xs], style, label=label)
    ax.set_xlabel("processes (TP1 x PP2 x DP N/2)")
    ax.set_ylabel("failure to first resumed iteration (s)")
    ax.set_title("Hot-swap recovery by job size (CPU, gloo, replicas over tcp, one killed rank)\n"
                 "bars: each phase's slowest rank (ranks wait for each other, so phases overlap); "
                 "labels: failure to first resumed iteration", fontsize=9)  # fmt: skip
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    work = out.parent / "bench_recovery_scale"
    runs: dict[int, dict] = {}
    if a.reuse:
        runs = {int(n): r for n, r in json.loads(out.read_text())["runs"].items()}
        a.counts = []  # nothing to run
    for n in a.counts:
        failed = job(a, n, work / f"n{n}" / "failure", failure=True)
        if not a.no_twins:
            twin = job(a, n, work / f"n{n}" / "free", failure=False)
            failed["bitwise_equal"] = failed["digest"] == twin["digest"]
        digest = twin["digest"] if not a.no_twins else None
        if not a.no_keep_model_run:
            failed["keep"] = keep_model_run(a, n, work, digest)
        if not a.no_prebuilt_run:
            failed["prebuilt"] = keep_model_run(a, n, work, digest, prebuilt=True)
        if not a.no_gloo_run:
            failed["gloo"] = keep_model_run(a, n, work, digest, transport="gloo")
        if not a.no_per_role_run:
            failed["per_role"] = keep_model_run(a, n, work, digest, per_role=True)
        runs[n] = failed
        ph, busiest = failed["phases"], failed["cpu_s_busiest_rank"]
        who = f"rank {busiest}" + (", the spare" if busiest == failed["victim"] else "")
        print(f"{n:>3} processes: recovery {failed['recovery_s']:.2f} s ("
              + ", ".join(f"{k} {ph[k]:.2f}" for k in PHASES)
              + f"; ranks resumed {failed['resume_skew_s'] or 0:.2f} s apart"
              + f"), CPU {failed['cpu_s_max']} s in the busiest process ({who}), per process "
              + ", ".join(f"{k} {v:.3f}" for k, v in (failed["phase_cpu_s_mean"] or {}).items())
              + f", iteration {failed['iteration_s']:.3f} s, bitwise equal to the twin: "
              f"{failed.get('bitwise_equal')}, job {failed['wall_s']:.0f} s", flush=True)  # fmt: skip
    summary = summarize(a, runs)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "runs": {str(n): r for n, r in runs.items()}},
                              indent=1))  # fmt: skip
    plot(summary, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
