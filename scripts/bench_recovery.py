#!/usr/bin/env python
"""Time lost per failure: hot-swap versus checkpoint-restart, same job, same failure, one run.

For each model size, eight or ten jobs run back to back on this machine, each strategy
without and with the same failure (the same rank killed in the same iteration): hot-swap
(--deadpool, one spare); hot-swap in which nobody builds a model ("prebuilt": survivors keep
theirs, --deadpool-keep-model, and the spare built every rank's while idle,
--deadpool-spare-prebuild; "streamed", only when asked for: the same with every replica
byte and the recovery's state transfer on connections, `--deadpool-transport tcp-stream`,
where the default reads them from the serving rank's memory on one host; "smallpages", only
when asked for: the same with torch's CPU memory in pages of 4 KiB, THP_MEM_ALLOC_ENABLE=0,
where deadpool-launch's default puts it on huge pages); checkpoint-restart by our launcher (`deadpool-launch
--restart-policy full`); and the restart path users know, `torchrun --max-restarts 1` with
--load and --save (the restarts write persistent checkpoints every --save-interval
iterations); and, when --ft-launcher names nvidia-resiliency-ext's `ft_launcher` (or one is
on PATH), the same under it (two jobs more). A run's unexplained time is its span (first
iteration's finish to last iteration's finish) minus the durations of the iterations that
count (each iteration's last run); time lost per failure = the failure run's unexplained
time minus its failure-free twin's. Measured within each run, it does not depend on how
fast this shared machine computed in either (a plain difference of spans swings by
seconds), and each strategy's failure-free costs (snapshots, periodic saves) are not
counted as failure losses; the event logs break it down (detect; stop + plan, rebuild
communicators, rebuild model, transfer state, verify, first iteration, for hot-swap;
restart processes, load, replay for the restarts; torchrun's and ft_launcher's agents log
no detection, so their restart includes it). `--strategies` picks which run, `--repeats N`
runs every job N times and reports each figure's median (a recovery's phases swing by tenths
of a second between runs of one job here). Writes JSON and a PNG; the last line printed
is one JSON object:
{"hotswap_lost_s", "ckpt_restart_lost_s", "ratio", "torchrun_lost_s", "ratio_torchrun",
 "nvrx_lost_s", "ratio_nvrx" (null without ft_launcher), "hotswap_recovery_s",
 "hotswap_growth_over_sizes", "hotswap_growth_beyond_iteration" (the same for the recovery
 minus one normal iteration: the resumed iteration it ends with costs what any iteration of
 that model costs), "hotswap_growth_beyond_local_iteration" (the same minus the median of the
 iterations around the resumed one in the same run, which leaves out how fast this shared
 machine computed in each run), "hotswap_growth_to_resume" (the same for the failure to the
 moment every rank resumed: the recovery without its resumed iteration), "prebuilt_lost_s",
 "prebuilt_recovery_s", "prebuilt_growth_over_sizes", "prebuilt_growth_beyond_iteration",
 "prebuilt_growth_beyond_local_iteration", "prebuilt_growth_to_resume", ...}.

nvidia-resiliency-ext's launcher runs from an environment of its own (it only launches: the
workers run this interpreter, through --no-python), e.g.
    python -m venv runs/nvrx && runs/nvrx/bin/pip install torch==2.13.0 nvidia-resiliency-ext
    python scripts/bench_recovery.py --ft-launcher runs/nvrx/bin/ft_launcher

    python scripts/bench_recovery.py                      # demo shape TP2xPP2xDP2, 3 sizes
    python scripts/bench_recovery.py --nproc 4 --tp 1 --hidden-sizes 64 --iters 30 --fail-at 25 \\
        --save-interval 10                                 # a quick look
    python scripts/bench_recovery.py --nproc 4 --tp 1 --hidden-sizes 128,512 --iters 30 \\
        --fail-at 25 --strategies hotswap,prebuilt --repeats 3   # the two hot-swaps, medians
    python scripts/bench_recovery.py --nproc 4 --tp 1 --pp 2 --hidden-sizes 128,512 --iters 30 \\
        --fail-at 25 --strategies prebuilt,streamed --repeats 3   # state read or streamed
"""

from __future__ import annotations

import argparse
import json
import os
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

# "streamed": prebuilt with --deadpool-transport tcp-stream (every replica byte, and the
# recovery's state transfer, over connections: nothing read from a peer's memory);
# "smallpages": prebuilt with THP_MEM_ALLOC_ENABLE=0 (torch's CPU memory in pages of 4 KiB)
HOTSWAPS = (("hotswap", "hotswap"), ("prebuilt", "prebuilt"), ("prebuilt_streamed", "streamed"),
            ("prebuilt_small_pages", "smallpages"))  # fmt: skip
RESTARTS = (("ckpt_restart", "ckpt"), ("torchrun", "torchrun"), ("nvrx", "nvrx"))
HOTSWAP_PHASES = ("detect", "plan", "rebuild_communicators", "rebuild_model", "transfer_state",
                  "verify", "rebuild_pipeline", "first_iteration")  # fmt: skip


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=8, help="worker processes (default 8)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=2)
    p.add_argument(
        "--hidden-sizes",
        default="64,128,184",
        help="model sizes to sweep (default 64,128,184: 8x parameters end to end)",
    )
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=80, help="iterations per job (default 80)")
    p.add_argument(
        "--fail-at",
        type=int,
        default=75,
        help="iteration in which the rank is killed (default 75: 25 after a save)",
    )
    p.add_argument("--victim", type=int, default=3, help="rank killed (default 3)")
    p.add_argument(
        "--save-interval",
        type=int,
        default=50,
        help="checkpoint-restart's save interval (default 50)",
    )
    p.add_argument(
        "--ft-launcher",
        default=shutil.which("ft_launcher"),
        help="nvidia-resiliency-ext's ft_launcher, run as a third restart baseline (default: the "
        "one on PATH; none: skipped)",
    )
    p.add_argument(
        "--strategies",
        default="hotswap,prebuilt,ckpt,torchrun,nvrx",
        help="which to run, of hotswap, prebuilt, streamed, smallpages, ckpt, torchrun, nvrx "
        "(default all but streamed and smallpages, which are prebuilt with --deadpool-transport "
        "tcp-stream and with THP_MEM_ALLOC_ENABLE=0; nvrx only with an ft_launcher)",
    )
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each job; every figure is the median over them (default 1)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_recovery.json"), type=results_file)
    p.add_argument("--reuse", action="store_true",
                   help="re-analyse the jobs a previous run left in its work folder")  # fmt: skip
    a = p.parse_args(argv)
    a.sizes = [int(h) for h in a.hidden_sizes.split(",")]
    a.strategies = [x for x in a.strategies.split(",") if x]
    known = ("hotswap", "prebuilt", "streamed", "smallpages", "ckpt", "torchrun", "nvrx")
    unknown = [x for x in a.strategies if x not in known]
    if unknown or not a.strategies:
        p.error(f"--strategies {','.join(unknown) or '(none)'}: choose from {', '.join(known)}")
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats} must be 1 or more")
    if not 1 < a.fail_at <= a.iters:
        p.error(f"--fail-at {a.fail_at} must lie in [2, --iters {a.iters}]")
    if not 0 <= a.victim < a.nproc:
        p.error(f"--victim {a.victim} must be a rank in [0, {a.nproc - 1}]")
    if a.ft_launcher and not shutil.which(a.ft_launcher):
        p.error(f"--ft-launcher {a.ft_launcher} is not an executable (nvidia-resiliency-ext's "
                "ft_launcher, e.g. runs/nvrx/bin/ft_launcher)")  # fmt: skip
    return a


def run(a, hidden: int, mode: str, workdir: Path) -> dict:
    """One job; returns its metrics records, events and wall time."""
    workdir.mkdir(parents=True, exist_ok=True)
    metrics, events = workdir / "metrics.jsonl", workdir / "events.jsonl"
    job = ["--config", str(ROOT / "configs" / "demo.yaml"),
           "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
           "--hidden-size", str(hidden), "--num-layers", str(a.num_layers),
           "--train-iters", str(a.iters), "--log-interval", "10",
           "--metrics-jsonl", str(metrics), "--deadpool-event-log", str(events)]  # fmt: skip
    strategy, failure = mode.rsplit("_", 1)
    if failure == "failure":
        job += ["--deadpool-inject", f"kill@{a.victim}:{a.fail_at}"]
    script = str(ROOT / "pretrain_gpt.py")
    launch = [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(a.nproc)]
    env = None
    if strategy in ("hotswap", "prebuilt", "streamed", "smallpages"):
        cmd = [*launch, "--spares", "1", script, *job, "--deadpool"]
        if strategy != "hotswap":  # nobody builds: survivors keep theirs, the spare built all
            cmd += ["--deadpool-keep-model", "--deadpool-spare-prebuild", str(a.nproc)]
        if strategy == "streamed":
            cmd += ["--deadpool-transport", "tcp-stream"]
        if strategy == "smallpages":  # deadpool-launch keeps a value it is given
            env = dict(os.environ, THP_MEM_ALLOC_ENABLE="0")
    else:
        job += ["--save", str(workdir / "ckpt"), "--save-interval", str(a.save_interval)]
        cmd = [*launch, "--restart-policy", "full", script, *job]
    restart = ["--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts", "1"]
    if strategy == "torchrun":  # every process restarted by torchrun, --load from the start
        cmd = [sys.executable, "-m", "torch.distributed.run", *restart,
               script, *job, "--load", str(workdir / "ckpt")]  # fmt: skip
    elif strategy == "nvrx":  # the same under nvidia-resiliency-ext's launcher
        cmd = [a.ft_launcher, *restart, "--no-python",
               sys.executable, script, *job, "--load", str(workdir / "ckpt")]  # fmt: skip
    start = time.time()
    if not (a.reuse and metrics.exists()):
        metrics.unlink(missing_ok=True)
        events.unlink(missing_ok=True)
        shutil.rmtree(workdir / "ckpt", ignore_errors=True)  # torchrun --load's it from the start
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                              env=env)  # fmt: skip
        (workdir / "job.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            raise SystemExit(f"{mode} job (hidden {hidden}) failed; see {workdir / 'job.log'}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return {**read_run(records), "wall_s": time.time() - start,
            "events": read_events(str(events)) if events.exists() else []}  # fmt: skip


def read_run(records: list[dict]) -> dict:
    """A job's metrics records: its span (first iteration's finish to last iteration's
    finish), what of it the iterations that count did not fill, its median iteration, each
    iteration's duration, loss and final digest (a replayed iteration's last run counts)."""
    its = [r for r in records if "iteration" in r and "lm_loss" in r]
    last = {r["iteration"]: r for r in its}  # later lines win
    first_done = min(r["time"] for r in its if r["iteration"] == 1)
    span = max(r["time"] for r in its) - first_done
    useful = sum(r["iteration_ms"] for i, r in last.items() if i > 1) / 1000.0
    final = next(r for r in records if r.get("event") == "final")
    return {"span_s": span, "unexplained_s": span - useful,
            "iteration_s": statistics.median(r["iteration_ms"] for r in last.values()) / 1000.0,
            "iteration_ms": {i: r["iteration_ms"] for i, r in last.items()},
            "losses": {i: r["lm_loss"] for i, r in last.items()},
            "digest": final["state_digest"]}  # fmt: skip


NEIGHBOURS = 5  # iterations each side of the resumed one that say how fast this run computed


def local_iteration_s(iteration_ms: dict[int, float], resumed: int) -> float | None:
    """The median of the iterations around the resumed one in the same run (up to NEIGHBOURS
    before and after it, neither the first iteration nor the resumed one): how long an
    iteration took while the recovery's ran. The median over every run of a size (iter_s)
    mixes runs that computed at different speeds on this shared machine."""
    near = [ms for i, ms in iteration_ms.items()
            if i > 1 and i != resumed and abs(i - resumed) <= NEIGHBOURS]  # fmt: skip
    return statistics.median(near) / 1000.0 if near else None


def breakdown_hotswap(
    events: list[dict], iter_s: float, iteration_ms: dict[int, float] | None = None
) -> dict:
    phases = {e["phase"]: e["duration_s"] for e in events if e["event"] == "recovery_phase"}
    done = next(e for e in events if e["event"] == "recovery_done")
    out = {k: phases.get(k, 0.0) for k in HOTSWAP_PHASES}
    out["replay"] = done["replayed_iterations"] * iter_s
    out["recovery_total_s"] = done["total_s"]
    # The recovery ends with one resumed iteration, which costs what any iteration of this
    # model costs: what is left beyond it is the part that should not grow with the model.
    out["beyond_iteration_s"] = done["total_s"] - iter_s
    # Failure to the moment the last rank resumed: the recovery without the resumed iteration,
    # whose duration swings with the machine (by +-0.2 s at 12.7M here) more than the rest.
    out["to_resume_s"] = done["total_s"] - phases.get("first_iteration", 0.0)
    # The same beyond the iterations around it in this run: the resumed iteration's own extra
    # cost (a warm-up) still counts, the run's speed against the other runs' does not.
    local = local_iteration_s(iteration_ms or {}, done["iteration"] + 1)
    out["local_iteration_s"] = local if local is not None else iter_s
    out["beyond_local_iteration_s"] = done["total_s"] - out["local_iteration_s"]
    out["bytes_moved"] = done["bytes_moved"]
    return out


def breakdown_restart(events: list[dict], iter_s: float, fail_at: int) -> dict:
    """Checkpoint-restart's phases; under torchrun, whose agent logs no detection, detection
    is counted in restart_processes (failure to the restarted processes' load)."""
    injected = next(e for e in events if e["event"] == "fault_injected")["time"]
    detected = next((e["time"] for e in events if e["event"] == "failure_detected"), injected)
    loaded = next(e for e in events if e["event"] == "checkpoint_loaded")
    return {
        "detect": detected - injected,
        "restart_processes": loaded["time"] - loaded["load_s"] - detected,
        "load": loaded["load_s"],
        "replay": (fail_at - 1 - loaded["iteration"]) * iter_s,
        "loaded_iteration": loaded["iteration"],
    }


def params_of(hidden: int, layers: int, vocab: int = 128, seq: int = 32) -> int:
    """GPT parameters: per layer 12 h^2 + 13 h, embeddings (vocab + positions) x h."""
    return layers * (12 * hidden * hidden + 13 * hidden) + (vocab + seq) * hidden + 2 * hidden


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [f"h={r['hidden_size']}\n{r['parameters'] / 1e6:.2f}M params" for r in results]
    bars = [
        ("torchrun", "torchrun --max-restarts"),
        ("nvrx", "nvidia-resiliency-ext ft_launcher"),
        ("ckpt_restart", "checkpoint-restart (deadpool-launch)"),
        ("hotswap", "DeadPool hot-swap"),
        ("prebuilt", "hot-swap, models kept and prebuilt"),
        ("prebuilt_streamed", "the same, state streamed (tcp-stream)"),
        ("prebuilt_small_pages", "the same, memory in 4 KiB pages"),
    ]
    bars = [(key, label) for key, label in bars if key in results[0]]  # fmt: skip
    width = 0.8 / len(bars)
    x = range(len(results))
    for n, (key, label) in enumerate(bars):
        dx = (n - (len(bars) - 1) / 2) * width
        lost = [r[key]["lost_s"] for r in results]
        ax.bar([i + dx for i in x], lost, width=width, label=label)
        for i in x:
            ax.annotate(f"{lost[i]:.2f} s" if key in dict(HOTSWAPS) else f"{lost[i]:.1f} s",
                        (i + dx, lost[i]), ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_xticks(list(x), labels)
    ax.set_ylabel("time lost per failure (s)")
    ax.set_title("One killed rank, same job, same failure point (CPU, gloo)")
    every = [r[key]["lost_s"] for r in results for key, _ in bars]
    # room above the bars for the legend; below zero when a noisy figure came out negative,
    # which a floor at zero would hide
    ax.set_ylim(min(0.0, 1.2 * min(every)), max(every) * 1.45)
    ax.axhline(0, color="black", linewidth=0.5)
    ax.legend(loc="upper center", ncol=2, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _median_breakdown(parts: list[dict]) -> dict:
    """Each figure's median over repeats (one repeat: itself); a hot-swap's recoveries kept
    too."""
    out = {k: statistics.median(p[k] for p in parts) for k in parts[0]}
    if "recovery_total_s" in parts[0]:  # a hot-swap's
        out["recovery_runs_s"] = [p["recovery_total_s"] for p in parts]
    return out


def _growth(results: list[dict], key: str, field: str) -> float | None:
    if key not in results[0]:
        return None
    return results[-1][key][field] / results[0][key][field] - 1.0


def _line(r: dict, iter_s: float) -> str:
    parts = []
    for key, label in (("hotswap", "hot-swap"), ("prebuilt", "hot-swap prebuilt"),
                       ("prebuilt_streamed", "hot-swap prebuilt, streamed"),
                       ("prebuilt_small_pages", "hot-swap prebuilt, 4 KiB pages")):  # fmt: skip
        if key in r:
            h = r[key]
            parts.append(
                f"{label} {h['lost_s']:.2f} s (recovery {h['recovery_total_s']:.2f} s, "
                f"{h['beyond_iteration_s']:.2f} s beyond one iteration, "
                f"{h['beyond_local_iteration_s']:.2f} s beyond one of its own run's "
                f"({h['local_iteration_s']:.2f} s), every rank resumed after "
                f"{h['to_resume_s']:.2f} s: "
                + ", ".join(f"{k} {h[k]:.3f}" for k in HOTSWAP_PHASES)
                + ")"
            )
    for key, label in (("ckpt_restart", "checkpoint-restart"),
                       ("nvrx", "nvidia-resiliency-ext ft_launcher"),
                       ("torchrun", "torchrun --max-restarts")):  # fmt: skip
        if key in r:
            c = r[key]
            parts.append(f"{label} {c['lost_s']:.2f} s (detect {c['detect']:.3f}, restart "
                         f"{c['restart_processes']:.2f}, load {c['load']:.2f}, replay "
                         f"{c['replay']:.2f})")  # fmt: skip
    return (f"hidden {r['hidden_size']} ({r['parameters'] / 1e6:.2f}M params, "
            f"{iter_s * 1000:.0f} ms/iter): lost per failure: " + "; ".join(parts)
            + f"; bitwise equal to failure-free: {r['bitwise_equal']}")  # fmt: skip


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    work = out.parent / "bench_recovery"
    results = []
    if not a.ft_launcher and "nvrx" in a.strategies:
        print("nvidia-resiliency-ext's ft_launcher not found: its baseline is skipped "
              "(--ft-launcher PATH)", flush=True)  # fmt: skip
        a.strategies.remove("nvrx")
    modes = [f"{m}_{kind}" for m in a.strategies for kind in ("free", "failure")]
    hotswaps = [(k, m) for k, m in HOTSWAPS if m in a.strategies]
    restarts = [(k, m) for k, m in RESTARTS if m in a.strategies]
    for hidden in a.sizes:
        runs = {
            m: [run(a, hidden, m, work / f"h{hidden}" / (m if i == 0 else f"{m}-r{i + 1}"))
                for i in range(a.repeats)]
            for m in modes
        }  # fmt: skip
        reference = runs[modes[0]][0]
        iter_s = statistics.median(r_["iteration_s"] for m in modes for r_ in runs[m])
        r = {"hidden_size": hidden, "parameters": params_of(hidden, a.num_layers),
             "iteration_s": iter_s, "repeats": a.repeats,
             "bitwise_equal": {m: all(x["digest"] == reference["digest"] for x in runs[m])
                               for m in modes}}  # fmt: skip
        for key, mode in hotswaps:
            r[key] = _median_breakdown(
                [
                    breakdown_hotswap(x["events"], iter_s, x["iteration_ms"])
                    for x in runs[f"{mode}_failure"]
                ]  # fmt: skip
            )
        for key, mode in restarts:
            r[key] = _median_breakdown(
                [breakdown_restart(x["events"], iter_s, a.fail_at)
                 for x in runs[f"{mode}_failure"]]
            )  # fmt: skip
        for key, mode in [*hotswaps, *restarts]:
            failed, free = runs[f"{mode}_failure"], runs[f"{mode}_free"]
            median = lambda xs, f: statistics.median(x[f] for x in xs)  # noqa: E731
            r[key]["lost_s"] = median(failed, "unexplained_s") - median(free, "unexplained_s")
            r[key]["span_difference_s"] = median(failed, "span_s") - median(free, "span_s")
        results.append(r)
        print(_line(r, iter_s), flush=True)
    first = results[0]
    lost = lambda key: first[key]["lost_s"] if key in first else None  # noqa: E731
    ratio = lambda key: (  # noqa: E731
        lost(key) / max(first["hotswap"]["lost_s"], 1e-9)
        if key in first and "hotswap" in first
        else None
    )
    summary = {
        "hotswap_lost_s": lost("hotswap"),
        "ckpt_restart_lost_s": lost("ckpt_restart"),
        "ratio": ratio("ckpt_restart"),
        "torchrun_lost_s": lost("torchrun"),
        "ratio_torchrun": ratio("torchrun"),
        "nvrx_lost_s": lost("nvrx"),
        "ratio_nvrx": ratio("nvrx"),
    }
    for key, _ in HOTSWAPS:
        summary[f"{key}_lost_s"] = lost(key)
        summary[f"{key}_recovery_s"] = first[key]["recovery_total_s"] if key in first else None
        summary[f"{key}_growth_over_sizes"] = _growth(results, key, "recovery_total_s")
        summary[f"{key}_growth_beyond_iteration"] = _growth(results, key, "beyond_iteration_s")
        summary[f"{key}_growth_to_resume"] = _growth(results, key, "to_resume_s")
        summary[f"{key}_growth_beyond_local_iteration"] = _growth(
            results, key, "beyond_local_iteration_s"
        )
    summary.update({
        "parameters_ratio": results[-1]["parameters"] / first["parameters"],
        "save_interval": a.save_interval,
        "shape": f"TP{a.tp}xPP{a.pp}x{a.nproc // (a.tp * a.pp)}DP",
        "nproc": a.nproc,
        "repeats": a.repeats,
        "bitwise_equal": all(all(r["bitwise_equal"].values()) for r in results),
    })  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "sizes": results}, indent=1))
    plot(results, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
