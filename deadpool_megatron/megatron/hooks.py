"""Wire DeadPool's protection pipeline into a megatron-core training job.

The training loop calls `pipeline.after_step(iteration)` at one place, after the optimizer
step; everything else (the fence before the next optimizer step, the replication group) is
set up here.
"""

from __future__ import annotations

import torch.distributed as dist

from ..checkpoint.pipeline import ProtectionPipeline
from ..checkpoint.transport import GlooTransport
from ..config import JobConfig
from ..runtime import ProcessEnv
from ..topology import Topology
from . import parallel
from .model import TrainState
from .shard import RankState


def build_pipeline(
    cfg: JobConfig, state: TrainState, env: ProcessEnv, on_gpu: bool, generation: int = 0
) -> ProtectionPipeline:
    p = cfg.parallel
    world = dist.get_world_size()
    rank = dist.get_rank()
    topo = Topology(world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size)
    group = parallel.ring_group(topo)
    k = cfg.deadpool.deadpool_replicas
    coords = topo.coords(rank)
    rank_state = RankState(state.model, state.optimizer, state.scheduler)
    shard_sizes: list[int] = [0] * world
    dist.all_gather_object(shard_sizes, rank_state.layout.optimizer_nbytes)
    predecessors = topo.ring_predecessors(rank, k)
    return ProtectionPipeline(
        rank_state,
        GlooTransport(group),
        successors=topo.ring_successors(rank, k),
        predecessors=predecessors,
        replica_nbytes={p: shard_sizes[p] for p in predecessors},
        use_cuda=on_gpu,
        snapshot_interval=cfg.deadpool.deadpool_snapshot_interval,
        local_ranks=env.local_world_size,
        metadata={
            "coordinates": (coords.tp, coords.pp, coords.dp),
            "generation": generation,
            "global_batch_size": cfg.training.global_batch_size,
        },
    )
