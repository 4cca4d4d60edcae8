"""Wire DeadPool's protection pipeline into a megatron-core training job.

The training loop calls `pipeline.after_step(iteration)` after the optimizer step; the fence
before the next step (megatron/fence.py), the replication ring's own group and the replica
sizes of every predecessor are set up here, once per generation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from ..checkpoint.buffers import Reusable
from ..checkpoint.pipeline import ProtectionPipeline
from ..checkpoint.transport import GlooTransport
from ..config import JobConfig
from ..megatron import gloo_ops, parallel
from ..megatron.exchange import all_gather_ints
from ..megatron.fence import step_fence_installer
from ..megatron.model import TrainState
from ..megatron.shard import RankState
from ..runtime import ProcessEnv
from ..topology import Topology


def build_pipeline(
    cfg: JobConfig,
    state: TrainState,
    env: ProcessEnv,
    on_gpu: bool,
    generation: int = 0,
    before_send: Callable[[int], bool | None] | None = None,
    on_error: Callable[[BaseException], None] | None = None,
    reuse: Reusable | None = None,
) -> ProtectionPipeline:
    """Collective over every ring: its edges' groups are created, then shard sizes exchanged
    on it. `reuse`: a recovery's slot pairs (see `Reusable`)."""
    p = cfg.parallel
    world = dist.get_world_size()
    rank = dist.get_rank()
    topo = Topology(
        world, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, env.local_world_size
    )
    k = cfg.deadpool.deadpool_replicas
    edges = parallel.ring_pairs(topo, k)
    coords = topo.coords(rank)
    rank_state = RankState(state.model, state.optimizer, state.scheduler)
    # Replica sizes over the ring's members (megatron's DP group, on this thread, before the
    # replication thread starts): every predecessor is one of them.
    ring = parallel.dp_group()
    sizes = all_gather_ints([rank_state.layout.optimizer_nbytes], ring)
    shard_sizes = {r: n for r, (n,) in zip(dist.get_process_group_ranks(ring), sizes, strict=True)}
    predecessors = topo.ring_predecessors(rank, k)
    return ProtectionPipeline(
        rank_state,
        GlooTransport(edges, gloo_ops.OpenWork),
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
        install_fence=step_fence_installer(state.optimizer),
        before_send=before_send,
        on_error=on_error,
        reuse=reuse,
    )
