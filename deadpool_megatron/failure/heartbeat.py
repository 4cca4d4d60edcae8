"""Heartbeats: a detector that finds hung ranks, and the thread that publishes a rank's beats.

Heartbeats catch what a collective error cannot: a hung peer (survivors only fail at the
process-group timeout, FIELD-NOTES). Start the sender only after warm-up (imports, the first
model build): heartbeat threads were starved of the GIL for seconds during those, and the
detector then accused healthy processes (FIELD-NOTES, "gloo under failure").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable

from ..errors import ConfigError
from .evidence import HeartbeatStale


def check_heartbeat_times(interval_s: float, timeout_s: float) -> None:
    """timeout > interval > 0, else one beat late would already look like a hang."""
    if not (0 < interval_s < timeout_s):
        raise ConfigError(
            f"heartbeat needs timeout > interval > 0 seconds, got "
            f"--deadpool-heartbeat-interval {interval_s} and "
            f"--deadpool-heartbeat-timeout {timeout_s}"
        )


class HeartbeatDetector:
    """Pure bookkeeping of the last beat per rank; no thread, time comes from `clock` or `now`.

    A rank is stale when more than `timeout_s` elapsed since its last beat (exactly at the
    timeout it is still fresh). A rank that never beat is stale only once `start(ranks)`
    listed it and `timeout_s` has elapsed since that start.
    """

    def __init__(self, interval_s: float, timeout_s: float, clock: Callable[[], float]):
        check_heartbeat_times(interval_s, timeout_s)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._last: dict[int, float] = {}
        self._expected: dict[int, float] = {}  # rank -> start time, until its first beat

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def start(self, ranks: Iterable[int], now: float | None = None) -> None:
        """Expect beats from `ranks` from now on (the generation's members, after warm-up)."""
        t = self._now(now)
        for rank in ranks:
            if rank not in self._last:
                self._expected[rank] = t

    def beat(self, rank: int, now: float | None = None) -> None:
        """Record a beat; an older beat delivered late never moves the last one back."""
        t = self._now(now)
        self._expected.pop(rank, None)
        self._last[rank] = max(t, self._last.get(rank, t))

    def forget(self, rank: int) -> None:
        """Stop watching `rank` (it was fenced, replaced, or left the job)."""
        self._last.pop(rank, None)
        self._expected.pop(rank, None)

    def last_seen(self, rank: int) -> float | None:
        return self._last.get(rank)

    def stale(self, now: float | None = None) -> list[HeartbeatStale]:
        """Evidence for every stale rank, in rank order; reported again until beat or forgot."""
        t = self._now(now)
        out = [
            HeartbeatStale(rank, last, t)
            for rank, last in self._last.items()
            if t - last > self.timeout_s
        ]
        out += [
            HeartbeatStale(rank, None, t)
            for rank, started in self._expected.items()
            if t - started > self.timeout_s
        ]
        return sorted(out, key=lambda e: e.rank)


class HeartbeatSender(threading.Thread):
    """Calls `publish(now)` every `interval_s` until `stop()`; the one thread in this package.

    Beats are scheduled on deadlines so they do not drift; after a stall longer than an
    interval (GIL starvation) the missed beats are skipped, not sent in a burst. A failing
    `publish` (store hiccup) is counted and retried at the next beat: if it keeps failing, the
    detector sees this rank go stale, which is the right outcome. `clock` and `sleep` are
    injectable so tests run `run()` directly, with no real waits. Start it after warm-up.
    """

    def __init__(
        self,
        publish: Callable[[float], None],
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        name: str = "deadpool-heartbeat",
    ):
        super().__init__(name=name, daemon=True)
        if not interval_s > 0:
            raise ConfigError(
                f"--deadpool-heartbeat-interval must be > 0 seconds, got {interval_s}"
            )
        self.publish = publish
        self.interval_s = interval_s
        self._clock = clock
        self._stopped = threading.Event()
        # The default sleep wakes up at once on stop(), so stopping never waits an interval.
        self._sleep = sleep or (lambda s: self._stopped.wait(s))
        self.beats = 0
        self.errors = 0
        self.last_error: BaseException | None = None

    def stop(self) -> None:
        self._stopped.set()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def run(self) -> None:
        deadline = self._clock()
        while not self._stopped.is_set():
            now = self._clock()
            try:
                self.publish(now)
                self.beats += 1
            except Exception as exc:  # a beat must never kill the thread
                self.errors += 1
                self.last_error = exc
            deadline += self.interval_s
            now = self._clock()
            if deadline <= now:  # stalled past a whole interval: skip, do not burst
                deadline = now + self.interval_s
            if self._stopped.is_set():
                break
            self._sleep(deadline - now)
