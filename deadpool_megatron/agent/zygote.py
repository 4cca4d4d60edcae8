"""A node's zygote: one long-lived interpreter that imports what a fork server preloads, once,
and forks every agent that asks for one a fork server that is ready at once.

Why: an agent's fork server (forkserver.py) imports torch and megatron-core before its first
child starts, 5-7 CPU-seconds here, and back-to-back jobs on one node (a test suite, a sweep of
short jobs, the job steps of one allocation) pay that at every start. With the zygote running
(`python -m deadpool_megatron.agent.zygote --socket PATH`) and `deadpool-launch --fork-zygote
PATH` (or DEADPOOL_FORK_ZYGOTE=PATH), the agent's fork server is a fork of it instead.

The forked server speaks the same protocol to its agent as one the agent started itself. It is
not the agent's child, so it cannot die with it by a parent-death signal: it ends when the
agent's end of its socket closes (the agent closed it, or died), and its children die with it
as before. It outlives the zygote. The zygote refuses (and the agent starts a server of its own)
when a fork of it would not be what the agent's own server would have imported: another
interpreter, other preloads, a script folder holding another copy of a preload, or another value
of a variable read at import (IMPORT_ENV_PREFIXES).

The protocol, over an AF_UNIX SOCK_SEQPACKET socket at PATH, one connection per request:
  agent -> zygote  {"preload": [...], "script_folder": "...", "executable": "...", "env": {...}}
                   + the server's end of its socket pair and its output pipe (SCM_RIGHTS)
  zygote -> agent  {"pid": N} | {"refused": "why"}
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from ..runtime import die_with_parent
from .forkserver import (
    DEFAULT_PRELOAD,
    MAX_MESSAGE,
    ForkingLoop,
    Server,
    decode,
    encode,
    end_server,
    ignore_stop_signals,
    preload,
    run_child,
    server_env,
    shadowed_preloads,
    unfit_to_fork,
)

ENV_FORK_ZYGOTE = "DEADPOOL_FORK_ZYGOTE"
# Variables that change what an import does (interpreter, thread pools, libraries loaded,
# CUDA and library switches): a fork of the zygote must have seen the agent's values.
IMPORT_ENV_PREFIXES = (
    "PYTHON", "LD_", "OMP_", "OPENBLAS_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH_", "CUDA_",
    "NVIDIA_", "NVTE_", "NCCL_", "MEGATRON", "TRITON_",
)  # fmt: skip
# Matched by a prefix above, read by no import: PYTHON is the launch scripts' choice of
# interpreter (scripts/slurm), which the request's `executable` already compares.
NOT_IMPORT_ENV = frozenset({"PYTHON"})


@dataclass(frozen=True)
class ServerRequest:
    """What an agent would start its own fork server with."""

    preload: tuple[str, ...]
    script_folder: str
    executable: str
    env: dict[str, str]

    def message(self) -> dict:
        return {"preload": list(self.preload), "script_folder": self.script_folder,
                "executable": self.executable, "env": self.env}  # fmt: skip

    @classmethod
    def from_message(cls, message: dict) -> ServerRequest:
        return cls(tuple(message["preload"]), str(message["script_folder"]),
                   str(message["executable"]), dict(message["env"]))  # fmt: skip


def import_env_differences(ours: Mapping[str, str], theirs: Mapping[str, str]) -> list[str]:
    """The names of import-time variables (IMPORT_ENV_PREFIXES) whose values differ."""
    names = {k for k in (*ours, *theirs)
             if k.startswith(IMPORT_ENV_PREFIXES) and k not in NOT_IMPORT_ENV}  # fmt: skip
    return sorted(k for k in names if ours.get(k) != theirs.get(k))


def refusal(request: ServerRequest, preloads: tuple[str, ...], preloaded: list[str],
            env: Mapping[str, str]) -> str | None:  # fmt: skip
    """Why a fork of this zygote is not the server the request describes (None: it is)."""
    if request.executable != sys.executable:
        return f"it runs {sys.executable}, the agent {request.executable}"
    if request.preload != preloads:
        return f"it preloaded {','.join(preloads)}, the agent asks for {','.join(request.preload)}"
    differ = import_env_differences(env, request.env)
    if differ:
        return f"the environment differs in {', '.join(differ)}"
    shadowed = shadowed_preloads(request.script_folder or sys.path[0], preloaded)
    if shadowed:
        return f"{request.script_folder} holds its own copy of {', '.join(shadowed)}"
    return None


class Zygote(ForkingLoop):
    def __init__(
        self,
        listener: socket.socket,
        preloads: tuple[str, ...],
        preloaded: list[str],
        import_env: dict[str, str],
    ):
        """`import_env`: the environment the preloads were imported in (importing torch sets
        variables of its own, as it does in an agent's server)."""
        super().__init__(listener)
        self.preloads, self.preloaded, self.import_env = preloads, preloaded, import_env

    def serve(self) -> tuple[ServerRequest, int, int]:
        """Answer requests until killed. Returns in a forked server only, with its request,
        its socket's descriptor and its output's."""
        for _ in self.readable():
            conn, _ = self.sock.accept()
            with conn:
                forked = self.answer(conn)
            if forked is not None:
                return forked
        raise AssertionError("unreachable: the loop never ends")

    def answer(self, conn: socket.socket) -> tuple[ServerRequest, int, int] | None:
        conn.settimeout(10)
        try:
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
        except OSError:
            return None
        if not data:  # a probe of whether the zygote listens
            for fd in fds:
                os.close(fd)
            return None
        try:
            request = ServerRequest.from_message(decode(data))
            if len(fds) != 2:
                raise ValueError(f"a request needs 2 descriptors, got {len(fds)}")
        except (ValueError, KeyError, TypeError) as err:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(encode({"refused": f"a bad request: {err}"}))
            return None
        why = refusal(request, self.preloads, self.preloaded, self.import_env)
        if why is not None:
            for fd in fds:
                os.close(fd)
            with contextlib.suppress(OSError):
                conn.send(encode({"refused": why}))
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.become_server()
            return request, fds[0], fds[1]
        for fd in fds:
            os.close(fd)
        with contextlib.suppress(OSError):
            conn.send(encode({"pid": pid}))
        return None

    def become_server(self) -> None:
        """In the forked server: drop everything of the zygote's, take a session of its own
        (the agent signals its children, never it, by group), and outlive the zygote."""
        self.drop()
        ignore_stop_signals()  # the zygote's SIGTERM handler is not the server's
        os.setsid()


def run_server(request: ServerRequest, sock_fd: int, out_fd: int, preloaded: list[str]) -> None:
    """In a forked server: become the fork server the agent would have started."""
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.environ.clear()
    os.environ.update(request.env)
    if request.script_folder:  # as the agent's own server puts it first
        sys.path[0] = request.script_folder
    sock = socket.socket(fileno=sock_fd)
    sock.send(encode({"ready": True, "preloaded": preloaded}))
    started = Server(sock).serve()
    if started is None:
        end_server()
    run_child(*started, preloaded)


def bind(path: str) -> socket.socket:
    """Listen at `path`; a socket file left there by a zygote that is gone is replaced."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # nobody listens there
        else:
            probe.close()
            raise SystemExit(f"a zygote already listens at {path}")
    listener.bind(path)
    listener.listen(64)
    return listener


def listening(path: str) -> bool:
    """Whether a zygote listens at `path` (it binds once its imports are done)."""
    if not os.path.exists(path):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as probe:
        try:
            probe.connect(path)
        except OSError:
            return False
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m deadpool_megatron.agent.zygote",
        description="Import what a fork server preloads once and fork a ready fork server for "
        "every deadpool-launch on this node started with --fork-zygote PATH (or "
        f"{ENV_FORK_ZYGOTE}=PATH). Runs until killed; dies with the process that started it.",
    )
    parser.add_argument("--socket", required=True, metavar="PATH",
                        help="Where to listen (an AF_UNIX socket file).")  # fmt: skip
    parser.add_argument("--preload", default=",".join(DEFAULT_PRELOAD), metavar="MODULES",
                        help="Modules to import, comma-separated (default: what an agent's "
                        f"fork server preloads, {','.join(DEFAULT_PRELOAD)}).")  # fmt: skip
    args = parser.parse_args(argv)
    die_with_parent()
    os.environ.update(server_env(os.environ))  # what an agent starts its own server with
    preloads = tuple(m for m in args.preload.split(",") if m)
    import_env = dict(os.environ)
    preloaded = preload(list(preloads))
    reason = unfit_to_fork()
    if reason is not None:
        raise SystemExit(f"zygote: cannot fork servers: {reason}")
    listener = bind(args.socket)
    print(f"zygote ready at {args.socket} (pid {os.getpid()}, preloaded "
          f"{', '.join(preloaded) or 'nothing'})", flush=True)  # fmt: skip
    zygote = os.getpid()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # so that the socket file goes
    try:
        request, sock_fd, out_fd = Zygote(listener, preloads, preloaded, import_env).serve()
    finally:
        if os.getpid() == zygote:
            with contextlib.suppress(OSError):
                os.unlink(args.socket)
    run_server(request, sock_fd, out_fd, preloaded)


if __name__ == "__main__":
    main()
