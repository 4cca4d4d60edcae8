"""The contract between deadpool-launch and the processes it starts, declared once.

The launcher passes everything through environment variables (the names torchrun uses where
one exists), so a training script reads one `ProcessEnv` instead of scattered `os.environ`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os
import signal
import sys
from dataclasses import dataclass

ROLE_WORKER = "worker"
ROLE_SPARE = "spare"

ENV_ROLE = "DEADPOOL_ROLE"
ENV_SPARE_INDEX = "DEADPOOL_SPARE_INDEX"
ENV_JOB_ID = "DEADPOOL_JOB_ID"
ENV_PREFLIGHT = "DEADPOOL_PREFLIGHT"
ENV_PREFLIGHT_OUT = "DEADPOOL_PREFLIGHT_OUT"
ENV_SPARES = "DEADPOOL_SPARES"
# Injected faults fire once per job, across checkpoint-restarts too (which change the job id).
ENV_FAULT_SCOPE = "DEADPOOL_FAULT_SCOPE"
# The shared-memory record where the process marks its progress (failure/progress.py).
ENV_PROGRESS_FILE = "DEADPOOL_PROGRESS_FILE"
# "1": every megatron-core role gets a gloo group of its own, as megatron-core makes them
# (parallel.one_group_per_rank_list off), for a megatron-core that tells groups apart by identity.
ENV_GROUP_PER_ROLE = "DEADPOOL_GROUP_PER_ROLE"
# Where a process started through MPI_Comm_spawn writes its exit status as it ends: Open MPI's
# daemon, not the agent, is its parent and reaps it (agent/mpi_spawn.py).
ENV_EXIT_STATUS_FILE = "DEADPOOL_EXIT_STATUS_FILE"


@dataclass(frozen=True)
class ProcessEnv:
    role: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int | None
    spare_index: int | None
    job_id: str
    preflight: bool
    under_launcher: bool
    fault_scope: str = "local"
    progress_file: str | None = None
    restart_count: int = 0  # torchrun's TORCHELASTIC_RESTART_COUNT: 0 in the first attempt
    hosts_store: bool = False  # this process hosts the store at MASTER_PORT (see `from_environ`)
    node: int = 0  # GROUP_RANK: the launcher's node (spare nodes count after the worker nodes)

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> ProcessEnv:
        env = os.environ if environ is None else environ
        port = env.get("MASTER_PORT")
        spare = env.get(ENV_SPARE_INDEX)
        rank = int(env.get("RANK", "0"))
        restarts = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        job = env.get(ENV_JOB_ID)
        if job is None and "TORCHELASTIC_RUN_ID" in env:
            # Under torchrun the store outlives a restart: each attempt's process groups meet
            # under a prefix of their own, never at a dead attempt's addresses.
            job = f"torchrun-{env['TORCHELASTIC_RUN_ID']}-attempt{restarts}"
        # torchrun hosts the store in its agent unless told not to share it; then rank 0 hosts
        # it, as torch's own env:// rendezvous does.
        hosts = (
            "TORCHELASTIC_RUN_ID" in env
            and env.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
            and rank == 0
        )
        return cls(
            role=env.get(ENV_ROLE, ROLE_WORKER),
            rank=rank,
            world_size=int(env.get("WORLD_SIZE", "1")),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1"))),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(port) if port else None,
            spare_index=int(spare) if spare is not None else None,
            job_id=job or "local",
            preflight=env.get(ENV_PREFLIGHT) == "1",
            under_launcher=ENV_ROLE in env,
            fault_scope=env.get(ENV_FAULT_SCOPE, env.get(ENV_JOB_ID, "local")),
            progress_file=env.get(ENV_PROGRESS_FILE),
            restart_count=restarts,
            hosts_store=hosts,
            node=int(env.get("GROUP_RANK", "0")),
        )


def write_preflight(cfg) -> None:
    """Tell deadpool-launch the settings it acts on (heartbeats, faults, event log), and
    every flag as parsed ("flags": the agents of a multi-node job compare theirs)."""
    path = os.environ.get(ENV_PREFLIGHT_OUT)
    if path:
        with open(path, "w") as fh:
            json.dump(
                {
                    **dataclasses.asdict(cfg.deadpool),
                    "parallel": dataclasses.asdict(cfg.parallel),
                    "save": cfg.checkpoint.save,
                    "load": cfg.checkpoint.load,
                    "flags": cfg.flat(),
                },
                fh,
            )


_FORKS_FREEZE = False


def freeze_imports() -> None:
    """Leave everything alive now (torch's and megatron-core's modules, functions and tables:
    some 400,000 objects) out of every later garbage collection, so that the full collection
    after a recovery walks only what the job built since. Call once the imports are done and
    before any model is built (a frozen object is never collected).

    And a child this process forks without exec (a DataLoader worker) freezes all it
    inherits: the previous generation's garbage, not yet collected here, is not the child's
    to collect. Collected there, a left data iterator's finalizer shut down workers that are
    not the child's, and the child died of a segmentation fault (patched Megatron-LM, a
    pretrain() run again from the start: 4 runs of 4, once its flag parsing no longer
    allocated enough to set off a collection in the parent before the fork)."""
    global _FORKS_FREEZE
    gc.freeze()
    if not _FORKS_FREEZE:
        os.register_at_fork(after_in_child=gc.freeze)
        _FORKS_FREEZE = True


def freeze_survivors() -> None:
    """Collect, then leave everything still alive out of every later collection, as
    freeze_imports does for the imports: for the caches a process builds once, after its
    imports and before any model (Megatron-LM's JIT warm-up: torch.compile's inductor
    tables, some 150,000 objects, which every collection after a recovery walked again)."""
    gc.collect()
    gc.freeze()


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """The kernel SIGKILLs this process when its parent (the thread that started it) dies,
    however it dies, so no orphan keeps ports, memory or a device. Light on purpose: a
    spawned helper that unpickles it as its initializer imports this module only."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def end_process(code: int) -> None:
    """Exit now with `code`, without the interpreter's teardown (seconds of torch and
    megatron-core, nothing left to flush): logs and streams flushed, and the status written
    where the launcher asked for it (ENV_EXIT_STATUS_FILE)."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    record_exit_status(code)
    finalize_mpi(code)
    os._exit(code)


def finalize_mpi(code: int, timeout_s: float = 5.0, *, mpi=None, timer=None) -> None:
    """MPI_Finalize, where this process initialised MPI (a child spawned for `--deadpool-transport
    mpi`): Open MPI's launcher reports a process that exits without it as an abnormal end.
    On the calling thread, MPI's rule; a finalize still waiting after `timeout_s` (on a dead
    peer, say) does not hold the exit up: a timer exits with `code` then. `mpi` (mpi4py's MPI
    module, once imported) and `timer` (threading.Timer) are for tests."""
    MPI = sys.modules.get("mpi4py.MPI") if mpi is None else mpi
    if MPI is None or not MPI.Is_initialized() or MPI.Is_finalized():
        return
    import threading

    deadline = (timer or threading.Timer)(timeout_s, os._exit, args=(code,))
    deadline.daemon = True
    deadline.start()
    MPI.Finalize()
    deadline.cancel()


def record_exit_status(code: int) -> None:
    """Write `code` where ENV_EXIT_STATUS_FILE names (nothing when it is unset)."""
    path = os.environ.get(ENV_EXIT_STATUS_FILE)
    if path:
        try:
            with open(path + ".tmp", "w") as fh:
                fh.write(str(code))
            os.replace(path + ".tmp", path)
        except OSError:
            pass
