"""torch.distributed and megatron-core parallel_state set-up and teardown.

Kept in one place because a recovery tears these down and builds them again on a fresh store
prefix: every group this job uses is created here.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import logging
import os
import random
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from ..config import JobConfig
from ..control.c10d import StoppableStore, poll_cap
from ..runtime import ENV_GROUP_PER_ROLE
from ..topology import Topology
from . import cpu_backend, groups

log = logging.getLogger(__name__)


def connect_store(
    host: str, port: int, world_size: int, timeout_s: float = 300.0, host_it: bool = False
) -> dist.TCPStore:
    """Client connection to the TCPStore the launcher (or torchrun's agent) hosts; with
    `host_it`, this process hosts it (rank 0 under torchrun with an unshared store)."""
    return dist.TCPStore(
        host,
        port,
        world_size=None,
        is_master=host_it,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def init_distributed(
    cfg: JobConfig, rank: int, world_size: int, store: dist.Store, prefix: str = "gen0",
    stop: Callable[[], None] | None = None,
) -> bool:  # fmt: skip
    """Create the default process group and megatron-core's groups. Returns True on a GPU.
    `stop`: raises once a recovery is ordered; the groups' rendezvous then gives up waiting
    for a peer (control/c10d.StoppableStore; for generation 0's, which no rendezvous of the
    recovery's own precedes)."""
    on_gpu = not cpu_backend.should_activate(cfg.system.cpu)
    share_gloo_device()
    backend = "nccl" if on_gpu else "gloo"
    meet: dist.Store = dist.PrefixStore(prefix, store)
    if stop is not None:
        meet = StoppableStore(meet, stop, 60.0 * cfg.system.distributed_timeout_minutes,
                              poll_cap(world_size))  # fmt: skip
        _python_stores[:] = [meet]
    _init(cfg, rank, world_size, meet, backend, on_gpu)
    return on_gpu


# The Python store the default group was given, kept alive as long as that group (until
# destroy_distributed): torch keeps only its C++ half, and a group created later (the replica
# ring's edges) would call into a Python object already collected ("Not implemented").
_python_stores: list[dist.Store] = []


def init_stand_in(cfg: JobConfig, rank: int, world_size: int) -> bool:
    """Stand-in groups for `rank` of `world_size`, in a process with no peers: torch's "fake"
    backend, whose collectives return at once and move nothing. megatron-core then builds what
    it builds for that rank (megatron/prebuild.py). Returns True on a GPU. The backend is
    registered by torch's module of it, imported here (megatron-core happens to import it
    through torch's FSDP utilities; that is not relied on)."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 (registers "fake")

    on_gpu = not cpu_backend.should_activate(cfg.system.cpu)
    _init(cfg, rank, world_size, dist.HashStore(), "fake", on_gpu)
    return on_gpu


def _init(
    cfg: JobConfig, rank: int, world_size: int, store: dist.Store, backend: str, on_gpu: bool
) -> None:
    if on_gpu:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        cpu_backend.activate()
    timeout = datetime.timedelta(minutes=cfg.system.distributed_timeout_minutes)
    dist.init_process_group(
        backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
    )
    vp_layers = cfg.parallel.num_layers_per_virtual_pipeline_stage
    vp = None
    if vp_layers is not None:
        vp = cfg.model.num_layers // (cfg.parallel.pipeline_model_parallel_size * vp_layers)
    share = backend == "gloo" and os.environ.get(ENV_GROUP_PER_ROLE) != "1"
    with one_group_per_rank_list(timeout, enabled=share):
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=cfg.parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=cfg.parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=vp,
            # as given: a whole number of minutes gave megatron-core's groups another timeout
            # than the default group's (0.5 became 1), and a role over every rank a group
            # of its own instead of the default group (one_group_per_rank_list's key)
            distributed_timeout_minutes=cfg.system.distributed_timeout_minutes,
            **supported_kwargs(
                parallel_state.initialize_model_parallel, create_gloo_process_groups=gloo_twins()
            ),
        )
    if backend != "fake":
        named = groups.named_groups()
        world = named.pop(groups.WORLD)
        mine = {id(g) for g in named.values() if g is not world and dist.get_rank(g) >= 0}
        log.info("process groups: %d roles in %d group(s) besides the default one%s",
                 len(named), len(mine), "" if share else f" ({ENV_GROUP_PER_ROLE}=1)")  # fmt: skip
    if not on_gpu:
        cpu_backend.patch_loaded_modules()
    set_random_seed(cfg.training.seed)


@contextlib.contextmanager
def one_group_per_rank_list(world_timeout: datetime.timedelta, enabled: bool = True):
    """While megatron-core creates its groups: one gloo group for every list of ranks, handed
    to each role that asks for the same list (and the default group for a list of every rank).

    megatron-core creates a group per role, and in a job without tensor, context or expert
    parallelism many roles have the same ranks: at TP1 x PP2 x DP16 a process is in 17 groups
    of 4 distinct rank lists (data-parallel, with and without context parallelism, tensor-and-
    data-parallel both ways and expert data-parallel are one list; seven groups of one; four of
    its pipeline pair; one of every rank, pipeline pair by pair): 110 gloo connections and 34
    worker threads beside the default group's 31 connections, made again by every recovery.
    Shared: 4 groups, 47 connections, 8 threads. A list of every rank in rank order is the
    default group's. A gloo group runs its operations in the order they are issued, which is
    program order on every member of an SPMD job, so roles that share one keep their order.
    Groups with options of their own (NCCL's), another backend or another timeout are made as
    asked (`world_timeout`: the default group's); roles that share a group each keep their
    name for a rebind (`groups.named_groups`)."""
    if not enabled:
        yield
        return
    new_group = dist.new_group
    world = dist.group.WORLD
    everyone = tuple(range(dist.get_world_size()))
    made: dict[tuple, object] = {}

    def shared(ranks=None, timeout=None, backend=None, pg_options=None, **rest):
        if ranks is None or pg_options is not None or backend not in (None, "gloo"):
            return new_group(ranks=ranks, timeout=timeout, backend=backend,
                             pg_options=pg_options, **rest)  # fmt: skip
        key = (tuple(ranks), timeout, rest.get("use_local_synchronization", False))
        if key[0] == everyone and timeout == world_timeout:
            return world
        if key not in made:
            made[key] = new_group(ranks=ranks, timeout=timeout, backend=backend, **rest)
        return made[key]

    # megatron-core may see torch.distributed through a view of it (cpu_backend): both.
    modules = {id(m): m for m in (dist, parallel_state.torch.distributed)}.values()
    for module in modules:
        module.new_group = shared
    try:
        yield
    finally:
        for module in modules:
            module.new_group = new_group


def share_gloo_device() -> None:
    """Make every gloo group this process creates from now on use one gloo device (listener
    and event loop) instead of one each.

    torch gives each gloo group a device of its own, and each device's event loop wakes every
    10 ms whether or not anything happens (measured: 95 epoll wake-ups a second per group).
    megatron-core creates some twenty groups per process (duplicates of one set of ranks and
    groups of one among them), and a recovery holds the left generation's beside the new one:
    1,600 wake-ups a second in one worker of a 32-process recovery on 2 cores (strace), and
    two thirds of the machine's CPU in the kernel while the recovery's own work waited. gloo's devices are meant to carry many
    contexts (a pair finds its peer's through the listener by sequence number); the groups
    keep their own connections and worker threads, only the listener and the loop are shared.
    Built as torch builds the default device (GLOO_SOCKET_IFNAME: one device per interface
    listed), once per process, the first time a group needs one."""
    c10d = dist.distributed_c10d
    base = c10d.ProcessGroupGloo
    if getattr(base, "deadpool_shared_device", False):
        return
    devices: list = []

    class SharedDeviceGloo(base):
        deadpool_shared_device = True

        def __init__(self, store, rank, size, timeout=datetime.timedelta(minutes=30)):
            if not devices:
                ifnames = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
                devices.extend([base.create_device(interface=i) for i in ifnames]
                               or [base.create_default_device()])  # fmt: skip
            options = base._Options()
            options._devices = list(devices)
            options._timeout = timeout
            options._threads = 2 * len(devices)  # torch's own choice
            super().__init__(store, rank, size, options)

    c10d.ProcessGroupGloo = SharedDeviceGloo


def gloo_twins() -> bool:
    """Whether megatron-core creates gloo twins of its data-parallel groups (and the optimizer
    is handed them). Not in a gloo job: its groups are gloo already, each twin is one more
    full mesh per DP group at every build and every recovery, and nothing here uses them (the
    checkpoints are dp_reshardable, which gathers nothing over them). Nor on stand-in groups
    (`init_stand_in`): gloo twins would wait for peers there are none of."""
    return dist.get_backend() not in ("gloo", "fake")


def supported_kwargs(fn, **kwargs) -> dict:
    """The keyword arguments `fn` takes (megatron-core versions differ)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def set_random_seed(seed: int) -> None:
    """Megatron-LM's seeding: one seed per pipeline stage, tracked model-parallel RNG states."""
    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()  # resets torch's count of unnamed groups
    else:
        # The default group's creation raised (a recovery order in its rendezvous): torch
        # had counted it, and the next one would be named "1" here and "0" in a spare, whose
        # rendezvous keys then never meet. Nothing else of it exists.
        dist.distributed_c10d._world.group_count = 0
    _python_stores.clear()


def coordinates() -> tuple[int, int, int]:
    """This rank's (tp, pp, dp) coordinates as megatron-core assigned them; dp counts context
    parallelism in, as the distributed optimizer's sharding and our topology do."""
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_data_parallel_rank(with_context_parallel=True),
    )


def expert_coordinates() -> tuple[int, int]:
    """This rank's (expert tensor-parallel, expert-parallel) ranks as megatron-core assigned
    them (0, 0 in a job without experts' parallelism)."""
    return (
        parallel_state.get_expert_tensor_parallel_rank(),
        parallel_state.get_expert_model_parallel_rank(),
    )


def host_group() -> dist.ProcessGroup:
    """A gloo group over every rank, for a recovery's host-memory transfers and checks.

    The state a recovery moves lives in host buffers; in an NCCL job the default group cannot
    carry CPU tensors, so a gloo group over every rank is created for them (collective over
    every rank). In a gloo job the default group is that group already: a second full mesh
    would cost every rank one connection per rank at each recovery for nothing (the
    separate-group path is tested on CPU with a default backend that moves nothing).
    """
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    return dist.new_group(ranks=list(range(dist.get_world_size())), backend="gloo")


def ring_pairs(topo: Topology, replicas: int) -> dict[int, dist.ProcessGroup]:
    """A gloo group of two for each ring edge of this rank (to its `replicas` successors and
    predecessors), keyed by the peer; owned by the replication thread alone.

    A group over a whole ring had every member connect to every other at each generation
    (a full mesh of DP size); an edge's group connects its two ranks only. Every rank calls
    `new_group` for every edge of the job, in one order (torch names groups by a per-process
    count, and local synchronization names them by the count of groups a process holds, which
    differs between the two ends), but only the two ranks of an edge connect; the others
    return at once (no barrier after creation unless TORCH_DIST_INIT_BARRIER=1). The one
    order also means no two creations wait on each other in a cycle, and it goes in rounds in
    which no rank has two edges (`Topology.ring_edges`), so that a round's pairs connect at
    once. megatron-core's DP group is not reused: a group is never shared between threads.
    """
    me = dist.get_rank()
    expected = dist.get_process_group_ranks(dp_group())
    if sorted(expected) != sorted(topo.dp_group(me)):
        raise RuntimeError(
            f"megatron-core's DP group {expected} differs from the ring "
            f"{topo.dp_group(me)}: unsupported rank order"
        )
    mine = {}
    for a, b in topo.ring_edges(replicas):
        group = dist.new_group(
            ranks=[a, b], backend="gloo", group_desc=f"DEADPOOL_RING_EDGE_{a}_{b}"
        )
        if me in (a, b):
            mine[b if me == a else a] = group
    return mine


def dp_group() -> dist.ProcessGroup:
    """megatron-core's data-parallel group of this rank (its ring's members), for the training
    thread's own exchanges at set-up: with context parallelism, the group the distributed
    optimizer shards over (data and context parallel; written, not run: context parallelism
    needs transformer-engine's attention, which a CPU has not)."""
    return parallel_state.get_data_parallel_group(with_context_parallel=True)
