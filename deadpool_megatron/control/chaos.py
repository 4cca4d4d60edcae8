"""Chaos mode: the launcher kills or hangs random ranks with exponential inter-arrival times.

The schedule is the pure, seeded `ChaosSchedule`; this file carries it out on this node's
processes (SIGKILL for a crash, SIGSTOP for a hang), starting the clock at the first
iteration, and reports each injection like an injected fault so its detection is timed.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import time

from ..events import FAULT_INJECTED, EventLog
from ..failure.inject import ChaosSchedule
from . import keys
from .store import KVStore

log = logging.getLogger("deadpool.chaos")


class Chaos:
    def __init__(self, settings, workers: dict, kv: KVStore, job: str, events: EventLog):
        self.workers = workers
        self.kv = kv
        self.job = job
        self.events = events
        self._schedule = None
        if settings.deadpool_chaos_mtbf:
            world = max(workers) + 1 if workers else 0
            self._schedule = iter(
                ChaosSchedule(settings.deadpool_chaos_mtbf, settings.deadpool_chaos_seed, world)
            )
        self._next = None
        self._t0: float | None = None

    def step(self, iteration: int) -> None:
        """Inject every event that is due; the clock starts once training does."""
        if self._schedule is None or iteration < 1:
            return
        now = time.time()
        if self._t0 is None:
            self._t0 = now
        while True:
            if self._next is None:
                self._next = next(self._schedule)
            if now - self._t0 < self._next.offset_s:
                return
            event, self._next = self._next, None
            child = self.workers.get(event.rank)
            if child is None or child.proc.poll() is not None:
                continue  # another node's rank, or already gone
            fault = f"chaos-{event.action}@{event.rank}"
            self.kv.set(
                keys.injected(self.job, 0, event.rank),
                json.dumps({"fault": fault, "at": now}).encode(),
            )
            self.events.emit(FAULT_INJECTED, rank=event.rank, fault=fault)
            log.warning("chaos: %s (pid %d) at %.1f s", fault, child.proc.pid, now - self._t0)
            os.kill(child.proc.pid, signal.SIGKILL if event.action == "kill" else signal.SIGSTOP)
