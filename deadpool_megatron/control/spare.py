"""A spare process: registers with the job's store and waits, idle, for the job to end.

Later this is where a spare pre-builds its model skeleton and waits to be claimed; for now it
only proves the launcher can keep spares alive beside the workers and end them cleanly.
"""

from __future__ import annotations

import datetime
import logging
import os
import time

from ..runtime import KEY_JOB_FINISHED, KEY_SPARE, ProcessEnv

log = logging.getLogger("deadpool.spare")


def run_spare(env: ProcessEnv, poll_s: float = 0.5) -> int:
    import torch.distributed as dist

    if env.master_port is None:
        log.error("a spare needs the launcher's store (MASTER_PORT is unset)")
        return 2
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        is_master=False,
        timeout=datetime.timedelta(seconds=300),
        wait_for_workers=False,
    )
    store.set(KEY_SPARE.format(index=env.spare_index), str(os.getpid()))
    log.info("spare %d registered (pid %d), idle", env.spare_index, os.getpid())
    while not store.check([KEY_JOB_FINISHED]):
        time.sleep(poll_s)
    log.info("spare %d: job finished, exiting", env.spare_index)
    return 0
