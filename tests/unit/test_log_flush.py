"""log_flush.Flusher: flushes on its own thread, never the caller's; requests made during a
flush coalesce; a failing flush does not end it; close flushes what was asked, then ends."""

from __future__ import annotations

import threading

from deadpool_megatron.megatron.log_flush import Flusher

WAIT_S = 5.0


class GatedFlush:
    """A flush that counts its calls and, while `gate` is clear, blocks inside each."""

    def __init__(self) -> None:
        self.calls = 0
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.done = threading.Condition()

    def __call__(self) -> None:
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        with self.done:
            self.calls += 1
            self.done.notify_all()

    def wait_calls(self, n: int) -> bool:
        with self.done:
            return self.done.wait_for(lambda: self.calls >= n, WAIT_S)


def test_a_request_returns_while_the_flush_waits_and_requests_meanwhile_make_one_more():
    flush = GatedFlush()
    flusher = Flusher(flush, name="test-flush")
    flusher.request()
    assert flush.entered.wait(WAIT_S)
    for _ in range(5):  # the training thread goes on: each iteration asks again
        flusher.request()
    assert flush.calls == 0  # the first flush still waits on its file system
    flush.gate.set()
    assert flush.wait_calls(2)
    flusher.close()
    assert not flusher.alive
    # the first, one for the five asked meanwhile, and close's own
    assert flush.calls == 3 and set(flush.threads) == {"test-flush"}


def test_a_failing_flush_is_logged_and_the_next_request_flushes_again(caplog):
    calls = []
    failed = threading.Event()

    def flush() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            failed.set()
            raise OSError("Writer is closed")

    flusher = Flusher(flush)
    with caplog.at_level("DEBUG", logger="deadpool.upstream"):
        flusher.request()
        assert failed.wait(WAIT_S)
        flusher.close()
    assert "log flush failed: Writer is closed" in caplog.text
    assert calls == [0, 1] and not flusher.alive


def test_close_without_a_request_flushes_once_and_ends():
    flush = GatedFlush()
    flush.gate.set()
    flusher = Flusher(flush)
    flusher.close()
    assert flush.calls == 1 and not flusher.alive
