"""Collectives and pipeline sends that a recovery can interrupt, on gloo (CPU backend).

gloo does not always wake an operation when its connection dies: a pipeline send waiting for
its peer to post the receive, or a collective posted on a connection the peer had already shut
down, waits out the process-group timeout (minutes), and the training thread could not join
the recovery. megatron-core's modules (and the training loop) get a view of torch.distributed
whose operations run with async_op=True and are waited for on a helper thread, so the training
thread gives up as soon as the recovery aborts the communicators; a helper thread left behind
ends when gloo's timeout fires. NCCL runs never come here: their communicators are aborted
through torch, which wakes every pending operation.
"""

from __future__ import annotations

import functools
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

POLL_S = 0.05
# Operations with an async_op flag (waited for here when the caller asked for a sync one).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "barrier",
    "all_to_all_single", "gather", "scatter",
)  # fmt: skip

_aborted = threading.Event()
_waiters = ThreadPoolExecutor(max_workers=64, thread_name_prefix="deadpool-gloo-wait")


class AbortedByRecovery(RuntimeError):
    """An operation given up because a recovery aborted the communicators."""


def abort_pending() -> None:
    """Make every pending (and future) wait give up, until `reset`."""
    _aborted.set()


def reset() -> None:
    """New communicators: their operations wait normally again."""
    _aborted.clear()


def _check() -> None:
    if _aborted.is_set():
        raise AbortedByRecovery("communication aborted: a recovery was ordered")


class AbortableWork:
    def __init__(self, work: dist.Work):
        self._work = work

    def wait(self, timeout=None) -> bool:
        _check()
        if timeout is not None:
            return self._work.wait(timeout)
        future = _waiters.submit(self._work.wait)
        while True:
            try:
                return future.result(timeout=POLL_S)
            except TimeoutError:
                _check()

    def __getattr__(self, name: str):
        return getattr(self._work, name)


def _collective(fn):
    @functools.wraps(fn)
    def call(*args, async_op: bool = False, **kwargs):
        _check()
        work = fn(*args, async_op=True, **kwargs)
        if work is None:  # this rank is not in the group
            return None
        wrapped = AbortableWork(work)
        if async_op:
            return wrapped
        wrapped.wait()
        return None

    return call


def _point_to_point(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        _check()
        work = fn(*args, **kwargs)
        return None if work is None else AbortableWork(work)

    return call


@functools.cache
def distributed_view() -> types.ModuleType:
    """torch.distributed with interruptible operations (for megatron-core and the loop)."""
    view = types.ModuleType("torch.distributed")
    view.__dict__.update(dist.__dict__)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(view, name, _collective(getattr(dist, name)))
    view.isend = _point_to_point(dist.isend)
    view.irecv = _point_to_point(dist.irecv)
    real = {view.isend: dist.isend, view.irecv: dist.irecv}

    def p2p_op(op, *args, **kwargs) -> dist.P2POp:
        return dist.P2POp(real.get(op, op), *args, **kwargs)  # it accepts torch's own only

    def batch_isend_irecv(ops: list) -> list:
        _check()
        return [AbortableWork(work) for work in dist.batch_isend_irecv(ops)]

    view.P2POp = p2p_op
    view.batch_isend_irecv = batch_isend_irecv
    return view
