"""A spare process: registers with the job's store, warms up, and waits idle for a claim or the
job's end.

While idle it pays in advance what a hot-swap would otherwise pay: the imports of torch and
megatron-core and the CPU backend's routing (several seconds per process here), the host
memory of its protection buffers (`reserve.py`), and, with --deadpool-spare-prebuild, the
model and optimizer of the ranks it is likely to take over (`prebuilds.py`). When the
agent claims it for a failed rank, it finds its assignment (rank, generation) in the store and
becomes that rank: it joins the generation's communicators and receives the rank's state
(process/worker.py, recovery/stages.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

from ..control import keys
from ..control.client import ControlClient, connect
from ..control.context import JobContext
from ..control.membership import MembershipStore
from ..control.messages import SpareAssignment, spare_id
from ..errors import DeadpoolError
from ..events import SPARE_REGISTERED, EventLog
from ..runtime import ROLE_WORKER, ProcessEnv, freeze_imports
from .exit_signal import ExitSignal
from .prebuilds import SparePrebuilds
from .reserve import SpareReserve

log = logging.getLogger("deadpool.spare")


class JobFinished(DeadpoolError):
    """The job ended while this spare was idle."""


def warm_up(force_cpu: bool) -> float:
    start = time.perf_counter()
    from ..megatron import cpu_backend

    if cpu_backend.should_activate(force_cpu):
        cpu_backend.activate()
    else:
        import megatron.core.models.gpt  # noqa: F401
    freeze_imports()
    return time.perf_counter() - start


def run_spare(
    env: ProcessEnv, cfg, poll_s: float = 0.05, become=None, exit_signal: ExitSignal | None = None
) -> int:
    """Idle until claimed, then `become(worker_env, takeover, exit_signal)` the claimed rank
    (by default our own worker; a patched Megatron-LM passes its own). `exit_signal`: the
    process's --exit-signal-handler handler, None without the flag."""
    ctx = connect(env, cfg.deadpool)
    client = ControlClient(ctx, env.fault_scope)
    me = spare_id(env.spare_index)
    events = EventLog(cfg.deadpool.deadpool_event_log, None, lambda: ctx.generation)
    client.register_spare(env.spare_index)
    warm_s = warm_up(cfg.system.cpu)
    events.emit(SPARE_REGISTERED, spare=env.spare_index, pid=os.getpid(), warm_up_s=warm_s)
    events.close()
    log.info(
        "spare %d registered (pid %d), warmed up in %.1f s, idle",
        env.spare_index, os.getpid(), warm_s,
    )  # fmt: skip
    client.start_heartbeats(
        cfg.deadpool.deadpool_heartbeat_interval,
        key=lambda: keys.spare_heartbeat(ctx.job, me),
        iteration=lambda: 0,
    )

    # SIGTERM while idle (the agent stopping its children, or Slurm signalling every process
    # of a step): leave cleanly, status 0, which the pool does not replace.
    stop = exit_signal if exit_signal is not None else ExitSignal()
    reserve = SpareReserve(client.footprint, env.world_size)
    prebuilds = spare_prebuilds(cfg, env, client) if become is None else None

    chores = [reserve.poll] + ([prebuilds.poll] if prebuilds is not None else [])
    idle = IdleWatch(me, stop, MembershipStore(ctx.kv, ctx.job), client.job_finished, chores)
    try:
        order = wait_for_assignment(ctx, me, idle, poll_s)
    except JobFinished as why:
        client.close()
        log.info("spare %d: %s, exiting", env.spare_index, why)
        return 0
    if exit_signal is None:
        stop.restore()  # without --exit-signal-handler, SIGTERM ends a worker
    # else the worker keeps the same handler: a SIGTERM that came while this spare was claimed
    # is the worker's too, and none can come in between and kill it.
    log.info(
        "spare %d claimed: takes over rank %d in generation %d",
        env.spare_index, order.rank, order.generation,
    )  # fmt: skip
    client.stop_heartbeats()  # it beats as its rank once the takeover is warm
    from .worker import Takeover, run_worker

    worker_env = dataclasses.replace(env, rank=order.rank, role=ROLE_WORKER)
    prebuilt = prebuilds.take(order.rank) if prebuilds is not None else None
    takeover = Takeover(ctx, client, order.generation, reserve.arena, prebuilt)
    if become is not None:
        return become(worker_env, takeover, exit_signal)
    return run_worker(cfg, worker_env, takeover, exit_signal)


class IdleWatch:
    """What an idle spare looks at between its looks for an assignment: SIGTERM, the job's
    end, and the work it does while idle (`chores`). Raises JobFinished to stop waiting."""

    def __init__(
        self, me: str, stop: Callable[[], bool], membership: MembershipStore,
        job_finished: Callable[[], bool], chores: list[Callable[[], None]],
    ):  # fmt: skip
        self.me = me
        self._stop = stop
        self._membership = membership
        self._job_finished = job_finished
        self._chores = chores
        self.claimed = False  # a recovery holds this spare: it must take its rank over

    def __call__(self) -> None:
        # SIGTERM: withdraw by the key a claim takes, so that a recovery either has this spare
        # or never will. Claimed already: take the rank over once the assignment comes (a
        # recovery in flight must end for the workers to stop and save); that worker stops
        # with the rest.
        if self._stop() and not self.claimed:
            self.claimed = not self._membership.withdraw_spare(self.me)
            if not self.claimed:
                raise JobFinished("stopped by SIGTERM")
        if self._job_finished():
            raise JobFinished("job finished")
        for chore in self._chores:
            chore()


def wait_for_assignment(
    ctx: JobContext, me: str, idle: IdleWatch, poll_s: float,
    clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
) -> SpareAssignment:  # fmt: skip
    """The rank a recovery gives spare `me`, once its assignment is written; JobFinished
    when `idle` ends the wait first."""
    return ctx.wait_for(keys.assignment(ctx.job, me), SpareAssignment, interrupt=idle,
                        interval_s=poll_s, clock=clock, sleep=sleep)  # fmt: skip


def spare_prebuilds(cfg, env: ProcessEnv, client: ControlClient) -> SparePrebuilds | None:
    """The builds this spare makes while idle (--deadpool-spare-prebuild), or None."""
    count = cfg.deadpool.deadpool_spare_prebuild
    if not count:
        return None
    from ..megatron.prebuild import prebuild
    from ..recovery.placement import fitting_ranks, prebuild_targets, spare_slot
    from ..topology import job_topology

    topo = job_topology(env.world_size, cfg.parallel, env.local_world_size)
    distopt = cfg.parallel.use_distributed_optimizer
    slot = spare_slot(env.local_rank, env.local_world_size)
    return SparePrebuilds(
        prebuild_targets(topo, env.node, slot, count, distopt),
        build=lambda rank: prebuild(cfg, rank, env.world_size),
        fits=lambda rank: fitting_ranks(topo, rank, distopt),
        publish=lambda ranks: client.publish_prebuilt(env.spare_index, ranks),
    )
