"""Generation 0 of one start of the job, as one node's agent sees it until it is recorded: is
it up (every rank registered with the launcher, its membership written), and what becomes of
a failure before then (agent/decide.py says which):

- a rank that died before it registered: no peer has met it, so its seat starts again;
- a rank that had registered: its peers may have met it (in their groups' rendezvous), and
  there is no recovery without generation 0, so the failure waits for every rank to
  register, for as long as a slow phase may last, and is hot-swapped then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import astuple

from ..control import keys
from ..control.context import JobContext
from ..control.membership import MembershipError, MembershipStore
from ..control.messages import Member, Membership, Registration, spare_id
from ..control.monitor import Detection
from ..events import RANK_RELAUNCHED, EventLog
from ..failure.evidence import ProcessExited, describe_exit
from ..topology import Topology
from .children import Child
from .hotswap import Held, Run

log = logging.getLogger("deadpool.launch")


class FirstGeneration:
    def __init__(
        self, ctx: JobContext, topo: Topology, spares: list[str], limit_s: float,
        start_seat: Callable[[int, int], Child], events: EventLog,
    ):  # fmt: skip
        """`spares`: every spare the job was launched with; `limit_s`: how long a failure
        may wait for every rank to register; `start_seat(rank, local_rank)`: a new worker
        process for that seat."""
        self.ctx = ctx
        self.topo = topo
        self.spares = spares
        self.limit_s = limit_s
        self._start_seat = start_seat
        self.events = events

    def up(self, idle: list[Child], record: bool) -> bool:
        """Whether generation 0's membership is recorded. With `record`, record it once every
        rank has registered: node 0 polls for that, and any agent deciding on a failure or
        holding one does it first; the first writer wins. `idle`: this node's idle spares."""
        if MembershipStore(self.ctx.kv, self.ctx.job).current() is not None:
            return True
        if not record:
            return False
        local = {spare_id(c.index): c for c in idle}

        def alive(sid: str) -> bool:  # this node's by its process, another's by its record
            if sid in local:
                return local[sid].alive()
            return self.ctx.kv.get(keys.spare(self.ctx.job, sid)) is not None

        return record_first_generation(self.ctx, self.topo, self.spares, alive)

    def registered(self, rank: int) -> bool:
        """Whether `rank`'s process registered with the job. Read after it exited: its
        registration is a write the store answered before the process went on, so a process
        not registered now never met a peer."""
        return self.ctx.get(keys.registration(self.ctx.job, 0, rank), Registration) is not None

    def relaunch(self, rank: int, exited: ProcessExited, run: Run) -> None:
        """`rank`'s process died before it registered (its imports, its first connection to
        the store): a new process takes its seat in generation 0 and the job starts as if
        nothing happened. Once per rank (decide.py)."""
        old = run.workers[rank]
        log.warning("worker rank %d (pid %d) %s before it registered with the job; nothing "
                    "of it is in the job yet, so its seat starts again", rank, old.proc.pid,
                    describe_exit(exited.returncode))  # fmt: skip
        child = self._start_seat(rank, old.local_rank)
        run.relaunch(rank, child)
        self.events.emit(RANK_RELAUNCHED, rank=rank, old_pid=old.proc.pid, pid=child.proc.pid,
                         returncode=exited.returncode)  # fmt: skip

    def hold(
        self, detection: Detection, held: Held | None, run: Run, fence: Callable[[], float]
    ) -> bool:
        """Keep a registered rank's failure until generation 0 is recorded (`fence`: kill
        its process first, when it is alive, and say how long that took). True while it may
        wait; False once it waited longer than the limit."""
        rank = detection.classification.rank
        if held is None:
            held = Held(detection, fence(), run.workers[rank].proc.pid)
            if self.registered(rank):  # else, fenced unregistered: its seat starts again
                log.warning("rank %d failed before every rank registered with the job: its "
                            "recovery waits for them (up to %.0f s)", rank, self.limit_s)  # fmt: skip
        elif detection.detected_at - held.detection.detected_at > self.limit_s:
            log.error("not every rank registered within %.0f s of the failure of rank %d; "
                      "ending the job", self.limit_s, rank)  # fmt: skip
            return False
        run.hold(rank, held)
        return True


def record_first_generation(
    ctx: JobContext, topo: Topology, spares: list[str], alive: Callable[[str], bool]
) -> bool:
    """Record generation 0's membership once every rank has registered: each rank by the
    process that registered it, and those of `spares` that are `alive` (a spare registering
    later joins as a replenished one does). Any agent may call it; the first writer wins.
    True once it is recorded (by this call or another), False while a rank has not
    registered."""
    holders = [
        ctx.get(keys.registration(ctx.job, 0, r), Registration) for r in range(topo.world_size)
    ]
    if any(h is None for h in holders):
        return False
    ranks = tuple(Member(r, h.process_id, astuple(topo.coords(r))) for r, h in enumerate(holders))
    free = tuple(sid for sid in spares if alive(sid))
    try:
        MembershipStore(ctx.kv, ctx.job).create(Membership(0, ranks, free))
    except MembershipError:
        return True  # another agent recorded it first
    log.info("generation 0: %d ranks and %d spare(s) recorded", len(ranks), len(free))
    return True
