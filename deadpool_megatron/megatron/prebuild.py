"""An idle spare's model, DDP and optimizer for a rank it may take over, built before any
claim, so that taking the rank over costs a swap of process groups instead of a build.

The build runs on stand-in groups (`parallel.init_stand_in`: torch's "fake" backend, the job's
world size, this process as the target rank), so megatron-core builds exactly what it builds
for that rank (its layers, shapes, DDP buckets and the distributed optimizer's shard) without
a peer. What the build's collectives would have moved is either overwritten by the restore
(the shared embedding's all-reduce) or the same on every rank (the parameter-group keys the
optimizer gathers: every rank of one GPT has the same). At the claim the state is handled as a
survivor's kept one (recovery/stages.py): rebound to the new generation's groups
(megatron/rebind.py), its hooks put back, and its build's collectives replayed if any peer
builds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch.distributed as dist

from ..config import JobConfig
from . import parallel
from .build_calls import unreplayable
from .checkpointing import materialize_optimizer_state
from .groups import group_roles
from .model import TrainState, build_train_state, unhook
from .rebind import CannotRebind, unrebindable


@dataclass
class Prebuilt:
    """A rank's state built while idle, with its gradient hooks cut off until it is rebound
    (`model.unhook`), and the role of every stand-in group it holds (kept: their ids stay
    unique)."""

    rank: int
    state: TrainState
    hooks: list[dict]
    roles: dict[int, tuple[str, dist.ProcessGroup]]
    build_s: float


def prebuild(cfg: JobConfig, rank: int, world_size: int) -> Prebuilt:
    """Build `rank`'s state on stand-in groups (torch.distributed is torn down again after).
    Raises CannotRebind if it could not be rebound or its build replayed later."""
    start = time.perf_counter()
    on_gpu = parallel.init_stand_in(cfg, rank, world_size)
    try:
        state = build_train_state(cfg, on_gpu, initialize=False)
        materialize_optimizer_state(state.optimizer)
        roles = group_roles()
        why = unreplayable(state.build_calls) or unrebindable(state, roles)
        if why:
            raise CannotRebind(f"the state built for rank {rank} could not be rebound: {why}")
        hooks = unhook(state)
    finally:
        parallel.destroy_distributed()
    return Prebuilt(rank, state, hooks, roles, time.perf_counter() - start)
