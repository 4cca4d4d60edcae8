"""The launcher's watch over its processes: child exits, heartbeats and self-reports become
evidence, and evidence becomes one classified failure to act on.

Three kinds of evidence, as the paper's detection layer: the launcher seeing a child exit
(crash: tens of milliseconds), a hang, and a worker's own report of an exception it caught (a
collective that raised, an injected transient error). A hang is never a late heartbeat alone:
the monitor also reads each process's progress marks (shared memory, failure/progress.py) and
its state as the OS reports it, and failure/hang.py decides; a late beat from a process that is
still progressing is a suspicion, handed to `on_suspect` and never fenced, and a process that
beats on time but whose training thread stopped progressing is a stall, handed to `on_stall`
and never fenced either. Classification is
the pure function in failure/classify.py; this file only gathers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..failure.classify import (
    Classification,
    ClassifyPolicy,
    FailureHistory,
    InconclusiveEvidence,
    classify,
    describe,
)
from ..failure.evidence import (
    CollectiveError,
    CudaError,
    Evidence,
    HealthCheckFailed,
    HeartbeatStale,
    InjectedTransient,
    ProcessExited,
    cuda_error_recoverable,
    is_peer_loss_message,
)
from ..failure.hang import STOPPED_STATES, HangPolicy, ProgressTracker, Verdict, assess
from ..failure.heartbeat import HeartbeatDetector
from ..failure.progress import ProgressMark
from . import keys
from .context import JobContext
from .messages import (
    COLLECTIVE_ERROR,
    CUDA_ERROR,
    HEALTH_CHECK,
    INJECTED_TRANSIENT,
    FailureReport,
    Heartbeat,
    Injection,
)

STORE_POLL_S = 0.1


@dataclass(frozen=True)
class ProcessProbe:
    """What the agent sees of the process holding a rank, without asking the process."""

    pid: int
    mark: ProgressMark | None  # its progress board, None when it has none
    state: str  # psutil's status name


@dataclass
class _Watched:
    """The monitor's running view of one process (a new process holding a rank starts anew)."""

    pid: int
    tracker: ProgressTracker = dataclasses.field(default_factory=ProgressTracker)
    state: str = "unknown"
    stopped_since: float | None = None
    suspected: bool = False  # a suspicion was reported and the heartbeat has not caught up
    stalled: bool = False  # a stall was reported and the process has not progressed since


@dataclass(frozen=True)
class Detection:
    classification: Classification
    evidence: tuple[Evidence, ...]
    detected_at: float
    injected_at: float | None  # when the fault was injected, if it was

    @property
    def latency_s(self) -> float | None:
        if self.injected_at is None:
            return None
        return self.detected_at - self.injected_at


def _is_hearsay(e: Evidence) -> bool:
    return isinstance(e, CollectiveError) and is_peer_loss_message(e.message)


class Monitor:
    """Watches `ranks` in the generation `ctx` is at (read at every poll: when it moves on,
    the old generation's heartbeats and reports are forgotten).

    `world_size`: the job's ranks (None: `ranks` are all of them). Hearsay that names no peer
    is pinned on the one silent member only by a monitor that watches every member: a node's
    agent sees only its own ranks, and a local rank that merely has not reported yet is not
    the failed one (the failure is elsewhere: its node's agent, or the node's lapsed lease,
    tells)."""

    def __init__(
        self,
        ctx: JobContext,
        ranks: list[int],
        returncode: Callable[[int], int | None],
        heartbeat_interval_s: float,
        policy: HangPolicy,
        watch_heartbeats: bool,
        clock: Callable[[], float] = time.time,
        probe: Callable[[int], ProcessProbe | None] = lambda rank: None,
        on_suspect: Callable[[int, str], None] = lambda rank, reason: None,
        world_size: int | None = None,
        on_stall: Callable[[int, str], None] = lambda rank, reason: None,
    ):
        self.ctx = ctx
        self.world_size = world_size
        self.job = ctx.job
        self.ranks = ranks
        self._generation = ctx.generation  # which generation's keys the state below is of
        self._returncode = returncode
        self.watch_heartbeats = watch_heartbeats
        self.hang_policy = policy
        self.detector = HeartbeatDetector(heartbeat_interval_s, policy.heartbeat_timeout_s, clock)
        self._probe = probe
        self._on_suspect = on_suspect
        self._on_stall = on_stall
        self._watched: dict[int, _Watched] = {}
        self._clock = clock
        self._last_beat: dict[int, Heartbeat] = {}
        self._next_store_poll = 0.0
        self.iteration = 0  # the highest iteration any heartbeat reported
        self.history = FailureHistory()
        self.policy = ClassifyPolicy()
        self._reports: dict[int, Evidence] = {}
        self._consumed: dict[int, float] = {}  # injection times already attributed, per rank
        self.hearsay_grace_s = heartbeat_interval_s
        # Hearsay alone for this long (twice what a hang takes to show): nothing more will come.
        self.stall_after_s = 2 * policy.heartbeat_timeout_s
        self._inconclusive_since: float | None = None  # evidence first seen, unresolved

    def poll(self) -> Detection | None:
        """One look at everything; a Detection when the evidence is conclusive."""
        if self.ctx.generation != self._generation:
            self._enter(self.ctx.generation)
        now = self._clock()
        evidence: list[Evidence] = []
        for rank in self.ranks:
            rc = self._returncode(rank)
            if rc == 0:  # finished: its heartbeats stop for a good reason
                self.detector.forget(rank)
            elif rc is not None:
                evidence.append(ProcessExited(rank, rc, now))
        if now >= self._next_store_poll:
            self._next_store_poll = now + STORE_POLL_S
            self._read_heartbeats(now)
            self._read_reports()
            if self.watch_heartbeats:
                self._observe_processes(now)
        elif evidence:
            # An exit is seen at once; what the process reported before it (its own error,
            # the cause classify weighs with the exit) is read with it, not a poll later.
            self._read_reports()
        evidence.extend(self._reports.values())
        if self.watch_heartbeats:
            evidence.extend(self._hung(now))
        if not evidence:
            self._inconclusive_since = None
            return None
        if self._inconclusive_since is None:
            self._inconclusive_since = now
        stalled = now - self._inconclusive_since >= self.stall_after_s
        try:
            decision = classify(evidence, self.history, self.policy, self._members(), stalled)
        except InconclusiveEvidence:
            return None  # only survivors' hearsay so far: the exit or a stale beat follows
        won = decision.evidence
        if _is_hearsay(won) and now - won.at < self.hearsay_grace_s:
            # Survivors noticed a peer's loss before we saw the peer exit or go quiet; give
            # the direct evidence a moment to arrive before acting on hearsay.
            return None
        return Detection(decision, tuple(evidence), now, self._injected_at(decision.rank))

    def _members(self) -> list[int] | None:
        """The generation's members for `classify`, when this monitor watches all of them."""
        if self.world_size is None or len(self.ranks) == self.world_size:
            return self.ranks
        return None

    def _observe_processes(self, now: float) -> None:
        for rank in self.ranks:
            self._observe(rank, now)

    def _observe(self, rank: int, now: float) -> None:
        probe = self._probe(rank)
        if probe is None:
            return
        w = self._watched.get(rank)
        if w is None or w.pid != probe.pid:  # a new process holds the rank
            w = self._watched[rank] = _Watched(probe.pid)
        w.tracker.observe(probe.mark, now)
        w.state = probe.state
        if probe.state in STOPPED_STATES:
            w.stopped_since = now if w.stopped_since is None else w.stopped_since
        else:
            w.stopped_since = None

    def _hung(self, now: float) -> list[HeartbeatStale]:
        """Evidence for every hung rank; late beats of progressing ranks become suspicions, and
        ranks beating on time without progress stalls (each reported once per episode)."""
        late = {e.rank: e for e in self.detector.stale(now)}
        out = []
        for rank in self.ranks:
            if self._returncode(rank) is not None:
                continue  # it exited: that is the evidence, or it finished
            w = self._watched.get(rank)
            stale = late.get(rank)
            if w is None:
                continue  # nothing seen of its process: a late beat alone proves nothing
            last = self.detector.last_seen(rank)
            age = None if stale is None else now - last if last is not None else float("inf")
            stopped = 0.0 if w.stopped_since is None else now - w.stopped_since
            a = assess(age, w.tracker, w.state, stopped, now, self.hang_policy)
            if a.verdict is Verdict.HUNG:
                out.append(
                    dataclasses.replace(stale, why=a.reason)
                    if stale is not None
                    else HeartbeatStale(rank, last, now, a.reason)
                )
            elif a.verdict is Verdict.SUSPECTED and not w.suspected:
                w.suspected = True
                self._on_suspect(rank, a.reason)
            elif a.verdict is Verdict.STALLED and not w.stalled:
                w.stalled = True
                self._on_stall(rank, a.reason)
            if a.verdict is Verdict.OK:
                w.suspected = w.stalled = False
        return out

    def training_over(self) -> bool:
        """A rank finished training (it marked `finish`, or exited with status 0): the job is
        in its last collectives, where a fault would end it rather than test a recovery."""
        for rank in self.ranks:
            w = self._watched.get(rank)
            if self._returncode(rank) == 0 or (
                w is not None and w.tracker.mark is not None and w.tracker.mark.phase == "finish"
            ):
                return True
        return False

    def finished(self, rank: int) -> bool:
        """The process holding `rank` exited with status 0: it finished training."""
        return self._returncode(rank) == 0

    def lost(self, rank: int) -> str | None:
        """During a recovery: why the process holding `rank` will never report (it exited with
        a nonzero status, is stopped, or shows no progress for its phase's limit), or None
        while it may still. An exit with status 0 is not a loss even when it lands between the
        coordinator's look at `finished` and this one: the next look finds it finished."""
        rc = self._returncode(rank)
        if rc == 0:
            return None
        if rc is not None:
            return describe(ProcessExited(rank, rc, self._clock()))
        now = self._clock()
        self._observe(rank, now)
        w = self._watched.get(rank)
        if w is None:
            return None
        stopped = 0.0 if w.stopped_since is None else now - w.stopped_since
        # Heartbeats do not matter here: the process was told to stop and report.
        a = assess(float("inf"), w.tracker, w.state, stopped, now, self.hang_policy)
        return a.reason if a.verdict is Verdict.HUNG else None

    def _read_heartbeats(self, now: float) -> None:
        for rank in self.ranks:
            beat = self.ctx.get(keys.heartbeat(self.job, self._generation, rank), Heartbeat)
            if (
                beat is not None
                and beat != self._last_beat.get(rank)
                and self._returncode(rank) is None
            ):
                self._last_beat[rank] = beat
                self.detector.beat(rank, now)
                self.iteration = max(self.iteration, beat.iteration)

    def _read_reports(self) -> None:
        for rank in self.ranks:
            if rank in self._reports:
                continue
            r = self.ctx.get(keys.report(self.job, self._generation, rank), FailureReport)
            if r is None:
                continue
            if r.kind == INJECTED_TRANSIENT:
                self._reports[rank] = InjectedTransient(rank, r.at)
            elif r.kind == HEALTH_CHECK:
                self._reports[rank] = HealthCheckFailed(rank, r.message, r.at)
            else:
                assert r.kind in (COLLECTIVE_ERROR, CUDA_ERROR), r.kind
                where = (r.iteration, r.phase) if r.iteration >= 0 else None
                recoverable = None  # read only where the reporter told a CUDA error
                if r.kind == CUDA_ERROR:
                    recoverable = cuda_error_recoverable(r.message)
                if recoverable is not None:
                    self._reports[rank] = CudaError(rank, r.message, recoverable, r.at, where)
                else:
                    self._reports[rank] = CollectiveError(rank, r.message, r.at, where=where)

    def _injected_at(self, rank: int) -> float | None:
        """When the fault behind this failure was injected, if one was (each injection is
        attributed to one detection only: a later, natural failure has no latency)."""
        inj = self.ctx.get(keys.injected(self.job, rank), Injection)
        if inj is None or inj.at <= self._consumed.get(rank, float("-inf")):
            return None
        self._consumed[rank] = inj.at
        return inj.at

    def _enter(self, generation: int) -> None:
        """Watch `generation` from now on (after a recovery): its heartbeats and reports.
        The failure history stays, so a rank that keeps failing transiently is escalated."""
        self._generation = generation
        self._inconclusive_since = None
        self._reports.clear()
        self._last_beat.clear()
        for rank in self.ranks:
            self.detector.forget(rank)

    def record_transient(self, rank: int, at: float) -> None:
        """A transient failure of `rank` was acted on (it counts towards escalation)."""
        self.history = self.history.record(rank, at).prune(at, self.policy.window_s)

    def record_error(self, evidence) -> None:
        """A failure was acted on: its evidence, if a rank's own error at a known place, is
        what a replay that fails the same way is matched with (classify.py)."""
        self.history = self.history.record_error(evidence)

    def set_ranks(self, ranks: list[int]) -> None:
        """Watch these ranks from now on (a recovery moved ranks onto or off this node)."""
        for rank in set(self.ranks) - set(ranks):
            self.forget(rank)
            self._reports.pop(rank, None)
        self.ranks = sorted(ranks)

    def forget(self, rank: int) -> None:
        """Stop watching a rank (fenced or ended)."""
        self.detector.forget(rank)
        self._watched.pop(rank, None)
