"""The agent's side of the fork server (forkserver.py): start it, ask it for children, and
hand each back as a `ForkedProcess` that answers like the `subprocess.Popen` it replaces
(pid, stdout, poll, wait, returncode), its exit status reported by the server that reaps it."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from ..failure.procstate import process_state
from .forkserver import DEFAULT_PRELOAD, MAX_MESSAGE, Request, decode, encode
from .zygote import ServerRequest

log = logging.getLogger("deadpool.launch")

READY_TIMEOUT_S = 300.0  # the imports, on a node whose cores the job's other agents share
REPLY_TIMEOUT_S = 60.0


class ForkServerUnavailable(RuntimeError):
    """The fork server cannot start children (the agent starts them the ordinary way)."""


class ForkedProcess:
    """A child of the fork server, seen from the agent."""

    def __init__(self, pid: int, stdout):
        self.pid = pid
        self.stdout = stdout
        self.returncode: int | None = None
        self._done = threading.Event()

    def _exited(self, code: int) -> None:
        self.returncode = code
        self._done.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
        return self.returncode


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")


class ServerLink:
    """The agent's end of the fork server's socket: one start request at a time, and a reader
    thread that routes what comes back (the readiness report, each request's reply, in order,
    and every child's exit, which can arrive before the reply has been handed back). When the
    server is gone its children are too (parent-death signals): each is reported killed once
    its process has disappeared (`alive`), at most ORPHAN_WAIT_S after."""

    ORPHAN_WAIT_S = 5.0

    def __init__(
        self,
        sock: socket.socket,
        on_ready: Callable[[dict], None] = lambda message: None,
        alive: Callable[[int], bool] = _alive,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ):
        self._sock = sock
        self._on_ready = on_ready  # the server's readiness report, when it says it can fork
        self._alive, self._clock, self._sleep = alive, clock, sleep
        self._replies: queue.Queue[dict] = queue.Queue()
        self._children: dict[int, ForkedProcess] = {}
        self._lock = threading.Lock()  # one request at a time: replies come in order
        self._state = threading.Condition()
        self._ready: bool | None = None
        self.reason = ""
        self._reader = threading.Thread(target=self._read, name="fork-server", daemon=True)
        self._reader.start()

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Raises ForkServerUnavailable with the reason when it cannot fork children."""
        with self._state:
            self._state.wait_for(lambda: self._ready is not None, timeout)
            if self._ready is None:
                self.reason = f"not ready after {timeout:.0f} s"
                self._ready = False
        if not self._ready:
            raise ForkServerUnavailable(self.reason)

    def spawn(self, request: Request, reply_timeout: float = REPLY_TIMEOUT_S) -> ForkedProcess:
        """Ask for one child, its stdout and stderr into a new pipe whose read end it gets."""
        self.wait_ready()
        read_end, write_end = os.pipe()
        try:
            reply = self._request(request, write_end, reply_timeout)
            if "pid" not in reply:
                raise ForkServerUnavailable(reply.get("error", f"unexpected reply {reply}"))
        except BaseException:
            os.close(read_end)
            raise
        with self._state:  # the reader made it with the reply: its exit may follow at once
            child = self._children[reply["pid"]]
        child.stdout = os.fdopen(read_end, "rb")
        return child

    def _request(self, request: Request, write_end: int, timeout: float) -> dict:
        """Send one start (the server gets its own copy of `write_end`, which is closed
        here) and wait for its answer."""
        try:
            with self._lock:
                socket.send_fds(self._sock, [encode(request.message())], [write_end])
                os.close(write_end)
                write_end = -1
                return self._replies.get(timeout=timeout)
        except queue.Empty:
            raise ForkServerUnavailable(f"no answer to a start within {timeout:.0f} s") from None
        except OSError as err:
            raise ForkServerUnavailable(f"the fork server is gone: {err}") from err
        finally:
            if write_end >= 0:
                os.close(write_end)

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(MAX_MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._server_gone()
                return
            message = decode(data)
            if "ready" in message:
                with self._state:
                    self._ready = bool(message["ready"])
                    self.reason = message.get("reason", "")
                    self._state.notify_all()
                if self._ready:
                    self._on_ready(message)
            elif "exit" in message:
                with self._state:
                    child = self._children.setdefault(
                        message["exit"], ForkedProcess(message["exit"], None)
                    )
                child._exited(int(message["code"]))
            else:
                if "pid" in message:
                    with self._state:
                        self._children.setdefault(
                            message["pid"], ForkedProcess(message["pid"], None)
                        )
                self._replies.put(message)

    def _server_gone(self) -> None:
        """Its children died with it (parent-death signal): report each as killed."""
        with self._state:
            if self._ready is None:
                self.reason = "it exited before it was ready"
            elif self._ready:
                self.reason = "the fork server exited"
            self._ready = False
            self._state.notify_all()
            orphans = [c for c in self._children.values() if c.returncode is None]
        for child in orphans:
            deadline = self._clock() + self.ORPHAN_WAIT_S
            while self._alive(child.pid) and self._clock() < deadline:
                self._sleep(0.01)
            child._exited(-signal.SIGKILL)
        self._replies.put({"error": "the fork server exited"})

    def close(self) -> None:
        """Tell the server no more requests come (it ends once its children have)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

    def join(self, timeout: float | None = None) -> None:
        self._reader.join(timeout)


class ZygoteServer:
    """A fork server that a zygote forked (zygote.py): not this agent's child, so it is
    waited for by its pid (reaped by the zygote, or by init once the zygote is gone)."""

    def __init__(self, pid: int, stdout):
        self.pid = pid
        self.stdout = stdout

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while process_state(self.pid) not in ("dead", "zombie"):
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.01)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)


def server_from_zygote(path: str, server_end: socket.socket, request: ServerRequest
                       ) -> ZygoteServer | None:  # fmt: skip
    """Ask the zygote at `path` for a fork server on `server_end`; None (logged) when it is
    unreachable or refuses, and the agent starts a server of its own."""
    read_end, write_end = os.pipe()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as conn:
            conn.settimeout(REPLY_TIMEOUT_S)
            conn.connect(path)
            socket.send_fds(conn, [encode(request.message())], [server_end.fileno(), write_end])
            reply = decode(conn.recv(MAX_MESSAGE))
    except (OSError, ValueError) as err:
        os.close(read_end)
        log.warning("no fork server from the zygote at %s (%s): starting one", path, err)
        return None
    finally:
        os.close(write_end)
    if "pid" not in reply:
        os.close(read_end)
        log.info("the zygote at %s refused a fork server (%s): starting one", path,
                 reply.get("refused", reply))  # fmt: skip
        return None
    return ZygoteServer(int(reply["pid"]), os.fdopen(read_end, "rb"))


class ForkServer:
    """The fork server's process (started at once, importing while the agent goes on, or
    forked ready from a zygote), the pump of what it prints, and its `ServerLink`."""

    def __init__(
        self,
        env: dict[str, str],
        preload: tuple[str, ...] = DEFAULT_PRELOAD,
        output: Callable[[bytes], None] | None = None,
        script_folder: str = "",
        zygote: str = "",
    ):
        """Start the server now (it imports while the caller goes on); the
        first spawn() waits until it is ready. `output` gets each line it prints itself;
        `script_folder` is where the children's script lies (first on the server's path);
        `zygote`: the socket of a zygote to fork the server from, if it can."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.zygote = ""
        self._proc: subprocess.Popen | ZygoteServer | None = None
        if zygote:
            request = ServerRequest(tuple(preload), script_folder, sys.executable, dict(env))
            self._proc = server_from_zygote(zygote, theirs, request)
            self.zygote = zygote if self._proc is not None else ""
        if self._proc is None:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "deadpool_megatron.agent.forkserver",
                 str(theirs.fileno()), ",".join(preload), script_folder],
                env=env, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        theirs.close()
        self._output = output or (lambda line: sys.stdout.buffer.write(line))
        self._pump = threading.Thread(target=self._pump_output, daemon=True)
        self._pump.start()
        self._link = ServerLink(ours, on_ready=self._log_ready)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def reason(self) -> str:
        """Why it cannot fork children, once it has said so."""
        return self._link.reason

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Raises ForkServerUnavailable with the reason when it cannot fork children."""
        self._link.wait_ready(timeout)

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None = None
              ) -> ForkedProcess:  # fmt: skip
        """Start `python argv...` as a child of the server, stdout and stderr into a pipe."""
        return self._link.spawn(Request(list(argv), dict(env), cwd or os.getcwd()))

    def _log_ready(self, message: dict) -> None:
        origin = f", forked from the zygote at {self.zygote}" if self.zygote else ""
        log.info("fork server ready (pid %d%s, preloaded %s)", self._proc.pid, origin,
                 ", ".join(message.get("preloaded", [])) or "nothing")  # fmt: skip

    def _pump_output(self) -> None:
        for line in iter(self._proc.stdout.readline, b""):
            self._output(line)

    def close(self) -> None:
        """Let the server end (its children should be gone by now)."""
        self._link.close()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._pump.join(timeout=2)
