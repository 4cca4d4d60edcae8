"""The agent's part in a hot-swap, on any node: coordinate a recovery (the first agent to
write a generation's order), or follow one another agent coordinates, and adopt the plan's
word on which local process holds which rank.

No node is special: the coordinator gathers every live rank's holdings from the store, asks
each rank's own agent (through the store) whether a rank that has not reported ever will, and
places spares by node (recovery/placement.py). A follower reports its own lost ranks, fences
only its own processes, and takes over the recovery (through the next generation) if the
coordinator's node is lost before it publishes a plan.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..control import keys
from ..control.chaos import Chaos
from ..control.context import JobContext
from ..control.membership import MembershipStore
from ..control.messages import (
    AgentBeat,
    PlanDecision,
    RankLost,
    RecoveryOrder,
    RecoveryPlan,
    SparePrebuilt,
    spare_id,
)
from ..control.monitor import Detection, Monitor
from ..control.store import StoreTimeout
from ..control.wait import wait_until
from ..events import FENCED, EventLog
from ..recovery.coordinator import Coordinator, OrderExists, Recovery, SpareUnavailable, claimed
from ..recovery.placement import order_spares
from ..recovery.plan import TrainingFinished, Unrecoverable
from .children import Child
from .nodes import NodeWatch
from .pool import SparePool

log = logging.getLogger("deadpool.launch")
# free spares in the order the plan seats them, and spare -> ranks it built a model for
Spares = tuple[list[str], dict[str, tuple[int, ...]]]

RECOVERY_TIMEOUT_S = 300.0
FOLLOW_POLL_S = 0.02
NODE_LOOK_S = 0.1  # other nodes' leases, read during a gather
SPARE_START_WAIT_S = 120.0  # a recovery short of spares waits this long for starting ones
SPARE_POLL_S = 0.2
MAX_PLANS = 8  # plans tried when a planned spare cannot be claimed (each try leaves it out)


@dataclass(frozen=True)
class Held:
    """A failure waiting for every rank to register (FirstGeneration.hold): its first detection
    (the recovery counts from it), the time its fence took, and the process it was of (a
    later process in the seat is a new case)."""

    detection: Detection
    fence_s: float
    pid: int


@dataclass
class Run:
    """One start of the job on this node (a checkpoint-restart begins a new one): its local
    processes and the watchers over them."""

    workers: dict[int, Child]  # rank -> the local process holding it
    pool: SparePool  # local idle spares
    monitor: Monitor
    coordinator: Coordinator
    chaos: Chaos
    nodes: NodeWatch
    up: bool = False  # generation 0's membership is recorded
    replaced_in: dict[int, int] = field(default_factory=dict)  # rank -> generation it moved in
    lost_nodes: list[AgentBeat] = field(default_factory=list)  # seen during a recovery, to act on
    relaunched: set[int] = field(default_factory=set)  # ranks started again before registering
    held: dict[int, Held] = field(default_factory=dict)  # failures waiting for generation 0

    # Changed through these by whoever the agent hands it (its hot-swap, generation 0's watch).
    def relaunch(self, rank: int, child: Child) -> None:
        """`rank`'s seat started again before it registered (once: decide.py)."""
        self.relaunched.add(rank)
        self.workers[rank] = child

    def hold(self, rank: int, held: Held) -> None:
        """`rank`'s failure waits for every rank to register."""
        self.held[rank] = held

    def replace(self, rank: int, generation: int) -> Child | None:
        """`rank` moved to a spare in `generation`: the process that held it here, if any."""
        self.replaced_in[rank] = generation
        return self.workers.pop(rank, None)

    def seat(self, rank: int, spare: Child) -> None:
        """A local spare now holds `rank`."""
        self.workers[rank] = spare

    def nodes_lost(self, beats: list[AgentBeat]) -> None:
        """Nodes seen lost during a recovery, acted on once it is through."""
        self.lost_nodes.extend(beats)


@dataclass(frozen=True)
class Stop:
    """The job cannot go on in memory: restart it from its checkpoint, or end it (as
    succeeded when `finished`: the failure came after training had finished)."""

    restart: bool
    reason: str
    finished: bool = False


class HotSwap:
    def __init__(self, ctx: JobContext, node: int, run: Run, events: EventLog,
                 on_unrecoverable: str, launched: Mapping[str, int] | None = None):  # fmt: skip
        """`launched`: every spare the job was launched with (its id -> its node)."""
        self.ctx = ctx
        self.kv = ctx.kv
        self.node = node
        self.run = run
        self.coordinator = run.coordinator
        self.events = events
        self.on_unrecoverable = on_unrecoverable
        self.launched = dict(launched or {})
        self._next_node_look = 0.0

    def fence(self, rank: int, reason: str) -> None:
        """Kill a process that must not come back (hung, or unfit) before anything is rebuilt:
        a hung gloo collective cannot be aborted, its peers fail once it is gone."""
        child = self.run.workers[rank]
        if child.alive():
            child.kill()
            child.proc.wait()
            self.events.emit(FENCED, rank=rank, pid=child.proc.pid, reason=reason)
            log.warning("fenced rank %d (pid %d): %s", rank, child.proc.pid, reason)
        self.run.monitor.forget(rank)

    def recover(
        self, permanent: set[int], reason: str, failed_at: float,
        phases: dict[str, float],
    ) -> Stop | None:  # fmt: skip
        """Recover without restarting the job: order every process to stop, plan from what
        they hold, seat spares, publish the new generation. The first agent to order the
        recovery coordinates it; an agent that finds one ordered already joins it. Returns a
        Stop only when the job cannot go on in memory."""
        coordinator = self.coordinator
        try:
            rec = coordinator.order(permanent, reason, failed_at)
        except OrderExists:
            generation = self.ctx.generation + 1
            log.info("a recovery into generation %d is already ordered; rank(s) %s join it",
                     generation, sorted(permanent))  # fmt: skip
            for rank in permanent:
                self.ctx.put(keys.rank_lost(self.ctx.job, generation, rank), RankLost(reason))
            return self.follow(generation)
        rec.phases.update(phases)
        held = coordinator.gather(
            rec,
            lost=lambda r: self._rank_lost(r, rec.generation),
            on_lost=lambda r, why: (
                r in self.run.workers and self.fence(r, f"lost during the recovery: {why}")
            ),
            finished=lambda r: self._rank_finished(r, rec.generation),
        )
        try:
            plan = self._decide(rec, held)
        except TrainingFinished as err:
            log.warning("no recovery into generation %d: %s; the job ends as finished",
                        rec.generation, err)  # fmt: skip
            return Stop(False, str(err), finished=True)
        except Unrecoverable as err:
            # what failed, beside why it cannot be recovered (no spare left says nothing of it)
            lost = f"rank(s) {sorted(rec.permanent) or ['?']} ({reason})"
            if self.on_unrecoverable == "checkpoint-restart":
                log.error("cannot hot-swap the failure of %s: %s; falling back to the "
                          "persistent checkpoint", lost, err)  # fmt: skip
                return Stop(True, f"unrecoverable in memory: {err}; the failure: {reason}")
            log.error("cannot recover from the failure of %s: %s; ending the job",
                      lost, err)  # fmt: skip
            return Stop(False, f"unrecoverable: {err}; the failure: {reason}")
        self.adopt(plan)
        return None

    def _decide(self, rec: Recovery, held: dict) -> RecoveryPlan:
        """Plan with the free spares; a spare that withdrew (or that an earlier generation
        holds) between the look and its claim is left out of the next look, so this ends."""
        for _ in range(MAX_PLANS):
            # Ranks that finished beside live ones are replaced too (plan_recovery); when no
            # rank is live, nothing is (it answers that training finished).
            free, prebuilt = self._spares_for(
                rec.generation, rec.permanent | rec.finished
            ) if held else ([], {})  # fmt: skip
            try:
                return self.coordinator.decide(rec, held, free, prebuilt)
            except SpareUnavailable as err:
                log.warning("recovery into generation %d: %s; planning again",
                            rec.generation, err)  # fmt: skip
        raise Unrecoverable(f"no plan's spares could be claimed in {MAX_PLANS} tries")

    def _rank_finished(self, rank: int, generation: int) -> bool:
        if rank in self.run.workers:
            return self.run.monitor.finished(rank)
        return self.run.nodes.finished_rank(rank, generation)

    def _rank_lost(self, rank: int, generation: int) -> str | None:
        if rank in self.run.workers:
            return self.run.monitor.lost(rank)
        now = time.monotonic()
        if now >= self._next_node_look:  # a node lost during the gather, seen in time
            self._next_node_look = now + NODE_LOOK_S
            self.run.nodes_lost(self.run.nodes.poll())
        return self.run.nodes.lost_rank(rank, generation)

    def _spares_for(self, generation: int, failed: set[int]) -> Spares:
        """The free spares; when they are fewer than the lost ranks and spares are still
        starting (a pool being replenished), wait for those first rather than give up."""
        spares = self._free_spares(failed)
        free = spares[0]
        starting = self._starting()
        if len(free) >= len(failed) or not starting:
            return spares
        log.info("recovery into generation %d: %d free spare(s) for %d lost rank(s); waiting "
                 "up to %.0f s for spare(s) %s, still starting", generation, len(free),
                 len(failed), SPARE_START_WAIT_S, starting)  # fmt: skip

        def poll() -> tuple[Spares] | None:
            spares = self._free_spares(failed)
            enough = len(spares[0]) >= len(failed)
            return (spares,) if enough or not self._starting() else None

        try:
            (spares,) = wait_until(poll, SPARE_START_WAIT_S, "spares still starting",
                                   interval_s=SPARE_POLL_S)  # fmt: skip
        except StoreTimeout as err:
            log.warning("%s; planning with the spares there are", err)
            spares = self._free_spares(failed)
        return spares

    def _starting(self) -> list[str]:
        """Spares alive here, listed by a live node's lease, or launched on a node whose lease
        is not seen yet (`_unlisted`), that are not ready yet."""
        local = [spare_id(c.index) for c in self.run.pool.idle if c.alive()]
        ids = dict.fromkeys([*local, *self.run.nodes.hosted_spares(), *self._unlisted()])
        return [sid for sid in ids if not self._ready(sid)]

    def _unlisted(self) -> list[str]:
        """The spares the job was launched with on another node whose lease this agent has
        not seen yet: a failure in the job's first seconds can come before it, and the
        spares' own registration and heartbeat are then all there is to go by."""
        return [sid for sid, node in self.launched.items() if node != self.node
                and not self.run.nodes.seen(node) and not self.run.nodes.is_lost(node)]  # fmt: skip

    def _free_spares(self, failed: set[int]) -> Spares:
        """The spares free to take over, in the order the plan should use them (by node, and
        among a node's, one that built the failed rank's model first), and the ranks each
        can take over with what it built while idle (read once, for the order and the plan)."""
        membership = MembershipStore(self.kv, self.ctx.job)
        current = membership.current()
        unlisted = self._unlisted()
        local = {spare_id(c.index): c for c in self.run.pool.idle}
        free: dict[str, int | None] = {}
        for sid in self._candidates(current.spares, local, unlisted):
            if not membership.claimable(sid, current.generation, self.coordinator.claimer):
                continue  # it withdrew (SIGTERM), or a claim whose commit lost holds it
            if sid in local:
                if local[sid].alive():
                    free[sid] = self.node
                continue
            node = self.run.nodes.node_of_spare(sid)
            if node is None and sid in unlisted:  # its node's lease not seen yet
                node = self.launched[sid]
            if node is None or self.run.nodes.is_lost(node):
                continue
            if self.kv.get(keys.spare(self.ctx.job, sid)) is not None:
                free[sid] = node
        where = {
            r: self.node if r in self.run.workers else self.run.nodes.host_of(r) for r in failed
        }
        busy = self.run.nodes.busy() | ({self.node} if self.run.workers else set())
        prebuilt = self._prebuilt(free)
        return order_spares(where, free, self.run.nodes.lost_nodes(), busy, prebuilt), prebuilt

    def _prebuilt(self, spares) -> dict[str, tuple[int, ...]]:
        """The ranks each spare can take over with the model it built while idle."""
        found = {s: self.ctx.get(keys.spare_prebuilt(self.ctx.job, s), SparePrebuilt)
                 for s in spares}  # fmt: skip
        return {s: p.ranks for s, p in found.items() if p is not None}

    def _candidates(
        self, members: tuple[str, ...], local: dict[str, Child], unlisted: list[str]
    ) -> list[str]:
        """The membership's spares, then spares started since (replenishing a pool, here or
        on another node, or on a node whose lease is not seen yet) once they are ready: one
        still warming up is not relied on."""
        seen = (*local, *self.run.nodes.hosted_spares(), *unlisted)
        new = [sid for sid in seen if sid not in members]
        return [*members, *dict.fromkeys(sid for sid in new if self._ready(sid))]

    def _ready(self, sid: str) -> bool:
        return self.kv.get(keys.spare_heartbeat(self.ctx.job, sid)) is not None

    def follow(self, generation: int) -> Stop | None:
        """Take part in a recovery another agent coordinates: say which local ranks will
        never report, then take the plan's word on which local processes hold which rank. If
        the coordinator's node is lost before it publishes a plan, return: its loss is queued,
        and the first agent to count it orders the next generation."""
        order = self.ctx.get(keys.recovery_order(self.ctx.job, generation), RecoveryOrder)
        self.ctx.advance(generation)
        log.info("following the recovery into generation %d (coordinated by node %d): %s",
                 generation, order.by, order.reason)  # fmt: skip
        told: set[int] = set()

        def poll():
            if self.ctx.get(keys.recovery_order(self.ctx.job, generation + 1), RecoveryOrder):
                return "superseded"
            decision = self.ctx.get(keys.recovery_plan(self.ctx.job, generation), PlanDecision)
            if decision is not None:
                return decision
            for rank in sorted(set(self.run.workers) - told):
                if rank not in order.permanent and self.run.monitor.finished(rank):
                    told.add(rank)
                    self.ctx.put(keys.rank_lost(self.ctx.job, generation, rank),
                                 RankLost("finished training", finished=True))  # fmt: skip
                    continue
                why = "failed" if rank in order.permanent else self.run.monitor.lost(rank)
                if why is not None:
                    told.add(rank)
                    self.fence(rank, f"lost during the recovery: {why}")
                    self.ctx.put(keys.rank_lost(self.ctx.job, generation, rank), RankLost(why))
            self.run.nodes_lost(self.run.nodes.poll())  # acted on once this recovery is through
            if order.by != self.node and self.run.nodes.is_lost(order.by):
                return "coordinator lost"
            return None

        got = wait_until(poll, RECOVERY_TIMEOUT_S, f"the plan of generation {generation}",
                         interval_s=FOLLOW_POLL_S)  # fmt: skip
        if got == "superseded":
            return self.follow(generation + 1)
        if got == "coordinator lost":
            # Its loss is queued: the first agent to count it orders the next generation,
            # whose gather finds the ranks this one had lost gone as well.
            log.error("node %d, coordinating the recovery into generation %d, is lost",
                      order.by, generation)  # fmt: skip
            return None
        if got.finished is not None:
            log.warning("no recovery into generation %d: %s; the job ends as finished",
                        generation, got.finished)  # fmt: skip
            return Stop(False, got.finished, finished=True)
        if got.unrecoverable is not None:
            if self.on_unrecoverable == "checkpoint-restart":
                return None  # the coordinator orders the restart; the next look joins it
            log.error("the recovery into generation %d is impossible: %s; ending",
                      generation, got.unrecoverable)  # fmt: skip
            return Stop(False, f"unrecoverable: {got.unrecoverable}")
        self.adopt(got.plan)
        return None

    def adopt(self, plan: RecoveryPlan) -> None:
        """The plan's word on this node: claimed local spares now hold ranks; local ranks it
        gave to spares elsewhere are no longer this node's."""
        for rank, sid in sorted(claimed(plan).items()):  # a spare seated already stays
            old = self.run.replace(rank, plan.generation)
            if old is not None:
                if old.alive():
                    old.kill()  # a replaced process must not live on beside its successor
                self.run.pool.worker_lost(old)
            spare = self.run.pool.take(sid)
            if spare is not None:
                self.run.seat(rank, spare)
                log.info("spare %d (pid %d) takes over rank %d", spare.index, spare.proc.pid,
                         rank)  # fmt: skip
        self.run.monitor.set_ranks(sorted(self.run.workers))

    # -- ending -----------------------------------------------------------------------------
