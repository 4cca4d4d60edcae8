"""Chaos mode: the agent kills or hangs random ranks with exponential inter-arrival times.

The schedule is the pure, seeded `ChaosSchedule`; this file carries it out on this node's
processes (SIGKILL for a crash, SIGSTOP for a hang). Its clock runs only while the job trains:
it starts at the first iteration and stops while a recovery is under way, while the agent
is busy elsewhere, and for good once training is over (the job's last collectives), so faults
go into a running job at the rate asked for and never come in a burst of overdue ones. Each
injection is recorded like an injected fault (with the generation it happened in), so its
detection is timed.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Mapping

from ..events import FAULT_INJECTED, EventLog
from ..failure.inject import ChaosEvent, ChaosSchedule
from . import keys
from .context import JobContext
from .messages import Injection

log = logging.getLogger("deadpool.chaos")

# A gap between two looks longer than this means the agent was busy (a recovery): the chaos
# clock does not run meanwhile.
PAUSE_S = 1.0


class Chaos:
    def __init__(
        self,
        mtbf_s: float | None,
        seed: int,
        world_size: int,
        ctx: JobContext,
        pids: Callable[[], Mapping[int, int]],
        events: EventLog,
        clock: Callable[[], float] = time.time,
        kill: Callable[[int, int], None] = os.kill,
    ):
        """`pids()`: rank -> pid of this node's live workers, at the time of the look."""
        self.ctx = ctx
        self._pids = pids
        self.events = events
        self._clock = clock
        self._kill = kill
        self._schedule = iter(ChaosSchedule(mtbf_s, seed, world_size)) if mtbf_s else None
        self._next: ChaosEvent | None = None
        self._elapsed = 0.0  # seconds of training the chaos clock has counted
        self._last: float | None = None
        self.injected: list[tuple[float, str]] = []

    def step(self, iteration: int, running: bool = True) -> None:
        """Inject the event that is due, if any. `iteration`: the newest the job reported (the
        clock starts at the first); `running`: False while a recovery is under way."""
        if self._schedule is None:
            return
        if iteration < 1 or not running:
            self._last = None  # the clock stands still
            return
        now = self._clock()
        if self._last is not None and now - self._last <= PAUSE_S:
            self._elapsed += now - self._last
        self._last = now
        if self._next is None:
            self._next = next(self._schedule)
        while self._next.offset_s <= self._elapsed:
            event, self._next = self._next, next(self._schedule)
            pid = self._pids().get(event.rank)
            if pid is None:
                continue  # another node's rank, or already gone
            fault = f"chaos-{event.action}@{event.rank}"
            self.ctx.put(keys.injected(self.ctx.job, event.rank),
                         Injection(fault, now, self.ctx.generation))  # fmt: skip
            self.events.emit(FAULT_INJECTED, rank=event.rank, fault=fault)
            self.injected.append((self._elapsed, fault))
            log.warning("chaos: %s (pid %d) at %.1f s of training", fault, pid, self._elapsed)
            self._kill(pid, signal.SIGKILL if event.action == "kill" else signal.SIGSTOP)
            return  # at most one per look: the job answers before the next one
