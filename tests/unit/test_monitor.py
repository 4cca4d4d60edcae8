"""The launcher's monitor on a real (in-process) TCPStore with a fake clock: evidence from
exits, heartbeats and self-reports becomes one classified detection."""

import json

import pytest

from deadpool_megatron.control import keys
from deadpool_megatron.control.monitor import Monitor
from deadpool_megatron.control.tcp_store import TcpKVStore

JOB = "monitor-test"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


@pytest.fixture
def kv():
    store = TcpKVStore("127.0.0.1", 0, is_master=True, timeout_s=5)
    yield store
    store.close()


def make(kv, codes, clock):
    return Monitor(kv, JOB, [0, 1, 2], codes.get, 0.5, 2.0, watch_heartbeats=True, clock=clock)


def beat(kv, rank, n):
    kv.set(keys.heartbeat(JOB, 0, rank), json.dumps({"t": n, "iteration": n}).encode())


def report_peer_loss(kv, ranks):
    msg = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    for rank in ranks:
        record = {"kind": "collective_error", "message": msg, "at": 1000.0}
        kv.set(keys.report(JOB, 0, rank), json.dumps(record).encode())


def advance(monitor, clock, seconds):
    clock.t += seconds
    return monitor.poll()


def test_a_killed_process_is_permanent_and_latency_comes_from_the_injection(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    assert monitor.poll() is None
    kv.set(keys.injected(JOB, 0, 1), json.dumps({"fault": "kill@1:3", "at": 999.9}).encode())
    codes[1] = -9
    d = advance(monitor, clock, 0.2)
    assert (d.classification.rank, d.classification.kind.value) == (1, "permanent")
    assert d.latency_s == pytest.approx(0.3)


def test_stale_heartbeat_is_detected_after_the_timeout_only(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    for n in range(3):
        for rank in (0, 1, 2):
            beat(kv, rank, n)
        assert advance(monitor, clock, 0.5) is None
    assert monitor.iteration == 2
    d = None
    for n in range(3, 10):  # rank 2 stops beating
        beat(kv, 0, n)
        beat(kv, 1, n)
        d = advance(monitor, clock, 0.5)
        if d is not None:
            break
    assert d.classification.rank == 2 and d.classification.kind.value == "permanent"
    assert type(d.classification.evidence).__name__ == "HeartbeatStale"
    assert clock.t - 1001.5 > 2.0  # no earlier than the timeout after the last beat


def test_a_rank_that_finished_is_never_accused(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    for rank in (0, 1, 2):
        beat(kv, rank, 1)
    assert advance(monitor, clock, 0.2) is None
    codes[0] = 0  # done; it beats no more
    for n in range(2, 12):
        beat(kv, 1, n)
        beat(kv, 2, n)
        assert advance(monitor, clock, 0.5) is None


def test_a_self_reported_injected_error_is_transient(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    kv.set(
        keys.report(JOB, 0, 0),
        json.dumps({"kind": "injected_transient", "message": "x", "at": 1000.0}).encode(),
    )
    d = advance(monitor, clock, 0.2)
    assert (d.classification.rank, d.classification.kind.value) == (0, "transient")


def test_survivors_hearsay_points_at_the_silent_rank_and_an_exit_overrides_it(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    report_peer_loss(kv, (0, 1))
    # Every member but rank 2 reports losing a peer: hearsay waits a heartbeat interval for
    # direct evidence, and the exit that arrives meanwhile decides.
    assert advance(monitor, clock, 0.2) is None
    codes[2] = -9
    d = advance(monitor, clock, 0.2)
    assert d.classification.rank == 2 and d.classification.kind.value == "permanent"


def test_hearsay_that_stays_alone_blames_the_silent_rank_after_the_grace(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    report_peer_loss(kv, (0, 1))
    assert advance(monitor, clock, 0.2) is None
    d = advance(monitor, clock, 0.4)
    assert d.classification.rank == 2 and d.classification.kind.value == "transient"
