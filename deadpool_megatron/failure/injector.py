"""Carry out injected faults inside a worker process, at a given iteration and phase.

kill: SIGKILL to itself (the process dies as a node would); hang: SIGSTOP to itself (every
thread stops, heartbeats included, as a hung node would); raise: an `InjectedFault` exception
in the training thread (a transient error: the process stays alive and healthy); unhealthy:
its device fails every health check from then on (alive and beating, but unfit); slow: the
training thread computes while holding the GIL (no heartbeat gets out) for a while, as a long
checkpoint save or kernel launch would: a healthy process that must not be accused; corrupt:
the replication thread sends the replica of that iteration with bytes flipped; stall: the
training thread waits for good on an event nobody sets, while the heartbeat and every other
thread go on (a deadlock, or a collective that never returns: alive, beating, stuck); bug:
an `InjectedBug`, the training's own error, every time the process holding the rank gets
there (a replay, or a spare that took the rank over, meets it again). The time of each
injection is reported first, so detection latency can be measured from it.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from ..errors import DeadpoolError
from .inject import Fault, awaited_at, companions, faults_at

log = logging.getLogger("deadpool.inject")


class InjectedFault(DeadpoolError):
    """A transient failure injected with raise@RANK:ITER."""


class InjectedBug(RuntimeError):
    """An error of the training's own (bug@RANK:ITER): reported as any error the training
    raises, not as an injected fault."""


def hold_gil(seconds: float, stretch_s: float) -> None:
    """Compute for `seconds` without letting another thread run for `stretch_s` at a time:
    `sum(range(n))` loops in C and never releases the GIL; n is calibrated as it goes."""
    deadline = time.monotonic() + seconds
    n = 100_000
    while (left := deadline - time.monotonic()) > 0:
        start = time.monotonic()
        sum(range(n))
        took = max(time.monotonic() - start, 1e-6)
        n = max(1000, int(n * min(stretch_s, left) / took))


class FaultInjector:
    def __init__(
        self,
        faults: tuple[Fault, ...],
        rank: int,
        report: Callable[[Fault, float], None],
        claim: Callable[[Fault], bool] | None = None,
        slow_s: float = 6.0,
        together: Callable[[Fault, tuple[int, ...]], tuple[int, ...]] | None = None,
        world_size: int | None = None,
    ):
        self.slow_s = slow_s  # how long a slow@ phase lasts
        self.faults = tuple(f for f in faults if not f.on_spare and f.target == rank)
        self._all = tuple(faults)
        # Waits until the other ranks of a fault that strikes several at once are there too,
        # and returns those that never came; None: each strikes when it gets there.
        self._together = together
        self.rank = rank
        self.world_size = world_size  # a finish kill waits for every rank (companions)
        self._report = report
        # Once per job, not per process: the spare that takes this rank over replays the
        # failed iteration and must not fail again (the launcher's store arbitrates).
        self._claim = claim
        self._fired: set[Fault] = set()
        self.on_unhealthy = None  # set by whoever runs the health checks

    def due(self, iteration: int, phase: str) -> bool:
        """A fault of this rank not fired yet waits at (`iteration`, `phase`)."""
        return any(
            f not in self._fired for f in faults_at(self.faults, iteration, phase, self.rank)
        )

    def fire(self, iteration: int, phase: str) -> bool:
        """Called at each phase of each iteration; does nothing unless a fault is due.
        True when the caller must corrupt what it is about to send (corrupt@)."""
        corrupt = False
        mine = faults_at(self.faults, iteration, phase, self.rank)
        awaited = awaited_at(self._all, iteration, phase, self.rank)
        if awaited is not None and not mine and self._together is not None:
            self._together(awaited, ())  # say this rank got there; wait for nobody
        for fault in mine:
            if fault.action == "bug":  # every time: neither claimed nor remembered
                self._report(fault, time.time())
                log.warning("injecting %s", fault)
                raise InjectedBug(f"injected bug at iteration {iteration}, phase {phase}")
            if fault in self._fired:  # a re-executed iteration does not fail again
                continue
            self._fired.add(fault)
            if self._claim is not None and not self._claim(fault):
                continue
            others = companions(self._all, fault, self.world_size)
            if others and self._together is not None:
                missing = self._together(fault, others)
                if missing:
                    log.warning("%s: rank(s) %s never reached iteration %d's %s phase: striking "
                                "alone", fault, list(missing), iteration, phase)  # fmt: skip
            at = time.time()
            self._report(fault, at)
            log.warning("injecting %s", fault)
            for handler in logging.getLogger().handlers:
                handler.flush()
            sys.stdout.flush()
            if fault.action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault.action == "hang":
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault.action == "unhealthy":
                if self.on_unhealthy is not None:
                    self.on_unhealthy()  # the device fails its health checks from now on
            elif fault.action == "slow":
                hold_gil(self.slow_s, stretch_s=self.slow_s / 2.4)
                log.warning("%s: slow phase over after %.1f s", fault, time.time() - at)
            elif fault.action == "stall":
                threading.Event().wait()  # nobody sets it: this thread never goes on
            elif fault.action == "corrupt":
                corrupt = True
            else:
                raise InjectedFault(f"injected transient fault {fault}")
        return corrupt
