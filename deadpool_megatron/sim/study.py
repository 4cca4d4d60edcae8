"""Monte Carlo over seeds, and the sweeps the simulator's plots show. Pure: no I/O."""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass, replace

from .engine import Outcome, poisson_failures, simulate, young_daly_interval_s
from .params import SimParams


@dataclass(frozen=True)
class Estimate:
    mean: float
    ci95: float  # half-width of the 95% confidence interval of the mean

    def __str__(self) -> str:
        return f"{self.mean:.1f} +/- {self.ci95:.1f}"


def estimate(values: list[float]) -> Estimate:
    mean = statistics.fmean(values)
    if len(values) < 2:
        return Estimate(mean, math.nan)
    return Estimate(mean, 1.96 * statistics.stdev(values) / math.sqrt(len(values)))


def run_seeds(p: SimParams, strategy: str, seeds: int, first_seed: int = 0) -> list[Outcome]:
    """One outcome per seed; a seed gives the same failures to every strategy."""
    return [
        simulate(p, strategy, poisson_failures(p, random.Random(first_seed + s)))
        for s in range(seeds)
    ]


def compare(p: SimParams, seeds: int, first_seed: int = 0) -> dict:
    """Hours lost to failures under each strategy, and hot-swap's share of checkpoint-restart's."""
    out, runs = {}, {}
    for strategy in ("ckpt_restart", "hotswap"):
        runs[strategy] = run_seeds(p, strategy, seeds, first_seed)
        out[strategy] = {
            "lost_h": estimate([r.lost_s / 3600 for r in runs[strategy]]),
            "overhead_h": estimate([r.overhead_s / 3600 for r in runs[strategy]]),
            "wall_h": estimate([r.wall_s / 3600 for r in runs[strategy]]),
            "failures": estimate([float(r.failures) for r in runs[strategy]]),
            "fallbacks": estimate([float(r.fallbacks) for r in runs[strategy]]),
        }
    ratios = [
        h.lost_s / c.lost_s
        for h, c in zip(runs["hotswap"], runs["ckpt_restart"], strict=True)
        if c.lost_s > 0
    ]
    out["hotswap_share_of_lost"] = estimate(ratios) if ratios else Estimate(math.nan, math.nan)
    return out


def optimal_interval_iterations(p: SimParams) -> float:
    """Young/Daly's checkpoint interval for checkpoint-restart, in iterations."""
    return young_daly_interval_s(p.checkpoint_s, p.mtbf_s) / p.iteration_s


def sweep_intervals(p: SimParams, intervals: list[int], seeds: int) -> list[dict]:
    """Checkpoint-restart's waste (saves + failures) per checkpoint interval, with hot-swap's
    failure loss beside it (hot-swap keeping its own checkpoint interval)."""
    rows = []
    for interval in intervals:
        q = replace(p, checkpoint_interval=interval)
        ckpt = run_seeds(q, "ckpt_restart", seeds)
        rows.append({
            "interval": interval,
            "ckpt_waste_h": estimate([(r.lost_s + r.overhead_s) / 3600 for r in ckpt]),
            "ckpt_lost_h": estimate([r.lost_s / 3600 for r in ckpt]),
            "hotswap_lost_h": estimate([r.lost_s / 3600 for r in run_seeds(q, "hotswap", seeds)]),
        })  # fmt: skip
    return rows


def sweep_scale(p: SimParams, gpus: list[int], seeds: int) -> list[dict]:
    rows = []
    for n in gpus:
        q = replace(p, gpus=n)
        rows.append({"gpus": n, **compare(q, seeds)})
    return rows
