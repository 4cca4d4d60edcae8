"""The helper-thread pool of the interruptible view: one thread for one-at-a-time waits
however many (the executor it replaces started a second one now and then), a second only
while the first is busy, errors handed to the waiter, and shutdown ending the idle threads
at once and a busy one when its wait returns."""

from __future__ import annotations

import threading

import pytest
from waiting import until

from deadpool_megatron.megatron.wait_pool import WaitPool


def _named(prefix: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(prefix)]


def test_waits_one_at_a_time_use_one_thread():
    pool = WaitPool("pool-seq")
    # The next wait submitted the moment the result is handed over (the done-callback runs
    # then, on the helper thread): the thread already counts itself idle and takes it. (The
    # executor this replaces started a second thread here.)
    go, chained = threading.Event(), []
    first = pool.submit(go.wait)
    first.add_done_callback(lambda _: chained.append(pool.submit(lambda: "next")))
    go.set()
    assert first.result(timeout=10) is True
    assert until(lambda: chained) and chained[0].result(timeout=10) == "next"
    assert pool.threads == 1
    for i in range(500):
        assert pool.submit(lambda i=i: i * 2).result(timeout=10) == i * 2
    assert pool.threads == 1 and len(_named("pool-seq")) == 1
    pool.shutdown()
    assert until(lambda: not _named("pool-seq"))


def test_a_second_thread_only_while_the_first_waits_and_errors_reach_the_waiter():
    pool = WaitPool("pool-two")
    release = threading.Event()
    blocked = pool.submit(release.wait)
    assert pool.submit(lambda: 7).result(timeout=10) == 7  # the first is busy: a second
    assert pool.threads == 2
    release.set()
    assert blocked.result(timeout=10) is True
    for _ in range(100):  # both idle now: no third, however the waits interleave
        pool.submit(lambda: None).result(timeout=10)
    assert pool.threads == 2

    def fails():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="closed by peer"):
        pool.submit(fails).result(timeout=10)
    pool.shutdown()
    assert until(lambda: not _named("pool-two"))


def test_shutdown_ends_idle_threads_now_and_a_busy_one_when_its_wait_returns():
    pool = WaitPool("pool-stop")
    release = threading.Event()
    busy = pool.submit(release.wait)
    pool.submit(lambda: None).result(timeout=10)
    assert len(_named("pool-stop")) == 2
    pool.shutdown()
    assert until(lambda: len(_named("pool-stop")) == 1)  # the idle one ended
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(lambda: None)
    release.set()  # the wait gloo never woke ends (at the group's timeout)
    assert busy.result(timeout=10) is True
    assert until(lambda: not _named("pool-stop"))
