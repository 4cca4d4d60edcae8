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
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> T:
    """The first non-None result of `poll`; raises StoreTimeout naming `what` after
    `timeout_s` seconds (math.inf: wait for ever)."""
    deadline = clock() + timeout_s
    while True:
        value = poll()
        if value is not None:
            return value
        if clock() > deadline:
            raise StoreTimeout(f"{what}: not within {timeout_s:g} s")
        sleep(interval_s)
