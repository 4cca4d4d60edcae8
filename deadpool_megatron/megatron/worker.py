"""One worker process from start to finish: store, process groups, model, (resume), train."""

from __future__ import annotations

import logging
import time

import psutil
import torch.distributed as dist

from ..config import JobConfig
from ..runtime import ProcessEnv
from . import checkpointing, parallel
from .model import build_train_state
from .training import Trainer

log = logging.getLogger("deadpool.worker")


def open_store(env: ProcessEnv) -> dist.Store:
    """The launcher's TCPStore; a private in-memory store for a single plain process."""
    if env.master_port is None:
        if env.world_size != 1:
            raise RuntimeError(
                f"WORLD_SIZE={env.world_size} but MASTER_PORT is unset; start the job with "
                "deadpool-launch (or set MASTER_ADDR/MASTER_PORT)"
            )
        return dist.HashStore()
    return parallel.connect_store(env.master_addr, env.master_port, env.world_size)


def run_worker(cfg: JobConfig, env: ProcessEnv) -> int:
    start = time.perf_counter()
    store = open_store(env)
    on_gpu = parallel.init_distributed(cfg, env.rank, env.world_size, store)
    tp, pp, dp = parallel.coordinates()
    log.info(
        "rank %d/%d up: tp=%d pp=%d dp=%d, backend %s",
        env.rank, env.world_size, tp, pp, dp, "nccl" if on_gpu else "gloo (CPU)",
    )  # fmt: skip
    state = build_train_state(cfg, on_gpu)
    trainer = Trainer(cfg, state, env.world_size, on_gpu)
    if cfg.checkpoint.load:
        trainer.iteration = checkpointing.load(cfg, state)
    if cfg.deadpool.deadpool:
        from .hooks import build_pipeline

        trainer.pipeline = build_pipeline(cfg, state, env, on_gpu)
    log.info(
        "ready to train %.1f s after process start (set-up %.1f s), from iteration %d",
        time.time() - psutil.Process().create_time(), time.perf_counter() - start,
        trainer.iteration,
    )  # fmt: skip
    trainer.train()
    c = cfg.checkpoint
    if c.save and (not c.save_interval or trainer.iteration % c.save_interval):
        checkpointing.save(cfg, state, trainer.iteration)
    if trainer.pipeline is not None:
        trainer.pipeline.close()
        log.info("protection: %s", trainer.protection_summary())
    trainer.finish()
    parallel.destroy_distributed()
    log.debug("worker done")
    return 0
