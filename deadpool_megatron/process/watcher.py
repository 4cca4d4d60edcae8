"""The order watcher: a process's ear on the store while its training thread computes.

It looks for the order into the generation after the newest it knows, every `interval_s`.
On an order it records it in the job context (the training loop then stops at its next phase
boundary) and cuts the communicators at once, so a training thread blocked in a collective
fails now instead of at the process-group timeout. Until the training thread has stopped and
joined the recovery, it watches that thread's progress (failure/hang.py's StallWatch) and
makes the process leave, with the thread's stack in the log, only when the thread is blocked
or has computed past its phase's limit without reaching a boundary: a spare then replaces it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable

from ..control import keys
from ..control.context import JobContext
from ..control.messages import RecoveryOrder
from ..failure.evidence import EXIT_BLOCKED
from ..failure.hang import HangPolicy, StallWatch
from ..failure.procstate import working_cpu_seconds
from ..failure.progress import ProgressBoard
from ..runtime import record_exit_status

log = logging.getLogger("deadpool.recovery")

POLL_S = 0.02


def leave_process(why: str) -> None:
    """Exit now (status 75): the training thread cannot join the recovery."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    stack = "".join(traceback.format_stack(frame)) if frame else "?"
    log.error(
        "the training thread is %s after the recovery order; leaving so that a spare takes "
        "this rank over. It is at:\n%s", why, stack,
    )  # fmt: skip
    for handler in logging.getLogger().handlers:
        handler.flush()
    record_exit_status(EXIT_BLOCKED)  # not MPI's finalize: only the main thread may call it
    os._exit(EXIT_BLOCKED)


class OrderWatcher:
    def __init__(
        self,
        ctx: JobContext,
        abort: Callable[[], object],
        progress: ProgressBoard,
        policy: HangPolicy,
        recovering: Callable[[], bool],
        leave: Callable[[str], None] = leave_process,
        cpu: Callable[[], float] = working_cpu_seconds,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = POLL_S,
    ):
        self.ctx = ctx
        self._abort = abort
        self._progress = progress
        self._recovering = recovering  # True once the training thread joined the recovery
        self._leave = leave
        self._cpu = cpu
        self._clock = clock
        self.interval_s = interval_s
        self._stall = StallWatch(policy)
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

    def poll_once(self) -> None:
        """One look at the store and at the training thread."""
        now = self._clock()
        nxt = max(self.ctx.generation, self.ctx.ordered) + 1
        order = self.ctx.get(keys.recovery_order(self.ctx.job, nxt), RecoveryOrder)
        if order is not None and self.ctx.see_order(nxt):
            log.info("recovery into generation %d ordered: %s", nxt, order.reason)
            self._abort()  # whoever is blocked in a collective now fails
        self._stall.observe(self._progress.read(), now)
        if self.ctx.stopping and not self._recovering():
            self._stall.watch_cpu(self._cpu(), now)
            why = self._stall.stalled(now)
            if why is not None:
                self._leave(why)
        else:
            self._stall.stop_watching()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="deadpool-order", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                self.poll_once()
            except Exception as err:  # the store is gone: the job is ending
                log.debug("order watcher stops: %s", err)
                return
            self._stopped.wait(self.interval_s)
