"""The event log: one JSON object per line, one line per event, from any process of the job.

Every record carries wall-clock `time`, `event`, `generation` (read, at the time of the event,
from the process's job context: the log keeps no copy) and `rank` (None for the launcher and
idle spares), plus the event's own fields. Several processes append to the same file; each
record is one write() of one short line to a file opened with O_APPEND, which local file
systems keep whole.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

# Event names, declared once (the report and the tests read them).
FAILURE_DETECTED = "failure_detected"
FENCED = "fenced"
SUSPECTED = "suspected"  # a late heartbeat from a process that is still progressing: not fenced
STALLED = "stalled"  # a process beating on time whose training thread stopped: not fenced
SPARE_REGISTERED = "spare_registered"
SPARE_CLAIMED = "spare_claimed"
SPARE_LOST = "spare_lost"
SPARE_STARTED = "spare_started"  # a fresh spare replenishing the pool
SPARE_POOL = "spare_pool"  # a node's idle spare count, whenever it changes
NODE_LOST = "node_lost"  # a node's agent lease lapsed: its ranks and spares are gone
NODE_JOINED = "node_joined"  # a fresh node joined the running job as a spare node (--join)
RANK_RELAUNCHED = "rank_relaunched"  # a rank died before it registered: its seat started again
FAULT_INJECTED = "fault_injected"
JOB_ENDED = "job_ended"
CHECKPOINT_LOADED = "checkpoint_loaded"
JOB_RESTART = "job_restart"  # checkpoint-restart: every process stopped, the job starts again
RECOVERY_STARTED = "recovery_started"
RECOVERY_PHASE = "recovery_phase"  # one per phase, with duration_s
RECOVERY_UNNEEDED = "recovery_unneeded"  # the failure came after training had finished
RECOVERY_DONE = "recovery_done"  # total_s: failure to the first resumed iteration finished


class EventLog:
    def __init__(
        self,
        path: str | None,
        rank: int | None = None,
        generation: Callable[[], int] = lambda: 0,
    ):
        self.path = path
        self.rank = rank
        self._generation = generation
        self._lock = threading.Lock()
        self._fd = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def emit(self, event: str, at: float | None = None, **fields: Any) -> dict:
        record = {
            "time": time.time() if at is None else at,
            "event": event,
            "generation": self._generation(),
            "rank": self.rank,
            **fields,
        }
        if self._fd is not None:
            line = (json.dumps(record, default=str) + "\n").encode()
            with self._lock:
                os.write(self._fd, line)
        return record

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def read_events(path: str) -> list[dict]:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]
