"""The tcp replica transport (`--deadpool-transport tcp`) over real sockets on loopback: its
set-up refuses connections that are not the expected predecessor's, messages keep their order
both ways while each side waits for its receives first (as the replicator does), the real
replication pipeline runs over it, and nothing outlives an abort or a peer cut mid-message:
the stop that gloo could leave waiting until the group's timeout (test_replication_stop.py)
ends at once here."""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
import time

import pytest
import torch
from rings import tcp_ring
from test_replication_stop import NBYTES, OneTensor
from waiting import until

from deadpool_megatron.checkpoint import tcp_connections
from deadpool_megatron.checkpoint.pipeline import ProtectionPipeline
from deadpool_megatron.checkpoint.replicator import FLAG_DATA, HEADER
from deadpool_megatron.checkpoint.tcp_connections import (
    HELLO,
    MAGIC,
    OUTSIDE,
    Address,
    _route_to,
    connect_ring,
    interface_address,
    listen,
    reachable_host,
)
from deadpool_megatron.checkpoint.tcp_transport import (
    TcpTransport,
    TransportAborted,
)
from deadpool_megatron.failure.evidence import is_peer_loss_message
from deadpool_megatron.process.protection import _decode, _encode


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(
        0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)
    )


def test_messages_arrive_in_order_both_ways_with_receives_waited_first():
    """Each rank posts its receives, then its sends, and waits for the receives first: sends
    must progress while a rank waits on a receive, or two ranks would wait on each other."""
    transports = tcp_ring(2)
    sizes = [24, 0, 9_000_000, 1, 4 << 20]  # a header, nothing, parts larger than a buffer
    results: dict[int, list[torch.Tensor]] = {}

    def rank(r: int) -> None:
        t, peer = transports[r], 1 - r
        outs = [_bytes(n, 10 * r + i) for i, n in enumerate(sizes)]
        ins = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        receives = [t.irecv(x, peer) for x in ins]
        sends = [t.isend(x, peer) for x in outs]
        for w in [*receives, *sends]:
            w.wait()
        results[r] = ins

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    for r in range(2):
        for i, n in enumerate(sizes):
            assert torch.equal(results[r][i], _bytes(n, 10 * (1 - r) + i))
    for t in transports:
        t.close()


def test_the_replication_pipeline_runs_over_it():
    """Three ranks, each replicating its snapshot to its successor through the real pipeline;
    every replica equals its predecessor's state, and the agreed stop ends every thread."""
    transports = tcp_ring(3)
    states = [OneTensor() for _ in range(3)]
    for r, s in enumerate(states):
        s.t.mul_(r + 1)
    pipelines = [
        ProtectionPipeline(
            states[r],
            transports[r],
            successors=[(r + 1) % 3],
            predecessors=[(r - 1) % 3],
            replica_nbytes={(r - 1) % 3: NBYTES},
            use_cuda=False,
        )  # fmt: skip
        for r in range(3)
    ]
    for it in (1, 2):
        for r, p in enumerate(pipelines):
            states[r].t.add_(1.0)
            p.after_step(it)
        for p in pipelines:
            p.wait_for_replicas(it, timeout=30)
    for r, p in enumerate(pipelines):
        pred = (r - 1) % 3
        replica = p.replicator.replica(pred)
        assert replica.iteration == 2
        assert torch.equal(replica.buffer[:NBYTES].view(torch.float32), states[pred].t)
    closing = [threading.Thread(target=p.close) for p in pipelines]
    for th in closing:
        th.start()
    for th in closing:
        th.join(60)
    assert all(p.stopped for p in pipelines)
    assert all(p.errors == [] for p in pipelines)


def _half_sent_replica(generation: int = 0) -> tuple[TcpTransport, socket.socket]:
    """A receiving rank 1 whose predecessor 0 announced a replica and sent half of it."""
    listener = listen("127.0.0.1")
    peer = socket.create_connection(listener.getsockname())
    peer.sendall(HELLO.pack(MAGIC, 0, 1, generation))
    _, recv_from = connect_ring(1, generation, listener, {}, [0], 10.0)
    peer.sendall(HEADER.pack(FLAG_DATA, 5, 0, NBYTES, 0) + b"\0" * (NBYTES // 2))
    return TcpTransport({}, recv_from, timeout_s=600.0), peer


def test_an_abort_ends_a_receive_cut_mid_message():
    """What gloo can leave waiting until the group's timeout ends at the abort: the thread
    stops, and holds no slot."""
    transport, peer = _half_sent_replica()
    errors = []
    pipeline = ProtectionPipeline(OneTensor(), transport, successors=[], predecessors=[0],
                                  replica_nbytes={0: NBYTES}, use_cuda=False,
                                  on_error=errors.append)  # fmt: skip
    pair = pipeline.replicator.replicas[0]
    assert until(lambda: sum(s.busy for s in pair.slots) == 1, 30)  # receiving the payload
    started = time.monotonic()
    pipeline.abort(timeout=600.0)
    assert pipeline.stopped and time.monotonic() - started < 5
    assert not any(s.busy for s in pair.slots) and pair.iterations() == []
    assert errors == []  # the abort's doing, not a failure
    peer.close()


def test_a_peer_that_goes_away_mid_message_fails_the_receive_at_once():
    """... as evidence against the peer: the error reads as gloo's would."""
    transport, peer = _half_sent_replica()
    errors = []
    pipeline = ProtectionPipeline(OneTensor(), transport, successors=[], predecessors=[0],
                                  replica_nbytes={0: NBYTES}, use_cuda=False,
                                  on_error=errors.append)  # fmt: skip
    pair = pipeline.replicator.replicas[0]
    assert until(lambda: sum(s.busy for s in pair.slots) == 1, 30)
    peer.close()
    assert until(lambda: pipeline.replicator.stopped, 10)
    (error,) = errors
    assert "replica receive from rank 0: Connection closed by peer" in str(error)
    assert is_peer_loss_message(str(error))  # hearsay about rank 0, not this rank's fault
    assert not any(s.busy for s in pair.slots)
    pipeline.abort(timeout=1.0)


def test_an_abort_from_another_thread_wakes_a_wait():
    transports = tcp_ring(2)
    pending = transports[0].irecv(torch.empty(100, dtype=torch.uint8), 1)
    threading.Timer(0.2, transports[0].abort).start()
    with pytest.raises(TransportAborted):
        pending.wait()
    with pytest.raises(TransportAborted):  # and every later one
        transports[0].isend(torch.empty(1, dtype=torch.uint8), 1).wait()
    for t in transports:
        t.close()


def test_an_abort_after_close_touches_no_descriptor():
    """The replication thread closes its transport when it ends; a recovery's stop aborts it
    later: the closed descriptors' numbers may belong to other files by then."""
    transports = tcp_ring(2)
    held = transports[0]._wake_w  # the number its abort would write to
    r, w = os.pipe()  # before the close: neither end takes a number the close frees
    transports[0].close()
    os.dup2(w, held)  # another file takes the number
    try:
        transports[0].abort()
        os.set_blocking(r, False)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)  # nothing was written into it
    finally:
        for fd in (r, w, held):
            os.close(fd)
        transports[1].close()


def test_a_wait_with_no_byte_moving_times_out_by_its_clock():
    listener = listen("127.0.0.1")
    peer = socket.create_connection(listener.getsockname())
    peer.sendall(HELLO.pack(MAGIC, 0, 1, 0))
    _, recv_from = connect_ring(1, 0, listener, {}, [0], 10.0)
    now = [0.0]

    def clock() -> float:
        now[0] += 10.0
        return now[0]

    transport = TcpTransport({}, recv_from, timeout_s=25.0, clock=clock)
    with pytest.raises(TimeoutError, match="no byte moved for 25 s .*receive from rank 0") as err:
        transport.irecv(torch.empty(8, dtype=torch.uint8), 0).wait()
    assert is_peer_loss_message(str(err.value))  # as a survivor's gloo timeout is
    transport.close()
    peer.close()


def test_set_up_refuses_a_stranger_and_waits_for_the_expected_predecessor(caplog):
    listener = listen("127.0.0.1")
    stale = socket.create_connection(listener.getsockname())
    stale.sendall(HELLO.pack(MAGIC, 0, 1, 2))  # generation 2's, not 3's
    other = socket.create_connection(listener.getsockname())
    other.sendall(HELLO.pack(MAGIC, 5, 1, 3))  # not a predecessor
    good = socket.create_connection(listener.getsockname())
    good.sendall(HELLO.pack(MAGIC, 0, 1, 3))
    _, recv_from = connect_ring(1, 3, listener, {}, [0], 10.0)
    assert list(recv_from) == [0]
    assert caplog.text.count("refused a replica connection") == 2
    assert stale.recv(1) == b"" and other.recv(1) == b""  # closed
    for s in (stale, other, good, *recv_from.values()):
        s.close()


def test_set_up_names_the_predecessor_that_never_connected():
    listener = listen("127.0.0.1")
    with pytest.raises(TimeoutError, match=r"no replica connection from rank\(s\) \[4\]"):
        connect_ring(1, 0, listener, {}, [4], 0.3)


def test_the_advertised_host_is_the_one_that_routes_to_the_master():
    assert reachable_host("127.0.0.1") == "127.0.0.1"  # a job on one machine
    assert reachable_host("localhost") in ("127.0.0.1", "::1")


def test_on_the_masters_node_a_name_that_resolves_to_loopback_advertises_the_default_route():
    """MASTER_ADDR is node 0's own name; its /etc/hosts maps it to a loopback address, which
    ranks on other nodes cannot connect to: the default route's address is advertised, and a
    listener there takes connections."""
    name = socket.gethostname()
    if not ipaddress.ip_address(socket.gethostbyname(name)).is_loopback:
        pytest.skip(f"this machine's name {name!r} does not resolve to a loopback address")
    try:
        expected = _route_to(OUTSIDE)
    except OSError:
        pytest.skip("no default route here")
    host = reachable_host(name)
    assert host == expected and not ipaddress.ip_address(host).is_loopback
    with listen(host) as listener, socket.create_connection(listener.getsockname(), timeout=5):
        pass


def test_gloo_socket_ifname_names_the_interface_to_listen_on():
    assert interface_address("lo") == "127.0.0.1"
    with pytest.raises(ValueError, match="'no-such-if0' has no IPv4 address"):
        interface_address("no-such-if0")


def test_a_silent_stranger_does_not_hold_the_expected_predecessor(monkeypatch):
    monkeypatch.setattr(tcp_connections, "HELLO_TIMEOUT_S", 0.2)
    listener = listen("127.0.0.1")
    silent = socket.create_connection(listener.getsockname())  # connects, says nothing
    good = socket.create_connection(listener.getsockname())
    good.sendall(HELLO.pack(MAGIC, 0, 1, 0))
    started = time.monotonic()
    _, recv_from = connect_ring(1, 0, listener, {}, [0], 30.0)
    assert list(recv_from) == [0] and time.monotonic() - started < 10
    for s in (silent, good, *recv_from.values()):
        s.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "10.1.2.3", "::1", "fe80::1:2"])
def test_listener_addresses_survive_the_fixed_layout_exchange(host):
    """Addresses travel as integers (one all-gather of equal-length rows): both families."""
    encoded = _encode((host, 41234))
    assert len(encoded) == 18
    assert _decode(encoded) == Address(host, 41234)
