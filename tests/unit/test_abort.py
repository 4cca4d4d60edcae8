"""Aborting communicators: every group of the backend is aborted through torch's API, one
failing group is logged and does not stop the others (the NCCL path runs the same function);
a connection the gloo abort cut is held open and drained, on real sockets, only once gloo's
own descriptor is closed."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest
import torch.distributed as dist
from waiting import until

from deadpool_megatron.recovery.abort import CutConnections, abort_groups


@pytest.fixture
def gloo_world(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1),
                            rank=0, world_size=1)  # fmt: skip
    yield
    dist.destroy_process_group()


def test_groups_of_the_backend_are_aborted_and_others_left(gloo_world):
    group = dist.new_group([0], backend="gloo")
    assert abort_groups([group], "nccl") == []  # not an NCCL group: untouched
    assert abort_groups([group], "gloo") == []


def test_a_group_that_cannot_be_aborted_is_logged_and_the_rest_still_aborted(gloo_world, caplog):
    gone, live = dist.new_group([0], backend="gloo"), dist.new_group([0], backend="gloo")
    dist.destroy_process_group(gone)
    with caplog.at_level(logging.ERROR, logger="deadpool.recovery"):
        errors = abort_groups([gone, live], "gloo")
    assert len(errors) == 1 and "not initialized" in errors[0], errors
    assert "could not abort gloo group" in caplog.text


def _pair():
    with socket.create_server(("127.0.0.1", 0)) as server:
        peer = socket.create_connection(server.getsockname())
        ours, _ = server.accept()
    return ours, peer


def _inode(sock) -> str:
    return os.readlink(f"/proc/self/fd/{sock.fileno()}")


def _write_all(sock, nbytes: int, timeout_s: float = 10.0) -> int:
    """Write `nbytes` without blocking for longer than `timeout_s`; how many went out."""
    sock.setblocking(False)
    sent, chunk = 0, b"x" * (1 << 16)
    deadline = time.monotonic() + timeout_s
    while sent < nbytes and time.monotonic() < deadline:
        try:
            sent += sock.send(chunk[: nbytes - sent])
        except BlockingIOError:
            time.sleep(0.005)
    return sent


def test_a_cut_connection_is_read_only_after_gloo_closed_its_descriptor_then_drained():
    # gloo's descriptor ("ours") still open: the drain must not read a byte of gloo's stream
    ours, peer = _pair()
    cut = CutConnections()
    cut.add(ours.fileno(), _inode(ours))
    assert cut.holds(_inode(ours)) and not cut.holds(_inode(peer))  # a second abort skips it
    peer.sendall(b"gloo's message")
    time.sleep(0.1)
    assert ours.recv(64, socket.MSG_PEEK) == b"gloo's message"
    # gloo read its end-of-file and closed its descriptor: from here the peer, still sending
    # (its abort comes later), never finds the receive buffer full (a queued send gloo would
    # then never fail), far past what the socket buffers hold
    ours.shutdown(socket.SHUT_RD)
    ours.close()
    assert _write_all(peer, 64 << 20) == 64 << 20
    assert len(cut) == 1  # the connection itself stays open: the peer's pair sees nothing
    # the peer closes its end (its own recovery): the duplicate goes, and the thread with it
    peer.close()
    assert until(lambda: len(cut) == 0)
    assert until(lambda: not any(t.name == "deadpool-drain" for t in threading.enumerate()))
    assert cut.close_all() == 0


def test_close_all_closes_what_is_held_and_ends_the_thread():
    ours, peer = _pair()
    cut = CutConnections()
    cut.add(ours.fileno(), _inode(ours))
    ours.close()
    assert cut.close_all() == 1
    assert not any(t.name == "deadpool-drain" for t in threading.enumerate())
    peer.settimeout(10)
    assert peer.recv(1) == b""  # the connection is closed: the peer reads its end


def test_the_drain_thread_sleeps_while_held_connections_are_quiet_and_wakes_for_bytes():
    # a recovery holds every group connection until its first resumed iteration; a thread
    # that read each of them every 10 ms took more CPU than 32 processes' recovery had
    pairs = [_pair() for _ in range(20)]
    cut = CutConnections()
    for ours, _ in pairs:
        cut.add(ours.fileno(), _inode(ours))
        ours.shutdown(socket.SHUT_RD)
        ours.close()  # gloo closed its descriptor: the drain reads from here on

    def quiet_for(seconds: float) -> bool:
        before = cut.wakeups
        time.sleep(seconds)
        return cut.wakeups == before

    # once every connection is adopted, no wake-up at all (the old loop: about 50 in 0.5 s)
    assert until(lambda: quiet_for(0.5))
    quiet = cut.wakeups
    peer = pairs[7][1]
    assert _write_all(peer, 16 << 20) == 16 << 20  # drained as it arrives: never blocked
    assert cut.wakeups > quiet
    for _, peer in pairs:
        peer.close()
    assert until(lambda: len(cut) == 0)
    assert cut.close_all() == 0


def test_the_drain_threads_look_at_gloos_descriptors_backs_off_and_starts_over_when_woken():
    step = CutConnections.next_interval
    seen, interval = [], CutConnections.INTERVAL_S
    for _ in range(7):  # gloo keeps a descriptor open: 10, 20, 40, 80, 160, 160 ms ...
        interval = step(interval, gloo_holds=True, woken=False)
        seen.append(round(interval * 1000))
    assert seen == [20, 40, 80, 160, 160, 160, 160]
    assert step(interval, gloo_holds=True, woken=True) == CutConnections.INTERVAL_S
    assert step(interval, gloo_holds=False, woken=False) == CutConnections.INTERVAL_S
