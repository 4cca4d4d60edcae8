"""Device-to-host snapshot of a rank's full state, off the critical path.

`start(iteration, meta)` runs right after the optimizer step. On CUDA it enqueues
non-blocking copies on a dedicated copy stream into pinned host memory and records an event;
on CPU a background thread performs the copies. Either way the training loop goes on at once:
the copy only has to finish before the next optimizer step modifies the state again, and
`fence()` (installed as a pre-step hook on the optimizer) waits for exactly that: on CUDA as
a stream wait on the event (no host stall), on CPU by joining the copy. A completion thread
then checksums the host bytes and commits the slot.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from .buffers import SAMPLES, Slot, SlotPair

log = logging.getLogger("deadpool.snapshot")


class Snapshotter:
    def __init__(
        self,
        tensors_fn: Callable[[], list[torch.Tensor]],
        views_fn: Callable[[torch.Tensor], list[torch.Tensor]],
        nbytes: int,
        use_cuda: bool,
        on_commit: Callable[[Slot], None] | None = None,
        replicated_nbytes: int | None = None,
        slots: SlotPair | None = None,
    ):
        """`replicated_nbytes`: the leading part of a snapshot the ring sends (its checksum is
        taken in the same pass as the whole snapshot's); `slots`: a pair to write into instead
        of allocating one (a recovery's, `Reusable`), of that size."""
        self._tensors_fn = tensors_fn
        self._views_fn = views_fn
        self.use_cuda = use_cuda
        if slots is not None and not slots.fits(nbytes, use_cuda, replicated_nbytes):
            raise ValueError(f"a {slots.nbytes}-byte slot pair cannot hold {nbytes}-byte snapshots")
        self.slots = slots or SlotPair(nbytes, pin=use_cuda, prefix_nbytes=replicated_nbytes)
        self._on_commit = on_commit
        self._stream = torch.cuda.Stream() if use_cuda else None
        self._work: queue.Queue = queue.Queue()
        self._copy_done = threading.Event()
        self._copy_done.set()
        self._event = None
        self.copy_s: deque = deque(maxlen=SAMPLES)  # per snapshot: device-to-host copy
        self.commit_s: deque = deque(maxlen=SAMPLES)  # per snapshot: checksum + commit
        self.cpu_s: deque = deque(maxlen=SAMPLES)  # per snapshot: this thread's CPU time
        self.errors: list[str] = []
        self._thread = threading.Thread(target=self._run, name="deadpool-snapshot", daemon=True)
        self._thread.start()

    def start(self, iteration: int, meta: bytes) -> None:
        """Begin copying the live state of `iteration`; returns without waiting."""
        self.fence()
        slot = self.slots.acquire_for_write()
        try:
            sources = self._tensors_fn()
            targets = self._views_fn(slot.buffer)
        except BaseException:
            self.slots.abandon(slot)
            raise
        self._copy_done.clear()
        if self.use_cuda:  # pragma: no cover (GPU)
            try:
                self._enqueue_cuda(sources, targets)
            except Exception as err:  # the copy stream refused it: report, keep the last one
                self._failed(slot, iteration, f"enqueueing the copy on the CUDA stream: {err}")
                return
            finally:
                self._copy_done.set()  # the host side is done; the event tracks the device side
        self._work.put((slot, iteration, meta, sources, targets, self._event))

    def _enqueue_cuda(self, sources: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
        """Copies on the snapshot stream, after what the training stream has queued so far."""
        self._event = None
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            for dst, src in zip(targets, sources, strict=True):
                dst.copy_(src.reshape(dst.shape), non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(self._stream)

    def _failed(self, slot: Slot, iteration: int, what: str) -> None:
        self.slots.abandon(slot)
        self.errors.append(f"iteration {iteration}: {what}")
        log.error("snapshot of iteration %d failed: %s", iteration, what)

    def fence(self) -> None:
        """Block until the in-flight copy no longer reads the live tensors."""
        if self.use_cuda:
            if self._event is not None:
                torch.cuda.current_stream().wait_event(self._event)
            return
        self._copy_done.wait()

    def copy_in_flight(self) -> bool:
        """The last snapshot's device-to-host copy has not finished yet (CUDA; on CPU the
        copy thread holds the fence until it has)."""
        if self.use_cuda:
            return self._event is not None and not self._event.query()
        return not self._copy_done.is_set()

    def wait_committed(self, timeout: float | None = None) -> None:
        """Wait until every started snapshot is committed (tests, shutdown)."""
        self._work.join() if timeout is None else _join_with_timeout(self._work, timeout)

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                self._work.task_done()
                return
            slot, iteration, meta, sources, targets, event = item
            try:
                start, cpu = time.perf_counter(), time.thread_time()
                if event is not None:
                    event.synchronize()
                else:
                    with torch.no_grad():
                        for dst, src in zip(targets, sources, strict=True):
                            dst.copy_(src.reshape(dst.shape))
                    self._copy_done.set()
                copied = time.perf_counter()
                self.slots.commit(slot, iteration, meta)
                self.copy_s.append(copied - start)
                self.commit_s.append(time.perf_counter() - copied)
                self.cpu_s.append(time.thread_time() - cpu)
                if self._on_commit is not None:
                    self._on_commit(slot)
            except Exception as err:  # a failed snapshot must not kill training; report it
                self._copy_done.set()
                self._failed(slot, iteration, f"{type(err).__name__}: {err}")  # CUDA's too
            finally:
                self._work.task_done()

    def close(self) -> None:
        self._work.put(None)
        self._thread.join(timeout=30)

    @property
    def stopped(self) -> bool:
        return not self._thread.is_alive()


def _join_with_timeout(q: queue.Queue, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while q.unfinished_tasks and time.monotonic() < deadline:
        time.sleep(0.001)
