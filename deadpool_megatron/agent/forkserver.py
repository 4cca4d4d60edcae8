"""The fork server: one process per agent that imports torch and megatron-core once, then forks
every worker and spare of the node from that state.

Why: a child started with `python script.py` pays those imports itself (6 CPU-seconds each on
the development machine), once per worker and spare at every job start and again for each
fresh spare; on a node where the cores are shared that is most of the time to the first
iteration. A forked child starts in milliseconds and runs the script as `python script.py`
would (its argv, environment, working directory, a session of its own, stdout and stderr into
the pipe the agent handed over, stdin from /dev/null).

Forking is only safe from a process with one thread and no CUDA context: the server checks
both (and that the CUDA driver is not even loaded) after the imports and reports itself
unusable otherwise (the agent then starts children the ordinary way). The server is the
children's parent: it reaps them and reports each exit status to the agent, and it dies with
the agent (and they with it: parent-death signals).

The protocol, over an AF_UNIX SOCK_SEQPACKET pair (one JSON message per packet):
  server -> agent  {"ready": true, "preloaded": [...]} | {"ready": false, "reason": "..."}
  agent -> server  {"argv": [...], "env": {...}, "cwd": "..."} + the stdout fd (SCM_RIGHTS)
  server -> agent  {"pid": N} | {"error": "..."}, then for every child {"exit": N, "code": rc}
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import importlib.machinery
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NoReturn

from ..runtime import die_with_parent

# What every worker imports first; a module that does not import here is skipped.
DEFAULT_PRELOAD = ("torch", "megatron.core", "deadpool_megatron.process.worker")
MAX_MESSAGE = 1 << 20  # a request carries a child's whole environment
PR_SET_NAME = 15


def server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment a fork server imports in: numpy's import starts its BLAS threads unless
    told one, and a process with threads cannot fork; the children get `worker_defaults`
    (torch reads both when the server imports it)."""
    env = {"OPENBLAS_NUM_THREADS": "1", **environ, "PYTHONUNBUFFERED": "1"}
    return worker_defaults(env)


def worker_defaults(env: dict[str, str]) -> dict[str, str]:
    """What a worker's environment gets unless it says otherwise: one intra-op thread each
    (OMP_NUM_THREADS; several processes share the node's cores, as torchrun sets), and torch's
    CPU allocations of 2 MiB and more on transparent huge pages (THP_MEM_ALLOC_ENABLE: a
    recovery's buffers fault in 2 MiB at a time, and the kernel tears a killed rank's memory
    down in 4 ms per GiB instead of 92, scripts/bench_teardown.py; the launcher no longer
    waits for that teardown to see the exit, procstate.exiting_status).

    In an NCCL job (gloo ignores it), TORCH_NCCL_ASYNC_ERROR_HANDLING=2: torch's watchdog
    aborts the communicator of a collective that failed or timed out and lets the error reach
    the training thread, whose recovery aborts and rebuilds every group anyway. torch's
    default, 3, ends the process instead, and every survivor of a hot-swap meets such an
    error when a peer dies (nvidia-resiliency-ext's in-process restart asks the same of its
    users: docs/source/inprocess/usage_guide.rst, "Requirements for the execution
    environment"). Not run on a GPU here."""
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    return env


def encode(message: dict) -> bytes:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"a fork-server message of {len(data)} bytes (at most {MAX_MESSAGE})")
    return data


def decode(data: bytes) -> dict:
    return json.loads(data.decode())


@dataclass(frozen=True)
class Request:
    """One child to start: `python argv[0] argv[1:]` in `cwd` with exactly `env`."""

    argv: list[str]
    env: dict[str, str]
    cwd: str

    def message(self) -> dict:
        return {"argv": self.argv, "env": self.env, "cwd": self.cwd}


def unfit_to_fork() -> str | None:
    """Why forking from this process would be unsafe now (None: it is safe)."""
    threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1
    if threads != 1 or threading.active_count() != 1:
        return f"the preloaded modules started threads ({threads} in this process)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "importing the preloaded modules initialised CUDA, which a fork cannot inherit"
    if _maps_cuda_driver():  # loaded by a library of its own (transformer-engine, say)
        return "the preloaded modules loaded the CUDA driver (libcuda), which a fork cannot share"
    return None


def _maps_cuda_driver() -> bool:
    """Whether libcuda is mapped: torch's own import leaves it unloaded until the first CUDA
    call, so seeing it means something may have initialised the driver."""
    try:
        with open("/proc/self/maps") as fh:
            return any("libcuda.so" in line for line in fh)
    except OSError:
        return False


def preload(modules: list[str]) -> list[str]:
    done = []
    for name in modules:
        try:
            if name == "megatron.core":  # with torch.compile deferred (see there)
                from deadpool_megatron.megatron.core_import import import_megatron_core

                import_megatron_core()
            importlib.import_module(name)
            done.append(name)
        except Exception as err:  # noqa: BLE001  (a script need not use every preload)
            print(f"[fork server] not preloading {name}: {err}", file=sys.stderr, flush=True)
    return done


class ForkingLoop:
    """The single-threaded loop of a process that forks (the fork server, the zygote): it waits
    on its socket and on SIGCHLD (through a wake-up pipe), reaping each exited child."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        os.set_blocking(self.wake_r, False)

    def readable(self) -> Iterator[None]:
        """Yields each time the socket is readable; reaps children in between."""
        signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so the wake-up fd fires
        signal.set_wakeup_fd(self.wake_w)
        self.selector.register(self.sock, selectors.EVENT_READ, "request")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        while True:
            for key, _ in self.selector.select():
                if key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wake_r, 4096)
                    self.reap()
                else:
                    yield

    def reap(self) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited(pid, os.waitstatus_to_exitcode(status))

    def exited(self, pid: int, code: int) -> None:
        """A child ended (reaped already)."""

    def drop(self) -> None:
        """In a forked child: let go of the loop's signals, descriptors and socket."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        self.selector.close()
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


class Server(ForkingLoop):
    def send(self, message: dict) -> None:
        self.sock.send(encode(message))

    def serve(self) -> tuple[Request, int] | None:
        """Fork children until the agent closes its end. Returns in a forked child only, with
        what it is to run and its stdout descriptor; None in the server when done."""
        for _ in self.readable():
            data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 1)
            if not data:
                return None  # the agent is done (or gone)
            started = self.start(decode(data), fds)
            if started is not None:
                return started
        return None

    def start(self, message: dict, fds: list[int]) -> tuple[Request, int] | None:
        if len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.send({"error": f"a request needs one stdout descriptor, got {len(fds)}"})
            return None
        request = Request(list(message["argv"]), dict(message["env"]), str(message["cwd"]))
        server = os.getpid()
        settled_r, settled_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as err:
            for fd in (fds[0], settled_r, settled_w):
                os.close(fd)
            self.send({"error": f"fork failed: {err}"})
            return None
        if pid == 0:
            os.close(settled_r)
            self.become_child(server)
            os.close(settled_w)  # its session exists: the agent may signal it as a group
            return request, fds[0]
        os.close(fds[0])
        os.close(settled_w)
        os.read(settled_r, 1)  # end-of-file once the child has its session (or died)
        os.close(settled_r)
        self.send({"pid": pid})
        return None

    def exited(self, pid: int, code: int) -> None:
        with contextlib.suppress(OSError):  # the agent is gone: nobody to tell
            self.send({"exit": pid, "code": code})

    def become_child(self, server: int) -> None:
        """In the forked child: drop everything of the server's."""
        self.drop()
        os.setsid()
        die_with_parent()
        if os.getppid() != server:  # the server died between the fork and the prctl
            os._exit(1)


def ignore_stop_signals() -> None:
    """The server is its agent's tool: it ends when the agent's socket closes, not on a signal
    meant for the job (Slurm signals every process of a step, this one too, and its children
    die with it: a SIGTERM the workers are to stop gracefully on would kill them)."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_child(request: Request, stdout_fd: int, preloaded: list[str]) -> NoReturn:
    """Set the forked child up as `python -u argv[0] ...` would start, run the script, exit."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # as a fresh interpreter has them
    signal.signal(signal.SIGINT, signal.default_int_handler)
    script = start_as_python(stdout_fd, request.env, request.cwd, request.argv)
    _name_process(os.path.basename(script))
    shadowed = shadowed_preloads(sys.path[0], preloaded)
    if shadowed:  # e.g. a Megatron-LM checkout's own megatron/ beside its pretrain_gpt.py
        print(f"[fork server] {script} imports {', '.join(shadowed)} from its own folder, not "
              "the preloaded one: starting it as its own interpreter", file=sys.stderr)  # fmt: skip
        os.execve(sys.executable, [sys.executable, "-u", *sys.argv], request.env)
    _fresh_per_process_state(request.env)
    os._exit(run_script(script))


def start_as_python(stdout_fd: int, env: Mapping[str, str], cwd: str, argv: list[str]) -> str:
    """Set this process up as `python -u argv[0] ...` would start (stdout and stderr to
    `stdout_fd`, line by line; stdin from /dev/null; `env`, `cwd`, sys.argv, sys.path[0]) and
    return the script's path: a fork server's child and an MPI-spawned one both start so."""
    os.dup2(stdout_fd, 1)
    os.dup2(stdout_fd, 2)
    if stdout_fd not in (0, 1, 2):
        os.close(stdout_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdout = sys.__stdout__ = io.TextIOWrapper(
        io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True
    )
    sys.stderr = sys.__stderr__ = io.TextIOWrapper(
        io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
        errors="backslashreplace",
    )  # fmt: skip
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    return script


def run_script(script: str) -> int:
    """Run the script, then what an interpreter's ending does that a script relies on (its
    threads joined, its atexit handlers, the streams flushed), and return the status `python
    script` would exit with; the child then exits without the rest of the teardown. Why: tearing
    down the torch and megatron-core the server imported takes seconds, and once aborted a
    worker after its results were out (SIGABRT, "terminate called without an active
    exception"), which its agent counts as a failure."""
    interrupted = False
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_status(exit_.code)
    except BaseException as err:  # noqa: BLE001 (reported as the interpreter would)
        sys.excepthook(type(err), err, err.__traceback__)
        interrupted, code = isinstance(err, KeyboardInterrupt), 1
    with contextlib.suppress(BaseException):
        getattr(threading, "_shutdown", lambda: None)()  # joins the non-daemon threads
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # prints a failing handler's error, as the interpreter does
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if interrupted:  # an uncaught Ctrl-C ends the interpreter by SIGINT, as its shell expects
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def exit_status(code: object) -> int:
    """The status `sys.exit(code)` ends an interpreter with: None is 0, an integer itself,
    anything else is printed to stderr and is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(BaseException):
        print(code, file=sys.stderr)
    return 1


def shadowed_preloads(folder: str, preloaded: list[str]) -> list[str]:
    """The preloaded top-level packages that `folder` (the script's, first on its path) holds
    a different copy of: a fresh interpreter would import that copy, so the child must be one."""
    out = []
    for top in sorted({name.split(".")[0] for name in preloaded}):
        module = sys.modules.get(top)
        spec = importlib.machinery.PathFinder.find_spec(top, [folder])
        if module is None or spec is None:
            continue
        theirs = list(spec.submodule_search_locations or []) or [spec.origin]
        ours = list(getattr(module, "__path__", []) or []) or [getattr(module, "__file__", "")]
        if not {os.path.realpath(p) for p in theirs if p} & {
            os.path.realpath(p) for p in ours if p
        }:
            out.append(top)
    return out


def _name_process(name: str) -> None:
    """`top` shows the script (ps still shows the fork server's command line)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15])


def _fresh_per_process_state(env: dict[str, str]) -> None:
    """What a fresh interpreter would not share with its siblings: numpy's global generator
    (Python's `random` reseeds itself at fork) and the intra-op thread count, which the
    OpenMP runtime read from the server's environment when torch was imported."""
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    torch = sys.modules.get("torch")
    threads = env.get("OMP_NUM_THREADS", "")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def end_server() -> None:
    """The server is done: exit at once. Finalising an interpreter that holds torch and
    megatron-core takes seconds here, and the agent waits for the server's end."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str]) -> None:
    """argv: the socket's descriptor, the modules to preload (comma-separated), and the
    folder of the script the children will run, first on the path as `python script` has it,
    so that the preloads are the copies the script would import."""
    fd = int(argv[0])
    modules = [m for m in (argv[1] if len(argv) > 1 else "").split(",") if m]
    if len(argv) > 2 and argv[2]:
        sys.path[0] = argv[2]
    sock = socket.socket(fileno=fd)
    die_with_parent()
    ignore_stop_signals()
    done = preload(modules)
    reason = unfit_to_fork()
    if reason is not None:
        sock.send(encode({"ready": False, "reason": reason}))
        return
    sock.send(encode({"ready": True, "preloaded": done}))
    started = Server(sock).serve()
    if started is None:
        end_server()
    run_child(*started, done)


if __name__ == "__main__":
    main(sys.argv[1:])
