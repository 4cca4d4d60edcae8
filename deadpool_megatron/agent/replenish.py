"""Spare replenishment: a node that is still healthy keeps its spare pool full.

A months-long job sees dozens of failures; without new spares the pool drains and the next
permanent failure ends the job. When one of this node's processes is lost (a worker replaced
by a spare, or an idle spare that died), the agent starts a fresh spare in the freed local
slot (its device on a GPU node) once no recovery is in flight. It stops doing so when the node
itself is suspect: a process failed its health check there, or several fresh spares in a row
died before they were ready. Pure bookkeeping; the agent starts the processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_FAILED_STARTS = 3  # fresh spares in a row that died before ready: the node cannot start one


@dataclass(frozen=True)
class SpareStart:
    """Start this spare: a job-wide unique index, in the freed local slot."""

    index: int
    local_rank: int


@dataclass
class Replenisher:
    """Which spares this node owes its pool. Replenished spares are numbered past every
    node's initial block (`first_index`), interleaved by node (`stride` = node count), so
    indices stay unique across the job without asking anyone."""

    enabled: bool
    first_index: int
    stride: int
    limit: int | None = None  # no index at or past it (another node's numbers begin there)
    owed: list[int] = field(default_factory=list)  # freed local slots awaiting a spare
    started: int = 0
    failed_starts: int = 0
    stopped: str | None = None  # why this node no longer replenishes

    def lost(self, local_rank: int) -> None:
        """A local process is gone for good: its slot is owed a fresh spare."""
        if self.enabled and self.stopped is None:
            self.owed.append(local_rank)

    def spare_died(self, ready: bool) -> None:
        """An idle spare died; one that was never ready counts as a failed start."""
        self.failed_starts = 0 if ready else self.failed_starts + 1
        if self.failed_starts >= MAX_FAILED_STARTS:
            self.stop(f"{self.failed_starts} spares in a row died before they were ready")

    def stop(self, reason: str) -> None:
        """The node is suspect: start nothing more on it."""
        if self.stopped is None:
            self.stopped = reason
        self.owed.clear()

    def next_start(self) -> SpareStart | None:
        """The next spare to start now, if any is owed."""
        if not self.enabled or self.stopped is not None or not self.owed:
            return None
        index = self.first_index + self.started * self.stride
        if self.limit is not None and index >= self.limit:
            self.stop(f"its spares' numbers are used up ({self.started} started since launch)")
            return None
        start = SpareStart(index, self.owed.pop(0))
        self.started += 1
        return start
