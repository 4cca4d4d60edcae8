"""Polling for a condition in tests that watch threads or sockets settle, how long a test
waits for a store connection, and a fake clock for code that waits with an injectable one."""

from __future__ import annotations

import time
from collections.abc import Callable

# How long a test's TCPStore client (or host: it connects to itself) may take to connect. torch
# names the address of every connection it makes or accepts by a reverse lookup (getnameinfo)
# of the v4-mapped "::ffff:127.0.0.1", which /etc/hosts cannot answer, so it goes to DNS; where
# the resolver drops the query (about 1 in 50 here) glibc waits its 5 s timeout and asks again.
# The product's clients wait 30 s (control/connect.py); 5 s failed the suite twice.
STORE_CONNECT_S = 30.0


def until(what: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.005) -> bool:
    """Whether `what()` became true within `timeout_s`, checked every `interval_s`."""
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


class FakeClock:
    """`clock()` reads the time; `sleep(s)` advances it (what a waiting loop is handed)."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
