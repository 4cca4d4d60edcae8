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

import inspect
import logging
import multiprocessing
import os
import queue
import sys
import threading
import time
import types
from multiprocessing.managers import SyncManager

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

from ..agreement import agreed_checkpoint
from ..config import JobConfig
from ..errors import CheckpointError
from ..runtime import die_with_parent
from .cpu_backend import is_active as is_cpu
from .digest import inner_optimizers
from .model import TrainState
from .rng import capture_rng_state, restore_rng_state

log = logging.getLogger(__name__)

TRACKER = "latest_checkpointed_iteration.txt"
OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


def checkpoint_dir(root: str, iteration: int) -> str:
    return os.path.join(root, f"iter_{iteration:07d}")


def _tracker_text(root: str) -> str | None:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path) as fh:
        return fh.read().strip()


def latest_iteration(root: str) -> int | None:
    """The newest complete checkpoint's iteration, or None when there is none."""
    text = _tracker_text(root)
    if text is not None and not text.isdigit():
        raise CheckpointError(
            f"{os.path.join(root, TRACKER)} holds {text!r}, not an iteration number"
        )
    return None if text is None else int(text)


def tracked_iteration(root: str) -> int | None:
    """The iteration the tracker names, for Megatron-LM's checkpoints too (the same file); None
    without one, or when it names Megatron-LM's `release`."""
    text = _tracker_text(root)
    return int(text) if text is not None and text.isdigit() else None


def _find_checkpoint(root: str) -> int | str | None:
    """What this rank finds under --load: the newest complete checkpoint's iteration, None
    for none, or why what it found cannot be loaded."""
    try:
        iteration = latest_iteration(root)
    except CheckpointError as err:
        return str(err)
    path = None if iteration is None else checkpoint_dir(root, iteration)
    if path is not None and not os.path.isdir(path):
        return f"{os.path.join(root, TRACKER)} names iteration {iteration} but {path} is missing"
    return iteration


def _sharded_state_dict(state: TrainState, iteration: int, is_loading: bool) -> dict:
    sd: dict = {}
    if len(state.model) == 1:
        sd["model"] = state.model[0].module.sharded_state_dict()
    else:
        for i, chunk in enumerate(state.model):
            sd[f"model{i}"] = chunk.module.sharded_state_dict()
    sd["optimizer"] = state.optimizer.sharded_state_dict(
        sd, is_loading=is_loading, metadata=OPTIMIZER_METADATA
    )
    sd["opt_param_scheduler"] = state.scheduler.state_dict()
    sd["iteration"] = iteration
    ps = parallel_state
    sd["rng_state"] = ShardedObject(
        "rng_state",
        capture_rng_state(),
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


# megatron-core >= 0.17 defaults asynchronous saves to nvidia-resiliency-ext's writer; this file
# drives megatron-core's own AsyncCallsQueue, so it asks for that one where there is a choice.
_MCORE_ASYNC = (
    {"async_strategy": "mcore"}
    if "async_strategy" in inspect.signature(dist_checkpointing.save).parameters
    else {}
)


def install_results_queue(async_save: bool) -> None:
    """Give megatron-core's writer a fresh queue for the write results of the next save (it
    takes the module's at each save's start), before it makes its own: a multiprocessing
    Manager's, spawned, whose server unpickles every result (its first imports
    torch.distributed.checkpoint) and runs the parent's __main__ again before it serves (the
    training script, with its torch and megatron-core imports). Measured with the demo's
    PP2 x DP2: the first save took 7.5 s, the next 0.25 s.

    A synchronous save writes and reads its results in this process: a plain queue.Queue does.
    An asynchronous one writes them from megatron-core's background process, so it keeps a
    Manager, started here with an empty __main__ (0.14 s and 22 MiB instead of 6.9 s and
    422 MiB) and killed by the kernel with its worker: megatron-core's own is stopped only by
    its finalizer, so a worker killed outright orphaned it for the rest of the job (measured
    under torchrun: one per restart, and the job's output pipe never closed). The kernel's
    signal follows the thread that started it, so only from the main thread (the training
    loop's). Fresh for each save: one that a recovery interrupted after its write and before
    its finalization (a barrier between them), or abandoned in flight, leaves its results in
    its queue, and the next save, reading the first item, would take them for its own."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not async_save:
        filesystem_async._results_queue = queue.Queue()
        return
    manager = getattr(getattr(filesystem_async, "_results_queue", None), "_manager", None)
    if manager is None:
        if threading.current_thread() is not threading.main_thread():
            return  # megatron-core starts its own
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        script = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            manager.start(initializer=die_with_parent)  # pickled by name: imports runtime only
        finally:
            sys.modules["__main__"] = script
    filesystem_async._results_queue = manager.Queue()


def save(
    cfg: JobConfig, state: TrainState, iteration: int, before_commit=None, async_queue=None
) -> str:
    """Collective: every rank writes its shard; the tracker moves only when all are done.
    `before_commit()` runs once the shards are written (fault injection: phase "save"). With
    an `AsyncCallsQueue` the shards are written by a background process and the commit runs
    when the queue finalizes the save (every rank, in step)."""
    root = cfg.checkpoint.save
    path = checkpoint_dir(root, iteration)
    start = time.perf_counter()
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    install_results_queue(cfg.checkpoint.async_save)  # the job's: a sync save may come first
    # One writer per rank: on a CPU node every core already runs a rank.
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, thread_count=1 if is_cpu() else 2)
    sharded = _sharded_state_dict(state, iteration, is_loading=False)
    if async_queue is not None:
        request = dist_checkpointing.save(
            sharded, path, sharded_strategy=strategy, async_sharded_save=True, **_MCORE_ASYNC
        )
        request.add_finalize_fn(lambda: _commit(root, iteration, path, start, before_commit))
        async_queue.schedule_async_request(request)
        return path
    dist_checkpointing.save(sharded, path, sharded_strategy=strategy)
    _commit(root, iteration, path, start, before_commit)
    return path


def _commit(root: str, iteration: int, path: str, start: float, before_commit) -> None:
    if before_commit is not None:
        before_commit()
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(root, TRACKER + ".tmp")
        with open(tmp, "w") as fh:
            fh.write(str(iteration))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, os.path.join(root, TRACKER))
    dist.barrier()
    log.log(
        logging.INFO if dist.get_rank() == 0 else logging.DEBUG,
        "saved checkpoint at iteration %d to %s in %.2f s",
        iteration, path, time.perf_counter() - start,
    )  # fmt: skip


def new_async_queue(cfg: JobConfig):
    """megatron-core's queue of asynchronous saves, when --async-save asks for one."""
    if not cfg.checkpoint.async_save:
        return None
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    return AsyncCallsQueue()


def load(cfg: JobConfig, state: TrainState) -> int:
    """Load the newest complete checkpoint under --load; returns its iteration (0: none).
    The ranks first agree on which one (`agreement.agreed_checkpoint`): a rank that found
    another, or none, would load something else, or wait alone in the load's collectives."""
    root = cfg.checkpoint.load
    found: list[int | str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, _find_checkpoint(root))
    iteration = agreed_checkpoint(root, found)
    if iteration is None:
        log.warning("no complete checkpoint under %s (no %s): starting from scratch", root, TRACKER)
        return 0
    path = checkpoint_dir(root, iteration)
    start = time.perf_counter()
    materialize_optimizer_state(state.optimizer)
    loaded = dist_checkpointing.load(_sharded_state_dict(state, iteration, is_loading=True), path)
    if len(state.model) == 1:
        state.model[0].module.load_state_dict(loaded["model"])
    else:
        for i, chunk in enumerate(state.model):
            chunk.module.load_state_dict(loaded[f"model{i}"])
    with torch.no_grad():  # the fp32 main params are views of leaves that require grad
        state.optimizer.load_state_dict(loaded["optimizer"])
    restore_adam_step(state.optimizer, loaded["optimizer"])
    state.scheduler.load_state_dict(loaded["opt_param_scheduler"])
    restore_rng_state(loaded["rng_state"])
    log.log(
        logging.INFO if dist.get_rank() == 0 else logging.DEBUG,
        "loaded checkpoint of iteration %d from %s in %.2f s",
        iteration, path, time.perf_counter() - start,
    )  # fmt: skip
    return int(loaded["iteration"])


def materialize_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state tensors so a checkpoint (or a restore) can be loaded
    into them.

    Before the first step torch's AdamW has no state (no `step`), and megatron-core's
    DistributedOptimizer.state_dict() asserts on it. torch's Adam and AdamW get the state their
    first step would create, as zeros (`fresh_adam_state`); any other optimizer takes a
    zero-gradient step, as megatron-core itself does for its FSDP path (on CPU, that step's
    arithmetic over every parameter was half of a recovery's model build; see
    scripts/bench_build.py). The load overwrites the state entirely, parameters included.
    """
    for megatron_opt in inner_optimizers(optimizer):
        torch_opt = megatron_opt.optimizer
        if any(torch_opt.state.get(p) for g in torch_opt.param_groups for p in g["params"]):
            continue
        if fresh_adam_state(torch_opt):
            continue
        for group in torch_opt.param_groups:
            for param in group["params"]:
                param.grad = torch.zeros_like(param)
        torch_opt.step()
        torch_opt.zero_grad()


def optimizer_state_ready(optimizer) -> bool:
    """Whether every inner optimizer holds its per-parameter state, so that a snapshot can
    capture it before the first step. A torch Adam/AdamW without any is given the state its
    first step would create (`fresh_adam_state`: the step then finds it and computes the
    same); any other optimizer is left as it is and answers False (the zero-gradient step
    `materialize_optimizer_state` takes would move its parameters under weight decay)."""
    ready = True
    for megatron_opt in inner_optimizers(optimizer):
        torch_opt = megatron_opt.optimizer
        held = [bool(torch_opt.state.get(p)) for g in torch_opt.param_groups for p in g["params"]]
        if all(held):
            continue
        ready = not any(held) and fresh_adam_state(torch_opt) and ready
    return ready


def fresh_adam_state(torch_opt: torch.optim.Optimizer) -> bool:
    """The per-parameter state torch's Adam/AdamW create at their first step (`_init_group`:
    `step` a float32 scalar, on the parameter's device only when fused or capturable, and
    zeroed moments), without the step's arithmetic; False for any other optimizer."""
    if type(torch_opt) not in (torch.optim.Adam, torch.optim.AdamW):
        return False
    for group in torch_opt.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            device = param.device if on_device else torch.device("cpu")
            state = torch_opt.state[param]
            state["step"] = torch.zeros((), dtype=torch.float32, device=device)
            for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")[: 3 if group["amsgrad"] else 2]:
                state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)
    return True


def release_writer_processes() -> None:
    """Stop the multiprocessing Manager of an asynchronous save's write results (a plain queue
    needs nothing): a separate, spawned process that only the Manager's finalizer stops, so a
    worker that leaves with os._exit would orphan it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    results = getattr(filesystem_async, "_results_queue", None)
    manager = getattr(results, "_manager", None)
    if manager is not None:
        manager.shutdown()
        filesystem_async._results_queue = None


def restore_adam_step(optimizer, loaded: dict) -> None:
    """Give every parameter its own, correct AdamW `step` after a load (torch-AdamW path).

    megatron-core's DistributedOptimizer.load_state_dict puts ONE shared `step` tensor into
    every parameter's state, which torch's AdamW then increments once per parameter per step,
    so the run silently diverges (FIELD-NOTES); and the in-place copies of the per-parameter
    state can leave the pre-load value in it. The step saved in the param groups is the truth
    (`own_adam_steps`).
    """
    inner = inner_optimizers(optimizer)
    per_optimizer = [loaded] if len(inner) == 1 else [loaded[i] for i in range(len(inner))]
    for megatron_opt, saved in zip(inner, per_optimizer):
        own_adam_steps(megatron_opt.optimizer, saved.get("optimizer", {}).get("param_groups", []))


def own_adam_steps(torch_opt: torch.optim.Optimizer, saved_groups: list[dict]) -> None:
    """Set each parameter's `step` in a torch Adam/AdamW's state to its own tensor holding the
    step that a DistributedOptimizer checkpoint's param groups (`saved_groups`) carry. torch's
    AdamW never reads the step there, so it is dropped again from the live groups (a run
    resumed from a checkpoint holds the same param groups as one that never stopped). Nothing
    changes where the groups carry no step, or the state holds none per parameter (TE/apex
    FusedAdam keeps its step in the param groups)."""
    steps = {g["step"] for g in saved_groups if "step" in g}
    if not steps:
        return
    if len(steps) != 1:
        raise CheckpointError(f"checkpoint param groups disagree on the optimizer step: {steps}")
    step = float(steps.pop())
    for param_state in torch_opt.state.values():
        if "step" in param_state:
            param_state["step"] = torch.tensor(step, dtype=torch.float32)
    if any("step" in s for s in torch_opt.state.values()):
        for group in torch_opt.param_groups:  # the checkpoint format's copy, not state
            group.pop("step", None)
