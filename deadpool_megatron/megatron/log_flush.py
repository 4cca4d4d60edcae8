"""Megatron-LM's TensorBoard scalars made durable off the training thread.

A hot-swap resumes from the last protected iteration without running the logged iterations
again, so scalars that a killed last rank still held (its writer's queue; a buffered file
with TensorFlow's file layer, flushed every 120 s) would be missing for good, where a
checkpoint-restart's replay writes them again. Flushing on the training thread would wait
on the file system (a shared one, on a cluster) in every iteration; this thread waits
instead, asked once per iteration, and requests that come while it flushes make one more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

log = logging.getLogger("deadpool.upstream")


class Flusher:
    """Calls `flush` on its own thread after each `request()`, never on the caller's.

    Requests made while a flush runs coalesce into one flush after it; an error from
    `flush` (a writer closed by a recovery meanwhile) is logged and the thread goes on."""

    def __init__(self, flush: Callable[[], None], name: str = "deadpool-log-flush") -> None:
        self._flush = flush
        self._wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def request(self) -> None:
        """Ask for a flush; returns at once."""
        self._wanted.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what was asked for, then end the thread (waiting up to `timeout_s`)."""
        self._closing = True
        self._wanted.set()
        self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            self._wanted.wait()
            self._wanted.clear()
            closing = self._closing
            try:
                self._flush()
            except Exception as exc:  # the writer may be closed under us by a recovery
                log.debug("log flush failed: %s", exc)
            if closing:
                return
