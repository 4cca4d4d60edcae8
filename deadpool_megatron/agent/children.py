"""The agent's child processes: starting them with the launcher <-> process contract
(runtime.py), prefixing every line they print, reading their progress boards, and stopping
them (their whole process groups: a dead child's helpers live on in its group)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

from ..control.monitor import ProcessProbe
from ..failure.procstate import exiting_status, process_state
from ..failure.progress import ProgressBoard, create_board_file
from ..runtime import (
    ENV_FAULT_SCOPE,
    ENV_JOB_ID,
    ENV_PROGRESS_FILE,
    ENV_ROLE,
    ENV_SPARE_INDEX,
    ROLE_WORKER,
    die_with_parent,
)
from .forks import ForkedProcess, ForkServer, ForkServerUnavailable
from .forkserver import DEFAULT_PRELOAD, server_env, worker_defaults
from .mpi_spawn import MpiSpawner, SpawnedProcess

log = logging.getLogger("deadpool.launch")

TERMINATE_GRACE_S = 5.0


def exit_seen(proc) -> int | None:
    """A worker's exit status once it is reaped, or already once the kernel shows it exiting
    with a nonzero status: a killed rank's memory is torn down before it can be reaped (92 ms
    per GiB in pages of 4 KiB here), which the detection would otherwise wait for."""
    rc = proc.poll()
    return rc if rc is not None else exiting_status(proc.pid)


@dataclass
class Child:
    role: str
    index: int  # global rank for a worker, spare index for a spare
    proc: subprocess.Popen | ForkedProcess | SpawnedProcess
    board: ProgressBoard  # its progress marks, read from shared memory
    pump: threading.Thread | None = None
    reported: bool = field(default=False)  # its exit was reported (spares)
    local_rank: int = 0  # its slot on this node (its device on a GPU node)

    @property
    def label(self) -> str:
        return f"{self.role} {self.index}"

    @property
    def name(self) -> str:
        return f"worker rank {self.index}" if self.role == ROLE_WORKER else self.label

    def alive(self) -> bool:
        return self.proc.poll() is None

    def probe(self) -> ProcessProbe:
        return ProcessProbe(self.proc.pid, self.board.read(), process_state(self.proc.pid))

    def kill(self, signum: int = signal.SIGKILL) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)


@dataclass(frozen=True)
class Launch:
    """What every child of this agent is started with."""

    script: str
    script_args: tuple[str, ...]
    master_addr: str
    world_size: int
    local_world_size: int
    node: int = 0  # this agent's node (GROUP_RANK, as torchrun names it)
    fork_server: bool = True  # fork children from a preloaded interpreter (forkserver.py)
    fork_preload: tuple[str, ...] = DEFAULT_PRELOAD  # what the fork server imports once
    fork_zygote: str = ""  # the socket of a zygote to fork the fork server from (zygote.py)
    mpi_spawn: bool = False  # start children through MPI_Comm_spawn (mpi_spawn.py), no forks


class Children:
    def __init__(self, launch: Launch):
        self.launch = launch
        self.all: list[Child] = []
        self._print_lock = threading.Lock()
        # Progress boards live in memory where the node has /dev/shm.
        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.board_dir = tempfile.mkdtemp(prefix="deadpool-progress-", dir=shm)
        self._spawned = 0
        self._forks: ForkServer | None = None
        self._use_forks = launch.fork_server and not launch.mpi_spawn  # until it proves unusable
        self._mpi = MpiSpawner() if launch.mpi_spawn else None

    def _fork_server(self) -> ForkServer | None:
        """The fork server, started with the first child or by `prepare` (bad input started
        nothing)."""
        if self._forks is None and self._use_forks:
            folder = os.path.dirname(os.path.abspath(self.launch.script))
            self._forks = ForkServer(server_env(os.environ), self.launch.fork_preload,
                                     self._printer("[fork server] "), script_folder=folder,
                                     zygote=self.launch.fork_zygote)  # fmt: skip
        return self._forks

    def prepare(self) -> None:
        """Start the fork server now, so that it imports torch and megatron-core (seconds)
        while the agent sets up the job's store, rather than after."""
        self._fork_server()

    @staticmethod
    def _base_env() -> dict[str, str]:
        return worker_defaults(dict(os.environ, PYTHONUNBUFFERED="1"))

    def _printer(self, prefix: str):
        def write(line: bytes) -> None:
            with self._print_lock:
                sys.stdout.buffer.write(prefix.encode() + line)
                sys.stdout.buffer.flush()

        return write

    def spawn(
        self, role: str, index: int, local_rank: int, env: dict[str, str], extra_args=()
    ) -> Child:
        """Start one child; `env` holds the job's variables (port, job id, fault scope)."""
        self._spawned += 1
        board = os.path.join(self.board_dir, f"{self._spawned}-{role}-{index}")
        create_board_file(board)
        full = self._base_env()
        full.update(
            MASTER_ADDR=self.launch.master_addr,
            WORLD_SIZE=str(self.launch.world_size),
            LOCAL_WORLD_SIZE=str(self.launch.local_world_size),
            GROUP_RANK=str(self.launch.node),
        )
        full.update(env)
        full[ENV_ROLE] = role
        full[ENV_PROGRESS_FILE] = board
        full["LOCAL_RANK"] = str(local_rank)  # a spare's too: its device, its slot on the node
        if role == ROLE_WORKER:
            full["RANK"] = str(index)
            full.pop(ENV_SPARE_INDEX, None)
        else:
            full[ENV_SPARE_INDEX] = str(index)
            full.pop("RANK", None)
        proc = self._start([self.launch.script, *self.launch.script_args, *extra_args], full)
        child = Child(role, index, proc, ProgressBoard(board, writable=False),
                      local_rank=local_rank)  # fmt: skip
        log.info("started %s (pid %d)", child.name, proc.pid)
        child.pump = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.pump.start()
        self.all.append(child)
        return child

    def _start(
        self, argv: list[str], env: dict[str, str]
    ) -> subprocess.Popen | ForkedProcess | SpawnedProcess:
        if self._mpi is not None:
            return self._mpi.spawn(argv, env)
        forks = self._fork_server()
        if forks is not None:
            try:
                return forks.spawn(argv, env)
            except ForkServerUnavailable as err:
                log.warning("fork server unusable (%s): starting children with %s",
                            err, sys.executable)  # fmt: skip
                forks.close()
                self._forks, self._use_forks = None, False
        return subprocess.Popen(
            [sys.executable, "-u", *argv],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,  # noqa: PLW1509 (a prctl only; the agent forks rarely)
        )

    def _pump(self, child: Child) -> None:
        prefix = f"[{child.label}] ".encode()
        for line in iter(child.proc.stdout.readline, b""):
            with self._print_lock:
                sys.stdout.buffer.write(prefix + line)
                sys.stdout.buffer.flush()

    def terminate(self, signum: int) -> None:
        """Signal every child's process group, wait, then SIGKILL whatever is left."""
        alive = [c for c in self.all if c.alive()]
        for c in self.all:
            c.kill(signum)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        for c in alive:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        for c in self.all:
            c.kill(signal.SIGKILL)
            c.proc.wait()
        self.join_pumps()

    def join_pumps(self) -> None:
        for c in self.all:
            if c.pump is not None:
                c.pump.join(timeout=2)

    def forget_all(self) -> None:
        """After a checkpoint-restart stopped every child: the next start begins anew."""
        self.all.clear()

    def close(self) -> None:
        if self._forks is not None:
            self._forks.close()
            self._forks = None
        if self._mpi is not None:
            self._mpi.close()
            self._mpi = None
        shutil.rmtree(self.board_dir, ignore_errors=True)


def job_env(job_id: str, port: int, fault_scope: str) -> dict[str, str]:
    return {"MASTER_PORT": str(port), ENV_JOB_ID: job_id, ENV_FAULT_SCOPE: fault_scope}
