#!/usr/bin/env python
"""Patched Megatron-LM's hot-swap against its checkpoint-restart, measured: time lost per
failure, the recovery's phases and the restart's.

Megatron-LM's own pretrain_gpt.py (the Megatron-LM test's small GPT on mock data: 2 layers,
hidden 64, dropout at Megatron-LM's default 0.1, PP2 x DP2 on 4 processes, a spare, 12
iterations, CPU/gloo) runs under deadpool-launch failure-free and with rank --victim killed
as iteration --fail-at starts, each both ways: hot-swap (the default policy), and
checkpoint-restart (`deadpool-launch --restart-policy full --max-restarts 1`, with
Megatron-LM's `--save`, `--save-interval` and `--load` in a fresh folder per job: every
process is stopped and the job started again from the newest checkpoint), alternating,
--repeats times each. A checkout given as a git
repository (a clone, or the mirror of `fetch github:NVIDIA/Megatron-LM`) is cloned at
core_v0.16.1 into the work folder and patched by scripts/apply_megatron_patch.sh; a folder
that is already patched is used as it is.

Time lost per failure is measured as in scripts/bench_recovery.py: a run's span (first
iteration's finish to last iteration's finish) minus the iterations that count, the failure
run's minus its failure-free twin's. The recovery and its phases come from the event log
(failure to first resumed iteration), the restart's as scripts/bench_recovery.py breaks it
down (detect, restart processes, load, replay). Every failure run's losses and final state
digest must equal its failure-free twin's, or the script fails. Each way is measured
against its own failure-free twin (the restart's twin saves on the same interval, which is
not a failure's cost). torchrun cannot be the restart here: without DeadPool's session
nothing routes Megatron-LM's CUDA calls to the CPU.

Writes JSON and a PNG beside it (each way's median phases and time lost); the last line
printed is one JSON object: {"recovery_s" (median), "recovery_runs_s", "lost_s" (median),
"lost_runs_s", "phases" (median per phase), "ckpt_restart_lost_s" (median),
"ckpt_restart_lost_runs_s", "ckpt_restart_phases", "ratio" (ckpt_restart_lost_s / lost_s),
"iteration_s", "bitwise": true, "repeats", "wall_s"}.

    python scripts/bench_megatron_lm.py --megatron-lm /path/to/Megatron-LM --repeats 3
    python scripts/bench_megatron_lm.py --megatron-lm DIR --data-cache-path  # indexes cached
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_recovery import (  # noqa: E402
    HOTSWAP_PHASES,
    breakdown_hotswap,
    breakdown_restart,
    read_run,
)
from results_path import results_file  # noqa: E402

from deadpool_megatron.events import read_events  # noqa: E402

TAG = "core_v0.16.1"
ITERS = 12
MODEL = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 8 "
    f"--train-iters {ITERS} --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 1024 --split 100,0,0 --distributed-backend gloo --transformer-impl local "
    "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
    "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm "
    "--use-cpu-initialization --use-distributed-optimizer --eval-iters 0 "
    "--eval-interval 1000 --log-interval 1 "
    "--pipeline-model-parallel-size 2 --deadpool --deadpool-heartbeat-interval 0.5 "
    "--deadpool-heartbeat-timeout 2.0"
).split()
NPROC = 4
RESTART_PHASES = ("detect", "restart_processes", "load", "replay")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--megatron-lm", required=True, metavar="DIR",
                   help=f"a Megatron-LM checkout or mirror (git: {TAG} is cloned and patched)")  # fmt: skip
    p.add_argument("--repeats", type=int, default=3, help="jobs of each kind (default 3)")
    p.add_argument("--victim", type=int, default=1, help="rank killed (default 1)")
    p.add_argument("--fail-at", type=int, default=6, help="iteration it dies in (default 6)")
    p.add_argument("--save-interval", type=int, default=4,
                   help="the checkpoint-restart jobs' --save-interval (default 4)")  # fmt: skip
    p.add_argument("--data-cache-path", action="store_true",
                   help="give the jobs a --data-cache-path, so pretrain() run again reads the "
                        "datasets' indexes back instead of building them")  # fmt: skip
    p.add_argument("--workdir", default=None, help="where the jobs run (default: a temp dir)")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_megatron_lm.json"),
                   type=results_file)  # fmt: skip
    a = p.parse_args(argv)
    if not Path(a.megatron_lm, "pretrain_gpt.py").exists() and not _is_git(a.megatron_lm):
        p.error(f"--megatron-lm {a.megatron_lm}: neither a Megatron-LM checkout (no "
                "pretrain_gpt.py) nor a git repository to clone one from")  # fmt: skip
    if a.repeats < 1:
        p.error(f"--repeats {a.repeats} must be 1 or more")
    if not 1 < a.fail_at <= ITERS:
        p.error(f"--fail-at {a.fail_at} must lie in [2, {ITERS}]")
    if not 1 <= a.save_interval < a.fail_at:
        p.error(f"--save-interval {a.save_interval} must lie in [1, {a.fail_at - 1}]: a "
                f"checkpoint must precede the failure in iteration {a.fail_at}")  # fmt: skip
    if not 0 <= a.victim < NPROC:
        p.error(f"--victim {a.victim} must be a rank in [0, {NPROC - 1}]")
    return a


def _is_git(path: str) -> bool:
    done = subprocess.run(["git", "-C", path, "rev-parse", "--git-dir"], capture_output=True)
    return done.returncode == 0


def patched_checkout(source: str, workdir: Path) -> Path:
    """The checkout the jobs run in: `source` itself when it holds pretrain_gpt.py patched
    already, else TAG cloned from it into `workdir` and patched."""
    if Path(source, "pretrain_gpt.py").exists():
        if "deadpool_hooks" in Path(source, "pretrain_gpt.py").read_text():
            return Path(source)
        if not _is_git(source):
            raise SystemExit(f"{source} is not patched; run scripts/apply_megatron_patch.sh")
    checkout = workdir / "Megatron-LM"
    if not checkout.exists():
        subprocess.run(["git", "clone", "-q", "--branch", TAG, source, str(checkout)], check=True)
        done = subprocess.run(["bash", str(ROOT / "scripts" / "apply_megatron_patch.sh"),
                               str(checkout)], capture_output=True, text=True,
                              env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"patching {checkout} failed:\n{done.stdout}{done.stderr}")
    return checkout


def python_first(where: Path) -> str:
    """A PATH whose `python3` and `python3-config` are this interpreter's: Megatron-LM's rank 0
    runs its dataset helper's Makefile, which asks them, and Megatron-LM's `.python-version`
    (3.12) would make a pyenv shim answer for another Python."""
    bin_dir = where / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir(parents=True)
        (bin_dir / "python3").symlink_to(sys.executable)
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        config = Path(sys.base_prefix) / "bin" / f"python{version}-config"
        if config.exists():
            (bin_dir / "python3-config").symlink_to(config)
    return f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"


def run_job(a, checkout: Path, workdir: Path, name: str, failure: bool, restart: bool) -> dict:
    """One job, hot-swapped or (`restart`) checkpoint-restarted; its metrics and events,
    analysed."""
    out = workdir / name
    out.mkdir(parents=True, exist_ok=True)
    metrics, events, ckpt = out / "metrics.jsonl", out / "events.jsonl", out / "ckpt"
    for f in (metrics, events):
        f.unlink(missing_ok=True)
    shutil.rmtree(ckpt, ignore_errors=True)  # --load must find this job's checkpoints only
    policy = ["--restart-policy", "full", "--max-restarts", "1"] if restart else []
    cmd = [sys.executable, "-m", "deadpool_megatron.launch", "--nproc-per-node", str(NPROC),
           "--spares", "1", *policy, "pretrain_gpt.py", *MODEL, "--deadpool-metrics-jsonl",
           str(metrics), "--deadpool-event-log", str(events)]  # fmt: skip
    if restart:
        cmd += ["--save", str(ckpt), "--save-interval", str(a.save_interval), "--load", str(ckpt)]
    if failure:
        cmd += ["--deadpool-inject", f"kill@{a.victim}:{a.fail_at}"]
    if a.data_cache_path:
        cmd += ["--data-cache-path", str(workdir / "data-cache")]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PATH": python_first(workdir)}
    done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    (out / "job.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed (exit {done.returncode}); see {out / 'job.log'}")
    return analyse([json.loads(x) for x in metrics.read_text().splitlines() if x.strip()],
                   read_events(str(events)) if events.exists() else [], a.fail_at)  # fmt: skip


def analyse(records: list[dict], events: list[dict], fail_at: int) -> dict:
    """A job as bench_recovery.read_run reads it, and, after a failure, the recovery's
    phases or the restart's (a job that loaded a checkpoint)."""
    out = read_run(records)
    if any(e["event"] == "recovery_done" for e in events):
        out["recovery"] = breakdown_hotswap(events, out["iteration_s"], out["iteration_ms"])
    if any(e["event"] == "checkpoint_loaded" for e in events):
        out["restart"] = breakdown_restart(events, out["iteration_s"], fail_at)
    return out


def _lost(pairs: list[tuple[dict, dict]], way: str) -> list[float]:
    """Each failure run's time lost against its failure-free twin; fails unless the failure
    run's losses and final digest equal the twin's and it went the `way` asked."""
    for free, failed in pairs:
        if failed["digest"] != free["digest"] or failed["losses"] != free["losses"]:
            raise SystemExit("a failure run did not end bitwise equal to the failure-free run")
        if way not in failed:
            raise SystemExit(f"a failure run logged no {way} (see its job.log)")
    return [failed["unexplained_s"] - free["unexplained_s"] for free, failed in pairs]


def _medians(pairs: list[tuple[dict, dict]], way: str, phases: tuple[str, ...]) -> dict:
    return {k: round(statistics.median(f[way][k] for _, f in pairs), 3) for k in phases}


def summarize(pairs: list[tuple[dict, dict]], restarts: list[tuple[dict, dict]]) -> dict:
    """Per failure run and its failure-free twin, each way: time lost, and the recovery's or
    the restart's phases; medians."""
    lost = _lost(pairs, "recovery")
    restart_lost = _lost(restarts, "restart")
    recoveries = [failed["recovery"]["recovery_total_s"] for _, failed in pairs]
    return {
        "recovery_s": round(statistics.median(recoveries), 3),
        "recovery_runs_s": [round(r, 3) for r in recoveries],
        "lost_s": round(statistics.median(lost), 3),
        "lost_runs_s": [round(x, 3) for x in lost],
        "phases": _medians(pairs, "recovery", HOTSWAP_PHASES),
        "ckpt_restart_lost_s": round(statistics.median(restart_lost), 3),
        "ckpt_restart_lost_runs_s": [round(x, 3) for x in restart_lost],
        "ckpt_restart_phases": _medians(restarts, "restart", RESTART_PHASES),
        "ratio": round(statistics.median(restart_lost) / max(statistics.median(lost), 1e-9), 2),
        "iteration_s": round(statistics.median(f["iteration_s"] for f, _ in pairs), 3),
        "bitwise": True,
        "repeats": len(pairs),
    }


def plot(result: dict, path: Path) -> None:
    """Each way's time lost per failure as a bar of its median phases (hot-swap: failure to
    first resumed iteration; checkpoint-restart: detection to the replay's end), with the
    median time lost marked on it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = [("hot-swap (--deadpool)", result["phases"], result["lost_s"]),
            ("checkpoint-restart", result["ckpt_restart_phases"],
             result["ckpt_restart_lost_s"])]  # fmt: skip
    fig, ax = plt.subplots(figsize=(9, 3.2))
    names = list(dict.fromkeys(k for _, phases, _ in ways for k in phases))  # detect: once
    colour = dict(zip(names, plt.get_cmap("tab20").colors))
    for y, (_, phases, lost) in enumerate(ways):
        left = 0.0
        for phase, seconds in phases.items():
            ax.barh(y, seconds, left=left, color=colour[phase], edgecolor="white", label=phase)
            left += seconds
        ax.plot([lost], [y], marker="|", markersize=28, color="black")
        ax.annotate(f"lost {lost:.2f} s", (max(lost, left), y), xytext=(6, 0),
                    textcoords="offset points", va="center", fontsize=9)  # fmt: skip
    ax.set_yticks(range(len(ways)), [w[0] for w in ways])
    ax.set_xlabel("seconds (phase medians; | time lost per failure, median)")
    ax.set_title(f"Megatron-LM pretrain_gpt.py, one rank killed ({result['repeats']} runs "
                 f"each, CPU/gloo, ratio {result['ratio']:.1f}x)")  # fmt: skip
    handles, labels = ax.get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    ax.legend(seen.values(), seen.keys(), fontsize=7, ncol=4, loc="lower right")
    ax.set_xlim(0, 1.25 * max(max(sum(w[1].values()), w[2]) for w in ways))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    a = parse_args(argv)
    workdir = Path(a.workdir or tempfile.mkdtemp(prefix="bench_megatron_lm_"))
    checkout = patched_checkout(a.megatron_lm, workdir)
    pairs, restarts = [], []
    started = time.time()
    for n in range(a.repeats):
        free = run_job(a, checkout, workdir, f"free_{n}", failure=False, restart=False)
        failed = run_job(a, checkout, workdir, f"failure_{n}", failure=True, restart=False)
        r = failed.get("recovery") or {}
        print(f"run {n + 1}/{a.repeats}: hot-swap recovered in "
              f"{r.get('recovery_total_s', float('nan')):.2f} s ("
              + ", ".join(f"{k} {r.get(k, float('nan')):.3f}" for k in HOTSWAP_PHASES)
              + f"), lost {failed['unexplained_s'] - free['unexplained_s']:.2f} s, "
              f"iteration {free['iteration_s'] * 1e3:.0f} ms", flush=True)  # fmt: skip
        pairs.append((free, failed))
        free = run_job(a, checkout, workdir, f"restart_free_{n}", failure=False, restart=True)
        failed = run_job(a, checkout, workdir, f"restart_failure_{n}", failure=True,
                         restart=True)  # fmt: skip
        r = failed.get("restart") or {}
        print(
            f"run {n + 1}/{a.repeats}: checkpoint-restart from iteration "
            f"{r.get('loaded_iteration')} ("
            + ", ".join(f"{k} {r.get(k, float('nan')):.3f}" for k in RESTART_PHASES)
            + f"), lost {failed['unexplained_s'] - free['unexplained_s']:.2f} s",
            flush=True,
        )
        restarts.append((free, failed))
    result = summarize(pairs, restarts)
    result["wall_s"] = round(time.time() - started, 1)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")
    plot(result, Path(a.out).with_suffix(".png"))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
