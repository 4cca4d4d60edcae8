"""This node's idle spares: injected spare deaths, spares that die idle, spares claimed by a
recovery, and fresh spares replenishing the pool (agent/replenish.py decides which).

The pool owns the list of local idle spares; the hot-swap takes claimed ones out through it.
Every change of its size is an event, so the pool over a long job can be plotted.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable

from ..control import keys
from ..control.messages import spare_id
from ..errors import BAD_INPUT_EXIT
from ..events import FAULT_INJECTED, SPARE_LOST, SPARE_POOL, SPARE_STARTED, EventLog
from ..failure.evidence import describe_exit
from .children import Child
from .replenish import Replenisher, SpareStart

log = logging.getLogger("deadpool.launch")


class SparePool:
    def __init__(
        self,
        node: int,
        spares: list[Child],
        replenisher: Replenisher,
        spawn: Callable[[SpareStart], Child],
        kv,
        job: str,
        events: EventLog,
        kills: list | None = None,
    ):
        self.node = node
        self._spares = list(spares)
        self.replenisher = replenisher
        self._spawn = spawn  # starts one spare process on this node
        self.kv = kv
        self.job = job
        self.events = events
        self._kills = list(kills or [])  # kill-spare@INDEX:ITER faults not yet fired

    @property
    def idle(self) -> list[Child]:
        """The local spares not claimed by any recovery (some may have died)."""
        return list(self._spares)

    def alive_ids(self) -> tuple[str, ...]:
        return tuple(spare_id(c.index) for c in self._spares if c.alive())

    def size(self) -> int:
        return sum(1 for c in self._spares if c.alive())

    def take(self, sid: str) -> Child | None:
        """A recovery claimed spare `sid`: it leaves the pool (None if it is not local)."""
        child = next((c for c in self._spares if spare_id(c.index) == sid), None)
        if child is not None:
            self._spares.remove(child)
            self._changed(f"spare {child.index} claimed")
        return child

    def worker_lost(self, child: Child) -> None:
        """A local worker was replaced by a spare: its slot is owed a fresh one."""
        self.replenisher.lost(child.local_rank)

    def node_unfit(self, reason: str) -> None:
        self._announcing_stop(lambda: self.replenisher.stop(reason))

    def _announcing_stop(self, change: Callable[[], None]) -> None:
        """Apply `change` to the replenisher; say so once if it stops replenishing."""
        was = self.replenisher.stopped
        change()
        if self.replenisher.enabled and was is None and self.replenisher.stopped is not None:
            log.warning("node %d no longer replenishes its spares: %s", self.node,
                        self.replenisher.stopped)  # fmt: skip

    def watch(self, iteration: int) -> None:
        """Fire due spare kills; report spares that died idle (they leave the pool)."""
        for fault in [f for f in self._kills if iteration >= f.iteration]:
            self._kills.remove(fault)
            for child in self._spares:
                if child.index == fault.target and child.alive():
                    log.warning("injecting %s (pid %d)", fault, child.proc.pid)
                    self.events.emit(FAULT_INJECTED, fault=str(fault), spare=child.index)
                    child.kill()
        for child in self._spares:
            rc = child.proc.poll()
            if rc is None or child.reported:
                continue
            child.reported = True
            if rc == 0:
                continue
            log.warning("spare %d (pid %d) %s; it leaves the pool and the job goes on",
                        child.index, child.proc.pid, describe_exit(rc))  # fmt: skip
            ready = self.ready(spare_id(child.index))
            self.kv.delete(keys.spare(self.job, spare_id(child.index)))
            self.events.emit(SPARE_LOST, spare=child.index, pid=child.proc.pid,
                             how=describe_exit(rc), ready=ready)  # fmt: skip
            self._announcing_stop(lambda ready=ready: self.replenisher.spare_died(ready))
            if rc == BAD_INPUT_EXIT:  # its replacement would be given the same input
                log.error("spare %d refused its input (its error is above); no spare is "
                          "started in its place", child.index)  # fmt: skip
            else:
                self.replenisher.lost(child.local_rank)
            self._changed(f"spare {child.index} lost")

    def refill(self) -> None:
        """Start the spares this node owes its pool (call when no recovery is in flight)."""
        while (start := self.replenisher.next_start()) is not None:
            child = self._spawn(start)
            self._spares.append(child)
            log.info("spare %d (pid %d) started to replenish the pool of node %d",
                     start.index, child.proc.pid, self.node)  # fmt: skip
            self.events.emit(SPARE_STARTED, spare=start.index, pid=child.proc.pid,
                             node=self.node, local_rank=start.local_rank)  # fmt: skip
            self._changed(f"spare {start.index} started")

    def stop_warming(self) -> None:
        """The job is done: spares still starting hold nothing and would not see the job end
        before their warm-up is over; stop them now."""
        for child in self._spares:
            if child.alive() and not self.ready(spare_id(child.index)):
                child.kill(signal.SIGTERM)

    def ready(self, sid: str) -> bool:
        """Warmed up and idle: a spare beats only once it could take over at once."""
        return self.kv.get(keys.spare_heartbeat(self.job, sid)) is not None

    def _changed(self, why: str) -> None:
        self.events.emit(SPARE_POOL, node=self.node, size=self.size(), why=why)
