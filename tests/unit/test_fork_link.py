"""The agent's end of the fork server's protocol (`ServerLink`) and its reader thread, against
an in-process server end of a real socket pair: readiness, replies in order, an exit that
arrives before its reply has been handed back, a server that refuses, and one that goes away
with children and a request pending (a fake clock for the wait on the orphans)."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
from waiting import FakeClock

from deadpool_megatron.agent.forks import ForkServerUnavailable, ServerLink
from deadpool_megatron.agent.forkserver import MAX_MESSAGE, Request, decode, encode


@pytest.fixture
def pair():
    agent, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield agent, server
    server.close()


def _serve_one(server: socket.socket, *replies: dict) -> threading.Thread:
    """Answer the next request with `replies` (each its own packet), in order."""

    def run():
        data, fds, _, _ = socket.recv_fds(server, MAX_MESSAGE, 1)
        assert decode(data)["argv"] == ["train.py"] and len(fds) == 1
        for fd in fds:
            os.write(fd, b"hello\n")
            os.close(fd)
        for reply in replies:
            server.send(encode(reply))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


REQUEST = Request(["train.py"], {}, "/")


def test_a_child_whose_exit_arrives_with_its_reply_is_already_exited(pair):
    agent, server = pair
    link = ServerLink(agent)
    server.send(encode({"ready": True, "preloaded": []}))
    link.wait_ready(10)
    _serve_one(server, {"pid": 4242}, {"exit": 4242, "code": 3})
    child = link.spawn(REQUEST, reply_timeout=10)
    assert child.pid == 4242 and child.wait(10) == 3 and child.poll() == 3
    assert child.stdout.read() == b"hello\n"  # the pipe handed over with the request
    link.close()
    link.join(10)


def test_replies_go_to_the_requests_in_order(pair):
    agent, server = pair
    link = ServerLink(agent)
    server.send(encode({"ready": True}))
    for pid in (11, 12):
        _serve_one(server, {"pid": pid})
        assert link.spawn(REQUEST, reply_timeout=10).pid == pid
    server.send(encode({"exit": 12, "code": 0}))
    server.send(encode({"exit": 11, "code": -9}))
    link.close()
    link.join(10)


def test_a_refusal_names_its_reason_to_every_caller(pair):
    agent, server = pair
    seen = []
    link = ServerLink(agent, on_ready=seen.append)
    server.send(encode({"ready": False, "reason": "the preloaded modules started threads"}))
    with pytest.raises(ForkServerUnavailable, match="started threads"):
        link.wait_ready(10)
    with pytest.raises(ForkServerUnavailable, match="started threads"):
        link.spawn(REQUEST)
    assert seen == []  # only a server that can fork is announced


def test_an_error_reply_raises_and_closes_the_pipe(pair, monkeypatch):
    agent, server = pair
    link = ServerLink(agent)
    server.send(encode({"ready": True}))
    # The pipe's own descriptors, not the process's count (other tests' threads and
    # collections open and close theirs meanwhile).
    opened, closed = [], []
    pipe, close = os.pipe, os.close
    monkeypatch.setattr(os, "pipe", lambda: opened.extend(pipe()) or tuple(opened[-2:]))
    monkeypatch.setattr(os, "close", lambda fd: closed.append(fd) or close(fd))
    t = _serve_one(server, {"error": "fork failed: out of memory"})
    with pytest.raises(ForkServerUnavailable, match="out of memory"):
        link.spawn(REQUEST, reply_timeout=10)
    t.join(10)
    assert len(opened) == 2 and set(opened) <= set(closed)  # both ends of the pipe closed


def test_no_answer_within_the_reply_timeout(pair):
    agent, server = pair
    link = ServerLink(agent)
    server.send(encode({"ready": True}))
    with pytest.raises(ForkServerUnavailable, match="no answer to a start within 0 s"):
        link.spawn(REQUEST, reply_timeout=0.2)


def test_a_server_that_never_says_it_is_ready():
    agent, server = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    link = ServerLink(agent)
    with pytest.raises(ForkServerUnavailable, match="not ready after 0 s"):
        link.wait_ready(0.1)
    server.close()


def test_a_server_gone_before_it_was_ready(pair):
    agent, server = pair
    link = ServerLink(agent)
    server.close()
    with pytest.raises(ForkServerUnavailable, match="exited before it was ready"):
        link.wait_ready(10)


def test_a_server_gone_reports_its_children_killed_once_they_are_gone(pair):
    agent, server = pair
    clock = FakeClock()
    alive = {21: True, 22: True}
    polls = {21: 0, 22: 0}

    def is_alive(pid: int) -> bool:
        polls[pid] += 1
        if polls[pid] > 3:  # 21 goes after a few looks; 22 never does
            alive[21] = False
        return alive[pid]

    link = ServerLink(agent, alive=is_alive, clock=clock, sleep=clock.sleep)
    server.send(encode({"ready": True}))
    done = _serve_one(server, {"pid": 21})
    first = link.spawn(REQUEST, reply_timeout=10)
    done.join(10)
    done = _serve_one(server, {"pid": 22})
    second = link.spawn(REQUEST, reply_timeout=10)
    done.join(10)
    server.close()
    assert first.wait(10) == -signal.SIGKILL and second.wait(10) == -signal.SIGKILL
    assert polls[21] == 4  # reported as soon as it had disappeared
    assert clock.now >= ServerLink.ORPHAN_WAIT_S  # 22: reported at the wait's end
    with pytest.raises(ForkServerUnavailable, match="fork server exited|is gone"):
        link.spawn(REQUEST, reply_timeout=10)
