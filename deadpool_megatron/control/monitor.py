"""The launcher's watch over its processes: child exits, heartbeats and self-reports become
evidence, and evidence becomes one classified failure to act on.

Three kinds of evidence, as the paper's detection layer: the launcher seeing a child exit
(crash: tens of milliseconds), a heartbeat that stopped (hang: the timeout), and a worker's own
report of an exception it caught (a collective that raised, an injected transient error).
Classification is the pure function in failure/classify.py; this file only gathers.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..failure.classify import (
    Classification,
    ClassifyPolicy,
    FailureHistory,
    InconclusiveEvidence,
    classify,
)
from ..failure.evidence import (
    CollectiveError,
    Evidence,
    HealthCheckFailed,
    InjectedTransient,
    ProcessExited,
    is_peer_loss_message,
)
from ..failure.heartbeat import HeartbeatDetector
from . import keys
from .store import KVStore

STORE_POLL_S = 0.1


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
    def __init__(
        self,
        kv: KVStore,
        job: str,
        ranks: list[int],
        returncode: Callable[[int], int | None],
        heartbeat_interval_s: float,
        heartbeat_timeout_s: float,
        watch_heartbeats: bool,
        clock: Callable[[], float] = time.time,
        generation: int = 0,
    ):
        self.kv = kv
        self.job = job
        self.ranks = ranks
        self.generation = generation
        self._returncode = returncode
        self.watch_heartbeats = watch_heartbeats
        self.detector = HeartbeatDetector(heartbeat_interval_s, heartbeat_timeout_s, clock)
        self._clock = clock
        self._last_beat: dict[int, bytes] = {}
        self._next_store_poll = 0.0
        self.iteration = 0  # the highest iteration any heartbeat reported
        self.history = FailureHistory()
        self.policy = ClassifyPolicy()
        self._reports: dict[int, Evidence] = {}
        self.hearsay_grace_s = heartbeat_interval_s

    def poll(self) -> Detection | None:
        """One look at everything; a Detection when the evidence is conclusive."""
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
        evidence.extend(self._reports.values())
        if self.watch_heartbeats:
            evidence.extend(self.detector.stale(now))
        if not evidence:
            return None
        try:
            decision = classify(evidence, self.history, self.policy, ranks=self.ranks)
        except InconclusiveEvidence:
            return None  # only survivors' hearsay so far: the exit or a stale beat follows
        won = decision.evidence
        if _is_hearsay(won) and now - won.at < self.hearsay_grace_s:
            # Survivors noticed a peer's loss before we saw the peer exit or go quiet; give
            # the direct evidence a moment to arrive before acting on hearsay.
            return None
        return Detection(decision, tuple(evidence), now, self._injected_at(decision.rank))

    def _read_heartbeats(self, now: float) -> None:
        for rank in self.ranks:
            raw = self.kv.get(keys.heartbeat(self.job, self.generation, rank))
            if (
                raw is not None
                and raw != self._last_beat.get(rank)
                and self._returncode(rank) is None
            ):
                self._last_beat[rank] = raw
                self.detector.beat(rank, now)
                self.iteration = max(self.iteration, json.loads(raw).get("iteration", 0))

    def _read_reports(self) -> None:
        for rank in self.ranks:
            if rank in self._reports:
                continue
            raw = self.kv.get(keys.report(self.job, self.generation, rank))
            if raw is None:
                continue
            r = json.loads(raw)
            if r["kind"] == "injected_transient":
                self._reports[rank] = InjectedTransient(rank, r["at"])
            elif r["kind"] == "health_check":
                self._reports[rank] = HealthCheckFailed(rank, r["message"], r["at"])
            else:
                self._reports[rank] = CollectiveError(rank, r["message"], r["at"])

    def _injected_at(self, rank: int) -> float | None:
        raw = self.kv.get(keys.injected(self.job, self.generation, rank))
        return json.loads(raw)["at"] if raw is not None else None

    def advance(self, generation: int) -> None:
        """Watch `generation` from now on (after a recovery): its heartbeats and reports.
        The failure history stays, so a rank that keeps failing transiently is escalated."""
        self.generation = generation
        self._reports.clear()
        self._last_beat.clear()
        for rank in self.ranks:
            self.detector.forget(rank)

    def forget(self, rank: int) -> None:
        """Stop watching a rank (fenced or ended)."""
        self.detector.forget(rank)
