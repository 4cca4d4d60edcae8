"""Replicas read from the sender's memory (`--deadpool-transport tcp` between two ranks on one
host): the kernel call against a real second process, the probe that decides which edges
pull, messages that skip the socket while small ones stream, the fallback when the kernel
refuses, and a sender that dies after its offer, which must read as the peer's loss."""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import select
import signal
import socket
import threading

import pytest
import torch
from rings import tcp_ring

from deadpool_megatron.checkpoint import cma, tcp_transport
from deadpool_megatron.checkpoint.layout import Entry, StateLayout
from deadpool_megatron.checkpoint.pipeline import ProtectionPipeline
from deadpool_megatron.checkpoint.tcp_connections import (
    HELLO,
    MAGIC,
    PROBE,
    PROBE_MAGIC,
    connect_ring,
    listen,
    negotiate_pull,
)
from deadpool_megatron.checkpoint.tcp_transport import (
    OFFER,
    OFFER_MAGIC,
    PULL_MIN_BYTES,
    TcpTransport,
)
from deadpool_megatron.failure.evidence import is_peer_loss_message

FORK = multiprocessing.get_context("fork")


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


SIZES = [40, 0, 9_000_000, 3000, PULL_MIN_BYTES, PULL_MIN_BYTES - 1, 4 << 20]
LARGE = sum(n >= PULL_MIN_BYTES for n in SIZES)


def _exchange(transports: list[TcpTransport]) -> None:
    """Both ranks of a ring of two send SIZES to each other, receives waited first (as the
    replicator does); every message arrives whole."""
    got: dict[int, list[torch.Tensor]] = {}

    def rank(r: int) -> None:
        t, peer = transports[r], 1 - r
        ins = [torch.empty(n, dtype=torch.uint8) for n in SIZES]
        receives = [t.irecv(x, peer) for x in ins]
        sends = [t.isend(_bytes(n, 10 * r + i), peer) for i, n in enumerate(SIZES)]
        for w in [*receives, *sends]:
            w.wait()
        got[r] = ins

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for r in range(2):
        for i, n in enumerate(SIZES):
            assert torch.equal(got[r][i], _bytes(n, 10 * (1 - r) + i)), (r, i, n)


@pytest.fixture
def reads(monkeypatch):
    """Every read of another process's memory the transport makes, by pid (the real call)."""
    calls: list[int] = []
    real = cma.read_from

    def counted(pid: int, address: int, into: memoryview) -> None:
        calls.append(pid)
        real(pid, address, into)

    monkeypatch.setattr(tcp_transport.cma, "read_from", counted)
    return calls


def _hold(conn, data: bytes) -> None:
    """A second process holding `data`: sends its pid and the address, then waits."""
    buf = ctypes.create_string_buffer(data, len(data))
    conn.send((os.getpid(), ctypes.addressof(buf)))
    conn.recv()


def test_reading_another_process_and_its_exit():
    data = os.urandom(1 << 20)
    parent, child = FORK.Pipe()
    proc = FORK.Process(target=_hold, args=(child, data))
    proc.start()
    pid, address = parent.recv()
    into = bytearray(len(data))
    cma.read_from(pid, address, memoryview(into))
    assert bytes(into) == data
    with pytest.raises(cma.PullRefused, match="Bad address"):
        cma.read_from(pid, 8, memoryview(into))  # no such mapping there
    os.kill(pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(cma.PeerGone, match=f"process {pid} has exited"):
        cma.read_from(pid, address, memoryview(into))


def test_large_messages_are_read_from_the_sender_and_small_ones_stream(reads):
    transports = tcp_ring(2, pull=True)
    assert [t._pulled_by for t in transports] == [{1}, {0}]
    assert [t._pull_from for t in transports] == [{1: os.getpid()}, {0: os.getpid()}]
    reads.clear()  # the probes'
    _exchange(transports)
    assert len(reads) == 2 * LARGE  # one read per large message, none for the small ones
    for t in transports:
        t.close()


def test_with_the_offer_off_every_byte_streams(reads):
    transports = tcp_ring(2, pull=False)
    assert [t._pulled_by for t in transports] == [set(), set()]
    _exchange(transports)
    assert reads == []
    for t in transports:
        t.close()


def test_a_read_the_kernel_refuses_streams_that_message_and_every_later_one(monkeypatch, caplog):
    """Where the kernel will not read the sender's buffer (memory another way mapped, say),
    the receiver asks for the bytes on the connection, once per offer, and stops trying."""
    transports = tcp_ring(2, pull=True)
    refused: list[int] = []

    def refuse(pid: int, address: int, into: memoryview) -> None:
        refused.append(pid)
        raise cma.PullRefused(14, "Bad address")

    monkeypatch.setattr(tcp_transport.cma, "read_from", refuse)
    _exchange(transports)
    _exchange(transports)
    assert len(refused) == 2  # one try per receiving rank
    assert caplog.text.count("are streamed from now on") == 2
    for t in transports:
        t.close()


def test_a_pid_that_names_another_process_is_not_read_from(monkeypatch, reads):
    """A sender on another host (or in another PID namespace) offers a pid that names some
    other process here: the token is not found there, and the edge streams."""
    monkeypatch.setattr(tcp_transport.os, "getpid", os.getppid)  # a real, other process
    transports = tcp_ring(2, pull=True)
    assert [t._pulled_by for t in transports] == [set(), set()]
    assert len(reads) == 2  # the probes, which found no token
    _exchange(transports)
    assert len(reads) == 2
    for t in transports:
        t.close()


def _offer_then_wait(port: int, ready) -> None:
    """Predecessor 0 in a process of its own: hello, probe, and an offer of 8 MB; then it
    waits for an answer it will not live to read."""
    payload = ctypes.create_string_buffer(os.urandom(8 << 20), 8 << 20)
    token = os.urandom(16)
    held = ctypes.create_string_buffer(token, 16)
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(HELLO.pack(MAGIC, 0, 1, 0))
    sock.sendall(PROBE.pack(PROBE_MAGIC, os.getpid(), ctypes.addressof(held), token))
    assert sock.recv(1) == b"\x01"
    sock.sendall(OFFER.pack(OFFER_MAGIC, ctypes.addressof(payload), 8 << 20))
    ready.set()
    sock.recv(1)


def test_a_sender_that_died_after_its_offer_fails_the_receive_as_its_loss():
    listener = listen("127.0.0.1")
    ready = FORK.Event()
    proc = FORK.Process(target=_offer_then_wait, args=(listener.getsockname()[1], ready))
    proc.start()
    _, recv_from = connect_ring(1, 0, listener, {}, [0], 10.0)
    pulled_by, pull_from = negotiate_pull({}, recv_from, 10.0)
    assert pull_from == {0: proc.pid}
    transport = TcpTransport({}, recv_from, 10.0, pulled_by=pulled_by, pull_from=pull_from)
    assert ready.wait(30)
    assert select.select([recv_from[0]], [], [], 10)[0]  # the offer is here
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    with pytest.raises(ConnectionError, match="Connection closed by peer") as err:
        transport.irecv(torch.empty(8 << 20, dtype=torch.uint8), 0).wait()
    assert is_peer_loss_message(str(err.value))  # hearsay about rank 0, not this rank's fault
    transport.close()


class _Big:
    """A ProtectedState of one float32 tensor of `nbytes`, all of it replicated."""

    def __init__(self, nbytes: int, scale: float):
        self.t = torch.arange(nbytes // 4, dtype=torch.float32) * scale
        entry = Entry("opt", 0, nbytes, torch.float32, (nbytes // 4,))
        self.layout = StateLayout((entry,), nbytes, nbytes)

    def tensors(self):
        return [self.t]

    def capture_metadata(self, iteration, extra):
        return b"{}"

    def restore_metadata(self, meta):
        pass

    def write_from(self, flat):
        self.t.copy_(flat.view(torch.float32))


def test_the_replication_pipeline_runs_over_pull_edges(reads):
    """Three ranks replicating 9 MB snapshots (three parts each) to their successors through
    the real pipeline: each part is read from the sender's slot, every replica verifies and
    equals its predecessor's state."""
    nbytes = 9_000_000
    transports = tcp_ring(3, pull=True)
    reads.clear()
    states = [_Big(nbytes, r + 1) for r in range(3)]
    pipelines = [
        ProtectionPipeline(
            states[r],
            transports[r],
            successors=[(r + 1) % 3],
            predecessors=[(r - 1) % 3],
            replica_nbytes={(r - 1) % 3: nbytes},
            use_cuda=False,
        )  # fmt: skip
        for r in range(3)
    ]
    for it in (1, 2):
        for r, p in enumerate(pipelines):
            states[r].t.add_(1.0)
            p.after_step(it)
        for p in pipelines:
            p.wait_for_replicas(it, timeout=60)
    for r, p in enumerate(pipelines):
        replica = p.replicator.replica((r - 1) % 3)
        assert replica.iteration == 2 and replica.verify()
        assert torch.equal(replica.buffer.view(torch.float32), states[(r - 1) % 3].t)
    closing = [threading.Thread(target=p.close) for p in pipelines]
    for th in closing:
        th.start()
    for th in closing:
        th.join(60)
    assert all(p.stopped for p in pipelines) and all(p.errors == [] for p in pipelines)
    assert len(reads) >= 3 * 2 * 3  # three ranks, two snapshots, three parts
