"""Heartbeat detector with a fake clock, and the sender thread driven without real waits."""

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.failure.evidence import HeartbeatStale
from deadpool_megatron.failure.heartbeat import HeartbeatDetector, HeartbeatSender


class FakeClock:
    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def _detector(clock=None):
    return HeartbeatDetector(interval_s=0.5, timeout_s=1.5, clock=clock or FakeClock())


def test_fresh_exactly_at_timeout_then_stale():
    clock = FakeClock(100.0)
    d = _detector(clock)
    d.beat(3)
    clock.t = 101.0
    assert d.stale() == []
    clock.t = 101.5  # exactly at the timeout: still fresh
    assert d.stale() == []
    clock.t = 101.5001
    assert d.stale() == [HeartbeatStale(3, 100.0, 101.5001)]
    assert d.stale() == [HeartbeatStale(3, 100.0, 101.5001)]  # reported until beat or forgot
    d.beat(3)
    assert d.stale() == [] and d.last_seen(3) == 101.5001


def test_explicit_now_overrides_the_clock_and_late_beats_never_move_back():
    d = _detector(FakeClock(0.0))
    d.beat(1, now=10.0)
    d.beat(1, now=9.0)  # delivered late
    assert d.last_seen(1) == 10.0
    assert d.stale(now=11.5) == []
    assert [e.rank for e in d.stale(now=11.6)] == [1]


def test_only_stale_ranks_are_reported_in_rank_order():
    d = _detector()
    for rank, t in [(5, 100.0), (0, 100.0), (2, 101.0)]:
        d.beat(rank, now=t)
    assert [e.rank for e in d.stale(now=102.0)] == [0, 5]


def test_a_rank_that_never_beat_is_stale_only_after_start_and_timeout():
    clock = FakeClock(100.0)
    d = _detector(clock)
    clock.t = 1000.0
    assert d.stale() == []  # nothing expected yet, however long it has been
    d.start([0, 1, 2])
    d.beat(0)
    clock.t = 1001.5
    assert d.stale() == []
    clock.t = 1001.6
    assert d.stale() == [
        HeartbeatStale(0, 1000.0, 1001.6),
        HeartbeatStale(1, None, 1001.6),
        HeartbeatStale(2, None, 1001.6),
    ]
    d.beat(1)
    assert [e.rank for e in d.stale()] == [0, 2]


def test_start_does_not_reset_a_rank_that_already_beat():
    d = _detector()
    d.beat(4, now=100.0)
    d.start([4], now=101.0)
    assert [e.rank for e in d.stale(now=101.6)] == [4]


def test_forget_stops_watching_a_rank():
    d = _detector()
    d.start([1], now=100.0)
    d.beat(2, now=100.0)
    d.forget(1)
    d.forget(2)
    d.forget(9)  # unknown: no error
    assert d.stale(now=200.0) == [] and d.last_seen(2) is None


@pytest.mark.parametrize("interval, timeout", [(0.0, 1.0), (-1.0, 1.0), (1.0, 1.0), (2.0, 1.0)])
def test_timeout_must_exceed_interval_must_exceed_zero(interval, timeout):
    with pytest.raises(ConfigError) as info:
        HeartbeatDetector(interval, timeout, clock=FakeClock())
    message = str(info.value)
    assert f"--deadpool-heartbeat-interval {interval}" in message
    assert f"--deadpool-heartbeat-timeout {timeout}" in message


def _driven_sender(publish, interval, clock, stop_after, stall_at=None):
    """A sender whose sleep advances the fake clock; stops itself after `stop_after` sleeps."""
    sleeps = []

    def sleep(s):
        sleeps.append(s)
        clock.t += s
        if len(sleeps) == stall_at:
            clock.t += 3.2 * interval  # a GIL stall
        if len(sleeps) >= stop_after:
            sender.stop()

    sender = HeartbeatSender(publish, interval, clock=clock, sleep=sleep)
    return sender, sleeps


def test_sender_publishes_every_interval_without_drift():
    clock = FakeClock(10.0)
    published = []

    def publish(now):
        published.append(now)
        clock.t += 0.1  # publishing takes time; the next beat must not drift by it

    sender, _ = _driven_sender(publish, 0.5, clock, stop_after=4)
    sender.run()
    assert published == pytest.approx([10.0, 10.5, 11.0, 11.5])
    assert sender.beats == 4 and sender.stopped


def test_sender_skips_missed_beats_after_a_stall_instead_of_bursting():
    clock = FakeClock(0.0)
    published = []
    sender, sleeps = _driven_sender(published.append, 1.0, clock, stop_after=4, stall_at=2)
    sender.run()
    assert published == pytest.approx([0.0, 1.0, 5.2, 6.2])
    assert all(s > 0 for s in sleeps)


def test_sender_survives_a_failing_publish():
    clock = FakeClock(0.0)
    calls = []

    def publish(now):
        calls.append(now)
        if len(calls) == 2:
            raise ConnectionError("store unreachable")

    sender, _ = _driven_sender(publish, 1.0, clock, stop_after=3)
    sender.run()
    assert len(calls) == 3 and sender.beats == 2 and sender.errors == 1
    assert isinstance(sender.last_error, ConnectionError)


def test_sender_thread_stops_promptly_with_the_default_sleep():
    import threading

    beaten = threading.Event()
    sender = HeartbeatSender(lambda now: beaten.set(), interval_s=60.0)
    sender.start()
    assert beaten.wait(5.0)
    sender.stop()  # must not wait out the 60 s interval
    sender.join(timeout=5.0)
    assert not sender.is_alive() and sender.beats == 1


def test_sender_rejects_a_non_positive_interval():
    with pytest.raises(ConfigError, match="interval"):
        HeartbeatSender(lambda now: None, 0.0)
