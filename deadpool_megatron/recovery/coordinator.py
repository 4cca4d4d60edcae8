"""The agent's half of a hot-swap: order the stop, gather what every live rank holds, plan,
claim spares, commit the new generation, publish the plan, and time the recovery.

The processes carry the plan out themselves (recovery/stages.py); the agent only writes
records and watches. One order per generation (first writer wins), always into the generation
after the agent's current one, which the order moves the agent's job context to: a failure
during a recovery is ordered into the next generation and supersedes it. A rank that dies
before it reports its holdings is added to the failed ones of the same recovery; a failure
after the plan is published (a survivor or the spare dying mid-rebuild) is a new failure,
recovered in the next generation.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field

from ..control import keys
from ..control.context import JobContext
from ..control.membership import MembershipStore
from ..control.messages import (
    HoldingsReport,
    Membership,
    PlanDecision,
    Recovered,
    RecoveryOrder,
    SpareAssignment,
)
from ..control.wait import wait_until
from ..errors import DeadpoolError
from ..events import (
    RECOVERY_DONE,
    RECOVERY_PHASE,
    RECOVERY_STARTED,
    RECOVERY_UNNEEDED,
    SPARE_CLAIMED,
    EventLog,
)
from ..topology import Topology
from .plan import RecoveryPlan, TrainingFinished, Unrecoverable, plan_recovery

log = logging.getLogger("deadpool.recovery")

POLL_S = 0.01  # holdings arrive within milliseconds of the order
# Per-rank phases (the slowest rank's duration is reported), in the order they happen.
RANK_PHASES = (
    "rebuild_communicators",
    "rebuild_model",
    "transfer_state",
    "verify",
    "rebuild_pipeline",
    "first_iteration",
)


def rank_phases(records: list[Recovered]) -> dict[str, float]:
    """Each per-rank phase as the slowest rank's duration, except the first resumed iteration:
    counted from the moment the last rank resumed to the moment the last rank finished it.

    Each rank times its first iteration from its own resume, so a rank that resumed early
    counted the time it then waited for the last one to resume (measured at 8 processes: the
    ranks resumed up to 0.12 s apart, and the slowest rank's first iteration exceeded a normal
    one by as much); that wait is the recovery's skew (`resume_skew`, reported apart), not the
    iteration's warm-up."""
    phases = {name: max(r.phases.get(name, 0.0) for r in records) for name in RANK_PHASES}
    resumed = [r.finished_at - r.phases.get("first_iteration", 0.0) for r in records]
    phases["first_iteration"] = max(r.finished_at for r in records) - max(resumed)
    phases["resume_skew"] = max(resumed) - min(resumed)
    return phases


def phase_cpu(records: list[Recovered]) -> dict[str, float]:
    """Each phase's CPU seconds per process, the mean over the ranks that timed it: what the
    phase costs one process, which more processes on the same cores do not inflate."""
    spent: dict[str, list[float]] = {}
    for r in records:
        for name, seconds in (r.phase_cpu_s or {}).items():
            spent.setdefault(name, []).append(seconds)
    return {name: round(sum(v) / len(v), 4) for name, v in spent.items()}


@dataclass
class Recovery:
    """One recovery the launcher ordered and is waiting to see finished."""

    generation: int
    failed_at: float  # the fault's injection time if known, else when it was detected
    permanent: set[int]
    reason: str
    ordered_at: float
    phases: dict[str, float] = field(default_factory=dict)
    plan: RecoveryPlan | None = None
    replayed: int = 0
    finished: set[int] = field(default_factory=set)  # ranks that exited with status 0


def claimed(plan: RecoveryPlan) -> dict[int, str]:
    """The replaced ranks whose spare this plan claims (not those seated already)."""
    return {r: s for r, s in plan.replaced.items() if r not in plan.arriving}


class OrderExists(DeadpoolError):
    """Another writer already ordered a recovery into this generation."""


class SpareUnavailable(DeadpoolError):
    """A spare of the plan could not be claimed (it withdrew on SIGTERM, or an earlier
    generation holds it): plan again without it. Nothing was published or committed."""


class Coordinator:
    def __init__(
        self,
        ctx: JobContext,
        topology: Topology,
        replicas: int,
        events: EventLog,
        clock: Callable[[], float] = time.time,
        node: int = 0,
    ):
        self.ctx = ctx
        self.node = node  # this agent's node, named in its orders
        self.claimer = f"node {node}"  # named in the claim keys of the spares it claims
        self.job = ctx.job
        self.topology = topology
        self.replicas = replicas
        self.events = events
        self._clock = clock
        self.membership = MembershipStore(ctx.kv, ctx.job)
        self.pending: Recovery | None = None  # published, not yet finished
        self.done: list[dict] = []
        self._retired_below = 0  # generations below this had their keys deleted

    def order(self, permanent: set[int], reason: str, failed_at: float) -> Recovery:
        """Tell every process to stop and recover into the next generation."""
        generation = self.ctx.generation + 1
        order = RecoveryOrder(reason, tuple(permanent), self.node)
        if not self.ctx.create(keys.recovery_order(self.job, generation), order):
            raise OrderExists(f"a recovery into generation {generation} was already ordered")
        self.ctx.advance(generation)
        self.events.emit(
            RECOVERY_STARTED, generation=generation, failed=sorted(permanent), reason=reason,
            kind="permanent" if permanent else "transient",
        )  # fmt: skip
        return Recovery(generation, failed_at, set(permanent), reason, self._clock())

    def gather(
        self,
        rec: Recovery,
        lost: Callable[[int], str | None],
        on_lost: Callable[[int, str], None],
        poll_s: float = POLL_S,
        sleep: Callable[[float], None] = time.sleep,
        finished: Callable[[int], bool] = lambda rank: False,
    ) -> dict[int, HoldingsReport]:
        """Wait for the holdings of every live rank. A rank still computing towards its next
        phase boundary is waited for as long as it progresses; one that `lost` says will
        never report (exited, stopped, no progress for its phase's limit) joins the failed
        ones; one that `finished` (exited with status 0) joins `rec.finished`. Returns
        {rank: its report}."""
        got: dict[int, HoldingsReport] = {}

        def poll() -> dict | None:
            for rank in range(self.topology.world_size):
                if rank in rec.permanent or rank in got or rank in rec.finished:
                    continue
                report = self.ctx.get(keys.holdings(self.job, rec.generation, rank), HoldingsReport)
                if report is not None:
                    got[rank] = report
                    continue
                if finished(rank):
                    log.info("rank %d had finished training (exited with status 0)", rank)
                    rec.finished.add(rank)
                    continue
                why = lost(rank)
                if why is not None:
                    log.warning("rank %d is lost during the recovery (%s); it is replaced too",
                                rank, why)  # fmt: skip
                    rec.permanent.add(rank)
                    on_lost(rank, why)
            waiting = set(range(self.topology.world_size)) - rec.permanent - set(got)
            waiting -= rec.finished
            return None if waiting else got

        return wait_until(poll, math.inf, "holdings", interval_s=poll_s, sleep=sleep)

    def decide(
        self,
        rec: Recovery,
        held: dict[int, HoldingsReport],
        free_spares: list[str],
        prebuilt: Mapping[str, Collection[int]] | None = None,
    ) -> RecoveryPlan:
        """Plan, claim the spares, commit the membership and publish the plan. Raises
        Unrecoverable (after publishing why, so every process stops) when nothing can, and
        TrainingFinished (published too) when the failure came after training ended.
        `prebuilt`: spare -> the ranks it can take over without building (the plan names the
        replaced ranks whose spare does)."""
        current = self.membership.current()
        view = Membership(current.generation, current.ranks, tuple(free_spares))
        arriving = {r for r, h in held.items() if h.arriving}  # seated by a superseded one
        try:
            plan = plan_recovery(
                view, self.topology, rec.permanent,
                {r: h.holdings for r, h in held.items() if r not in arriving}, self.replicas,
                rec.finished, untrained=not any(h.trained for h in held.values()),
                arriving=arriving,
            )  # fmt: skip
            ready = {} if plan.from_start else prebuilt or {}  # from the start, all build
            plan = dataclasses.replace(plan, prebuilt=tuple(
                r for r, s in sorted(plan.replaced.items()) if r in ready.get(s, ())
            ))  # fmt: skip
            joined = tuple(s for s in free_spares if s not in current.spares)
            for _, spare_id in sorted(claimed(plan).items()):
                if not self.membership.claim_spare(
                    spare_id, current.generation, self.claimer, joined
                ):
                    raise SpareUnavailable(f"spare {spare_id} withdrew or was claimed before")
            self.membership.commit(
                Membership(current.generation + 1, plan.membership.ranks, plan.membership.spares),
                current.generation,
            )
        except TrainingFinished as err:
            self.ctx.put(
                keys.recovery_plan(self.job, rec.generation), PlanDecision(finished=str(err))
            )
            self.events.emit(RECOVERY_UNNEEDED, generation=rec.generation,
                             failed=sorted(rec.permanent), finished=sorted(rec.finished))  # fmt: skip
            raise
        except Unrecoverable as err:
            decision = PlanDecision(unrecoverable=str(err))
            self.ctx.put(keys.recovery_plan(self.job, rec.generation), decision)
            raise
        for rank, spare_id in sorted(claimed(plan).items()):
            assignment = SpareAssignment(rank, rec.generation)
            self.ctx.put(keys.assignment(self.job, spare_id), assignment)
            self.events.emit(SPARE_CLAIMED, spare=spare_id, replaces=rank)
        completed = max(h.completed for h in held.values())
        decision = PlanDecision(plan, failed_iteration=completed + 1)
        self.ctx.put(keys.recovery_plan(self.job, rec.generation), decision)
        rec.plan = plan
        rec.replayed = 0 if plan.from_start else max(0, completed - plan.iteration)
        rec.phases["plan"] = self._clock() - rec.ordered_at
        log.info(
            "generation %d: %s; %s; transfers: %s", rec.generation,
            "nothing trained yet: every rank sets up again from the start" if plan.from_start
            else f"roll back to iteration {plan.iteration}",
            ", ".join(f"{s} replaces rank {r}" + (" (prebuilt)" if r in plan.prebuilt else "")
                      + (" (seated already)" if r in plan.arriving else "")
                      for r, s in plan.replaced.items()) or "no spare",
            ", ".join(f"{t.kind} {t.src}->{t.dst}" for t in plan.transfers) or "none",
        )  # fmt: skip
        self.pending = rec
        return plan

    def poll_done(self) -> dict | None:
        """The finished recovery's summary once every rank has run its first iteration."""
        rec = self.pending
        if rec is None:
            return None
        records = []
        for rank in range(self.topology.world_size):
            record = self.ctx.get(keys.recovered(self.job, rec.generation, rank), Recovered)
            if record is None:
                return None
            records.append(record)
        self.pending = None
        rec.phases.update(rank_phases(records))
        for name, seconds in rec.phases.items():
            self.events.emit(RECOVERY_PHASE, phase=name, duration_s=seconds)
        finished = max(r.finished_at for r in records)
        summary = {
            "total_s": finished - rec.failed_at,
            "replayed_iterations": rec.replayed,
            "bytes_moved": sum(r.bytes_moved for r in records),
            "iteration": rec.plan.iteration,
            "replaced": {str(k): v for k, v in rec.plan.replaced.items()},
        }
        if rec.plan.from_start:  # where the set-up found training starts: before the first
            summary["iteration"] = min(r.iteration for r in records) - 1  # resumed one
            summary["from_start"] = True
        cpu = {rank: r.cpu_s for rank, r in enumerate(records) if r.cpu_s is not None}
        if cpu:  # per process: what the recovery costs where every process has its own cores
            busiest = max(cpu, key=cpu.__getitem__)
            summary["cpu_s_max"] = round(cpu[busiest], 4)
            summary["cpu_s_busiest_rank"] = busiest
            summary["cpu_s_mean"] = round(sum(cpu.values()) / len(cpu), 4)
        by_phase = phase_cpu(records)
        if by_phase:
            summary["phase_cpu_s_mean"] = by_phase
        checked = [r.groups_checked for r in records]
        if all(c is not None for c in checked):  # --deadpool-verify-groups
            summary["groups_checked_min"] = min(checked)
        self.events.emit(RECOVERY_DONE, **summary)
        log.info(
            "generation %d: recovered in %.2f s (failure to first resumed iteration); %s; "
            "%d iteration(s) re-executed, %.1f MiB moved",
            rec.generation, summary["total_s"],
            ", ".join(f"{k} {v:.3f} s" for k, v in rec.phases.items()),
            rec.replayed, summary["bytes_moved"] / 2**20,
        )  # fmt: skip
        self.done.append(summary)
        self._retire_before(rec.generation)
        return summary

    def _retire_before(self, generation: int) -> None:
        """Delete what the generations before `generation` wrote (its heartbeats, reports,
        orders, holdings, plans and, in etcd, its process groups' rendezvous): every process
        works in `generation` now and nothing reads them again, and a job that recovers for
        months must not leave its store growing. Stores that cannot list keys (the TCPStore,
        which ends with the job) keep them."""
        removed = 0
        for old in range(self._retired_below, generation):
            for prefix in (keys.generation_prefix(self.job, old),
                           keys.C10D_ROOT + keys.process_group_prefix(self.job, old) + "/"):  # fmt: skip
                n = self.ctx.kv.delete_prefix(prefix)
                if n is None:
                    return
                removed += n
        self._retired_below = generation
        log.info("retired generation(s) before %d: %d key(s) deleted", generation, removed)
