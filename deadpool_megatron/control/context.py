"""Where the job stands, as one process sees it: the one owner of the membership generation.

Whoever needs the generation (heartbeats, reports, the event log, fault injection, the
recovery, the agent's monitor and chaos) is handed this object and reads it when it needs it;
nobody keeps a copy. It also carries the job's typed line to the store (records of
`messages.py` under keys of `keys.py`).

Two numbers: `generation`, the membership generation this process works in, and `ordered`, the
newest generation a recovery was ordered into (seen by this process's order watcher). While
`ordered > generation` the process is stopping: it must leave its iteration and recover.
Only the recovery moves `generation` forward (`advance`); the agent, which decides the
generations, advances when it orders one.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from . import keys, messages
from .messages import Record
from .store import KVStore
from .wait import POLL_S, wait_until

R = TypeVar("R", bound=Record)


class JobContext:
    def __init__(self, kv: KVStore, job: str, generation: int = 0):
        keys.job_prefix(job)  # validates the job id
        self.kv = kv
        self.job = job
        self._lock = threading.Lock()
        self._generation = generation
        self._ordered = generation

    # -- the generation ----------------------------------------------------------------------
    @property
    def generation(self) -> int:
        with self._lock:
            return self._generation

    @property
    def ordered(self) -> int:
        with self._lock:
            return self._ordered

    @property
    def stopping(self) -> bool:
        """A recovery into a newer generation was ordered and this process is not in it yet."""
        with self._lock:
            return self._ordered > self._generation

    def see_order(self, generation: int) -> bool:
        """Record an order into `generation`; True if it is newer than any seen before."""
        with self._lock:
            if generation <= self._ordered:
                return False
            self._ordered = generation
            return True

    def advance(self, generation: int) -> None:
        """This process now works in `generation` (a recovery into it succeeded)."""
        with self._lock:
            if generation <= self._generation:
                raise ValueError(
                    f"generation {generation} is not newer than the current {self._generation}"
                )
            self._generation = generation
            self._ordered = max(self._ordered, generation)

    def store_prefix(self, generation: int | None = None) -> str:
        """Where `generation`'s (default: the current one's) process groups meet."""
        return keys.process_group_prefix(
            self.job, self.generation if generation is None else generation
        )

    # -- the typed store ---------------------------------------------------------------------
    def put(self, key: str, record: Record) -> None:
        messages.put(self.kv, key, record)

    def get(self, key: str, cls: type[R]) -> R | None:
        return messages.get(self.kv, key, cls)

    def create(self, key: str, record: Record) -> bool:
        return messages.create(self.kv, key, record)

    def wait_for(
        self,
        key: str,
        cls: type[R],
        timeout_s: float = math.inf,
        what: str | None = None,
        interrupt: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        interval_s: float = POLL_S,
    ) -> R:
        """The record at `key` once it exists; `interrupt()` may raise to stop waiting."""

        def poll() -> R | None:
            if interrupt is not None:
                interrupt()
            return self.get(key, cls)

        return wait_until(poll, timeout_s, what or f"{cls.__name__} at {key}",
                          interval_s=interval_s, clock=clock, sleep=sleep)  # fmt: skip
