"""Polling for a condition in tests that watch threads or sockets settle."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(what: Callable[[], object], timeout_s: float = 10.0, interval_s: float = 0.005) -> bool:
    """Whether `what()` became true within `timeout_s`, checked every `interval_s`."""
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True
