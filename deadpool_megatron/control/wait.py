"""Waiting on the store: the one polling loop, with a deadline, an injectable clock and sleep.

`poll` returns a value when what is awaited has happened and None while it has not; it may
raise to stop waiting early (a newer recovery order supersedes the wait, say).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from .store import StoreTimeout

T = TypeVar("T")

POLL_S = 0.02


def wait_until(
    poll: Callable[[], T | None],
    timeout_s: float,
    what: str,
    *,
    interval_s: float = POLL_S,
    max_interval_s: float | None = None,
    timed_out: Callable[[], str] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """The first non-None result of `poll`; raises StoreTimeout naming `what` after
    `timeout_s` seconds (math.inf: wait for ever), or saying `timed_out()` where given.
    `max_interval_s`: the pause starts at `interval_s` and doubles up to it (a wait for what
    usually comes within milliseconds, by many waiters on one store); None: it stays."""
    deadline = clock() + timeout_s
    pause = interval_s
    while True:
        value = poll()
        if value is not None:
            return value
        if clock() > deadline:
            raise StoreTimeout(timed_out() if timed_out else f"{what}: not within {timeout_s:g} s")
        sleep(pause)
        if max_interval_s is not None:
            pause = min(max_interval_s, pause * 2)
