"""How one node's part of a job ends once its workers succeeded: it counts its ranks done,
waits for every node's (telling a recovery ordered meanwhile that they had finished), then
leaves in order. Node 0's agent, which hosts the TCPStore, leaves last; in etcd the last agent
to leave deletes the job's keys. The agent decides what follows (agent.Agent.finish)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..control import keys
from ..control.context import JobContext
from ..control.messages import Flag, PlanDecision, RankLost, RecoveryOrder, RestartOrder
from ..control.store import StoreTimeout, StoreUnreachable
from ..control.wait import wait_until
from .children import Child
from .launches import forget_job

log = logging.getLogger("deadpool.launch")

FINISH_TIMEOUT_S = 600.0  # for every node's workers to succeed
AGENTS_LEAVE_S = 30.0


@dataclass(frozen=True)
class Ending:
    """One node's end of one start of the job (a checkpoint-restart is another start)."""

    ctx: JobContext
    node: int
    node_count: int
    world_size: int
    fault_scope: str  # the job id every restart of it shares
    restarts: int  # this start's count
    hosts_store: bool  # node 0's TCPStore: every other agent reads it until it has left
    outlives: bool  # etcd: the job's keys outlive every agent unless deleted
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)

    def wait(self, workers: dict[int, Child]) -> Flag | RestartOrder | PlanDecision:
        """Count this node's ranks done (whoever completes the count says the job finished)
        and wait for that word, or for a checkpoint-restart ordered meanwhile, or for an
        unrecoverable plan of a recovery ordered late. Raises StoreTimeout."""
        job = self.ctx.job
        finished = keys.job_finished(job)
        if workers and self.ctx.kv.add(keys.ranks_done(job), len(workers)) >= self.world_size:
            self.ctx.put(finished, Flag("agent"))
        told: set[int] = set()

        def poll() -> Flag | RestartOrder | PlanDecision | None:
            order = self.ctx.get(keys.restart(self.fault_scope, self.restarts + 1), RestartOrder)
            return self.ctx.get(finished, Flag) or order or self._answer_late(workers, told)

        return wait_until(poll, FINISH_TIMEOUT_S, "every node's workers to succeed",
                          interval_s=0.2, clock=self.clock, sleep=self.sleep)  # fmt: skip

    def _answer_late(self, workers: dict[int, Child], told: set[int]) -> PlanDecision | None:
        """While this node waits for the others to finish: a recovery ordered since (a rank
        elsewhere failed after its last collective) is told that this node's workers had
        finished training, so it plans none and says the job finished; returns its plan
        decision if that is unrecoverable instead."""
        job = self.ctx.job
        generation = self.ctx.generation + 1
        if self.ctx.get(keys.recovery_order(job, generation), RecoveryOrder) is None:
            return None
        if generation not in told:
            told.add(generation)
            for rank, child in sorted(workers.items()):
                if child.proc.poll() == 0:
                    self.ctx.put(keys.rank_lost(job, generation, rank),
                                 RankLost("finished training", finished=True))  # fmt: skip
            log.info("a recovery into generation %d was ordered after this node's workers "
                     "finished: told its coordinator so", generation)  # fmt: skip
        decision = self.ctx.get(keys.recovery_plan(job, generation), PlanDecision)
        return decision if decision is not None and decision.unrecoverable else None

    def leave(self, members: int) -> None:
        """Say goodbye; node 0, whose agent hosts the TCPStore, leaves last (every other agent
        still reads the store until it has seen the job finish). In etcd, the last agent to
        leave deletes the job's keys: nothing else reads them, and a finished job leaves
        nothing behind in a store that serves job after job. In etcd the caller stops its
        lease before this: no renewal may write its key back after the deletion. `members`:
        the nodes in the job as this agent sees them (launched or joined, not lost)."""
        kv = self.ctx.kv
        left = kv.add(keys.agents_left(self.ctx.job), 1)
        expected = members
        if self.outlives:
            if left == expected:
                self.forget("finished: every agent left")
            return
        if self.node != 0 or self.node_count == 1 or not self.hosts_store:
            return
        try:
            wait_until(lambda: left >= expected or kv.add(keys.agents_left(self.ctx.job), 0)
                       >= expected or None, AGENTS_LEAVE_S, "every agent to leave",
                       interval_s=0.05, clock=self.clock, sleep=self.sleep)  # fmt: skip
        except StoreTimeout as err:
            log.warning("%s; closing the store anyway", err)

    def forget(self, why: str) -> None:
        """Delete the job's keys and rendezvous, its checkpoint-restarts' included; a store
        that cannot be reached keeps them (said once: the job itself is over)."""
        scope = self.fault_scope
        jobs = [scope, *(keys.restarted_job(scope, n) for n in range(1, self.restarts + 1))]
        try:
            removed = forget_job(self.ctx.kv, jobs)
        except (StoreUnreachable, StoreTimeout) as err:
            log.warning("job %s %s, but its keys stay in the store: %s", self.ctx.job, why, err)
            return
        log.info("job %s %s; its %d key(s) deleted from the store", scope, why, removed)
