"""Hung or only slow: the pure decisions of failure/hang.py with explicit times, and the
shared-memory progress board they read."""

import multiprocessing
import os
import signal

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.failure.hang import (
    HangPolicy,
    ProgressTracker,
    StallWatch,
    Verdict,
    assess,
)
from deadpool_megatron.failure.progress import ProgressBoard, ProgressMark, create_board_file

POLICY = HangPolicy(heartbeat_timeout_s=2.0, floor_s=10.0, factor=5.0, slow_phase_s=100.0)


def _tracker(steps, start=0.0):
    """A tracker fed with (phase, seconds spent in it) for successive marks."""
    t, seq, it = start, 0, 0
    tracker = ProgressTracker()
    for phase, spent in steps:
        seq += 2
        it += phase == "forward"
        tracker.observe(ProgressMark(seq, it, phase), t)
        t += spent
    return tracker, t


def test_policy_refuses_limits_that_contradict_each_other():
    with pytest.raises(ConfigError, match="--deadpool-hang-timeout 1.0 must be at least"):
        HangPolicy(heartbeat_timeout_s=2.0, floor_s=1.0)
    with pytest.raises(ConfigError, match="factor must be >= 1"):
        HangPolicy(factor=0.5)
    with pytest.raises(ConfigError, match="--deadpool-slow-phase-timeout 30.0"):
        HangPolicy(floor_s=60.0, slow_phase_s=30.0)


def test_phase_limit_is_the_floor_then_a_multiple_of_the_longest_seen():
    steps = [("forward", 1.0), ("optimizer", 0.2)] * 3 + [("forward", 4.0), ("optimizer", 0.1)]
    tracker, _ = _tracker(steps)
    assert not tracker.in_warmup()
    assert tracker.longest["forward"] == 4.0
    assert tracker.mark.phase == "optimizer"
    assert tracker.limit(POLICY) == 10.0  # 5 x 0.2 s is under the floor
    tracker, _ = _tracker(steps + [("forward", 0.5)])
    assert tracker.limit(POLICY) == 20.0  # 5 x the longest forward (4 s)


def test_slow_phases_and_the_first_iterations_get_their_allowance():
    tracker, _ = _tracker([("start", 0.0)])
    assert tracker.limit(POLICY) == 100.0
    tracker, _ = _tracker([("forward", 0.1), ("optimizer", 0.1)])
    assert tracker.in_warmup() and tracker.limit(POLICY) == 100.0
    tracker, _ = _tracker([("forward", 0.1), ("done", 0.1)] * 3 + [("save", 0)])
    assert not tracker.in_warmup() and tracker.limit(POLICY) == 100.0
    tracker, _ = _tracker([("forward", 0.1), ("done", 0.1)] * 3 + [("recovery", 0)])
    assert tracker.limit(POLICY) == 100.0


def test_an_unchanged_mark_does_not_count_as_progress():
    tracker = ProgressTracker()
    tracker.observe(ProgressMark(0, 0, "start"), 1.0)  # never marked: nothing seen yet
    assert tracker.idle_for(5.0) is None
    tracker.observe(ProgressMark(2, 1, "forward"), 2.0)
    tracker.observe(ProgressMark(2, 1, "forward"), 7.0)
    assert tracker.idle_for(9.0) == 7.0


def test_assess_a_late_beat_is_suspected_while_progress_is_recent():
    tracker, t = _tracker([("forward", 0.5), ("done", 0.1)] * 4)
    ok = assess(1.9, tracker, "running", 0.0, t, POLICY)
    assert ok.verdict is Verdict.OK
    late = assess(30.0, tracker, "running", 0.0, t + 9.0, POLICY)
    assert late.verdict is Verdict.SUSPECTED and "30.0 s late" in late.reason
    hung = assess(30.0, tracker, "running", 0.0, t + 10.5, POLICY)
    assert (
        hung.verdict is Verdict.HUNG and "no progress for 10.6 s" in hung.reason
    )  # last mark at t - 0.1


def test_assess_a_blocked_training_thread_beating_on_time_is_stalled_never_hung():
    # Its heartbeat thread beats, its training thread marks nothing: past the phase's limit
    # it is stalled (said once, never fenced), whatever the beat's age up to the timeout.
    tracker, t = _tracker([("forward", 0.5), ("done", 0.1)] * 4)
    assert assess(None, tracker, "sleeping", 0.0, t + 9.9, POLICY).verdict is Verdict.OK
    for beat_age in (None, 0.3, 2.0):
        a = assess(beat_age, tracker, "sleeping", 0.0, t + 10.5, POLICY)
        assert a.verdict is Verdict.STALLED, beat_age
    assert "no progress for 10.6 s at iteration 4, phase done (limit 10 s)" in a.reason
    assert "heartbeat is on time" in a.reason and "--distributed-timeout-minutes" in a.reason
    # A slow phase gets its allowance here too: a long save is not a stall.
    tracker, t = _tracker([("forward", 0.5), ("done", 0.1)] * 4 + [("save", 0.0)])
    assert assess(None, tracker, "running", 0.0, t + 99.0, POLICY).verdict is Verdict.OK
    assert assess(None, tracker, "running", 0.0, t + 101.0, POLICY).verdict is Verdict.STALLED
    # Before its first mark nothing is known of its progress.
    assert assess(None, ProgressTracker(), "running", 0.0, 1e6, POLICY).verdict is Verdict.OK


def test_assess_a_stopped_process_is_hung_after_the_heartbeat_timeout_whatever_its_beat():
    tracker, t = _tracker([("forward", 0.5)] * 4)
    assert assess(None, tracker, "stopped", 1.5, t, POLICY).verdict is Verdict.OK
    a = assess(None, tracker, "stopped", 2.1, t, POLICY)
    assert a.verdict is Verdict.HUNG and "stopped" in a.reason
    assert assess(0.1, tracker, "dead", 2.1, t, POLICY).verdict is Verdict.HUNG


def test_a_zombie_is_exiting_and_hung_only_after_the_hang_timeout():
    # Its exit status is on its way (its last threads are still leaving): not a hang yet.
    tracker, t = _tracker([("forward", 0.5)] * 4 + [("finish", 0.5)])
    assert assess(0.1, tracker, "zombie", 2.1, t, POLICY).verdict is Verdict.OK
    assert assess(3.0, tracker, "zombie", 9.0, t, POLICY).verdict is Verdict.SUSPECTED
    a = assess(3.0, tracker, "zombie", 10.5, t, POLICY)
    assert a.verdict is Verdict.HUNG and "zombie (for 10.5 s)" in a.reason


def test_stall_watch_waits_for_a_computing_thread_and_gives_up_on_a_blocked_one():
    watch = StallWatch(POLICY)
    tracker_steps = [("forward", 0.5), ("done", 0.1)] * 4
    seq = 0
    for phase, _ in tracker_steps:
        seq += 2
        watch.observe(ProgressMark(seq, seq // 4, phase), seq / 10)
    now = seq / 10
    assert watch.stalled(now + 100) is None  # no order: nothing is waited for
    # An order: the training thread computes (CPU time grows) but marks nothing for 8 s.
    watch.watch_cpu(10.0, now)
    for i in range(1, 9):
        watch.watch_cpu(10.0 + i, now + i)
        watch.observe(ProgressMark(seq, seq // 4, "done"), now + i)
        assert watch.stalled(now + i) is None
    # Then it blocks (from now + 8): no CPU time and no mark for longer than max(1 s,
    # heartbeat timeout).
    watch.watch_cpu(18.0, now + 9.0)
    watch.watch_cpu(18.0, now + 10.0)
    assert watch.stalled(now + 9.9) is None
    why = watch.stalled(now + 10.1)
    assert why.startswith("blocked at iteration") and "no CPU time for 2.1 s" in why


def test_stall_watch_gives_up_on_a_thread_computing_past_its_phase_limit():
    watch = StallWatch(POLICY)
    for seq in range(2, 20, 2):
        watch.observe(ProgressMark(seq, seq, "forward"), seq / 10)
    watch.watch_cpu(1.0, 2.0)
    for t in range(3, 14):
        watch.watch_cpu(float(t), float(t))
    why = watch.stalled(13.0)
    assert why is not None and why.startswith("computing without progress for 11.2 s")
    watch.stop_watching()
    assert watch.stalled(100.0) is None


def test_board_marks_are_read_through_a_second_mapping(tmp_path):
    path = str(tmp_path / "board")
    create_board_file(path)
    reader = ProgressBoard(path, writable=False)
    assert reader.read() == ProgressMark(0, 0, "start")
    writer = ProgressBoard(path)
    writer.mark(7, "backward")
    assert reader.read() == ProgressMark(2, 7, "backward")
    writer.mark(7, "optimizer")
    assert reader.read() == ProgressMark(4, 7, "optimizer")
    again = ProgressBoard(path)  # a process reopening its board continues the sequence
    again.mark(8, "forward")
    assert reader.read() == ProgressMark(6, 8, "forward")


def _mark_then_stop(path):
    board = ProgressBoard(path)
    board.mark(3, "save")
    os.kill(os.getpid(), signal.SIGSTOP)


def test_board_of_a_stopped_process_still_reads_its_last_mark(tmp_path):
    path = str(tmp_path / "board")
    create_board_file(path)
    reader = ProgressBoard(path, writable=False)
    child = multiprocessing.get_context("spawn").Process(target=_mark_then_stop, args=(path,))
    child.start()
    try:
        for _ in range(500):
            if reader.read().seq:
                break
            child.join(0.02)
        assert reader.read() == ProgressMark(2, 3, "save")
    finally:
        child.kill()
        child.join(10)


def test_private_board_without_a_file():
    board = ProgressBoard()
    board.mark(1, "forward")
    assert board.read() == ProgressMark(2, 1, "forward")
