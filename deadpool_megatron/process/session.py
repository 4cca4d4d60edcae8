"""What a protected training loop does at each call of the hook API, for our own loop
(process/worker.py) and patched Megatron-LM's (process/upstream.py) alike.

`ProtectedLoop` implements megatron/training.py's `LoopHooks`: at a phase boundary it marks
the progress (where the agent reads it), obeys a recovery order and lets an injected fault
act; after each optimizer step it snapshots the state and hands the optimizer shard to the
ring, then lets the guard and the recovery do their per-iteration work. The loop's position
(the newest completed iteration, the state, the protection pipeline) belongs to the loop: our
Trainer, or upstream.py's LoopPosition.

`serving(session)` makes a session the one hooks.py's module functions reach: patched
Megatron-LM calls them from deep inside its own functions, where nothing can be passed in.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator

from ..control.store import StoreTimeout
from ..control.wait import wait_until
from ..failure.injector import FaultInjector
from ..failure.progress import ProgressBoard
from ..megatron.checkpointing import optimizer_state_ready
from ..megatron.model import TrainState, train_state
from ..megatron.stop_points import StopPoints
from ..megatron.training import LoopHooks
from ..recovery.stages import ProcessRecovery, Protect, RecoveryOrdered
from .guard import Guard

log = logging.getLogger("deadpool.worker")

START_REPLICAS_S = 60.0  # how long training waits for the ring to hold its start state

_CURRENT: list[LoopHooks] = []


def current() -> LoopHooks | None:
    """The session hooks.py's functions reach, if one is serving."""
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def serving(session: LoopHooks) -> Iterator[None]:
    """Route the hook API's module functions to `session` while the block runs."""
    _CURRENT.append(session)
    try:
        yield
    finally:
        _CURRENT.remove(session)


class ProtectedLoop(LoopHooks):
    """DeadPool's side of one training loop. Without a guard (a plain process, or a bench)
    nothing is reported, and faults are injected only through `faults` (a process torchrun
    restarts); without `protect` nothing is snapshotted."""

    def __init__(
        self,
        progress: ProgressBoard,
        guard: Guard | None = None,
        recovery: ProcessRecovery | None = None,
        protect: Protect | None = None,
        after_iteration: Callable[[object], None] | None = None,
        faults: FaultInjector | None = None,
    ):
        self.progress = progress
        self.guard = guard
        self.recovery = recovery
        self.protect = protect  # None: no --deadpool, nothing to snapshot
        self._after_iteration = after_iteration  # a bench's or a test's own bookkeeping
        self.faults = faults  # injected faults when no guard injects them
        self.position = None  # the loop: iteration, state, pipeline, attach/detach
        self.stop_points = StopPoints(self.check_stop)

    def bind(self, position) -> None:
        """The loop whose position this session protects (a new one after a takeover)."""
        self.position = position

    # -- the hook API --------------------------------------------------------------------------
    def after_setup(self, model: list, optimizer, scheduler) -> None:
        """Generation 0 is built (and loaded): protect it from the loop's iteration on. The
        loop's own state when it holds these objects (it carries the record of their build,
        which a survivor replays with --deadpool-keep-model)."""
        held = getattr(self.position, "state", None)
        if held is None or held.model != list(model) or held.optimizer is not optimizer:
            held = train_state(model, optimizer, scheduler)
        self.start(held, self.position.iteration)

    def before_step(self, iteration: int) -> None:
        p = self.position
        if self.guard is not None and not p.on_gpu and p.state is not None:
            covered = self.stop_points.cover(p.state.model)  # a model new to the loop
            if covered:
                log.info("stop points before %d transformer layer(s): a recovery order stops "
                         "this rank's forward pass there", covered)  # fmt: skip
        self.phase(iteration + 1, "forward")

    def check_stop(self) -> None:
        """Raise RecoveryOrdered when a recovery was ordered (the stop points inside a
        micro-batch, megatron/stop_points.py, call it too)."""
        if self.guard is not None:
            self.guard.check_stop()

    def phase(self, iteration: int, name: str) -> None:
        self.progress.mark(iteration, name)
        self.check_stop()  # a recovery was ordered: stop at this boundary
        self.inject(iteration, name)

    def after_step(self, iteration: int, loss) -> None:
        p = self.position
        if p.pipeline is not None:
            try:
                self.phase(iteration, "snapshot")
            except RecoveryOrdered:
                # The iteration's step is done: snapshot it before obeying, so that the plan
                # need not throw it away (the abort that follows finishes the copy; its ring
                # replica may not get out, and the plan then rolls back as before).
                p.pipeline.after_step(iteration)
                raise
            p.pipeline.after_step(iteration)
        self.progress.mark(iteration, "done")
        if self.guard is not None:
            self.guard.after_warmup(p.on_gpu)  # warm-up is over after the first iteration
        if self.recovery is not None:
            self.recovery.after_iteration(p)
        if self._after_iteration is not None:
            self._after_iteration(p)

    def mark(self, iteration: int, name: str) -> None:
        self.progress.mark(iteration, name)

    def after_training(self, iteration: int) -> None:
        """A recovery from a failure during the final save resumed into no iteration: it is
        accounted once the save is written (its `first_iteration` is that save)."""
        if self.recovery is not None:
            self.recovery.after_iteration(self.position)

    def inject(self, iteration: int, name: str) -> None:
        if self.guard is not None:
            self.guard.inject(iteration, name)
        elif self.faults is not None:
            self.faults.fire(iteration, name)

    # -- shared by the loops -------------------------------------------------------------------
    def start(self, state: TrainState, iteration: int) -> None:
        """Generation 0's protection pipeline (collective), attached to the loop, with the
        state training starts from snapshotted where the optimizer's state can be taken
        before its first step."""
        p = self.position
        pipeline = None if self.protect is None else self.protect(state, p.on_gpu, 0, None)
        if pipeline is not None:
            self._protect_start(pipeline, state, iteration)
        p.attach(state, iteration, pipeline)

    def _protect_start(self, pipeline, state: TrainState, iteration: int) -> None:
        """Snapshot the state training starts from and wait until the ring holds it, so that
        a failure anywhere in the first iteration rolls back to it (without, nothing could be
        restored: no rank would hold a snapshot yet). A one-time wait of one replication;
        given up, with a warning, after START_REPLICAS_S or when a recovery is ordered (the
        loop obeys it at its first phase)."""
        if not optimizer_state_ready(state.optimizer):
            log.warning("no snapshot of iteration %d: this optimizer creates its state at its "
                        "first step, so a failure before that step is not recovered in place "
                        "(--deadpool-on-unrecoverable)", iteration)  # fmt: skip
            return
        started = time.perf_counter()
        pipeline.protect_start(iteration)
        try:  # check_stop() raises RecoveryOrdered, else is None
            wait_until(lambda: self.check_stop() or pipeline.replicated(iteration) or None,
                       START_REPLICAS_S, f"iteration {iteration}'s replicas", interval_s=0.002)  # fmt: skip
        except RecoveryOrdered:
            return
        except StoreTimeout:
            log.warning("iteration %d's replicas did not arrive within %.0f s; training "
                        "starts without them", iteration, START_REPLICAS_S)  # fmt: skip
            return
        log.info("iteration %d, where training starts, snapshotted and replicated in %.3f s",
                 iteration, time.perf_counter() - started)  # fmt: skip
