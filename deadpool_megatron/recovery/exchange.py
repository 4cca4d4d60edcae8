"""What one process says and hears on the job's store during a recovery (recovery/stages.py
carries the stages out): the agent's order (stage 2), its own holdings (2), the agent's plan
(3), and the rendezvous of everyone of the generation before any group is built (4). Every
wait has its stage's timeout and gives way to a newer order; nothing here touches torch."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..control import keys
from ..control.context import JobContext
from ..control.messages import Flag, HoldingsReport, PlanDecision
from ..control.store import StoreTimeout
from ..control.wait import wait_until
from ..errors import DeadpoolError
from ..failure.hang import HangPolicy

log = logging.getLogger("deadpool.recovery")


class RecoveryOrdered(DeadpoolError):
    """The agent ordered a recovery into a newer generation: stop this iteration."""


class RecoveryFailed(DeadpoolError):
    """This process cannot take part in any recovery (unrecoverable, timed out, inconsistent)."""


class Superseded(DeadpoolError):
    """A newer generation was ordered while this one was being recovered into."""


@dataclass(frozen=True)
class StageTimeouts:
    """Seconds each waiting stage may take before the process gives up."""

    stop_s: float  # the protection threads must stop
    order_s: float  # the agent may first wait for slow ranks to stop
    plan_s: float  # the agent waits for every rank's holdings, slow ones included
    rendezvous_s: float  # everyone of the generation must arrive

    @classmethod
    def from_config(cls, dpc) -> StageTimeouts:
        slow = HangPolicy.from_config(dpc).slow_phase_s
        return cls(max(10.0, dpc.deadpool_heartbeat_timeout), slow, slow, slow)


class RecoveryExchange:
    def __init__(
        self, ctx: JobContext, rank: int, world_size: int, timeouts: StageTimeouts,
        clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
    ):  # fmt: skip
        self.ctx = ctx
        self.rank = rank
        self.world_size = world_size
        self.timeouts = timeouts
        self._clock = clock
        self._sleep = sleep

    def await_order(self, spent: int) -> int:
        """The newest generation ordered past this process's and past `spent` (the newest
        whose store prefix an attempt used: never tried again); raises RecoveryFailed."""

        def poll() -> int | None:
            ordered = self.ctx.ordered
            return ordered if ordered > max(self.ctx.generation, spent) else None

        try:
            return wait_until(poll, self.timeouts.order_s, "a recovery order from the agent",
                              clock=self._clock, sleep=self._sleep)  # fmt: skip
        except StoreTimeout as err:
            raise RecoveryFailed(str(err)) from err

    def report_holdings(self, generation: int, report: HoldingsReport) -> None:
        self.ctx.put(keys.holdings(self.ctx.job, generation, self.rank), report)
        h = report.holdings
        log.info(
            "generation %d: holding snapshots %s and replicas %s",
            generation, sorted(h.snapshots), {o: sorted(i) for o, i in h.replicas.items()},
        )  # fmt: skip

    def await_plan(self, generation: int) -> PlanDecision:
        """The agent's decision for `generation`, which holds a plan; raises RecoveryFailed
        (no plan, or none in time) or Superseded."""
        try:
            decision = self.ctx.wait_for(
                keys.recovery_plan(self.ctx.job, generation), PlanDecision,
                self.timeouts.plan_s, f"the plan of generation {generation}",
                interrupt=lambda: self.superseded(generation, "waiting for its plan"),
                clock=self._clock, sleep=self._sleep,
            )  # fmt: skip
        except StoreTimeout as err:
            raise RecoveryFailed(str(err)) from err
        if decision.plan is None:
            raise RecoveryFailed(decision.unrecoverable or decision.finished or "unrecoverable")
        return decision

    def superseded(self, generation: int, where: str) -> None:
        """Raise Superseded if a generation newer than `generation` was ordered."""
        ordered = self.ctx.ordered
        if ordered > generation:
            raise Superseded(f"generation {ordered} was ordered while {where} of {generation}")

    def rendezvous(self, generation: int) -> None:
        """Everyone of the generation is here: only then build groups (a gloo rendezvous
        waiting for a dead process cannot be interrupted; this wait can)."""
        job = self.ctx.job
        self.ctx.put(keys.arrived(job, generation, self.rank), Flag(str(self.rank)))
        waiting = set(range(self.world_size))

        def poll() -> bool | None:
            self.superseded(generation, "meeting for the rendezvous")
            waiting.difference_update(
                {r for r in waiting if self.ctx.get(keys.arrived(job, generation, r), Flag)}
            )
            return True if not waiting else None

        try:
            wait_until(poll, self.timeouts.rendezvous_s, f"the rendezvous of generation "
                       f"{generation}", clock=self._clock, sleep=self._sleep)  # fmt: skip
        except StoreTimeout as err:
            raise RecoveryFailed(f"ranks {sorted(waiting)} never joined: {err}") from err
