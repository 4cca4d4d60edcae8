"""The soak's growth figures (scripts/soak.py): a leak that stays raises a process's floor and
is reported; a left generation held one generation longer is not; a process is sampled in a
generation only once its log says it collected the generation before."""

from __future__ import annotations

import sys

from jobs import ROOT

sys.path.insert(0, str(ROOT / "scripts"))

import soak  # noqa: E402


def _generations(rows: dict[int, list[tuple[int, int, int]]]) -> dict[int, dict]:
    return {
        g: {"samples": [soak.Sample(pid, fds, threads, 400.0) for pid, fds, threads in r]}
        for g, r in rows.items()
    }


def test_a_generation_held_one_generation_longer_is_not_growth():
    # the short soak's own figures (fds, threads per process and generation)
    rows = {
        1: [(1, 131, 88), (2, 143, 97), (3, 144, 97), (4, 95, 61)],
        2: [(2, 159, 109), (3, 148, 102), (4, 151, 103), (5, 99, 64)],
        3: [(3, 96, 61), (4, 95, 61), (5, 99, 64), (6, 99, 64)],
        4: [(3, 96, 61), (4, 95, 61), (6, 99, 64), (7, 99, 64)],
        5: [(3, 108, 70), (4, 95, 61), (6, 99, 64), (7, 115, 76)],
    }
    out = soak.growth(_generations(rows))
    assert (out["fd_growth"], out["thread_growth"]) == (0, 0)
    assert out["processes_followed"] == 3  # 1, 2, 5 and 7 were sampled in fewer than 3


def test_a_leak_that_stays_is_growth():
    every = {g: [(1, 95 + 64 * (g - 1), 61 + 48 * (g - 1)), (2, 95, 61)] for g in range(1, 6)}
    assert soak.growth(_generations(every))["fd_growth"] == 192
    once = {g: [(1, 95 if g < 3 else 159, 61 if g < 3 else 109)] for g in range(1, 6)}
    out = soak.growth(_generations(once))
    assert (out["fd_growth"], out["thread_growth"]) == (64, 48)


def test_a_process_is_known_by_its_label_and_counted_once_it_collected():
    log = "\n".join([
        "10:00:00 [launcher] INFO deadpool.launch: started worker rank 1 (pid 101)",
        "10:00:00 [launcher] INFO deadpool.launch: started spare 0 (pid 200)",
        "10:00:05 [launcher] INFO deadpool.launch: spare 0 (pid 200) takes over rank 2",
        "[worker 1] 10:00:06 INFO deadpool.recovery: generation 1: freed the previous "
        "generation (1305 objects) in 0.2 s",
        "[spare 0] 10:00:06 INFO deadpool.recovery: generation 1: freed the previous "
        "generation (0 objects) in 0.0 s",
        "[worker 3] 10:00:06 INFO deadpool.recovery: generation 1: freed the previous "
        "generation (3 objects) in 0.2 s",
    ])  # fmt: skip
    assert soak.collected(log) == {101: {1}, 200: {1}}  # worker 3's start is not in this log
