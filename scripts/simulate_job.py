#!/usr/bin/env python
"""Simulate a long training job at scale: time lost to failures, checkpoint-restart vs hot-swap.

An event-driven Monte Carlo (deadpool_megatron.sim) over --seeds seeds of the job's failures
(Poisson, at the Llama 3 report's per-node rate by default). Prints the comparison at the given
scale with 95% confidence intervals, the Young/Daly checkpoint interval, and sweeps scale
(1K-100K GPUs), checkpoint interval, spares and correlated ring-neighbour failures into one
PNG; writes JSON; the last line printed is one JSON object.

    python scripts/simulate_job.py                        # paper-like recovery costs
    python scripts/simulate_job.py --costs bench          # costs measured by bench_recovery.py
    python scripts/simulate_job.py --gpus 4096 --spares 2 --correlated-fraction 0.1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from results_path import results_file  # noqa: E402 (this folder, as a script)

from deadpool_megatron.errors import ConfigError  # noqa: E402
from deadpool_megatron.sim.params import SimParams, with_bench_costs  # noqa: E402
from deadpool_megatron.sim.study import (  # noqa: E402
    compare,
    optimal_interval_iterations,
    sweep_intervals,
    sweep_scale,
)

SCALES = [1024, 2048, 4096, 8192, 16384, 32768, 65536, 100_000]
SPARES = [0, 1, 2, 4, 8, 16]
CORRELATED = [0.0, 0.05, 0.1, 0.2, 0.4]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    defaults = SimParams()
    for f in dataclasses.fields(SimParams):
        p.add_argument(f"--{f.name.replace('_', '-')}", type=type(getattr(defaults, f.name)),
                       default=getattr(defaults, f.name),
                       help=f"(default {getattr(defaults, f.name):g})")  # fmt: skip
    p.add_argument("--seeds", type=int, default=50, help="Monte Carlo seeds (default 50)")
    p.add_argument("--costs", choices=("paper", "bench"), default="paper",
                   help="recovery costs: the paper's figures (default) or this repo's benchmark")  # fmt: skip
    p.add_argument("--bench-json", default=str(ROOT / "runs" / "bench_recovery.json"))
    p.add_argument("--scale-json", default=str(ROOT / "runs" / "bench_recovery_scale.json"),
                   help="with --costs bench: recovery growth per process, from "
                        "bench_recovery_scale.py (used when the file exists)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "simulate_job.json"), type=results_file)
    a = p.parse_args(argv)
    if a.seeds < 2:
        p.error(f"--seeds {a.seeds} must be at least 2 (for confidence intervals)")
    return a


def share(row: dict) -> float:
    return row["hotswap_share_of_lost"].mean


def plot(p: SimParams, scale, intervals, spares, correlated, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8.5))
    g = [r["gpus"] for r in scale]
    for key, label in (("ckpt_restart", "checkpoint-restart"), ("hotswap", "DeadPool hot-swap")):
        ax[0, 0].errorbar(g, [r[key]["lost_h"].mean for r in scale],
                          yerr=[r[key]["lost_h"].ci95 for r in scale], marker="o", label=label)  # fmt: skip
    ax[0, 0].set(xscale="log", yscale="log", xlabel="GPUs", ylabel="hours lost to failures",
                 title=f"{p.iterations:,} iterations of {p.iteration_s:g} s")  # fmt: skip
    ax[0, 0].legend()
    xs = [r["interval"] for r in intervals]
    ax[0, 1].errorbar(xs, [r["ckpt_waste_h"].mean for r in intervals],
                      yerr=[r["ckpt_waste_h"].ci95 for r in intervals], marker="o",
                      label="checkpoint-restart: saves + failures")  # fmt: skip
    ax[0, 1].plot(xs, [r["hotswap_lost_h"].mean for r in intervals], marker="s",
                  label="hot-swap: failures")  # fmt: skip
    ax[0, 1].axvline(optimal_interval_iterations(p), color="gray", ls="--", label="Young/Daly")
    ax[0, 1].set(xscale="log", xlabel="checkpoint interval (iterations)", ylabel="hours",
                 title=f"{p.gpus:,} GPUs")  # fmt: skip
    ax[0, 1].legend()
    ax[1, 0].plot([r["spares"] for r in spares], [100 * share(r) for r in spares], marker="o")
    ax[1, 0].set(xlabel="spares", ylabel="hot-swap loss, % of checkpoint-restart's",
                 title=f"spares (replenished after {p.replenish_s / 3600:g} h)")  # fmt: skip
    ax[1, 1].plot([r["correlated_fraction"] for r in correlated],
                  [100 * share(r) for r in correlated], marker="o")  # fmt: skip
    ax[1, 1].set(xlabel="fraction of permanent failures that also take the ring neighbour",
                 ylabel="hot-swap loss, % of checkpoint-restart's", title="correlated failures")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def jsonable(obj):
    if dataclasses.is_dataclass(obj):
        return dataclasses.asdict(obj)
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [jsonable(v) for v in obj]
    return obj


def main(argv=None) -> int:
    a = parse_args(argv)
    fields = {f.name: getattr(a, f.name) for f in dataclasses.fields(SimParams)}
    try:
        p = SimParams(**fields)
        if a.costs == "bench":
            if not Path(a.bench_json).exists():
                raise ConfigError(f"--costs bench needs {a.bench_json}: run bench_recovery.py")
            scale = a.scale_json if Path(a.scale_json).exists() else None
            p = with_bench_costs(p, a.bench_json, scale)
    except ConfigError as err:
        print(f"simulate_job.py: error: {err}", file=sys.stderr)
        return 2
    main_row = compare(p, a.seeds)
    yd = optimal_interval_iterations(p)
    print(f"{p.gpus:,} GPUs ({p.nodes:,} nodes), job MTBF {p.mtbf_s / 3600:.2f} h, "
          f"{p.iterations:,} iterations of {p.iteration_s:g} s, {a.seeds} seeds, {a.costs} costs")  # fmt: skip
    projected = {n: round(dataclasses.replace(p, gpus=n).at_scale(p.swap_s), 2)
                 for n in (512, 16_384)}  # fmt: skip
    print(f"  hot-swap recovery {p.swap_s:.2f} s at {p.recovery_measured_gpus} GPUs, "
          f"+{1000 * p.recovery_s_per_gpu:.3f} ms per GPU: {projected[512]} s at 512 GPUs, "
          f"{projected[16_384]} s at 16,384")  # fmt: skip
    for key in ("ckpt_restart", "hotswap"):
        r = main_row[key]
        print(f"  {key:13s} lost to failures {r['lost_h']} h, failure-free overhead "
              f"{r['overhead_h']} h, {r['failures']} failures, {r['fallbacks']} fallbacks")  # fmt: skip
    s = main_row["hotswap_share_of_lost"]
    print(f"  hot-swap loses {100 * s.mean:.1f}% (+/- {100 * s.ci95:.1f}) of checkpoint-restart's "
          f"time; Young/Daly interval {yd:.0f} iterations (now {p.checkpoint_interval})")  # fmt: skip
    seeds = max(2, a.seeds // 5)  # sweeps: fewer seeds per point
    scale = sweep_scale(p, SCALES, seeds)
    intervals = sweep_intervals(
        p, sorted({max(1, int(yd * f)) for f in (0.125, 0.25, 0.5, 1, 2, 4, 8)}), seeds
    )
    spares = [{"spares": n, **compare(dataclasses.replace(p, spares=n), seeds)} for n in SPARES]
    corr = [
        {"correlated_fraction": c, **compare(dataclasses.replace(p, correlated_fraction=c), seeds)}
        for c in CORRELATED
    ]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"params": dataclasses.asdict(p), "main": main_row, "young_daly_interval": yd,
           "scale": scale, "intervals": intervals, "spares": spares, "correlated": corr}  # fmt: skip
    out.write_text(json.dumps(jsonable(doc), indent=1))
    plot(p, scale, intervals, spares, corr, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    summary = {
        "gpus": p.gpus,
        "ckpt_restart_lost_h": main_row["ckpt_restart"]["lost_h"].mean,
        "hotswap_lost_h": main_row["hotswap"]["lost_h"].mean,
        "hotswap_share": s.mean,
        "hotswap_share_ci95": s.ci95,
        "young_daly_interval": yd,
        "hotswap_s_at_512": projected[512],
        "hotswap_s_at_16384": projected[16_384],
        "costs": a.costs,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
