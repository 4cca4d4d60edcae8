"""The launcher's monitor on a real (in-process) TCPStore with a fake clock and fake process
probes: evidence from exits, heartbeats, progress marks, the OS's process state and
self-reports becomes one classified detection, or a suspicion that is never fenced."""

import pytest

from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import FailureReport, Heartbeat, Injection
from deadpool_megatron.control.monitor import Monitor, ProcessProbe
from deadpool_megatron.failure.hang import HangPolicy
from deadpool_megatron.failure.progress import ProgressMark

JOB = "monitor-test"


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class Processes:
    """What the agent would read of each rank's process: its progress mark and OS state."""

    def __init__(self):
        self.marks = {r: ProgressMark(2, 1, "forward") for r in (0, 1, 2)}
        self.states = {r: "running" for r in (0, 1, 2)}

    def progress(self, rank, phase="forward"):
        m = self.marks[rank]
        self.marks[rank] = ProgressMark(m.seq + 2, m.iteration + (phase == "forward"), phase)

    def probe(self, rank):
        return ProcessProbe(1000 + rank, self.marks[rank], self.states[rank])


POLICY = HangPolicy(heartbeat_timeout_s=2.0, floor_s=10.0, factor=5.0, slow_phase_s=30.0)


def make(kv, codes, clock, procs=None, suspicions=None, ctx=None, stalls=None):
    procs = procs or Processes()
    return Monitor(
        ctx or JobContext(kv, JOB), [0, 1, 2], codes.get, 0.5, POLICY, watch_heartbeats=True, clock=clock,
        probe=procs.probe,
        on_suspect=lambda r, why: suspicions.append((r, why)) if suspicions is not None else None,
        on_stall=lambda r, why: stalls.append((r, why)) if stalls is not None else None,
    )  # fmt: skip


def beat(kv, rank, n, generation=0):
    kv.set(keys.heartbeat(JOB, generation, rank), Heartbeat(n, n, 100 + rank).encode())


def report_peer_loss(kv, ranks):
    msg = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    for rank in ranks:
        record = FailureReport("collective_error", msg, 1000.0)
        kv.set(keys.report(JOB, 0, rank), record.encode())


def advance(monitor, clock, seconds):
    clock.t += seconds
    return monitor.poll()


def test_a_killed_process_is_permanent_and_latency_comes_from_the_injection(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    assert monitor.poll() is None
    kv.set(keys.injected(JOB, 1), Injection("kill@1:3", 999.9, 0).encode())
    codes[1] = -9
    d = advance(monitor, clock, 0.2)
    assert (d.classification.rank, d.classification.kind.value) == (1, "permanent")
    assert d.latency_s == pytest.approx(0.3)


def test_a_stopped_process_is_hung_after_the_heartbeat_timeout_only(kv):
    clock, codes, procs = Clock(), {}, Processes()
    monitor = make(kv, codes, clock, procs)
    for n in range(3):
        for rank in (0, 1, 2):
            beat(kv, rank, n)
            procs.progress(rank)
        assert advance(monitor, clock, 0.5) is None
    assert monitor.iteration == 2
    procs.states[2] = "stopped"  # SIGSTOP: rank 2 stops beating and marking
    stopped_at = clock.t + 0.5
    d = None
    for n in range(3, 10):
        beat(kv, 0, n)
        beat(kv, 1, n)
        d = advance(monitor, clock, 0.5)
        if d is not None:
            break
    assert d.classification.rank == 2 and d.classification.kind.value == "permanent"
    assert type(d.classification.evidence).__name__ == "HeartbeatStale"
    assert "stopped" in d.classification.reason
    assert 2.0 < clock.t - stopped_at <= 2.0 + 0.5  # the timeout, within one poll


def test_a_late_heartbeat_from_a_progressing_process_is_only_suspected(kv):
    clock, codes, procs, suspicions = Clock(), {}, Processes(), []
    monitor = make(kv, codes, clock, procs, suspicions)
    for rank in (0, 1, 2):
        beat(kv, rank, 0)
    assert advance(monitor, clock, 0.1) is None
    # Rank 1 holds its GIL for 40 s (a checkpoint save): no beats, but its marks move on.
    for n in range(1, 81):
        beat(kv, 0, n)
        beat(kv, 2, n)
        procs.progress(0)
        procs.progress(2)
        if n % 20 == 0:
            procs.progress(1, "save")
        assert advance(monitor, clock, 0.5) is None
    assert [r for r, _ in suspicions] == [1]  # reported once per episode
    assert "heartbeat" in suspicions[0][1] and "late" in suspicions[0][1]
    beat(kv, 1, 99)  # it beats again: a later episode would be reported again
    assert advance(monitor, clock, 0.5) is None
    assert [r for r, _ in suspicions] == [1]


def test_a_late_heartbeat_without_progress_is_hung_after_the_phase_limit(kv):
    clock, codes, procs = Clock(), {}, Processes()
    monitor = make(kv, codes, clock, procs)
    for n in range(4):  # past the warm-up iterations; forward takes 0.5 s
        for rank in (0, 1, 2):
            beat(kv, rank, n)
            procs.progress(rank)
        assert advance(monitor, clock, 0.5) is None
    # Rank 0 deadlocks holding its GIL: running, but no beat and no mark. The limit of its
    # phase is the floor (10 s): 5 x 0.5 s is less.
    frozen_at = clock.t
    d = None
    while d is None and clock.t - frozen_at < 30:
        beat(kv, 1, 9)
        beat(kv, 2, 9)
        d = advance(monitor, clock, 0.5)
    assert d.classification.rank == 0
    assert "no progress for" in d.classification.reason
    assert 10.0 < clock.t - frozen_at <= 10.5 + 0.5


def test_a_blocked_training_thread_beating_on_time_is_said_once_and_never_fenced(kv):
    # Rank 2's training thread waits for itself (a deadlock), its heartbeat thread beats on;
    # ranks 0 and 1 wait for it in a collective, beating too. Past the phase limit (the
    # floor, 10 s) each is reported stalled once, with where it stopped; nobody is fenced.
    clock, codes, procs, suspicions, stalls = Clock(), {}, Processes(), [], []
    monitor = make(kv, codes, clock, procs, suspicions, stalls=stalls)
    for n in range(4):  # past the warm-up iterations; forward takes 0.5 s
        for rank in (0, 1, 2):
            beat(kv, rank, n)
            procs.progress(rank)
        assert advance(monitor, clock, 0.5) is None
    procs.progress(2, "optimizer")
    for n in range(4, 64):  # 30 s
        for rank in (0, 1, 2):
            beat(kv, rank, n)
        assert advance(monitor, clock, 0.5) is None
    assert sorted(r for r, _ in stalls) == [0, 1, 2] and suspicions == []
    why = dict(stalls)
    assert "at iteration 5, phase forward" in why[0] and "phase optimizer" in why[2]
    assert all("heartbeat is on time" in w for w in why.values())
    # Rank 0 progresses again, then stops again: a new episode, reported again once past
    # its limit, which has grown to 5 x the longest forward seen (the stall, some 30 s).
    procs.progress(0)
    resumed_at, n = clock.t, 64
    while len(stalls) == 3 and clock.t - resumed_at < 300:
        n += 1
        for rank in (0, 1, 2):
            beat(kv, rank, n)
        assert advance(monitor, clock, 0.5) is None
    assert sorted(r for r, _ in stalls) == [0, 0, 1, 2] and suspicions == []
    assert 150 < clock.t - resumed_at < 160, stalls[-1]


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


def test_training_is_over_once_a_rank_marks_finish_or_exits_cleanly(kv):
    clock, codes, procs = Clock(), {}, Processes()
    monitor = make(kv, codes, clock, procs)
    advance(monitor, clock, 0.1)
    assert not monitor.training_over()
    procs.progress(2, "finish")
    advance(monitor, clock, 0.1)
    assert monitor.training_over()
    monitor = make(kv, {1: 0}, clock)
    assert monitor.training_over()
    monitor = make(kv, {1: 1}, clock)  # a failed exit is a failure, not the end of training
    assert not monitor.training_over()


def test_a_self_reported_injected_error_is_transient(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    kv.set(keys.report(JOB, 0, 0), FailureReport("injected_transient", "x", 1000.0).encode())
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


def test_a_node_s_monitor_never_blames_its_own_silent_rank_for_hearsay(kv):
    # A node's agent watches its ranks 0 and 1 of a 3-rank job: rank 0 reports a lost peer,
    # rank 1 has not yet. The failure is elsewhere (rank 2's node tells, or its lease lapses):
    # rank 1 is not accused; only after twice the heartbeat timeout with nothing else is the
    # whole generation reset, attributed to the reporter.
    clock, codes = Clock(), {}
    monitor = Monitor(JobContext(kv, JOB), [0, 1], codes.get, 0.5, POLICY,
                      watch_heartbeats=True, clock=clock, probe=Processes().probe,
                      world_size=3)  # fmt: skip
    report_peer_loss(kv, (0,))
    for n in range(7):  # first seen at 0.4 s, still waiting 3.4 s later
        for rank in (0, 1):
            beat(kv, rank, n)
        assert advance(monitor, clock, 0.5 if n else 0.4) is None
    d = advance(monitor, clock, 1.1)  # 4.1 s after the report was first seen
    assert d.classification.kind.value == "transient" and d.classification.rank == 0
    assert "whole generation" in d.classification.reason


def test_hearsay_from_every_member_is_acted_on_after_twice_the_heartbeat_timeout(kv):
    # Every member reports a lost peer, every heartbeat stays fresh: nothing more will come
    # (the stall a process's own report overwritten by its consequence used to cause).
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    report_peer_loss(kv, (0, 1, 2))
    for n in range(8):  # first seen at 0.4 s, still waiting 3.5 s later
        for rank in (0, 1, 2):
            beat(kv, rank, n)
        assert advance(monitor, clock, 0.5 if n else 0.4) is None
    for rank in (0, 1, 2):
        beat(kv, rank, 9)
    d = advance(monitor, clock, 0.6)  # 4.1 s: twice the 2 s heartbeat timeout
    assert d.classification.kind.value == "transient" and d.classification.rank == 0
    assert "whole generation" in d.classification.reason


def test_a_process_stopped_before_its_first_beat_is_hung(kv):
    # Heartbeats start after the first iteration; a SIGSTOP during start-up is still seen.
    clock, codes, procs = Clock(), {}, Processes()
    monitor = make(kv, codes, clock, procs)
    procs.states[1] = "stopped"
    assert advance(monitor, clock, 0.1) is None
    assert advance(monitor, clock, 2.0) is None
    d = advance(monitor, clock, 0.2)
    assert d.classification.rank == 1 and "stopped" in d.classification.reason


def test_during_a_recovery_a_computing_rank_is_waited_for_and_a_stuck_one_is_lost(kv):
    clock, codes, procs = Clock(), {}, Processes()
    monitor = make(kv, codes, clock, procs)
    for _ in range(4):
        for rank in (0, 1, 2):
            procs.progress(rank)
        advance(monitor, clock, 0.5)
    codes[2] = -9
    assert "killed by signal SIGKILL" in monitor.lost(2)
    clock.t += 9.0  # rank 0 computes towards its next phase boundary: 9 s, under its limit
    assert monitor.lost(0) is None
    procs.progress(0)
    clock.t += 9.0
    assert monitor.lost(0) is None
    clock.t += 2.0  # rank 1 has shown nothing for 20 s: past the 10 s limit
    assert "no progress for" in monitor.lost(1)


def test_the_generation_is_read_from_the_context_and_an_injection_is_timed_once(kv):
    clock, codes, procs = Clock(), {}, Processes()
    ctx = JobContext(kv, JOB)
    monitor = make(kv, codes, clock, procs, ctx=ctx)
    kv.set(keys.injected(JOB, 1), Injection("kill@1:3", 999.9, 0).encode())
    codes[1] = -9
    assert advance(monitor, clock, 0.1).latency_s == pytest.approx(0.2)
    codes.pop(1)
    ctx.advance(1)  # the agent moved on: generation 1's keys from now on
    report = FailureReport("injected_transient", "x", 1001.0)
    kv.set(keys.report(JOB, 0, 2), report.encode())  # generation 0's: not looked at any more
    assert advance(monitor, clock, 0.2) is None
    kv.set(keys.report(JOB, 1, 2), report.encode())
    d = advance(monitor, clock, 0.2)
    assert d.classification.rank == 2 and d.latency_s is None  # no injection into rank 2
    ctx.advance(2)  # rank 2 reset in place; then a natural failure of rank 1:
    codes[1] = -9  # its old injection is not reused
    d = advance(monitor, clock, 0.2)
    assert d.classification.rank == 1 and d.latency_s is None


def test_an_own_error_is_read_with_the_place_its_rank_was(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    report = FailureReport("collective_error", "RuntimeError: bug", 1000.0, 5, "backward")
    kv.set(keys.report(JOB, 0, 1), report.encode())
    d = advance(monitor, clock, 0.2)
    assert d.classification.evidence.where == (5, "backward")
    monitor.record_error(d.classification.evidence)
    assert monitor.history.errors == (("RuntimeError: bug", 5, "backward"),)
    legacy = FailureReport.decode(b'{"at": 1.0, "kind": "collective_error", "message": "m"}')
    assert (legacy.iteration, legacy.phase) == (-1, "")  # where unknown: never a repeat


def test_a_reported_cuda_error_is_cuda_evidence_and_an_illegal_access_is_permanent(kv):
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    msg = "AcceleratorError: CUDA error: an illegal memory access was encountered"
    kv.set(keys.report(JOB, 0, 2), FailureReport("cuda_error", msg, 1000.0, 4, "forward").encode())
    d = advance(monitor, clock, 0.2)
    e = d.classification.evidence
    assert type(e).__name__ == "CudaError" and not e.recoverable and e.where == (4, "forward")
    assert (d.classification.rank, d.classification.kind.value) == (2, "permanent")


def test_an_exit_is_classified_with_the_own_error_its_process_reported_before_it(kv):
    # A spare whose takeover failed reports its error, then exits: the exit is seen at once,
    # and the report must be read with it (not a store poll later), since the error is what
    # the replay rule matches. The store was read 0.05 s before the exit: not due again yet.
    clock, codes = Clock(), {}
    monitor = make(kv, codes, clock)
    assert advance(monitor, clock, 0.2) is None
    bug = "InjectedBug: injected bug at iteration 5, phase recovery"
    kv.set(keys.report(JOB, 0, 1), FailureReport("collective_error", bug, 1000.2, 5,
                                                 "recovery").encode())  # fmt: skip
    codes[1] = 1
    d = advance(monitor, clock, 0.05)
    c = d.classification
    assert (c.rank, c.kind.value, type(c.evidence).__name__) == (1, "permanent", "ProcessExited")
    assert c.cause.where == (5, "recovery") and "after CollectiveError: rank 1: InjectedBug" in (
        c.reason
    )
    monitor.record_error(c.cause)
    assert monitor.history.errors == ((bug, 5, "recovery"),)
