"""A spare process: registers with the job's store, warms up, and waits idle for the job's end.

While idle it pays in advance what a hot-swap would otherwise pay: the imports of torch and
megatron-core and the CPU backend's routing (several seconds per process here). When the
launcher claims it for a failed rank, it finds its assignment (rank, generation) in the store
and becomes that rank: it joins the generation's communicators and receives the rank's state
(megatron/worker.py, recovery/hotswap.py).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time

from ..events import SPARE_REGISTERED, EventLog
from ..runtime import ROLE_WORKER, ProcessEnv
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


def run_spare(env: ProcessEnv, cfg, poll_s: float = 0.05) -> int:
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
    spare_id = f"spare-{env.spare_index}"
    while not client.job_finished():
        raw = client.kv.get(keys.assignment(env.job_id, spare_id))
        if raw is not None:
            order = json.loads(raw)
            log.info(
                "spare %d claimed: takes over rank %d in generation %d",
                env.spare_index, order["rank"], order["generation"],
            )  # fmt: skip
            events.close()
            from ..megatron.worker import run_worker

            worker_env = dataclasses.replace(env, rank=order["rank"], role=ROLE_WORKER)
            return run_worker(cfg, worker_env, takeover=(client, order["generation"]))
        time.sleep(poll_s)
    client.close()
    log.info("spare %d: job finished, exiting", env.spare_index)
    return 0
