"""Break this process's pending collectives, so that every peer's collective fails at once.

gloo has no abort: `ProcessGroup.abort()` does not unblock a pending gloo collective, and
destroying the groups does not close their connections while anything still references them
(FIELD-NOTES, and measured again here: after a transient failure, peers stayed blocked in a
DP reduce-scatter). Ending the read side of the TCP connections the groups opened does: gloo's
pair reads end-of-file, fails every operation it knows of and closes its descriptor.

Only the read side, and the connection kept open under a duplicate descriptor until the next
generation is up (`release`): gloo (torch 2.13's, and its main branch) fails the sends queued
on a pair when the pair closes, except a collective's (an unbound buffer's), which then waits
out the group's timeout with the group's threads and descriptors. A send is queued when its
write fails without an error yet on the pair: EPIPE after this process shut its write side,
ECONNRESET after the peer's side went away. Shutting both sides here, or letting gloo's close
reach a peer still sending, left such a send behind about once per soak run (seen with gdb: a
TENSOR_MODEL_PARALLEL_GROUP all-reduce's thread in `UnboundBuffer::waitSend` of gloo's ring
all-reduce, the group's listener, pipe and epoll descriptors and threads held past its release).
With the write side open and the peer's end not closed, a write in progress completes; peers
end their own side when the order reaches them (every process's order watcher aborts).

What remains: about one rank-round in 100 of tests/drivers/abort_race_driver.py (4 MB
all-reduces running while two processes abort, one up to 50 ms after the other) leaves an
all-reduce pending on the process that aborted second. gloo's source says why, though it was not
caught in a debugger here: a pair that closes fails neither an unbound send in its queue nor a
receive whose message has started to arrive, so a message the first process's cut ended midway
leaves its receiver waiting. Such an operation keeps its group's threads and descriptors until
the group's timeout; the recovery does not wait for it (gloo_ops: the training thread gives up
at the abort, and old groups are released each on its own).

Every TCP connection of the process is cut except the control plane's (the store, etcd, by
port) and listeners: a pending operation may wait on any group's connection, and the groups are
all rebuilt anyway. NCCL communicators are aborted through torch's `ProcessGroup.abort()`
(public since torch 2.6), each group on its own, and a group that fails to abort is logged.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import select
import socket
import struct
import termios
import threading
import time
from dataclasses import dataclass

import torch.distributed as dist

from ..megatron import gloo_ops
from ..megatron.groups import live_groups

log = logging.getLogger("deadpool.recovery")
SEND_GRACE_S = 0.2  # longest an abort waits for a connection's queued bytes to go out


def _sockets() -> dict[int, str]:
    """This process's socket descriptors: fd -> 'socket:[inode]'."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{name}")
            if target.startswith("socket:"):
                out[int(name)] = target
    return out


def abort_groups(groups: list, backend: str) -> list[str]:
    """`abort()` every group of `backend` (its pending collectives fail, its communicator is
    freed); returns the errors, each logged with the group it concerns."""
    errors = []
    for group in groups:
        try:
            if dist.get_backend(group) != backend:
                continue
            if hasattr(group, "abort"):
                group.abort()
            else:  # torch before ProcessGroup.abort() was public
                dist.distributed_c10d._abort_process_group(group)
        except Exception as err:  # one group failing to abort must not stop the others
            name = group.group_name if hasattr(group, "group_name") else repr(group)
            errors.append(f"{name}: {type(err).__name__}: {err}")
            log.error("could not abort %s group %s: %s: %s", backend, name,
                      type(err).__name__, err)  # fmt: skip
    return errors


class CutConnections:
    """Connections an abort cut, kept open under duplicate descriptors and drained: a peer
    that has not aborted yet may still be writing, and a write that cannot complete (a full
    receive buffer: EAGAIN) queues in gloo, which its own abort then never fails (the bug
    above). A connection is read only once gloo has closed its own descriptor (never in the
    middle of one of gloo's messages), and closed when the peer closed its end or at
    `close_all`. A drain thread exists while anything is held.

    The thread sleeps in an edge-triggered epoll: it wakes when a held connection receives
    bytes or its peer closes, and, while gloo still holds a descriptor, to look whether it has
    closed it (one fstat per such connection, at INTERVAL_S growing to MAX_INTERVAL_S). A
    recovery holds every connection of every group (135-141 per process at 32 processes)
    until its first resumed iteration; reading each of them every 10 ms, as it first did, took
    7% of a core per process while idle (`/proc/self/fd` scans on top while gloo still held
    some), more than this machine's 2 cores at 32 processes: the agent planning the recovery
    starved (4.4 minutes to plan, and the recovery timed out)."""

    INTERVAL_S = 0.01
    MAX_INTERVAL_S = 0.16
    EVENTS = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLET

    def __init__(self):
        self._lock = threading.Lock()
        self._held: dict[int, _Held] = {}  # our duplicate's fd -> the connection
        self._thread: tuple[threading.Thread, threading.Event] | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self.wakeups = 0  # times the drain thread woke (it should not while nothing happens)

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    def holds(self, inode: str) -> bool:
        """Whether the socket `inode` ('socket:[N]') is held (under any descriptor)."""
        with self._lock:
            return any(h.inode == inode for h in self._held.values())

    def add(self, fd: int, inode: str) -> None:
        """Hold a duplicate of `fd` (a socket gloo owns and is about to close)."""
        sock = socket.socket(fileno=os.dup(fd))
        sock.setblocking(False)
        with self._lock:
            self._held[sock.fileno()] = _Held(sock, inode, fd)
            if self._thread is None:
                stop = threading.Event()
                thread = threading.Thread(target=self._run, args=(stop,), name="deadpool-drain",
                                          daemon=True)  # fmt: skip
                self._thread = (thread, stop)
                thread.start()
        self._wake()

    def close_all(self) -> int:
        """Close everything held and end the drain thread; returns how many were held."""
        with self._lock:
            held, self._held = self._held, {}
            running, self._thread = self._thread, None
        if running is not None:
            running[1].set()
            self._wake()
            running[0].join()
        for h in held.values():
            h.sock.close()
        return len(held)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a wake-up is pending already
            os.write(self._wake_w, b"w")

    def _run(self, stop: threading.Event) -> None:
        with select.epoll() as ep:
            ep.register(self._wake_r, select.EPOLLIN)
            interval = self.INTERVAL_S
            while not stop.is_set():
                self.wakeups += 1
                gloo_holds = self._adopt(ep, stop)
                with self._lock:
                    if not self._held and self._thread is not None and self._thread[1] is stop:
                        self._thread = None
                        return
                events = ep.poll(interval if gloo_holds else -1)
                woken = False
                for fd, _ in events:
                    if fd == self._wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_r, 4096)
                        woken = True
                    else:
                        self._drain_one(ep, fd)
                interval = self.next_interval(interval, gloo_holds, woken)

    @classmethod
    def next_interval(cls, interval: float, gloo_holds: bool, woken: bool) -> float:
        """The drain thread's next look at descriptors gloo still holds: doubling up to
        MAX_INTERVAL_S while nothing changes, soon again after a new connection (`woken`) or
        once gloo held none (the next one is new)."""
        if woken or not gloo_holds:
            return cls.INTERVAL_S
        return min(2 * interval, cls.MAX_INTERVAL_S)

    def _adopt(self, ep: select.epoll, stop: threading.Event) -> bool:
        """Start watching the connections whose gloo descriptor is closed now; True while
        gloo still holds one (to be looked at again)."""
        with self._lock:
            waiting = [(fd, h) for fd, h in self._held.items() if not h.ours]
        left = False
        for fd, h in waiting:
            if stop.is_set():
                return False
            if h.gloo_holds():
                left = True
                continue
            with self._lock:
                if self._held.get(fd) is not h:
                    continue  # taken by close_all meanwhile
                h.ours = True
                # registering reports the connection once (a read-shut socket is readable):
                # the first drain runs at once
                ep.register(fd, self.EVENTS)
        return left

    def _drain_one(self, ep: select.epoll, fd: int) -> None:
        with self._lock:
            h = self._held.get(fd)
            if h is None:
                return  # taken by close_all meanwhile
            closed, more = _drain(h.sock)
            if closed:  # the peer closed its end: nothing left to protect
                ep.unregister(fd)
                del self._held[fd]
                h.sock.close()
        if more:  # edge-triggered: bytes left unread raise no new event
            self._wake()


@dataclass
class _Held:
    """One cut connection: our duplicate, and gloo's descriptor until gloo closes it."""

    sock: socket.socket
    inode: str  # 'socket:[N]'
    gloo_fd: int
    ours: bool = False  # gloo closed its descriptor: only we read it

    def gloo_holds(self) -> bool:
        """Whether gloo's descriptor still names this socket (a closed one's number may have
        been reused by another file: a different inode)."""
        try:
            return f"socket:[{os.fstat(self.gloo_fd).st_ino}]" == self.inode
        except OSError:
            return False


def _drain(sock: socket.socket, passes: int = 64) -> tuple[bool, bool]:
    """Read and drop what the peer sent; returns (the peer closed its end, bytes may be left
    after `passes` reads of 1 MiB: the lock is held meanwhile). After a read shutdown a read
    returns b'' whenever nothing is queued, so the TCP state tells whether the peer closed."""
    more = False
    with contextlib.suppress(OSError):
        for i in range(passes):
            if not sock.recv(1 << 20):
                break
            more = i == passes - 1
    try:
        state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:
        return True, False
    return state in (TCP_CLOSE, TCP_CLOSE_WAIT, TCP_LAST_ACK), more


TCP_CLOSE, TCP_CLOSE_WAIT, TCP_LAST_ACK = 7, 8, 9  # linux/tcp_states.h


class CommunicatorAbort:
    """Cut every connection of this process's process groups (all of them: whichever group a
    pending operation waits on), never the control plane's."""

    def __init__(self, control_ports: set[int] | None = None):
        self.control_ports = set(control_ports or ())
        self.cut = CutConnections()
        self._lock = threading.Lock()

    def rearm(self) -> None:
        """New groups are about to be built: their operations wait normally again. Never in
        the middle of an abort (another thread's, for a newer order): that abort's end would
        leave the new groups' operations refused."""
        with self._lock:
            gloo_ops.reset()

    def release(self) -> int:
        """Close the connections the aborts cut: once every peer has ended its own side (the
        next generation is up), closing reaches no gloo pair still sending. Returns how many."""
        return self.cut.close_all()

    def abort(self) -> int:
        """Make every pending collective of this process fail now; peers fail theirs when
        they abort in turn (the order reaches every process).

        A connection with bytes still in its send queue is cut once they are out (for at most
        SEND_GRACE_S): gloo then has no partly written send queued on it, which the cut would
        leave pending (measured with 4 MB all-reduces: 2 of 100 rank-rounds without the grace).
        Safe from any thread, idempotent; returns the number of connections cut.
        """
        n = 0
        with self._lock:
            gloo_ops.stop_posting()  # what fails next is the abort's doing, not a new failure
            if dist.is_initialized() and dist.get_backend() == "nccl":  # pragma: no cover (GPU)
                abort_groups(live_groups(), "nccl")
            todo = {fd: inode for fd, inode in _sockets().items()
                    if not self.cut.holds(inode) and self._group_connection(fd)}  # fmt: skip
            deadline = time.monotonic() + SEND_GRACE_S
            while todo:
                late = time.monotonic() >= deadline
                for fd in [fd for fd in todo if late or _unsent(fd) == 0]:
                    n += self._cut(fd, todo.pop(fd))
                if todo:
                    time.sleep(0.001)
            gloo_ops.abort_pending()  # operations gloo would not wake
        if n:
            log.info("aborted communicators: cut %d connection(s)", n)
        return n

    def _group_connection(self, fd: int) -> bool:
        """A connected TCP socket that is not the control plane's (the store, etcd)."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return False  # closed in the meantime
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                socket.AF_INET,
                socket.AF_INET6,
            ):
                return False
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False  # a listener: nothing waits on it
            ports = {sock.getsockname()[1]}
            with contextlib.suppress(OSError):
                ports.add(sock.getpeername()[1])
            return not ports & self.control_ports  # the recovery needs the control plane
        except OSError:
            return False
        finally:
            sock.detach()  # gloo owns the descriptor

    def _cut(self, fd: int, inode: str) -> bool:
        """End the read side of one group connection, keeping it open (and drained)."""
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return False  # closed in the meantime
        try:
            self.cut.add(fd, inode)  # before the shutdown: gloo closes fd on the end-of-file
            sock.shutdown(socket.SHUT_RD)
            return True
        except OSError:
            return False  # not connected (any more): nothing to break
        finally:
            sock.detach()  # gloo owns the descriptor and closes it


def _unsent(fd: int) -> int:
    """Bytes in a socket's send queue not yet acknowledged (0 if it cannot be read)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0
