"""Replicas over plain TCP connections that an abort ends at once (`--deadpool-transport tcp`).

gloo cannot always be woken from a transfer cut mid-message: its pair neither fails a
receive whose message has started to arrive nor an unbound send it queued, so a recovery's
stop could leave the replication thread waiting until the group's timeout (3-5 stops in 20
in scripts/bench_replica_abort.py). Here every ring edge is a connection of its own, one
direction of data each (the sender connected to the receiver), driven by the replication
thread itself with non-blocking sockets: `abort()` shuts the connections down from any
thread, and a wait raises at once; a peer that died resets or closes its end, which raises
too. Nothing waits on a connection longer than `timeout_s` without a byte moving.

Its connections are set up by tcp_connections.py (`connect_ring`, `negotiate_pull`).

Between two ranks on one host a payload need not cross the kernel twice (`send` into socket
buffers, `recv` out of them): `negotiate_pull` finds the edges whose receiver can read the
sender's memory itself (cma.py, one copy), and on those a large message goes as an offer (its
address and length); the receiver reads it, then answers, and the sender's operation ends
with the answer. A receiver the kernel refuses answers "stream it" and the bytes follow on
the connection. Both ends of an edge decide by the message's size alone (PULL_MIN_BYTES), so
they never disagree on what comes next.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping

import torch

from . import cma
from .transport import Transport

log = logging.getLogger("deadpool.replicate")

SOCKET_BUFFER_BYTES = 4 << 20  # a replica part (replicator.CHUNK_BYTES) in flight at once
# Pull edges: a message of at least this size is offered, smaller ones (a replica's header,
# its metadata) are streamed; what a read costs beyond its bytes is a system call and a reply.
PULL_MIN_BYTES = 64 << 10
OFFER = struct.Struct("<8sQQ")  # magic, address, length of a message the receiver reads
OFFER_MAGIC = b"DPOFFER1"
PULLED, STREAM_IT = b"\x01", b"\x02"  # a receiver's answer to an offer


class TransportAborted(ConnectionError):
    """The transport was aborted (a recovery stops the replication)."""


class _Op:
    """One posted send or receive: the tensor's bytes, its phase and how far it got.

    Phases: "stream" (the bytes go through the connection), or on a pull edge "offer" (the
    sender writes, the receiver reads, the offer's bytes), then "answer" (the receiver, having
    read the bytes itself, writes its answer; the sender reads it), then done, or "stream" if
    the answer was `STREAM_IT`. None: done."""

    __slots__ = ("tensor", "view", "offset", "error", "phase", "frame", "frame_offset", "answer")

    def __init__(self, tensor: torch.Tensor, pull: bool = False):
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise ValueError("the tcp transport moves contiguous host tensors only")
        self.tensor = tensor  # keeps the memory alive while the op is open
        self.view = (
            memoryview(tensor.view(torch.uint8).reshape(-1).numpy())
            if tensor.numel()
            else memoryview(b"")
        )
        self.offset = 0
        self.error: BaseException | None = None
        self.phase: str | None = ("offer" if pull else "stream") if len(self.view) else None
        self.frame = memoryview(bytearray(OFFER.size))  # the offer, written or read
        self.frame_offset = 0
        self.answer = PULLED

    @property
    def done(self) -> bool:
        return self.phase is None

    def reads(self, kind: str) -> bool:
        """Whether its next step reads from the connection (else it writes)."""
        return (kind == "receive") != (self.phase == "answer")


class TcpWork:
    """A posted operation's handle: `wait()` drives the transport until it is done."""

    def __init__(self, transport: TcpTransport, op: _Op):
        self._transport = transport
        self._op = op

    def wait(self) -> bool:
        self._transport._drive(self._op)
        return True

    def is_completed(self) -> bool:
        return self._op.done or self._op.error is not None


class TcpTransport(Transport):
    """Point-to-point over one connection per ring edge and direction (see the module). Only
    the thread that posts operations drives them (in `wait`); `abort` may come from any
    thread. Operations on one connection complete in the order they were posted."""

    def __init__(
        self,
        send_to: Mapping[int, socket.socket],
        recv_from: Mapping[int, socket.socket],
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        pulled_by: Iterable[int] = (),
        pull_from: Mapping[int, int] | None = None,
    ):
        """`pulled_by`: successors that read large messages from this process's memory;
        `pull_from`: the pid of each predecessor whose large messages this process reads
        (`negotiate_pull`)."""
        self._pulled_by = set(pulled_by)
        self._pull_from = dict(pull_from or {})
        self._refused: set[int] = set()  # predecessors whose memory the kernel would not read
        self._send_to = dict(send_to)
        self._recv_from = dict(recv_from)
        self.timeout_s = timeout_s
        self._clock = clock
        self._sends: dict[int, deque[_Op]] = {dst: deque() for dst in self._send_to}
        self._recvs: dict[int, deque[_Op]] = {src: deque() for src in self._recv_from}
        self._failed: dict[tuple[str, int], BaseException] = {}
        self._aborted = threading.Event()
        self._lock = threading.Lock()  # `abort` (any thread) against `close`
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._closed = False
        for sock in self._sockets():
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for sock in self._send_to.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        for sock in self._recv_from.values():
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)

    def _sockets(self) -> list[socket.socket]:
        return [*self._send_to.values(), *self._recv_from.values()]

    # -- Transport ------------------------------------------------------------------------
    def isend(self, tensor: torch.Tensor, dst: int) -> TcpWork:
        return self._post(tensor, "send", dst, self._sends)

    def irecv(self, tensor: torch.Tensor, src: int) -> TcpWork:
        return self._post(tensor, "receive", src, self._recvs)

    def abort(self) -> None:
        """End every connection now: a wait in progress, and every later one, raises."""
        self._aborted.set()
        with self._lock:  # after `close`, the descriptors' numbers may be another file's
            if self._closed:
                return
            for sock in self._sockets():
                with contextlib.suppress(OSError):  # not connected any more
                    sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Close the connections (by the thread that drove them, once it is done)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for sock in self._sockets():
                sock.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    # -- the progress engine --------------------------------------------------------------
    def _post(self, tensor: torch.Tensor, kind: str, peer: int, queues: dict) -> TcpWork:
        if peer not in queues:
            raise ValueError(f"no replica connection to {kind} {'to' if kind == 'send' else 'from'} "
                             f"rank {peer}: connections to {sorted(queues)}")  # fmt: skip
        edges = self._pulled_by if kind == "send" else self._pull_from
        op = _Op(tensor, pull=peer in edges and tensor.numel() * tensor.element_size()
                 >= PULL_MIN_BYTES)  # fmt: skip
        failed = self._failed.get((kind, peer))
        if failed is not None:
            op.error = failed
        elif not op.done:
            queues[peer].append(op)
        return TcpWork(self, op)

    def _drive(self, target: _Op) -> None:
        """Move bytes on every connection with something posted until `target` is done."""
        last_progress = self._clock()
        while True:
            if self._aborted.is_set():
                raise TransportAborted("the replica transport was aborted")
            if target.error is not None:
                raise target.error
            if target.done:
                return
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            by_fd = {}
            for kind, queues, conns in (("receive", self._recvs, self._recv_from),
                                        ("send", self._sends, self._send_to)):  # fmt: skip
                for peer, queue in queues.items():
                    if queue:
                        sock = conns[peer]
                        by_fd[sock.fileno()] = (kind, peer, sock, queue)
                        poller.register(
                            sock, select.POLLIN if queue[0].reads(kind) else select.POLLOUT
                        )
            left = self.timeout_s - (self._clock() - last_progress)
            if left <= 0:
                peers = ", ".join(f"{k} {'to' if k == 'send' else 'from'} rank {p}"
                                  for k, p, _, _ in by_fd.values())  # fmt: skip
                raise TimeoutError(f"Timed out waiting: no byte moved for {self.timeout_s:g} s "
                                   f"on the replica connections ({peers})")  # fmt: skip
            moved = False
            for fd, _events in poller.poll(min(left, 1.0) * 1000):
                if fd == self._wake_r:
                    continue
                kind, peer, sock, queue = by_fd[fd]
                try:
                    moved |= self._step(kind, peer, sock, queue)
                except OSError as err:
                    self._fail(kind, peer, queue, err)
            if moved:
                last_progress = self._clock()

    def _step(self, kind: str, peer: int, sock: socket.socket, queue: deque[_Op]) -> bool:
        op = queue[0]
        try:
            moved = self._advance(kind, peer, sock, op)
        except (BlockingIOError, InterruptedError):
            return False
        if op.done:
            queue.popleft()
        return moved

    def _advance(self, kind: str, peer: int, sock: socket.socket, op: _Op) -> bool:
        """One step of `op` on its connection, which poll found ready for it."""
        if op.phase == "stream":
            n = _move(sock, kind, op.view[op.offset :])
            op.offset += n
            if op.offset >= len(op.view):
                op.phase = None
            return n > 0
        if op.phase == "offer":
            if kind == "send" and op.frame_offset == 0:
                op.frame[:] = OFFER.pack(OFFER_MAGIC, op.tensor.data_ptr(), len(op.view))
            n = _move(sock, kind, op.frame[op.frame_offset :])
            op.frame_offset += n
            if op.frame_offset == OFFER.size:
                op.phase = "answer"
                if kind == "receive":
                    self._pull(peer, op)
            return n > 0
        # "answer": the receiver writes it, the sender reads it
        if kind == "receive":
            n = sock.send(op.answer)
            if n:
                op.phase = None if op.answer == PULLED else "stream"
            return n > 0
        answer = sock.recv(1)
        if not answer:
            raise ConnectionResetError("end of stream")
        if answer not in (PULLED, STREAM_IT):
            raise RuntimeError(f"rank {peer} answered an offer with {answer!r}: the two ends "
                               f"run different versions")  # fmt: skip
        op.phase = None if answer == PULLED else "stream"
        return True

    def _pull(self, peer: int, op: _Op) -> None:
        """Read an offered message from the sender's memory into `op`'s tensor (one copy); if
        the kernel refuses, once, answer "stream it" to this one and every later offer."""
        magic, address, nbytes = OFFER.unpack(op.frame)
        if magic != OFFER_MAGIC or nbytes != len(op.view):
            raise RuntimeError(f"rank {peer} offered {nbytes} bytes where {len(op.view)} were "
                               f"expected (magic {magic!r}): the two ends disagree")  # fmt: skip
        op.answer = STREAM_IT
        if peer in self._refused:
            return
        try:
            cma.read_from(self._pull_from[peer], address, op.view)
        except cma.PullRefused as err:  # e.g. memory the kernel will not read (pinned?)
            self._refused.add(peer)
            log.warning("replicas from rank %d are streamed from now on: reading its memory "
                        "failed (%s)", peer, err)  # fmt: skip
            return
        op.answer = PULLED

    def _fail(self, kind: str, peer: int, queue: deque[_Op], err: OSError) -> None:
        """A connection broke: every operation posted on it, and every later one, fails. The
        message says "Connection closed by peer", as gloo's do: it is evidence against the
        peer, not against this rank (failure/evidence.py)."""
        error = ConnectionError(f"replica {kind} {'to' if kind == 'send' else 'from'} rank "
                                f"{peer}: Connection closed by peer ({type(err).__name__}: "
                                f"{err})")  # fmt: skip
        self._failed[(kind, peer)] = error
        while queue:
            queue.popleft().error = error


def _move(sock: socket.socket, kind: str, view: memoryview) -> int:
    """Send from, or receive into, `view` what the connection takes or has now."""
    if kind == "send":
        return sock.send(view)
    n = sock.recv_into(view)
    if n == 0:
        raise ConnectionResetError("end of stream")
    return n
