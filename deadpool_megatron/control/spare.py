"""A spare process: registers with the job's store, warms up, and waits idle for the job's end.

While idle it pays in advance what a hot-swap would otherwise pay: the imports of torch and
megatron-core and the CPU backend's routing (several seconds per process here). The hot-swap
issue adds being claimed and taking over a failed rank's coordinates.
"""

from __future__ import annotations

import logging
import os
import time

from ..events import SPARE_REGISTERED, EventLog
from ..runtime import ProcessEnv
from . import keys
from .client import ControlClient

log = logging.getLogger("deadpool.spare")


def warm_up(force_cpu: bool) -> float:
    start = time.perf_counter()
    from ..megatron import cpu_backend

    if cpu_backend.should_activate(force_cpu):
        cpu_backend.activate()
    else:
        import megatron.core.models.gpt  # noqa: F401
    return time.perf_counter() - start


def run_spare(env: ProcessEnv, cfg, poll_s: float = 0.5) -> int:
    client = ControlClient(env, cfg.deadpool)
    events = EventLog(cfg.deadpool.deadpool_event_log)
    client.register_spare(env.spare_index)
    warm_s = warm_up(cfg.system.cpu)
    events.emit(SPARE_REGISTERED, spare=env.spare_index, pid=os.getpid(), warm_up_s=warm_s)
    log.info(
        "spare %d registered (pid %d), warmed up in %.1f s, idle",
        env.spare_index, os.getpid(), warm_s,
    )  # fmt: skip
    client.start_heartbeats(
        cfg.deadpool.deadpool_heartbeat_interval, keys.spare_heartbeat(env.job_id, env.spare_index)
    )
    while not client.job_finished():
        time.sleep(poll_s)
    client.close()
    log.info("spare %d: job finished, exiting", env.spare_index)
    return 0
