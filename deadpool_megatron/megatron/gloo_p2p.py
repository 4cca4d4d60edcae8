"""Pipeline point-to-point operations that a recovery can interrupt, on gloo (CPU backend).

A gloo send of megatron-core's pipeline schedule waits for the peer to post the matching
receive; when the peer is gone, shutting the connection down does not wake it (gloo signals
pending receives and collectives, not sends waiting for the peer's readiness), so the training
thread would wait out the process-group timeout, minutes, and could not join the recovery.
megatron-core's p2p module gets a view of torch.distributed whose isend/irecv return works
that wait on a helper thread, so the training thread can give up when the recovery aborts the
communicators. The helper thread stays blocked until gloo's timeout and then ends harmlessly.
NCCL runs never come here: they abort their communicators through torch.
"""

from __future__ import annotations

import threading
import types
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

POLL_S = 0.05

_aborted = threading.Event()
_waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="deadpool-p2p-wait")


class AbortedByRecovery(RuntimeError):
    """A pending pipeline send/receive given up because a recovery aborted the communicators."""


def abort_pending() -> None:
    """Make every pending (and future) wait give up, until `reset`."""
    _aborted.set()


def reset() -> None:
    """New communicators: their operations wait normally again."""
    _aborted.clear()


class AbortableWork:
    def __init__(self, work: dist.Work):
        self._work = work

    def wait(self, timeout=None) -> bool:
        if _aborted.is_set():
            raise AbortedByRecovery("pipeline p2p operation aborted: a recovery was ordered")
        future = _waiters.submit(self._work.wait) if timeout is None else None
        if future is None:
            return self._work.wait(timeout)
        while True:
            try:
                return future.result(timeout=POLL_S)
            except TimeoutError:
                if _aborted.is_set():
                    raise AbortedByRecovery(
                        "pipeline p2p operation aborted: a recovery was ordered"
                    ) from None

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _isend(*args, **kwargs):
    work = dist.isend(*args, **kwargs)
    return None if work is None else AbortableWork(work)


def _irecv(*args, **kwargs):
    work = dist.irecv(*args, **kwargs)
    return None if work is None else AbortableWork(work)


def distributed_view() -> types.ModuleType:
    """torch.distributed, with abortable isend/irecv (for megatron-core's p2p module)."""
    view = types.ModuleType("torch.distributed")
    view.__dict__.update(dist.__dict__)
    view.isend = _isend
    view.irecv = _irecv
    return view
