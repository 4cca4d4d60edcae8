"""The helper threads that wait on gloo for the training loop (`gloo_ops`).

One generation's waits come one at a time from the training thread, so one thread serves
them; a second starts only while the first is still waiting (a wait the abort gave up, or two
threads waiting at once). `concurrent.futures.ThreadPoolExecutor` counted its thread idle
only after the result was handed over, so the training thread's next wait, submitted in
between, often started another thread: the pool's size varied from one generation to the next
(the soak's "thread growth 1"). Here a thread counts itself idle before it hands the result
over.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class WaitPool:
    """Runs blocking waits on daemon threads named `prefix-N`, starting one only when none
    is idle; `shutdown` ends the idle threads now and each busy one when its wait returns."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._threads = 0
        self._closed = False
        self._names = itertools.count()

    def submit(self, fn: Callable[[], object]) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.prefix}: the pool was shut down")
            if self._idle:
                self._idle -= 1
            else:
                self._threads += 1
                name = f"{self.prefix}-{next(self._names)}"
                threading.Thread(target=self._run, name=name, daemon=True).start()
            self._queue.put((fn, future))
        return future

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            threads = self._threads
        for _ in range(threads):
            self._queue.put(None)

    @property
    def threads(self) -> int:
        with self._lock:
            return self._threads

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                with self._lock:
                    self._threads -= 1
                return
            fn, future = item
            try:
                result, error = fn(), None
            except BaseException as err:  # handed to the waiter, as an executor would
                result, error = None, err
            with self._lock:
                self._idle += 1  # idle before the waiter can submit its next wait
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)
            del fn, future, item, result, error  # a finished wait holds nothing
