"""Is a process hung, or only slow? Pure decisions over what the agent and the process observe.

A late heartbeat alone never condemns a process: on a loaded node, or while a checkpoint save
or a long kernel holds the GIL, healthy processes miss beats for seconds. A process counts as
hung only on evidence that it is not progressing:

- the operating system reports it stopped (SIGSTOP) or dead for longer than the heartbeat
  timeout; or
- its heartbeat is late AND its training thread has marked no phase boundary
  (failure/progress.py) for longer than the limit of the phase it is in.

A process whose heartbeat is on time but whose training thread has marked nothing past that
limit is stalled: logged once, never fenced. Its training thread is blocked, and every rank
waiting on it in a collective looks the same from here; the collectives' timeout ends those
waits, their errors point at the rank they waited for, and the recovery fences it once it
has made no progress past its limit (`Monitor.lost`). Without the log a deadlock was silent
until then (minutes: a signal handler that waited for itself, 2026-12-06).

The limit of a phase adapts to what the process has shown: `factor` times the longest that
phase has taken so far, never below `floor_s`; phases known to be slow (a checkpoint save, a
recovery, and every phase of the first iterations of a process, which include lazy
initialisation) get at least `slow_phase_s`. A late heartbeat from a process that is still
progressing is a suspicion: logged, never fenced.

After a recovery order, the process itself asks `StallWatch` whether its training thread is
still working towards the next phase boundary (where it stops and joins the recovery): it
waits as long as the thread makes progress, and leaves only when it is blocked (no mark and no
CPU time for `idle_s`: e.g. a gloo send its peer will never receive) or computing without
reaching a boundary for its phase's limit.

Everything here takes the time as an argument; no clock, thread or I/O.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..errors import ConfigError
from .progress import ProgressMark

# Phases with their own allowance: set-up and the end of training (imports, the final save),
# saves write to storage, a recovery rebuilds everything.
SLOW_PHASES = frozenset({"start", "save", "evaluate", "recovery", "finish"})
# Iterations of a process (counted from the first it is seen in) that get the slow allowance:
# the first step builds optimizer state and warms caches, the second still pays some of it.
WARMUP_ITERATIONS = 2
# Process states, as psutil names them, that mean the process cannot progress.
STOPPED_STATES = frozenset({"stopped", "zombie", "dead"})
# Of those, the state of a process on its way out: its exit status is coming (a process of
# many threads shows as a zombie until its last thread has left, which on a loaded machine
# takes seconds: measured, 32 processes finishing on 2 cores), so it is hung only after the
# hang timeout, and its exit status, when it comes, is the evidence.
EXITING_STATES = frozenset({"zombie"})


@dataclass(frozen=True)
class HangPolicy:
    """The limits, all in seconds; built from the --deadpool-heartbeat/hang... flags."""

    heartbeat_timeout_s: float = 2.0
    floor_s: float = 60.0
    factor: float = 5.0
    slow_phase_s: float = 600.0

    def __post_init__(self) -> None:
        if not self.heartbeat_timeout_s > 0:
            raise ConfigError(
                f"--deadpool-heartbeat-timeout must be > 0 seconds, got {self.heartbeat_timeout_s}"
            )
        if not self.floor_s >= self.heartbeat_timeout_s:
            raise ConfigError(
                f"--deadpool-hang-timeout {self.floor_s} must be at least "
                f"--deadpool-heartbeat-timeout {self.heartbeat_timeout_s}"
            )
        if not self.factor >= 1:
            raise ConfigError(f"--deadpool-hang-timeout-factor must be >= 1, got {self.factor}")
        if not self.slow_phase_s >= self.floor_s:
            raise ConfigError(
                f"--deadpool-slow-phase-timeout {self.slow_phase_s} must be at least "
                f"--deadpool-hang-timeout {self.floor_s}"
            )

    @classmethod
    def from_config(cls, dpc) -> HangPolicy:
        """From a DeadpoolConfig (the flags of the same names)."""
        return cls(
            heartbeat_timeout_s=dpc.deadpool_heartbeat_timeout,
            floor_s=dpc.deadpool_hang_timeout,
            factor=dpc.deadpool_hang_timeout_factor,
            slow_phase_s=dpc.deadpool_slow_phase_timeout,
        )

    @property
    def idle_s(self) -> float:
        """How long a process may sit without any mark or CPU time after a recovery order."""
        return max(1.0, self.heartbeat_timeout_s)


@dataclass
class ProgressTracker:
    """One process's progress as observed through its marks: when the mark last changed, and
    the longest each phase has taken. Fed by whoever polls the board (agent or process)."""

    mark: ProgressMark | None = None
    changed_at: float | None = None  # when `mark` was first seen
    longest: dict[str, float] = field(default_factory=dict)
    first_iteration: int | None = None

    def observe(self, mark: ProgressMark | None, now: float) -> None:
        if mark is None or mark.seq == 0:
            return
        if self.mark is None:
            self.first_iteration = mark.iteration
        elif mark.seq != self.mark.seq:
            # The phase seen last lasted at most this long (marks between two polls are
            # folded into it: an overestimate, which only lengthens the limit).
            spent = now - self.changed_at
            phase = self.mark.phase
            self.longest[phase] = max(self.longest.get(phase, 0.0), spent)
        else:
            return
        self.mark, self.changed_at = mark, now

    def idle_for(self, now: float) -> float | None:
        """Seconds since the mark last changed; None before the first mark."""
        return None if self.changed_at is None else now - self.changed_at

    def in_warmup(self) -> bool:
        if self.mark is None or self.first_iteration is None:
            return True
        return self.mark.iteration < self.first_iteration + WARMUP_ITERATIONS

    def limit(self, policy: HangPolicy) -> float:
        """How long the current phase may go without a new mark before the process is hung."""
        phase = self.mark.phase if self.mark is not None else "start"
        limit = max(policy.floor_s, policy.factor * self.longest.get(phase, 0.0))
        if phase in SLOW_PHASES or self.in_warmup():
            limit = max(limit, policy.slow_phase_s)
        return limit

    def where(self) -> str:
        if self.mark is None:
            return "before its first progress mark"
        return f"iteration {self.mark.iteration}, phase {self.mark.phase}"


class Verdict(enum.Enum):
    OK = "ok"
    SUSPECTED = "suspected"  # heartbeat late, but alive and progressing: log, never fence
    STALLED = "stalled"  # heartbeat on time, no progress past the limit: log, never fence
    HUNG = "hung"  # not progressing: fence and replace


@dataclass(frozen=True)
class Assessment:
    verdict: Verdict
    reason: str  # one line, for the log and the event


def assess(
    beat_age_s: float | None,
    tracker: ProgressTracker,
    state: str | None,
    stopped_for_s: float,
    now: float,
    policy: HangPolicy,
) -> Assessment:
    """Judge one process. `beat_age_s`: seconds since its last heartbeat (None: no beat yet or
    not watched); `state`: what the OS says (psutil's names, None if unknown);
    `stopped_for_s`: how long it has been continuously in a stopped state."""
    where = tracker.where()
    if state in STOPPED_STATES:
        limit = policy.floor_s if state in EXITING_STATES else policy.heartbeat_timeout_s
        if stopped_for_s > limit:
            return Assessment(
                Verdict.HUNG, f"the process is {state} (for {stopped_for_s:.1f} s), at {where}"
            )
    idle = tracker.idle_for(now)
    limit = tracker.limit(policy)
    if beat_age_s is None or beat_age_s <= policy.heartbeat_timeout_s:
        if idle is not None and idle > limit:
            # Its other threads beat, its training thread marks nothing: blocked, in a
            # collective that waits for a peer or in a deadlock of its own. Which of the two
            # is not known here, and every rank waiting for the blocked one looks the same.
            return Assessment(
                Verdict.STALLED,
                f"no progress for {idle:.1f} s at {where} (limit {limit:.0f} s) while its "
                f"heartbeat is on time: its training thread is blocked (a collective waiting "
                f"for a peer, or a deadlock); the collectives' timeout "
                f"(--distributed-timeout-minutes) ends a wait for a peer",
            )
        return Assessment(Verdict.OK, "")
    if idle is not None and idle > limit:
        return Assessment(
            Verdict.HUNG,
            f"no progress for {idle:.1f} s at {where} (limit {limit:.0f} s), process {state}",
        )
    progress = "no mark yet" if idle is None else f"last progress {idle:.1f} s ago"
    return Assessment(
        Verdict.SUSPECTED,
        f"heartbeat {beat_age_s:.1f} s late but the process is {state or 'alive'} at {where} "
        f"({progress}, limit {limit:.0f} s)",
    )


@dataclass
class StallWatch:
    """A process's own view of its training thread: fed with its board's marks all the time
    (cheap), and, once a recovery was ordered, with the CPU time of its working threads
    (training, snapshot, replication: not the control plane's own threads)."""

    policy: HangPolicy
    tracker: ProgressTracker = field(default_factory=ProgressTracker)
    _cpu_s: float | None = None
    _busy_at: float | None = None  # the last time a mark or CPU time advanced; None: idle

    def observe(self, mark: ProgressMark | None, now: float) -> None:
        before = self.tracker.mark
        self.tracker.observe(mark, now)
        if self._busy_at is not None and self.tracker.mark is not before:
            self._busy_at = now

    def watch_cpu(self, cpu_s: float, now: float) -> None:
        """After an order: CPU time the working threads have used so far."""
        if self._busy_at is None or self._cpu_s is None or cpu_s > self._cpu_s:
            self._busy_at = now
        self._cpu_s = cpu_s

    def stop_watching(self) -> None:
        """The training thread stopped (it joined the recovery): nothing to wait for."""
        self._busy_at = self._cpu_s = None

    def stalled(self, now: float) -> str | None:
        """Why the training thread is not coming to a phase boundary, or None while it is (or
        while no order is being waited on)."""
        if self._busy_at is None:
            return None
        where = self.tracker.where()
        if now - self._busy_at > self.policy.idle_s:
            return (
                f"blocked at {where}: no progress mark and no CPU time for "
                f"{now - self._busy_at:.1f} s (a wait a recovery cannot interrupt)"
            )
        idle = self.tracker.idle_for(now)
        limit = self.tracker.limit(self.policy)
        if idle is not None and idle > limit:
            return f"computing without progress for {idle:.1f} s at {where} (limit {limit:.0f} s)"
        return None
