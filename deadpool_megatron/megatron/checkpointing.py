"""Persistent checkpoints with megatron.core.dist_checkpointing (torch_dist format).

Layout follows Megatron-LM: SAVE/iter_0000010/ per checkpoint and
SAVE/latest_checkpointed_iteration.txt, written (atomically, by rename) only after every rank
finished its part, so a job that dies while saving leaves the previous checkpoint as the
newest complete one. A checkpoint holds the model, the distributed optimizer state
(`dp_reshardable`), the LR scheduler, the iteration (which fixes the data position: batches are
a pure function of the iteration) and every RNG state, so a resumed run continues bitwise
identically.
"""

from __future__ import annotations

import logging
import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from ..config import JobConfig
from ..errors import CheckpointError
from .digest import inner_optimizers
from .model import TrainState

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def latest_iteration(root: str) -> int | None:
    """The newest complete checkpoint's iteration, or None when there is none."""
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path).read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path} holds {text!r}, not an iteration number")
    return int(text)


def _rng_state() -> dict:
    return {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }


def _set_rng_state(state: dict) -> None:
    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _sharded_state_dict(state: TrainState, iteration: int, is_loading: bool) -> dict:
    sd: dict = {}
    if len(state.model) == 1:
        sd["model"] = state.model[0].sharded_state_dict()
    else:
        for i, chunk in enumerate(state.model):
            sd[f"model{i}"] = chunk.sharded_state_dict()
    sd["optimizer"] = state.optimizer.sharded_state_dict(
        sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    sd["opt_param_scheduler"] = state.scheduler.state_dict()
    sd["iteration"] = iteration
    ps = parallel_state
    sd["rng_state"] = ShardedObject(
        "rng_state",
        _rng_state(),
        (
            ps.get_pipeline_model_parallel_world_size(),
            ps.get_tensor_model_parallel_world_size(),
            ps.get_data_parallel_world_size(),
        ),
        (
            ps.get_pipeline_model_parallel_rank(),
            ps.get_tensor_model_parallel_rank(),
            ps.get_data_parallel_rank(),
        ),
        replica_id=0,
    )
    return sd


def save(cfg: JobConfig, state: TrainState, iteration: int) -> str:
    """Collective: every rank writes its shard; the tracker moves only when all are done."""
    root = cfg.checkpoint.save
    path = checkpoint_dir(root, iteration)
    start = time.perf_counter()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded_state_dict(state, iteration, is_loading=False), path)
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as fh:
            fh.write(str(iteration))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    log.info(
        "saved checkpoint at iteration %d to %s in %.2f s",
        iteration, path, time.perf_counter() - start,
    )  # fmt: skip
    return path


def load(cfg: JobConfig, state: TrainState) -> int:
    """Load the newest complete checkpoint under --load; returns its iteration (0: none)."""
    root = cfg.checkpoint.load
    iteration = latest_iteration(root)
    if iteration is None:
        log.warning("no complete checkpoint under %s (no %s): starting from scratch", root, TRACKER)
        return 0
    path = checkpoint_dir(root, iteration)
    if not os.path.isdir(path):
        raise CheckpointError(f"{os.path.join(root, TRACKER)} names iteration {iteration} but {path} is missing")
    start = time.perf_counter()
    loaded = dist_checkpointing.load(_sharded_state_dict(state, iteration, is_loading=True), path)
    if len(state.model) == 1:
        state.model[0].load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(state.model):
            chunk.load_state_dict(loaded[f"model{i}"])
    state.optimizer.load_state_dict(loaded["optimizer"])
    unshare_adam_step(state.optimizer)
    state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    _set_rng_state(loaded["rng_state"])
    log.info(
        "loaded checkpoint of iteration %d from %s in %.2f s",
        iteration, path, time.perf_counter() - start,
    )  # fmt: skip
    return int(loaded["iteration"])


def unshare_adam_step(optimizer) -> None:
    """Work around megatron-core giving every parameter ONE shared `step` tensor on load.

    torch's AdamW increments `step` once per parameter per iteration, so a shared tensor
    advances N times per step and the run silently diverges (FIELD-NOTES).
    """
    for megatron_opt in inner_optimizers(optimizer):
        for param_state in megatron_opt.optimizer.state.values():
            step = param_state.get("step")
            if torch.is_tensor(step):
                param_state["step"] = step.clone()
