"""A child the agent starts through MPI_Comm_spawn (`--deadpool-transport mpi`): it becomes the
process the fork server's child would be, then runs the script in this interpreter.

Started as `python -m deadpool_megatron.agent.mpi_child SOCKET REQUEST`: MPI is initialised
first (MPI_THREAD_MULTIPLE: the replication thread uses it beside the training thread), the
request (argv, environment, working directory; a JSON file the agent wrote for it alone) is
read and removed, and the child connects to the agent's SOCKET, says its pid, and writes its
stdout and stderr there. It leads a process group of its own (the agent signals that group).
Its exit status goes to the file the environment names (runtime.ENV_EXIT_STATUS_FILE), since
Open MPI's daemon, not the agent, is its parent.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import sys
import threading
from collections.abc import Callable

from ..runtime import finalize_mpi, record_exit_status
from .forkserver import run_script, start_as_python

MPI_ENV = ("OMPI_", "PMIX_", "PRTE_")  # what Open MPI told this process of itself


def become(sock_path: str, request: dict) -> str:
    """Set this process up as `python -u argv[0] ...` would start, its output to the agent's
    socket and its place in MPI kept (not the agent's); returns the script."""
    with contextlib.suppress(OSError):
        os.setsid()  # a process group (and session) of its own, as the fork server's children
    out = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    out.connect(sock_path)
    out.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    env = {k: v for k, v in request["env"].items() if not k.startswith(MPI_ENV)}
    env.update({k: v for k, v in os.environ.items() if k.startswith(MPI_ENV)})
    return start_as_python(out.detach(), env, request["cwd"], request["argv"])


def die_with_agent(pid: int, end: Callable[[], object] | None = None) -> threading.Thread:
    """SIGKILL this process (or call `end`) when the agent that spawned it ends, as the fork
    server's children die with theirs; here Open MPI's daemon is the parent, so a thread waits
    on a pidfd of the agent. Returns the thread."""
    fd = os.pidfd_open(pid)

    def watch() -> None:
        select.select([fd], [], [])
        os.close(fd)
        if end is None:
            os.kill(os.getpid(), signal.SIGKILL)
        else:
            end()

    thread = threading.Thread(target=watch, name="deadpool-agent-watch", daemon=True)
    thread.start()
    return thread


# Open MPI's TCP connections listen in a range of their own, below Linux's ephemeral ports
# (where gloo's and the store's are): a recovery's abort cuts every other TCP connection of
# the process but never these (control/client.py: mpi_ports). A user's own setting stands.
MPI_TCP_PORTS = {"OMPI_MCA_btl_tcp_port_min_v4": "27000", "OMPI_MCA_btl_tcp_port_range_v4": "2000",
                 "OMPI_MCA_btl_tcp_port_min_v6": "27000", "OMPI_MCA_btl_tcp_port_range_v6": "2000"}  # fmt: skip


def init_mpi() -> None:
    """MPI_Init_thread(MPI_THREAD_MULTIPLE), mpi4py's default: the replication thread uses
    MPI beside the training thread."""
    for name, value in MPI_TCP_PORTS.items():
        os.environ.setdefault(name, value)
    from mpi4py import MPI  # noqa: F401 (importing initialises MPI)


def main(argv: list[str]) -> None:
    init_mpi()
    sock_path, request_path = argv
    with open(request_path) as fh:
        request = json.load(fh)
    os.unlink(request_path)
    die_with_agent(request["agent_pid"])
    script = become(sock_path, request)
    code = run_script(script)
    record_exit_status(code)
    finalize_mpi(code)
    os._exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
