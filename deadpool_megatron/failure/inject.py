"""Fault injection: the `--deadpool-inject` grammar and a reproducible chaos schedule.

Faults are data (`Fault`), parsed and validated once at start-up so a typo fails before any
process starts, and the training-loop hooks only ask `faults_at(...)`: "should I fail now?".
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

from ..errors import ConfigError

# raise = transient: the process stays alive; unhealthy: its device fails the health check;
# slow: a healthy but slow phase (the training thread computes holding the GIL); corrupt: the
# rank's replica of ITER has bytes flipped in flight (its successors must reject it); stall:
# the training thread blocks for good while the process's other threads beat on; bug: an
# error of the training's own, raised every time the process that holds RANK gets there
# (not once per job: a replay or a spare meets it again, as a bug in the code)
ACTIONS = ("kill", "hang", "raise", "unhealthy", "slow", "corrupt", "stall", "bug")
SPARE_ACTIONS = ("kill-spare",)
PHASES = (
    "forward", "backward", "optimizer", "snapshot", "replicate", "recovery", "save", "evaluate",
    "finish", "setup", "launch", "groups", "digest",
)  # fmt: skip
AFTER_TRAINING = ("digest", "finish")  # kills only, at the last iteration
# `forward`, the start of the iteration, is the default: a fault at ITER then means iteration
# ITER never completes, so the last committed iteration is ITER - 1, easy to check in tests.
DEFAULT_PHASE = "forward"
TOGETHER_ACTIONS = ("kill", "hang")  # of several ranks at one point: they strike together
BEFORE_TRAINING = ("launch", "groups", "setup")  # the phases of ITER 0, in their order
# `evaluate`: as Megatron-LM's evaluation after ITER begins (ITER a multiple of its
# --eval-interval), once ITER is protected; our pretrain_gpt.py does not evaluate.
# `finish`: after the rank's training loop, final save and agreed replication stop, just before
# it exits: only a kill, at the last iteration (a death after the job's last collective: it
# waits until every rank has got there, see companions).
# `digest`: after the rank's training loop and final save, as the final state digest is about to
# be gathered (the other ranks wait in that gather for it): only a kill, at the last iteration
# (a death in the job's last second: training and its final save are whole).
# `setup`: during the process's set-up (groups up and the model built; in our pretrain_gpt.py
# before --load's checkpoint is read, in Megatron-LM's after), which comes before any
# iteration: ITER is 0, and only there.
# `launch`: in the process's first moments, connected to the job's store but not registered
# with it yet (as a death in its imports): only a kill or a hang, at ITER 0.
# `groups`: registered, as its process groups are about to be created (its peers wait for it
# in their rendezvous), at ITER 0; in Megatron-LM's pretrain_gpt.py just before pretrain().

GRAMMAR = (
    "--deadpool-inject SPEC[,SPEC...] with SPEC one of: "
    "kill@RANK:ITER[:PHASE], hang@RANK:ITER[:PHASE], raise@RANK:ITER[:PHASE], "
    "unhealthy@RANK:ITER[:PHASE], slow@RANK:ITER[:PHASE], stall@RANK:ITER[:PHASE], "
    "bug@RANK:ITER[:PHASE] "
    f"(PHASE: {'|'.join(PHASES)}; default {DEFAULT_PHASE}), corrupt@RANK:ITER (phase replicate), "
    "kill-spare@INDEX:ITER; kill@RANK:LAST:finish kills after the last iteration LAST, "
    "kill@RANK:LAST:digest as its final state digest is gathered; "
    "ACTION@RANK:0:setup strikes during the set-up, before iteration 1; "
    "kill@RANK:0:launch (or hang@) strikes a rank before it registers with the job; "
    "ACTION@RANK:0:groups strikes as its process groups are created; "
    "RANK, INDEX >= 0, ITER >= 1; kills (or hangs) of several ranks at one ITER and PHASE "
    "strike together, as a node's loss; e.g. kill@5:20,raise@0:30:backward,kill-spare@0:40"
)

_SPEC = re.compile(r"^(?P<action>[a-z-]+)@(?P<target>\d+):(?P<iteration>\d+)(?::(?P<phase>\w+))?$")


@dataclass(frozen=True)
class Fault:
    """One injected fault: `action` on `target` (a rank, or a spare index for kill-spare)."""

    action: str
    target: int
    iteration: int
    phase: str | None  # None for kill-spare: a spare runs no training phases

    @property
    def on_spare(self) -> bool:
        return self.action in SPARE_ACTIONS

    @property
    def transient(self) -> bool:
        return self.action == "raise"

    def __str__(self) -> str:
        suffix = "" if self.phase is None else f":{self.phase}"
        return f"{self.action}@{self.target}:{self.iteration}{suffix}"


def _bad(spec: str, why: str) -> ConfigError:
    return ConfigError(f"bad fault spec {spec!r}: {why}; expected {GRAMMAR}")


def parse_fault(
    spec: str, world_size: int | None = None, spares: int | None = None,
    last_iteration: int | None = None,
) -> Fault:  # fmt: skip
    """One SPEC; ranks, spare indexes and an after-training fault's iteration are checked only
    against the sizes given."""
    m = _SPEC.match(spec)
    if m is None:
        raise _bad(spec, "not of the form ACTION@TARGET:ITER[:PHASE]")
    action, phase = m["action"], m["phase"]
    target, iteration = int(m["target"]), int(m["iteration"])
    if action not in ACTIONS + SPARE_ACTIONS:
        raise _bad(spec, f"unknown action {action!r}")
    if iteration < 1 and not (iteration == 0 and phase in BEFORE_TRAINING):
        raise _bad(spec, f"iteration {iteration} must be >= 1 (iterations count from 1; 0 "
                   "only with phase launch, groups or setup)")  # fmt: skip
    if phase in BEFORE_TRAINING and iteration != 0:
        raise _bad(spec, f"phase {phase} comes before any iteration: write "
                   f"{action}@{target}:0:{phase}")  # fmt: skip
    if phase == "launch" and action not in ("kill", "hang"):
        raise _bad(spec, f"{action} cannot act before the process registers: only kill and "
                   "hang take phase launch")  # fmt: skip
    if action in SPARE_ACTIONS:
        if phase is not None:
            raise _bad(spec, "kill-spare takes no phase (a spare runs no training phases)")
        if spares is not None and target >= spares:
            raise _bad(spec, f"spare index {target} out of range: the job has {spares} spare(s)")
        return Fault(action, target, iteration, None)
    if action == "corrupt":
        if phase not in (None, "replicate"):
            raise _bad(spec, "corrupt acts on a replica in flight: its phase is replicate")
        phase = "replicate"
    if phase is None:
        phase = DEFAULT_PHASE
    elif phase not in PHASES:
        raise _bad(spec, f"unknown phase {phase!r}")
    if phase in AFTER_TRAINING:
        if action != "kill":
            raise _bad(spec, f"{action} cannot act after training: only kill takes phase {phase}")
        if last_iteration is not None and iteration != last_iteration:
            raise _bad(spec, f"phase {phase} comes after the last iteration, {last_iteration}, "
                       f"not after {iteration}")  # fmt: skip
    if world_size is not None and target >= world_size:
        raise _bad(spec, f"rank {target} out of range: world size is {world_size}")
    return Fault(action, target, iteration, phase)


def parse_faults(
    text: str, world_size: int | None = None, spares: int | None = None,
    last_iteration: int | None = None,
) -> tuple[Fault, ...]:  # fmt: skip
    """The whole flag value; empty text means no faults. Two faults on the same target,
    iteration and phase are refused: which one fires would be ambiguous."""
    if not text.strip():
        return ()
    faults = tuple(
        parse_fault(s.strip(), world_size, spares, last_iteration) for s in text.split(",")
    )
    seen: dict[tuple, Fault] = {}
    for f in faults:
        key = (f.on_spare, f.target, f.iteration, f.phase)
        if key in seen:
            raise _bad(str(f), f"conflicts with {str(seen[key])!r} (same target, iteration, phase)")
        seen[key] = f
    return faults


def faults_at(faults: Iterable[Fault], iteration: int, phase: str, rank: int) -> tuple[Fault, ...]:
    """The worker faults `rank` must act on at (`iteration`, `phase`): should it fail now?"""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; phases are {', '.join(PHASES)}")
    return tuple(
        f
        for f in faults
        if not f.on_spare and f.target == rank and f.iteration == iteration and f.phase == phase
    )


def companions(
    faults: Iterable[Fault], fault: Fault, world_size: int | None = None
) -> tuple[int, ...]:
    """The other ranks to be killed or hung at `fault`'s iteration and phase: they fail
    together with it (each waits for the others to be there), as the processes of a node do.
    Without that, the first to die would start a recovery that stops the others before they
    got there, and they would fail only in the replay. A kill at phase finish waits for every
    rank of the job (`world_size`): it is a death after the job's last collective, and a rank
    still in it (the final digest's gather) would be cut off by the recovery it starts."""
    if fault.action not in TOGETHER_ACTIONS:
        return ()
    if _waits_for_every_rank(fault) and world_size is not None:
        return tuple(r for r in range(world_size) if r != fault.target)
    return tuple(sorted({
        f.target for f in faults
        if f.action in TOGETHER_ACTIONS and not f.on_spare and f.target != fault.target
        and (f.iteration, f.phase) == (fault.iteration, fault.phase)
    }))  # fmt: skip


def awaited_at(faults: Iterable[Fault], iteration: int, phase: str, rank: int) -> Fault | None:
    """A kill of another rank that waits for `rank` to get to (`iteration`, `phase`), which
    `rank` must say it reached: a finish kill waits for every rank (companions)."""
    for f in faults:
        if (_waits_for_every_rank(f) and (f.iteration, f.phase) == (iteration, phase)
                and not f.on_spare and f.target != rank):  # fmt: skip
            return f
    return None


def _waits_for_every_rank(fault: Fault) -> bool:
    """A kill after the job's last collective (phase finish): it strikes once every rank got
    there, so no rank is still in that collective when the recovery it starts cuts them."""
    return fault.action in TOGETHER_ACTIONS and fault.phase == "finish"


def spare_kills_at(faults: Iterable[Fault], iteration: int) -> tuple[int, ...]:
    """Spare indexes to kill when the job reaches `iteration`."""
    return tuple(f.target for f in faults if f.on_spare and f.iteration == iteration)


class ChaosEvent(NamedTuple):
    offset_s: float  # seconds since the chaos clock started (the caller owns the clock)
    action: str  # "kill" or "hang"
    rank: int


class ChaosSchedule:
    """Random kills and hangs with exponential inter-arrival times (mean `mtbf_s`).

    Pure and reproducible: each iteration over the schedule replays the same infinite sequence
    from `random.Random(seed)`; the caller maps offsets onto its own clock.
    """

    def __init__(self, mtbf_s: float, seed: int, world_size: int, hang_fraction: float = 0.2):
        if not (mtbf_s > 0 and math.isfinite(mtbf_s)):
            raise ConfigError(
                f"--deadpool-chaos-mtbf must be a positive number of seconds, got {mtbf_s}"
            )
        if world_size < 1:
            raise ConfigError(f"chaos needs a world size >= 1, got {world_size}")
        if not 0.0 <= hang_fraction <= 1.0:
            raise ConfigError(f"chaos hang_fraction must be in [0, 1], got {hang_fraction}")
        self.mtbf_s = float(mtbf_s)
        self.seed = seed
        self.world_size = world_size
        self.hang_fraction = hang_fraction

    def __iter__(self) -> Iterator[ChaosEvent]:
        rng = random.Random(self.seed)
        offset = 0.0
        while True:
            # Fixed draw order (gap, action, rank) keeps a seed's sequence stable.
            offset += rng.expovariate(1.0 / self.mtbf_s)
            action = "hang" if rng.random() < self.hang_fraction else "kill"
            yield ChaosEvent(offset, action, rng.randrange(self.world_size))

    def take(self, n: int) -> list[ChaosEvent]:
        """The first `n` events."""
        it = iter(self)
        return [next(it) for _ in range(n)]

    def until(self, horizon_s: float) -> list[ChaosEvent]:
        """Every event with an offset <= `horizon_s`."""
        out = []
        for event in self:
            if event.offset_s > horizon_s:
                return out
            out.append(event)
        return out  # unreachable: the schedule is infinite
