#!/usr/bin/env python
"""Failure-free overhead of DeadPool's in-memory checkpoint, measured in ONE run.

One job trains with --deadpool; protection is switched off and on in alternating windows of
iterations (off first), so drift on a shared machine hits both equally. With several replica
transports (--transports gloo,tcp: one protection pipeline each, built side by side in the
job), the "on" windows take them in turn: off, gloo, off, tcp, off, gloo, ... Prints
per-window medians, the snapshot (device-to-host copy, checksum) and replication times per
iteration, bytes per iteration and the maximum replica lag, writes JSON and a PNG, and ends
with one JSON line: {"median_iter_ms_off", "median_iter_ms_on", "ratio", "transport" (the
transport with the lower ratio, whose figures these are), "ratio_gloo", "ratio_tcp",
"ratio_by_neighbours" (each on window against the off windows beside it: robust to a machine
whose speed drifts during the run), "replica_lag_max", "stall_ms", "protection_cpu_ms", ...}.
The two costs are measured apart: the stall is the time the training thread itself spends on
protection per iteration (the fence waiting for the previous copy, starting the next); the CPU
cost is what the snapshot and replication threads burn (copy, checksum, posting sends; over
tcp, the sends themselves) plus the stall, which on a CPU node whose cores all compute is wall
time too; gloo's I/O threads come on top (in process_cpu_extra_ms, the on-minus-off
difference of the whole process's CPU time, a noisier figure).

    python scripts/bench_overhead.py                     # 2 CPU ranks (DP2), 41 MB shards
    python scripts/bench_overhead.py --transports gloo   # one transport, 8 windows
    python scripts/bench_overhead.py --transports tcp-stream,tcp   # streamed against read
    python scripts/bench_overhead.py --transports tcp,mpi  # MPI (scripts/setup_mpi.sh, VENV=.venv)
    python scripts/bench_overhead.py --nproc 8 --tp 2 --pp 2
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_path import pyplot, results_file  # noqa: E402 (this folder, as a script)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--hidden-size", type=int, default=384)
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    # 64 x 128 tokens = 4096 tokens per DP rank per iteration: still ~10x fewer than a typical
    # LLM run gives each GPU, and the overhead on a CPU node scales with state / compute.
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--transports", default="gloo,tcp", type=_transports,
                   help="replica transports compared, in turn (default gloo,tcp)")  # fmt: skip
    p.add_argument("--window", type=int, default=5, help="iterations per window (default 5)")
    p.add_argument("--windows", type=int, default=None,
                   help="windows, alternating off/on (default 4 on windows per transport)")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3, help="iterations before the first window")
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--out", default=str(ROOT / "runs" / "bench_overhead.json"), type=results_file)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.windows is None:
        a.windows = 8 * len(a.transports)
    if a.windows < 2 * len(a.transports):
        p.error(f"--windows {a.windows} leaves a transport of {','.join(a.transports)} without "
                f"an on window: give at least {2 * len(a.transports)}")  # fmt: skip
    return a


def _transports(value: str) -> list[str]:
    names = [t.strip() for t in value.split(",") if t.strip()]
    bad = [t for t in names if t not in TRANSPORTS]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give distinct transports out of {', '.join(TRANSPORTS)}, comma-separated"
        )
    return names


TRANSPORTS = ("gloo", "tcp", "tcp-stream", "mpi")  # --deadpool-transport's choices


def protected_by(iteration: int, warmup: int, window: int, transports: list[str]) -> str | None:
    """The transport protecting `iteration` (1-based), None for off: after the warm-up,
    windows alternate off and on, the on windows taking the transports in turn."""
    if iteration <= warmup:
        return None
    w = (iteration - warmup - 1) // window
    return transports[(w // 2) % len(transports)] if w % 2 else None


def job_flags(a: argparse.Namespace) -> list[str]:
    flags = [
        "--tensor-model-parallel-size", str(a.tp), "--pipeline-model-parallel-size", str(a.pp),
        "--use-distributed-optimizer", "--deadpool", "--deadpool-replicas", str(a.replicas),
        "--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
        "--num-attention-heads", "8", "--seq-length", str(a.seq_length), "--vocab-size", "128",
        "--micro-batch-size", str(a.micro_batch_size),
        "--global-batch-size", str(a.global_batch_size),
        "--train-iters", str(a.warmup + a.windows * a.window), "--lr", "1e-4",
        "--lr-decay-style", "constant", "--log-interval", str(a.window),
    ]  # fmt: skip
    return flags + (["--bf16"] if a.bf16 else [])


# -- worker side (runs under deadpool-launch) ------------------------------------------------
def run_worker(a: argparse.Namespace, job: list[str]) -> int:
    import torch.distributed as dist

    from deadpool_megatron.failure.progress import ProgressBoard
    from deadpool_megatron.logging_setup import setup_logging
    from deadpool_megatron.megatron import parallel
    from deadpool_megatron.megatron.arguments import parse_job_args
    from deadpool_megatron.megatron.model import build_train_state
    from deadpool_megatron.megatron.training import Trainer
    from deadpool_megatron.process.protection import build_pipeline
    from deadpool_megatron.process.session import ProtectedLoop
    from deadpool_megatron.process.worker import open_store
    from deadpool_megatron.runtime import ProcessEnv

    env = ProcessEnv.from_environ()
    cfg = parse_job_args(job, env.world_size)
    setup_logging()
    on_gpu = parallel.init_distributed(cfg, env.rank, env.world_size, open_store(env, cfg))
    state = build_train_state(cfg, on_gpu)
    # One pipeline per transport, side by side; only the window's own is enabled.
    pipelines = {
        t: build_pipeline(dataclasses.replace(
            cfg, deadpool=dataclasses.replace(cfg.deadpool, deadpool_transport=t)),
            state, env, on_gpu)
        for t in a.transports
    }  # fmt: skip
    active = [protected_by(1, a.warmup, a.window, a.transports)]
    for t, p in pipelines.items():
        p.enabled = t == active[0]
    samples: list[tuple[int, str | None, float, float]] = []
    last = [time.perf_counter(), time.process_time()]

    def on_iteration(t) -> None:
        if active[0] is not None:  # where the trainer would call it: after the step
            pipelines[active[0]].after_step(t.iteration)
        # Wall time, and CPU time of the whole process (every thread, user + system).
        now, cpu = time.perf_counter(), time.process_time()
        samples.append((t.iteration, active[0], (now - last[0]) * 1000.0,
                        (cpu - last[1]) * 1000.0))  # fmt: skip
        nxt = protected_by(t.iteration + 1, a.warmup, a.window, a.transports)
        if active[0] is not None and nxt != active[0]:  # drain, outside the timed span
            pipelines[active[0]].snapshotter.wait_committed()
        for name, p in pipelines.items():
            p.enabled = name == nxt
        active[0] = nxt
        last[0], last[1] = time.perf_counter(), time.process_time()

    session = ProtectedLoop(ProgressBoard(), after_iteration=on_iteration)
    trainer = Trainer(cfg, state, env.world_size, on_gpu, hooks=session)
    session.bind(trainer)
    trainer.train()
    mine = {"rank": env.rank, "samples": samples, "transports": {}}
    for name, pipeline in pipelines.items():
        pipeline.close()
        mine["transports"][name] = {
            "copy_ms": [x * 1000 for x in pipeline.snapshotter.copy_s],
            "checksum_ms": [x * 1000 for x in pipeline.snapshotter.commit_s],
            "replicate_ms": [x * 1000 for x in pipeline.replicator.stats.send_s],
            "thread_cpu_ms": [
                x * 1000 for x in [*pipeline.snapshotter.cpu_s, *pipeline.replicator.stats.cpu_s]
            ],
            "snapshot_bytes": pipeline.state.layout.total_nbytes,
            "replica_bytes": pipeline.state.layout.optimizer_nbytes
            * len(pipeline.replicator.successors),
            "stall_ms": [x * 1000 for x in pipeline.stats.stall_s],
            "lag_max": pipeline.stats.lag_max,
            "rejected": pipeline.replicator.stats.rejected,
        }
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if env.rank == 0:
        Path(a.worker_result).write_text(json.dumps(everyone))
    trainer.finish()
    parallel.destroy_distributed()
    return 0


# -- parent side -----------------------------------------------------------------------------
def summarize(a: argparse.Namespace, ranks: list[dict]) -> dict:
    # An iteration takes as long as its slowest rank: collectives synchronise them.
    per_iter: dict[int, list[float]] = {}
    cpu: dict[str | None, list[float]] = {t: [] for t in [None, *a.transports]}
    state: dict[int, str | None] = {}
    for r in ranks:
        for it, on, ms, cpu_ms in r["samples"]:
            per_iter.setdefault(it, []).append(ms)
            state[it] = on
            if it > a.warmup:
                cpu[on].append(cpu_ms)
    windows = []
    for w in range(a.windows):
        its = range(a.warmup + w * a.window + 1, a.warmup + (w + 1) * a.window + 1)
        times = [max(per_iter[i]) for i in its]
        windows.append({"window": w, "on": state[its[0]], "median_ms": statistics.median(times)})
    off = [max(per_iter[i]) for i in per_iter if i > a.warmup and state[i] is None]
    median_off = statistics.median(off)
    by_transport = {t: _transport_figures(a, ranks, t, per_iter, state, cpu, median_off)
                    for t in a.transports}  # fmt: skip
    for t, figures in by_transport.items():
        figures["ratio_by_neighbours"] = _ratio_by_neighbours(windows, t)
    best = min(a.transports, key=lambda t: by_transport[t]["ratio"])
    first = ranks[0]["transports"][a.transports[0]]
    return {
        "windows": windows,
        "median_iter_ms_off": round(median_off, 2),
        **by_transport[best],
        "transport": best,
        **{f"ratio_{t}": by_transport[t]["ratio"] for t in a.transports},
        "by_transport": by_transport,
        "cpu_ms_per_iter_off": round(statistics.median(cpu[None]), 2),
        "snapshot_mb_per_iter_per_rank": round(first["snapshot_bytes"] / 2**20, 2),
        "replica_mb_sent_per_iter_per_rank": round(first["replica_bytes"] / 2**20, 2),
        "nproc": a.nproc,
        "shape": f"TP{a.tp}xPP{a.pp}xDP{a.nproc // (a.tp * a.pp)}",
        "per_iteration_ms": {str(i): max(v) for i, v in sorted(per_iter.items())},
        "per_iteration_on": {str(i): state[i] for i in sorted(state)},
    }


def _ratio_by_neighbours(windows: list[dict], transport: str) -> float:
    """The median over `transport`'s windows of each one's median against the mean of the off
    windows on either side of it: a machine whose speed drifts during the run (seen here: 4.0
    to 2.8 s per iteration in one run) skews the plain ratio of medians towards whichever
    transport's windows come later, not this one."""
    ratios = []
    for i, w in enumerate(windows):
        if w["on"] != transport:
            continue
        around = [windows[j]["median_ms"] for j in (i - 1, i + 1)
                  if 0 <= j < len(windows) and windows[j]["on"] is None]  # fmt: skip
        ratios.append(w["median_ms"] / statistics.mean(around))
    return round(statistics.median(ratios), 4)


def _transport_figures(a, ranks, t, per_iter, state, cpu, median_off) -> dict:
    """One transport's windows against every off window."""
    on = [max(per_iter[i]) for i in per_iter if state[i] == t]
    mine = [r["transports"][t] for r in ranks]

    def mean(key):
        vals = [v for r in mine for v in r[key]]
        return statistics.mean(vals) if vals else 0.0

    median_on = statistics.median(on)
    cpu_extra = statistics.median(cpu[t]) - statistics.median(cpu[None])
    # The stall: what the training thread itself spends on protection per iteration (the
    # fence's wait for the previous copy, metadata, starting the copy); the rank that stalls
    # most sets the pace. The CPU cost: what the snapshot and replication threads burn per
    # protected iteration (thread CPU clocks), plus the stall; gloo's I/O threads and the
    # kernel's loopback copies come on top and show only in the whole process's CPU time
    # (cpu_extra, the on-minus-off difference of medians: the noisier figure).
    stall = max(statistics.median(r["stall_ms"]) for r in mine if r["stall_ms"])
    threads_cpu = sum(v for r in mine for v in r["thread_cpu_ms"]) / len(mine) / max(1, len(on))
    return {
        "median_iter_ms_on": round(median_on, 2),
        "ratio": round(median_on / median_off, 4),
        "snapshot_copy_ms": round(mean("copy_ms"), 2),
        "snapshot_checksum_ms": round(mean("checksum_ms"), 2),
        "replicate_ms": round(mean("replicate_ms"), 2),
        # CPU our two threads burn per protected iteration and rank (gloo's own I/O threads
        # and the kernel's loopback copies come on top): on a CPU node it competes with compute.
        "background_cpu_ms_per_iter": round(threads_cpu, 2),
        # The profile: what protection costs each rank in CPU time per iteration (all threads,
        # gloo's and the kernel's loopback copies included). With every core computing, CPU
        # taken is wall time lost: the ratio this predicts is 1 + cpu_extra / median_off.
        "cpu_ms_per_iter_on": round(statistics.median(cpu[t]), 2),
        "predicted_ratio_from_cpu": round(1 + cpu_extra / median_off, 4),
        "stall_ms": round(stall, 3),
        "stall_pct_of_iteration": round(100 * stall / median_off, 3),
        "protection_cpu_ms": round(threads_cpu + stall, 2),
        "process_cpu_extra_ms": round(cpu_extra, 2),
        "replica_lag_max": max(r["lag_max"] for r in mine),
        "rejected": sum(r["rejected"] for r in mine),
    }


def plot(summary: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    its = [int(i) for i in summary["per_iteration_ms"]]
    ms = list(summary["per_iteration_ms"].values())
    on = [summary["per_iteration_on"][str(i)] for i in its]
    colors = {
        None: "tab:blue",
        "gloo": "tab:red",
        "tcp": "tab:orange",
        "tcp-stream": "tab:green",
        "mpi": "tab:purple",
    }
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.bar(its, ms, color=[colors[o] for o in on])
    ax.axhline(summary["median_iter_ms_off"], color="tab:blue", ls="--", label="median off")
    for t, fig_t in summary["by_transport"].items():
        ax.axhline(fig_t["median_iter_ms_on"], color=colors[t], ls="--",
                   label=f"median on, {t} (ratio {fig_t['ratio']:.3f})")  # fmt: skip
    names = {"gloo": "red", "tcp": "orange", "tcp-stream": "green", "mpi": "purple"}
    shown = "; ".join(f"{names[t]}: on, {t}" for t in summary["by_transport"])
    ax.set_xlabel(f"iteration (blue: protection off; {shown})")
    ax.set_ylabel("iteration time (ms)")
    ax.set_title(
        f"DeadPool overhead, {summary['shape']}: best ratio {summary['ratio']:.3f} "
        f"({summary['transport']}), "
        f"{summary['snapshot_mb_per_iter_per_rank']:.0f} MB snapshot/rank/iteration"
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mpirun_prefix() -> list[str]:
    """`mpirun --with-ft ulfm -n 1` of the Open MPI beside this interpreter; [] without one."""
    from deadpool_megatron.agent.mpi_spawn import mpirun_command

    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return []
    command = mpirun_command()
    return [*command, "-n", "1"] if Path(command[0]).exists() else []


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker_result:
        from deadpool_megatron.runtime import end_process

        # As pretrain_gpt.py ends: everything is written and every group destroyed. The
        # interpreter's own teardown of torch once ended a worker here with "terminate called
        # without an active exception" (SIGABRT) after its results were out.
        end_process(run_worker(a, job_flags(a)))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    worker_result = out.with_suffix(".ranks.json")
    prefix = []
    if "mpi" in a.transports:  # the launcher under mpirun spawns the workers (README)
        prefix = mpirun_prefix()
        if not prefix:
            print("bench_overhead: --transports mpi needs Open MPI 5 and mpi4py beside this "
                  "interpreter: VENV=.venv bash scripts/setup_mpi.sh", file=sys.stderr)  # fmt: skip
            return 2
    cmd = [
        *prefix, sys.executable, "-m", "deadpool_megatron.launch", "--no-preflight",
        *(["--mpi-spawn"] if prefix else []),
        "--nproc-per-node", str(a.nproc), __file__, *(sys.argv[1:] if argv is None else argv),
        "--worker-result", str(worker_result),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ))
    if done.returncode != 0:
        print(f"bench_overhead: the job failed with status {done.returncode}", file=sys.stderr)
        return done.returncode
    summary = summarize(a, json.loads(worker_result.read_text()))
    out.write_text(json.dumps(summary, indent=1))
    plot(summary, out.with_suffix(".png"))
    print(f"\n{'window':>6} {'protection':>10} {'median ms':>10}")
    for w in summary["windows"]:
        print(f"{w['window']:>6} {w['on'] or 'off':>10} {w['median_ms']:>10.1f}")
    print(f"snapshot {summary['snapshot_mb_per_iter_per_rank']} MB/rank/iteration, replica "
          f"{summary['replica_mb_sent_per_iter_per_rank']} MB/rank/iteration; median iteration "
          f"off {summary['median_iter_ms_off']} ms")  # fmt: skip
    for t, f in summary["by_transport"].items():
        print(
            f"{t}: ratio {f['ratio']}, by neighbouring windows {f['ratio_by_neighbours']} "
            f"(on {f['median_iter_ms_on']} ms; copy "
            f"{f['snapshot_copy_ms']} ms, checksum {f['snapshot_checksum_ms']} ms, replicate "
            f"{f['replicate_ms']} ms); lag max {f['replica_lag_max']}; training-thread stall "
            f"{f['stall_ms']} ms/iteration ({f['stall_pct_of_iteration']}%), protection CPU "
            f"{f['protection_cpu_ms']} ms/iteration (our threads; the whole process's CPU on "
            f"minus off: {f['process_cpu_extra_ms']} ms)"
        )
    print(f"results in {out} and {out.with_suffix('.png')}")
    keys = ("median_iter_ms_off", "median_iter_ms_on", "ratio", "transport",
            *(f"ratio_{t}" for t in a.transports), "ratio_by_neighbours", "replica_lag_max",
            "snapshot_copy_ms", "snapshot_checksum_ms", "replicate_ms", "background_cpu_ms_per_iter",
            "cpu_ms_per_iter_off", "cpu_ms_per_iter_on", "predicted_ratio_from_cpu",
            "stall_ms", "stall_pct_of_iteration", "protection_cpu_ms", "process_cpu_extra_ms",
            "snapshot_mb_per_iter_per_rank", "replica_mb_sent_per_iter_per_rank", "shape")  # fmt: skip
    print(json.dumps({k: summary[k] for k in keys}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
