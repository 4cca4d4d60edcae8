"""Rebuild every communicator in place and roll this rank back to its own host snapshot.

A recovery tears down torch.distributed and every megatron-core group, and builds them again
on a fresh store prefix (one per generation). Rather than hunting for every object that holds
a group (model modules, DDP buffers and buckets, the distributed optimizer, the pipeline's
p2p communicator, the replication ring), the model, optimizer and protection pipeline are
built anew against the new groups and the state is written back from the host snapshot, which
survives the teardown: nothing built before the recovery stays reachable from training.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from ..checkpoint.restore import restore_from_snapshot
from ..config import JobConfig
from ..megatron import parallel
from ..megatron.checkpointing import materialize_optimizer_state
from ..megatron.hooks import build_pipeline
from ..megatron.model import build_train_state
from ..megatron.shard import RankState
from ..runtime import ProcessEnv

log = logging.getLogger("deadpool.recovery")


def rebuild_in_place(
    cfg: JobConfig, env: ProcessEnv, store: dist.Store, trainer, generation: int
) -> dict[str, float]:
    """Every live rank calls this together; returns the phase durations in seconds."""
    phases: dict[str, float] = {}
    start = time.perf_counter()
    old = trainer.pipeline
    old.close()  # agreed stop: every rank of the ring takes part
    slot = old.snapshotter.slots.committed()  # host memory: survives the teardown
    trainer.pipeline = None
    parallel.destroy_distributed()
    phases["teardown"] = time.perf_counter() - start
    t = time.perf_counter()
    on_gpu = parallel.init_distributed(
        cfg, env.rank, env.world_size, store, prefix=f"gen{generation}"
    )
    phases["rebuild_communicators"] = time.perf_counter() - t
    t = time.perf_counter()
    state = build_train_state(cfg, on_gpu)
    materialize_optimizer_state(state.optimizer)  # the snapshot overwrites it entirely
    trainer.attach(state)
    phases["rebuild_model"] = time.perf_counter() - t
    t = time.perf_counter()
    trainer.iteration = restore_from_snapshot(
        RankState(state.model, state.optimizer, state.scheduler), slot
    )
    trainer.pipeline = build_pipeline(cfg, state, env, on_gpu, generation)
    phases["restore"] = time.perf_counter() - t
    log.info(
        "generation %d: communicators rebuilt, rolled back to iteration %d (%s)",
        generation, trainer.iteration, ", ".join(f"{k} {v:.3f} s" for k, v in phases.items()),
    )  # fmt: skip
    return phases
