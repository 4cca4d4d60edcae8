"""Event-driven simulation of one long job under one recovery strategy. Pure: no I/O.

Time advances segment by segment (up to the next persistent checkpoint, or the next failure);
work is counted in seconds of useful compute. Every wall-clock second is accounted for exactly
once: useful work, failure-free overhead (persistent saves, snapshot slowdown), or time lost to
failures (downtime plus work re-executed), so wall = work + overhead + lost.

Strategies: "ckpt_restart" (every failure stops the job, which restarts and loads the newest
complete checkpoint) and "hotswap" (a transient failure resets in place, a permanent one is
hot-swapped onto a spare; both roll back at most `replay_iterations` iterations; with no spare
left, or when a correlated failure lost both copies of a shard, it falls back to
checkpoint-restart). A failure during a save loses that save; failures during a recovery's
downtime are absorbed by it (counted in `absorbed`).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from .params import SimParams

STRATEGIES = ("ckpt_restart", "hotswap")


@dataclass(frozen=True)
class Failure:
    at: float  # wall-clock seconds since the job started
    transient: bool = False
    correlated: bool = False  # also took down the DP-ring neighbour holding the replica


@dataclass(frozen=True)
class Outcome:
    wall_s: float
    work_s: float
    overhead_s: float  # failure-free: persistent saves, snapshot slowdown
    lost_s: float  # to failures: downtime + re-executed work
    failures: int
    fallbacks: int  # hot-swap failures recovered by checkpoint-restart instead
    absorbed: int  # failures that struck during another recovery's downtime


def poisson_failures(p: SimParams, rng: random.Random) -> Iterator[Failure]:
    """Failures of the whole job: exponential inter-arrival times at the job's failure rate."""
    rate = p.failures_per_second
    t = 0.0
    while rate > 0:
        t += rng.expovariate(rate)
        transient = rng.random() < p.transient_fraction
        correlated = not transient and rng.random() < p.correlated_fraction
        yield Failure(t, transient, correlated)


def young_daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimal compute time between checkpoints, sqrt(2 delta M), with Daly's
    first-order correction (- delta) when it is positive."""
    tau = math.sqrt(2.0 * checkpoint_s * mtbf_s)
    return tau - checkpoint_s if tau > 2 * checkpoint_s else tau


def simulate(p: SimParams, strategy: str, failures: Iterable[Failure]) -> Outcome:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy {strategy!r}: expected one of {STRATEGIES}")
    hot = strategy == "hotswap"
    interval = p.hotswap_checkpoint_interval if hot else p.checkpoint_interval
    ckpt_every = interval * p.iteration_s if interval else math.inf  # work seconds
    slow = 1.0 + (p.snapshot_overhead if hot else 0.0)
    total = p.iterations * p.iteration_s
    it = iter(failures)
    nxt = next(it, None)
    t = work = saved = overhead = lost = 0.0
    count = fallbacks = absorbed = 0
    spares, returns = p.spares, []

    def take(now: float) -> Failure | None:
        nonlocal nxt, absorbed
        while nxt is not None and nxt.at < now:
            absorbed += 1
            nxt = next(it, None)
        return nxt

    while work < total - 1e-9:
        boundary = min(total, (math.floor(work / ckpt_every + 1e-9) + 1) * ckpt_every)
        seg_wall = (boundary - work) * slow
        failure = nxt
        if failure is None or failure.at >= t + seg_wall:
            t += seg_wall
            overhead += seg_wall - (boundary - work)
            work = boundary
            if work >= total - 1e-9:
                break
            failure = nxt
            if failure is None or failure.at >= t + p.checkpoint_s:
                t += p.checkpoint_s
                overhead += p.checkpoint_s
                saved = work
                continue
            overhead += failure.at - t  # the interrupted save
            t = failure.at
        else:
            done = (failure.at - t) / slow
            overhead += (failure.at - t) - done
            work += done
            t = failure.at
        # A failure at t, `work` done, newest complete checkpoint at `saved`.
        count += 1
        spares += sum(1 for r in returns if r <= t)
        returns = [r for r in returns if r > t]
        swappable = failure.transient or (spares > 0 and not failure.correlated)
        if hot and swappable:
            down = p.at_scale(p.reset_s if failure.transient else p.swap_s)
            if not failure.transient:
                spares -= 1
                returns.append(t + p.replenish_s)
            partial = work - math.floor(work / p.iteration_s + 1e-9) * p.iteration_s
            redo = min(work, partial + p.replay_iterations * p.iteration_s)
        else:
            fallbacks += hot
            down = p.at_scale(p.restart_s) + p.load_s
            redo = work - saved
        work -= redo
        lost += redo + down
        t += down
        nxt = next(it, None)
        take(t)
    return Outcome(t, total, overhead, lost, count, fallbacks, absorbed)
