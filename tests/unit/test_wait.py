"""The one polling loop (control/wait.py) with a fake clock: the first non-None result, the
pause fixed or doubling up to its cap, the timeout's message, and a poll that raises."""

from __future__ import annotations

import pytest

from deadpool_megatron.control.store import StoreTimeout
from deadpool_megatron.control.wait import wait_until


class Clock:
    def __init__(self):
        self.t = 0.0
        self.pauses: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.pauses.append(s)
        self.t += s


def _ready_after(n: int, value="done"):
    calls = iter(range(n + 1))
    return lambda: value if next(calls) == n else None


def test_the_first_result_ends_the_wait_after_fixed_pauses():
    clock = Clock()
    got = wait_until(_ready_after(3), 10.0, "x", interval_s=0.1, clock=clock, sleep=clock.sleep)
    assert got == "done" and clock.pauses == [0.1, 0.1, 0.1]


def test_the_pause_doubles_up_to_its_cap():
    clock = Clock()
    wait_until(_ready_after(6), 10.0, "x", interval_s=0.001, max_interval_s=0.005, clock=clock,
               sleep=clock.sleep)  # fmt: skip
    assert clock.pauses == [0.001, 0.002, 0.004, 0.005, 0.005, 0.005]


def test_the_timeout_names_what_was_awaited_or_says_its_own_words():
    clock = Clock()
    with pytest.raises(StoreTimeout, match="every agent to leave: not within 0.5 s"):
        wait_until(lambda: None, 0.5, "every agent to leave", interval_s=0.2, clock=clock,
                   sleep=clock.sleep)  # fmt: skip
    assert clock.t > 0.5 and len(clock.pauses) == 3
    with pytest.raises(StoreTimeout, match=r"keys \['a'\] did not appear"):
        wait_until(lambda: None, 0.5, "keys", timed_out=lambda: "keys ['a'] did not appear",
                   clock=clock, sleep=clock.sleep)  # fmt: skip


def test_a_poll_that_raises_stops_the_wait():
    clock = Clock()

    def poll():
        if clock.t >= 0.3:
            raise RuntimeError("a newer order")
        return None

    with pytest.raises(RuntimeError, match="a newer order"):
        wait_until(poll, 10.0, "x", interval_s=0.1, clock=clock, sleep=clock.sleep)
