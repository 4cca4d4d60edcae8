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

import contextlib
import datetime
import functools
import inspect
import logging
import sys
import threading
import types
import weakref

import torch.distributed as dist

from .wait_pool import WaitPool

POLL_S = 0.05
# Operations with an async_op flag (waited for here when the caller asked for a sync one).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
    "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "reduce", "barrier",
    "all_to_all_single", "gather", "scatter",
)  # fmt: skip

log = logging.getLogger("deadpool.recovery")
_aborted = threading.Event()


def _helper_threads() -> WaitPool:
    return WaitPool("deadpool-gloo-wait")


_waiters = _helper_threads()
# Sends and receives posted and not yet waited for to completion (see `_time_out`); weakly:
# gloo marks a send or receive complete only once waited for, so one dropped unwaited would
# otherwise stay here with its tensors.
_open_lock = threading.Lock()
_open: weakref.WeakSet[OpenWork] = weakref.WeakSet()
# Every operation posted through here and not yet waited for to completion, and those the last
# generation change left behind (`reset`): what a stuck old group still waits on (`waiting_on`).
_posted: weakref.WeakSet[OpenWork] = weakref.WeakSet()
_left: weakref.WeakSet[OpenWork] = weakref.WeakSet()
_TIME_OUT = datetime.timedelta(milliseconds=1)


class AbortedByRecovery(RuntimeError):
    """An operation given up because a recovery aborted the communicators."""


def stop_posting() -> None:
    """From now until `reset`, every wait gives up and no operation is posted."""
    _aborted.set()


def abort_pending() -> None:
    """Make every pending (and future) wait give up, until `reset`; end the pending sends and
    receives."""
    _aborted.set()
    with _open_lock:
        works = list(_open)
        _open.clear()
    for work in works:
        _time_out(work._work)


def _time_out(work: dist.Work) -> None:
    """End a send or receive gloo would never wake: a wait with a timeout makes gloo time the
    operation out and close its pair, which wakes whoever else waits on it (a helper thread
    here) and ends the operation (the group's destructor waits for pending ones: until the
    group's timeout, minutes, it held back the release of the generation's other groups).
    Measured on torch 2.13: a receive or send with no peer, waited for on one thread, raises
    there within a millisecond of another thread's 1 ms wait. A collective's wait with a
    timeout only raises in the caller (the operation goes on): collectives are not here."""
    with contextlib.suppress(RuntimeError):
        work.wait(_TIME_OUT)


def reset() -> None:
    """New communicators: their operations wait normally again, on a fresh set of helper
    threads. The old set ends its idle threads now and any still waiting (on a collective
    gloo never woke) when that wait ends: kept, they would stay in the pool for good, one
    more each time a wait was left behind while a new one needed a thread."""
    global _waiters, _left
    old, _waiters = _waiters, _helper_threads()
    old.shutdown()
    with _open_lock:
        _left = weakref.WeakSet(w for w in _posted if not w.is_completed())
        _posted.clear()
    _aborted.clear()
    if _left:  # each keeps its group's connections and threads until gloo's timeout
        log.warning("%d operation(s) of the last generation still pending: %s", len(_left),
                    ", ".join(sorted(w.label for w in _left)))  # fmt: skip


def waiting_on(group_name: str) -> list[str]:
    """The operations posted on group `group_name` still not complete, as "op (group
    description) from caller < its caller": what keeps its destructor waiting. Those posted
    since the last generation change are marked "posted in this generation" (on an old group:
    a stale reference the new generation used)."""
    with _open_lock:
        works = [(w, "") for w in _left] + [(w, ", posted in this generation") for w in _posted]
    return sorted(
        f"{w.label}{since}"
        for w, since in works
        if w.group_name == group_name and not w.is_completed()
    )


def _check() -> None:
    if _aborted.is_set():
        raise AbortedByRecovery("communication aborted: a recovery was ordered")


class OpenWork:
    """A send or receive that `abort_pending` ends while it is open, waited for directly: the
    replication thread's (it has no recovery to join, only an abort to notice). Every
    operation is labelled (op, group, who posted it) and known until complete (`waiting_on`)."""

    def __init__(
        self, work: dist.Work, end_at_abort: bool = True, op: str = "", group=None, caller=""
    ):
        self._work = work
        self.group_name = getattr(group, "group_name", "")
        desc = getattr(group, "group_desc", "default group")
        self.label = f"{op or 'operation'} ({desc})" + (f" from {caller}" if caller else "")
        with _open_lock:
            _posted.add(self)
            late = end_at_abort and _aborted.is_set()
            if end_at_abort and not late:
                _open.add(self)
        if late:  # posted after the abort (the replication thread does not check): end it now
            _time_out(work)

    def wait(self, timeout=None) -> bool:
        return self._closed(self._work.wait() if timeout is None else self._work.wait(timeout))

    def _closed(self, done: bool) -> bool:
        with _open_lock:  # complete: nothing to end (a wait given up stays, for the abort)
            _open.discard(self)
            if done:
                _posted.discard(self)
        return done

    def __getattr__(self, name: str):
        return getattr(self._work, name)


class AbortableWork(OpenWork):
    """The training loop's operations: waited for on a helper thread, given up at the abort."""

    def __init__(
        self, work: dist.Work, point_to_point: bool = False, op: str = "", group=None, caller=""
    ):
        super().__init__(work, point_to_point, op, group, caller)

    def wait(self, timeout=None) -> bool:
        _check()
        if timeout is not None:
            return super().wait(timeout)
        future = _waiters.submit(self._wait_on_helper)
        while True:
            try:
                return self._closed(future.result(timeout=POLL_S))
            except TimeoutError:
                _check()
            except RuntimeError:
                _check()  # ended by `abort_pending`: say so, not "pair closure"
                raise

    def _wait_on_helper(self) -> bool:
        """The helper thread holds the wrapper while it waits: one the training thread gave up
        stays known (`waiting_on`) for as long as gloo keeps it waiting."""
        return self._work.wait()


def _collective(fn):
    at = _param_position(fn, "async_op")

    @functools.wraps(fn)
    def call(*args, **kwargs):
        _check()
        if _coalescing(_group(fn, args, kwargs)):
            # Inside torch's _coalescing_manager the operation is only recorded (an async one
            # returns a placeholder that cannot be waited on); the manager posts them all as
            # one at its exit (megatron-core's grads across distributed-optimizer instances)
            return fn(*args, **kwargs)
        # Posted asynchronously whatever the caller asked, by name or by position (Megatron-LM's
        # signal handler passes `async_op` positionally to all_gather).
        if at is not None and at < len(args):
            async_op, args = args[at], (*args[:at], True, *args[at + 1 :])
        else:
            async_op, kwargs = kwargs.pop("async_op", False), {**kwargs, "async_op": True}
        work = fn(*args, **kwargs)
        if work is None:  # this rank is not in the group
            return None
        wrapped = AbortableWork(work, False, fn.__name__, _group(fn, args, kwargs), _caller())
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
        if work is None:
            return None
        return AbortableWork(work, True, fn.__name__, _group(fn, args, kwargs), _caller())

    return call


def _caller() -> str:
    """Who posted an operation: the two functions above the view's wrapper (a frame lookup
    costs about a microsecond; a stack summary would cost tens per collective)."""
    frame = sys._getframe(2)
    names = []
    while frame is not None and len(names) < 2:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return " < ".join(names)


def _group(fn, args: tuple, kwargs: dict):
    """The group an operation was posted on (its `group` argument, or the default group)."""
    at = _group_position(fn)
    group = kwargs.get("group", args[at] if at is not None and at < len(args) else None)
    return group if group is not None else dist.group.WORLD


def _coalescing(group) -> bool:
    """Whether `group` is inside torch's _coalescing_manager on this thread's process."""
    return group is not None and group in dist.distributed_c10d._world.pg_coalesce_state


@functools.cache
def _group_position(fn) -> int | None:
    return _param_position(fn, "group")


def _param_position(fn, name: str) -> int | None:
    params = list(inspect.signature(fn).parameters)
    return params.index(name) if name in params else None


@contextlib.contextmanager
def coalescing_manager(group=None, device=None, async_ops=False):
    """torch's `_coalescing_manager`, its coalesced operation waited for as the view's are.
    Inside it, operations are only recorded (by the view's functions, or by torch's own that
    megatron-core bound at import: `dist_reduce_scatter_func`, `dist_all_gather_func`); torch
    posts them as one at its exit and, for a synchronous manager, waits there itself, on the
    training thread, where no abort reaches: megatron-core's gradient reduce-scatter and
    parameter all-gather (DDP's bucket groups) waited out gloo's timeout when a peer died
    mid-message, and the rank left the recovery as blocked. Here the manager is always
    asynchronous to torch, and its work is waited for on a helper thread."""
    _check()
    with dist._coalescing_manager(group, device, async_ops=True) as cm:
        yield cm
    on = group if group is not None else dist.group.WORLD
    cm.works = [AbortableWork(w, False, "coalesced", on) for w in cm.works]
    if not async_ops:
        cm.wait()
        cm.works = []


@functools.cache
def distributed_view() -> types.ModuleType:
    """torch.distributed with interruptible operations (for megatron-core and the loop)."""
    view = types.ModuleType("torch.distributed")
    view.__dict__.update(dist.__dict__)
    for name in COLLECTIVES:
        if hasattr(dist, name):
            setattr(view, name, _collective(getattr(dist, name)))
    view._coalescing_manager = coalescing_manager
    view.isend = _point_to_point(dist.isend)
    view.irecv = _point_to_point(dist.irecv)
    real = {view.isend: dist.isend, view.irecv: dist.irecv}

    def p2p_op(op, *args, **kwargs) -> dist.P2POp:
        return dist.P2POp(real.get(op, op), *args, **kwargs)  # it accepts torch's own only

    def batch_isend_irecv(ops: list) -> list:
        _check()
        works = dist.batch_isend_irecv(ops)
        return [
            AbortableWork(work, True, op="batch_isend_irecv", group=ops[0].group if ops else None)
            for work in works
        ]

    view.P2POp = p2p_op
    view.batch_isend_irecv = batch_isend_irecv
    return view
