"""A worker's watch over itself, besides the in-memory checkpoint: heartbeats (after warm-up),
device health checks, fault injection, the failures it reports, and the hooks it hands the
training loop (stop at a phase boundary when a recovery was ordered; inject a fault)."""

from __future__ import annotations

import logging
import threading
import time
from functools import partial

import torch

from ..config import JobConfig
from ..control import keys
from ..control.client import ControlClient
from ..control.context import JobContext
from ..control.messages import COLLECTIVE_ERROR, CUDA_ERROR, HEALTH_CHECK, INJECTED_TRANSIENT
from ..events import FAULT_INJECTED, EventLog
from ..failure.evidence import cuda_error_recoverable
from ..failure.health import HealthCheck, HealthChecker
from ..failure.inject import Fault, parse_faults
from ..failure.injector import FaultInjector, InjectedFault
from ..failure.progress import ProgressBoard
from ..recovery.stages import RecoveryOrdered
from ..runtime import ProcessEnv

log = logging.getLogger("deadpool.worker")
# How long ranks failing together at one point wait for each other (inject.companions).
TOGETHER_TIMEOUT_S = 20.0


class Guard:
    def __init__(
        self,
        cfg: JobConfig,
        env: ProcessEnv,
        ctx: JobContext,
        client: ControlClient,
        progress: ProgressBoard,
    ):
        self.cfg = cfg
        self.rank = env.rank
        self.ctx = ctx
        self.client = client
        self.progress = progress
        self.events = EventLog(cfg.deadpool.deadpool_event_log, env.rank, lambda: ctx.generation)
        self.injector = _injector(cfg, env, self._injected, client.claim_fault,
                                  together=partial(_strike_together, client, env.rank))  # fmt: skip
        self.health: HealthChecker | None = None  # started after warm-up, with the heartbeats
        self._report_lock = threading.Lock()
        self._reported_in: int | None = None  # the generation this process last reported in

    # -- the training loop's hooks --------------------------------------------------------------
    def check_stop(self) -> None:
        """Raise RecoveryOrdered when a recovery was ordered (at every phase boundary)."""
        if self.ctx.stopping:
            raise RecoveryOrdered(f"recovery into generation {self.ctx.ordered} ordered")

    def inject(self, iteration: int, phase: str) -> None:
        self.injector.fire(iteration, phase)

    def fault_due(self, iteration: int, phase: str) -> bool:
        return self.injector.due(iteration, phase)

    def before_send(self, iteration: int) -> bool:
        """The replication thread is about to send `iteration` (fault phase "replicate");
        True: send it corrupted."""
        return self.injector.fire(iteration, "replicate")

    def after_warmup(self, on_gpu: bool) -> None:
        """Heartbeats and health checks, from the end of the first iteration on (imports and
        the first model build starve threads of the GIL for seconds). Idempotent."""
        dpc = self.cfg.deadpool
        if not dpc.deadpool:
            return
        self.client.start_heartbeats(
            dpc.deadpool_heartbeat_interval,
            key=lambda: keys.heartbeat(self.ctx.job, self.ctx.generation, self.rank),
            iteration=lambda: self.progress.read().iteration,
        )
        if self.health is None and dpc.deadpool_health_check_interval:
            device = torch.device("cuda", torch.cuda.current_device()) if on_gpu else "cpu"
            check = HealthCheck(torch.device(device))
            self.injector.on_unhealthy = check.break_device
            self.health = HealthChecker(check, dpc.deadpool_health_check_interval, self._unfit)
            self.health.start()

    # -- reports -------------------------------------------------------------------------------
    def report(self, err: BaseException) -> None:
        """A failure this process caught (training or replication thread), for the agent.

        The first report of a generation stands: what follows in the same generation is its
        consequence (the replication thread losing the connections the training thread's
        failure just shut down) and must not overwrite the cause the agent classifies by."""
        if self.ctx.stopping:
            return  # a recovery is under way: this error is its doing, not new evidence
        mark = self.progress.read()
        self._send(err, self.ctx.generation, (mark.iteration, mark.phase))

    def report_recovery(self, err: BaseException, generation: int, iteration: int) -> None:
        """This process's own error in the recovery into `generation` from a failure in
        `iteration`: evidence in that generation, which the agent watches since it ordered it
        (until the next order nothing else would tell it; it waited out its timeout)."""
        self._send(err, generation, (iteration, "recovery"))

    def _send(self, err: BaseException, generation: int, where: tuple[int, str]) -> None:
        with self._report_lock:
            if self._reported_in == generation:
                log.info("not reported (generation %d already has this process's report): "
                         "%s: %s", generation, type(err).__name__, err)  # fmt: skip
                return
            self._reported_in = generation
        message = f"{type(err).__name__}: {err}"
        kind = COLLECTIVE_ERROR
        if isinstance(err, InjectedFault):
            kind = INJECTED_TRANSIENT
        elif cuda_error_recoverable(message) is not None:
            kind = CUDA_ERROR
        self.client.report_failure(self.rank, kind, message, where=where, generation=generation)

    def _unfit(self, reason: str) -> None:
        log.error("health check failed: %s; reported to the agent", reason)
        self.client.report_failure(self.rank, HEALTH_CHECK, reason)

    def _injected(self, fault, at: float) -> None:
        self.client.report_injection(self.rank, str(fault), at)
        self.events.emit(FAULT_INJECTED, at=at, fault=str(fault))

    def failed(self, err: Exception) -> int:
        """Without --deadpool there is nothing to recover from: report what this process saw,
        stay alive and healthy, and let the agent end the job."""
        self.report(err)
        log.error("training failed: %s: %s; reported to the agent", type(err).__name__, err,
                  exc_info=err)  # where it failed: nothing recovers it to tell  # fmt: skip
        time.sleep(self.cfg.deadpool.deadpool_heartbeat_timeout + 30.0)
        return 1

    def close(self) -> None:
        if self.health is not None:
            self.health.stop()
        self.client.close()
        self.events.close()


def restart_faults(cfg: JobConfig, env: ProcessEnv, events: EventLog) -> FaultInjector:
    """--deadpool-inject for a process that no deadpool-launch watches (torchrun's restarts,
    the baseline users would pick): each fault fires in the first attempt only (a restarted
    attempt replays the failed iteration and must not fail again) and goes to the event log."""
    return _injector(
        cfg, env, lambda fault, at: events.emit(FAULT_INJECTED, at=at, fault=str(fault)),
        claim=lambda fault: env.restart_count == 0,
    )  # fmt: skip


def _injector(cfg: JobConfig, env: ProcessEnv, report, claim, together=None) -> FaultInjector:
    """This rank's faults from --deadpool-inject; a slow@ phase lasts three heartbeat timeouts."""
    return FaultInjector(
        parse_faults(cfg.deadpool.deadpool_inject or ""), env.rank, report, claim,
        slow_s=3 * cfg.deadpool.deadpool_heartbeat_timeout, together=together,
        world_size=env.world_size,
    )  # fmt: skip


def _strike_together(
    client: ControlClient, rank: int, fault: Fault, others: tuple[int, ...]
) -> tuple[int, ...]:
    """Ranks failing at one point wait for each other through the store (bounded: a rank
    that never gets there, say one waiting on this one's pipeline stage, is not waited for)."""
    return client.strike_together(f"{fault.iteration}:{fault.phase}", rank, others,
                                  timeout_s=TOGETHER_TIMEOUT_S)  # fmt: skip
