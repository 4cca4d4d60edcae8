"""A spare process: registers with the job's store, warms up, and waits idle for a claim or the
job's end.

While idle it pays in advance what a hot-swap would otherwise pay: the imports of torch and
megatron-core and the CPU backend's routing (several seconds per process here), and the host
memory of its protection buffers (`reserve.py`). When the
agent claims it for a failed rank, it finds its assignment (rank, generation) in the store and
becomes that rank: it joins the generation's communicators and receives the rank's state
(process/worker.py, recovery/stages.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

from ..control import keys
from ..control.client import ControlClient, connect
from ..control.messages import SpareAssignment, spare_id
from ..errors import DeadpoolError
from ..events import SPARE_REGISTERED, EventLog
from ..runtime import ROLE_WORKER, ProcessEnv, freeze_imports
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


def run_spare(env: ProcessEnv, cfg, poll_s: float = 0.05, become=None) -> int:
    """Idle until claimed, then `become(worker_env, takeover)` the claimed rank (by default
    our own worker; a patched Megatron-LM passes its own)."""
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

    reserve = SpareReserve(client.footprint, env.world_size)

    def finished() -> None:
        if client.job_finished():
            raise JobFinished("the job finished")
        reserve.poll()

    try:
        order = ctx.wait_for(keys.assignment(ctx.job, me), SpareAssignment, interrupt=finished,
                             interval_s=poll_s)  # fmt: skip
    except JobFinished:
        client.close()
        log.info("spare %d: job finished, exiting", env.spare_index)
        return 0
    log.info(
        "spare %d claimed: takes over rank %d in generation %d",
        env.spare_index, order.rank, order.generation,
    )  # fmt: skip
    client.stop_heartbeats()  # it beats as its rank once the takeover is warm
    from .worker import Takeover, run_worker

    worker_env = dataclasses.replace(env, rank=order.rank, role=ROLE_WORKER)
    takeover = Takeover(ctx, client, order.generation, reserve.arena)
    if become is not None:
        return become(worker_env, takeover)
    return run_worker(cfg, worker_env, takeover)
