"""Classifier: evidence -> transient | permanent, as a table; escalation; conflicting evidence."""

import pytest

from deadpool_megatron.errors import ConfigError
from deadpool_megatron.failure.classify import (
    ClassifyPolicy,
    Decision,
    FailureHistory,
    InconclusiveEvidence,
    classify,
    suspect_rank,
)
from deadpool_megatron.failure.evidence import (
    CollectiveError,
    CudaError,
    HealthCheckFailed,
    HeartbeatStale,
    InjectedTransient,
    ProcessExited,
    is_peer_loss_message,
)

T, P = Decision.TRANSIENT, Decision.PERMANENT
CLOSED = "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:4242"
TIMEOUT = "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete"
NCCL_WD = (
    "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE)"
)
LOCAL = "Mismatch in tensor sizes: expected 1024, got 512"

# (id, evidence, expected kind, expected rank, the evidence class that must lead the reason)
TABLE = [
    ("exit", [ProcessExited(3, -9, 10.0)], P, 3, "ProcessExited"),
    ("exit-status-0", [ProcessExited(2, 0, 10.0)], P, 2, "ProcessExited"),
    ("stale", [HeartbeatStale(4, 8.0, 10.0)], P, 4, "HeartbeatStale"),
    ("never-beat", [HeartbeatStale(4, None, 10.0)], P, 4, "HeartbeatStale"),
    ("health", [HealthCheckFailed(1, "GPU fell off the bus", 10.0)], P, 1, "HealthCheckFailed"),
    ("cuda-fatal", [CudaError(5, "illegal memory access", False, 10.0)], P, 5, "CudaError"),
    ("cuda-recoverable", [CudaError(5, "out of memory", True, 10.0)], T, 5, "CudaError"),
    ("injected", [InjectedTransient(6, 10.0)], T, 6, "InjectedTransient"),
    ("local-collective", [CollectiveError(2, LOCAL, 10.0)], T, 2, "CollectiveError"),
    # a survivor's peer-loss report is hearsay about the peer, with its heartbeat fresh
    ("peer-loss-named", [CollectiveError(0, CLOSED, 10.0, peer=7)], T, 7, "CollectiveError"),
    # conflicts: exit beats the collective errors it causes, on the dying rank or survivors
    (
        "exit-beats-own-collective",
        [CollectiveError(3, LOCAL, 9.9), ProcessExited(3, -9, 10.0)],
        P,
        3,
        "ProcessExited",
    ),
    (
        "exit-beats-survivors-reports",
        [
            CollectiveError(0, CLOSED, 10.04),
            CollectiveError(2, CLOSED, 10.05, peer=1),
            ProcessExited(3, -9, 10.0),
        ],
        P,
        3,
        "ProcessExited",
    ),
    # exit beats stale even when the stale report came first: it is the more certain cause
    (
        "exit-beats-stale",
        [HeartbeatStale(2, 1.0, 9.0), ProcessExited(5, -6, 10.0)],
        P,
        5,
        "ProcessExited",
    ),
    # a hung rank cannot be trusted to reset itself: stale beats its own transient report
    (
        "stale-beats-injected",
        [InjectedTransient(2, 9.0), HeartbeatStale(2, 8.0, 10.0)],
        P,
        2,
        "HeartbeatStale",
    ),
    (
        "stale-beats-timeouts",
        [CollectiveError(0, TIMEOUT, 31.0), HeartbeatStale(1, 8.0, 10.0)],
        P,
        1,
        "HeartbeatStale",
    ),
    (
        "health-beats-cuda-fatal",
        [CudaError(0, "x", False, 9.0), HealthCheckFailed(1, "ecc", 10.0)],
        P,
        1,
        "HealthCheckFailed",
    ),
    (
        "permanent-beats-transient",
        [InjectedTransient(0, 1.0), CudaError(4, "x", False, 10.0)],
        P,
        4,
        "CudaError",
    ),
    # first-hand beats hearsay: the rank that raised explains its peers' reports
    (
        "first-hand-beats-hearsay",
        [CollectiveError(1, CLOSED, 10.0, peer=2), InjectedTransient(3, 10.1)],
        T,
        3,
        "InjectedTransient",
    ),
    (
        "earliest-transient",
        [InjectedTransient(4, 10.2), CudaError(1, "oom", True, 10.1)],
        T,
        1,
        "CudaError",
    ),
    (
        "earliest-exit",
        [ProcessExited(6, -9, 10.2), ProcessExited(2, 1, 10.1)],
        P,
        2,
        "ProcessExited",
    ),
    (
        "same-time-lowest-rank",
        [ProcessExited(6, -9, 10.0), ProcessExited(2, -9, 10.0)],
        P,
        2,
        "ProcessExited",
    ),
]


@pytest.mark.parametrize(
    "evidence, kind, rank, lead", [row[1:] for row in TABLE], ids=[r[0] for r in TABLE]
)
def test_classifier_table(evidence, kind, rank, lead):
    c = classify(evidence, FailureHistory(), ClassifyPolicy())
    assert (c.kind, c.rank) == (kind, rank)
    assert c.reason.startswith(lead + ":"), c.reason
    assert type(c.evidence).__name__ == lead


def test_reason_names_the_signal():
    c = classify([ProcessExited(3, -9, 1.0)], FailureHistory())
    assert "SIGKILL" in c.reason and "rank 3" in c.reason


def _history(rank, times):
    h = FailureHistory()
    for t in times:
        h = h.record(rank, t)
    return h


@pytest.mark.parametrize(
    "past, now, kind",
    [
        ([], 1000.0, T),
        ([900.0, 950.0], 1000.0, T),  # 3rd failure: at the limit, still transient
        ([900.0, 950.0, 990.0], 1000.0, P),  # 4th within the window: escalates
        ([400.0, 950.0, 990.0], 1000.0, P),  # window edge included: 1000 - 600 = 400
        ([399.9, 950.0, 990.0], 1000.0, T),  # just outside the window: forgotten
        ([900.0, 950.0, 1000.5], 1000.0, T),  # records after the evidence do not count
    ],
)
def test_repeated_transients_escalate_within_the_window(past, now, kind):
    c = classify([InjectedTransient(2, now)], _history(2, past), ClassifyPolicy(3, 600.0))
    assert c.kind is kind and c.rank == 2
    assert ("escalated" in c.reason) == (kind is P)


def test_escalation_counts_only_the_same_rank():
    h = _history(1, [990.0, 991.0, 992.0, 993.0])
    assert classify([InjectedTransient(2, 1000.0)], h).kind is T
    assert classify([InjectedTransient(1, 1000.0)], h).kind is P


def test_max_transient_zero_makes_every_failure_permanent():
    c = classify(
        [CudaError(0, "oom", True, 1.0)], FailureHistory(), ClassifyPolicy(max_transient=0)
    )
    assert c.kind is P and "max 0" in c.reason


def test_survivor_reporting_a_peer_loss_is_not_accused_even_with_a_bad_history():
    survivor_history = _history(0, [995.0, 996.0, 997.0, 998.0])
    reports = [
        CollectiveError(0, CLOSED, 1000.0, peer=3),
        CollectiveError(1, CLOSED, 1000.0, peer=3),
    ]
    c = classify(reports, survivor_history)
    assert (c.kind, c.rank) == (T, 3) and "attributed to rank 3" in c.reason
    c = classify([*reports, ProcessExited(3, -9, 999.97)], survivor_history)
    assert (c.kind, c.rank) == (P, 3)


def test_anonymous_peer_loss_is_attributed_to_the_one_silent_member():
    reports = [CollectiveError(r, CLOSED, 10.0) for r in (0, 1, 3)]
    assert classify(reports, FailureHistory(), ranks=range(4)).rank == 2
    with pytest.raises(InconclusiveEvidence, match=r"\[0, 1, 3\]"):
        classify(reports, FailureHistory())
    with pytest.raises(InconclusiveEvidence):  # two silent members: cannot tell
        classify(reports, FailureHistory(), ranks=range(5))


def test_hearsay_from_every_member_is_a_transient_of_the_earliest_once_stalled():
    # Every member lost "a peer" and none is lost (one's own report was a consequence of its
    # failure): after the caller's wait, the whole generation resets from its snapshots.
    reports = [CollectiveError(r, CLOSED, 10.0 + 0.1 * (3 - r)) for r in (3, 1, 0, 2)]
    with pytest.raises(InconclusiveEvidence):
        classify(reports, FailureHistory(), ranks=range(4))
    c = classify(reports, FailureHistory(), ranks=range(4), stalled=True)
    assert (c.rank, c.kind) == (3, Decision.TRANSIENT) and "whole generation" in c.reason
    # a stall does not override attributable evidence
    assert classify(reports[:3], FailureHistory(), ranks=range(4), stalled=True).rank == 2


def test_suspect_rank_votes_for_the_peer_most_survivors_name():
    reports = [
        CollectiveError(0, CLOSED, 10.0, peer=5),
        CollectiveError(4, NCCL_WD, 10.1, peer=1),
        CollectiveError(6, CLOSED, 10.2, peer=1),
    ]
    assert suspect_rank(reports) == 1
    # a tie goes to the peer named first
    assert suspect_rank(reports[:2]) == 5
    # direct evidence outranks any vote; a local (first-hand) error outranks hearsay
    assert suspect_rank([*reports, HeartbeatStale(7, 1.0, 11.0)]) == 7
    assert suspect_rank([*reports, CollectiveError(3, LOCAL, 10.5)]) == 3
    # a reporter naming itself is not a vote
    with pytest.raises(InconclusiveEvidence):
        suspect_rank([CollectiveError(2, CLOSED, 1.0, peer=2)])


def test_no_evidence_is_an_error():
    with pytest.raises(ValueError):
        classify([], FailureHistory())


@pytest.mark.parametrize("kwargs", [{"max_transient": -1}, {"window_s": 0}, {"window_s": -5.0}])
def test_policy_validation(kwargs):
    with pytest.raises(ConfigError):
        ClassifyPolicy(**kwargs)


def test_history_is_immutable_and_prunes():
    h0 = FailureHistory()
    h1 = h0.record(1, 5.0)
    assert h0.transients == () and h1.transients == ((1, 5.0),)
    assert h1.record(2, 700.0).prune(now=700.0, window_s=600.0).transients == ((2, 700.0),)


@pytest.mark.parametrize(
    "message, lost",
    [
        (CLOSED, True),
        ("Connection reset by peer", True),
        ("[gloo/transport/tcp/pair.cc:598] Read error [127.0.0.1]:1234: Connection refused", True),
        (TIMEOUT, True),
        (NCCL_WD, True),
        ("NCCL error in: ProcessGroupNCCL.cpp:1275, unhandled system error", True),
        (
            "replica receive with rank 2 failed: MPI_ERR_PROC_FAILED (MPI_ERR_PROC_FAILED: "
            "Process Failure)",
            True,
        ),
        (
            "replica send with rank 3 failed: MPI_ERR_REVOKED (MPI_ERR_REVOKED: Communication "
            "Object Revoked)",
            True,
        ),
        (LOCAL, False),
        ("CUDA out of memory. Tried to allocate 2.00 GiB", False),
    ],
)
def test_is_peer_loss_message(message, lost):
    assert is_peer_loss_message(message) is lost


def test_an_own_error_replayed_at_the_same_place_is_replaced_then_ends_the_job():
    # The replay after a recovery is bitwise: an own error that comes again with the same
    # message at the same iteration and phase is the training's. Once again: replaced all
    # the same (a device at fault fails the same way in place); twice, on any rank: REPEATED.
    bug = "RuntimeError: injected bug at iteration 5, phase forward"
    first = CollectiveError(1, bug, 10.0, where=(5, "forward"))
    history = FailureHistory()
    assert classify([first], history).kind is T
    history = history.record(1, 10.0).record_error(first)
    again = CollectiveError(1, bug, 20.0, where=(5, "forward"))
    c = classify([again], history)
    assert c.kind is P and c.rank == 1
    assert "the same error as 1 time(s) before at iteration 5 (phase forward)" in c.reason
    assert c.reason.endswith("replaced, in case its device is at fault")
    history = history.record_error(again)
    c = classify([CollectiveError(3, bug, 30.0, where=(5, "forward"))], history)
    assert c.kind is Decision.REPEATED and c.rank == 3
    assert c.reason.endswith("a deterministic error in the training, not a fault")
    # elsewhere, or another message, or a peer's loss, or no place known: not a repeat
    for other in (
        CollectiveError(1, bug, 30.0, where=(6, "forward")),
        CollectiveError(1, bug, 30.0, where=(5, "backward")),
        CollectiveError(1, LOCAL, 30.0, where=(5, "forward")),
        CollectiveError(1, bug, 30.0),
    ):
        assert classify([other], history).kind is T, other
    hearsay = CollectiveError(0, CLOSED, 30.0, peer=1, where=(5, "forward"))
    assert history.record_error(hearsay) == history
    assert classify([hearsay], history.record_error(hearsay)).kind is T


def test_an_own_error_in_a_recovery_resets_then_is_replaced_then_ends_on_the_spare():
    # A recovery's own error has its place as (the iteration recovered from, "recovery"):
    # the rank that holds it resets in place, is replaced when the recovery meets it again,
    # and the spare that reports it and exits (its takeover failed: it holds nothing) ends
    # the job. The exit decides (permanent); the error is what is matched and recorded.
    bug = "InjectedBug: injected bug at iteration 5, phase recovery"
    first = CollectiveError(0, bug, 10.0, where=(5, "recovery"))
    c = classify([first], FailureHistory())
    assert c.kind is T and c.cause is first
    history = FailureHistory().record(0, 10.0).record_error(c.cause)
    c = classify([CollectiveError(0, bug, 20.0, where=(5, "recovery"))], history)
    assert c.kind is P and "in the recovery from a failure in iteration 5" in c.reason
    history = history.record_error(c.cause)
    exited = ProcessExited(0, 1, 30.1)
    on_spare = CollectiveError(0, bug, 30.0, where=(5, "recovery"))
    hearsay = CollectiveError(2, CLOSED, 30.05, peer=0)
    c = classify([hearsay, exited, on_spare], history)
    assert c.kind is Decision.REPEATED and c.rank == 0
    assert c.evidence is exited and c.cause is on_spare
    assert c.reason.startswith("ProcessExited: rank 0 exited with status 1 after CollectiveError")
    assert "the same error as 2 time(s) before in the recovery from a failure in iteration 5" in (
        c.reason
    )
    # the first spare to meet it is replaced (a spare meeting it again ends the job)
    once = FailureHistory().record_error(first)
    c = classify([exited, on_spare], FailureHistory())
    assert c.kind is P and c.cause is on_spare and "after CollectiveError" in c.reason
    assert classify([exited, on_spare], once).kind is Decision.REPEATED
    # an exit alone, or with another rank's error or a peer's loss only: the exit as before
    for evidence in (
        [exited],
        [exited, hearsay],
        [exited, CollectiveError(1, bug, 30.0, where=(5, "recovery"))],
    ):
        c = classify(evidence, history)
        assert (
            c.kind is P
            and c.cause is exited
            and c.reason == "ProcessExited: rank 0 exited with status 1"
        ), evidence


def test_the_errors_kept_are_the_newest_and_outlive_the_transient_window():
    from deadpool_megatron.failure.classify import ERRORS_KEPT

    history = FailureHistory()
    for i in range(ERRORS_KEPT + 4):
        history = history.record_error(CollectiveError(0, LOCAL, float(i), where=(i, "forward")))
    assert len(history.errors) == ERRORS_KEPT and history.errors[-1] == (LOCAL, ERRORS_KEPT + 3,
                                                                         "forward")  # fmt: skip
    pruned = history.record(0, 10_000.0).prune(10_000.0, 600.0)
    assert pruned.errors == history.errors and pruned.transients == ((0, 10_000.0),)


def test_a_cuda_error_is_read_from_its_message_and_replayed_ends_after_one_spare():
    from deadpool_megatron.failure.evidence import cuda_error_recoverable

    assert cuda_error_recoverable("OutOfMemoryError: CUDA out of memory. Tried to allocate") is True
    assert cuda_error_recoverable("AcceleratorError: CUDA error: an illegal memory access was "
                                  "encountered") is False  # fmt: skip
    assert cuda_error_recoverable("RuntimeError: CUDA error: device-side assert triggered") is False
    assert (
        cuda_error_recoverable("RuntimeError: CUBLAS_STATUS_EXECUTION_FAILED when calling") is False
    )
    assert cuda_error_recoverable(LOCAL) is None and cuda_error_recoverable(CLOSED) is None
    # a context that may be corrupted: a spare at once; the same on the spare: the job ends
    assert_ = "RuntimeError: CUDA error: device-side assert triggered"
    first = CudaError(1, assert_, False, 10.0, where=(7, "forward"))
    history = FailureHistory()
    assert classify([first], history).kind is P
    history = history.record_error(first)
    c = classify([CudaError(1, assert_, False, 20.0, where=(7, "forward"))], history)
    assert c.kind is Decision.REPEATED and "the same error as 1 time(s) before" in c.reason
    assert classify([CudaError(1, assert_, False, 20.0, where=(8, "forward"))], history).kind is P
    # out of memory resets in place first, as any own error
    oom = CudaError(2, "OutOfMemoryError: CUDA out of memory", True, 10.0, where=(3, "backward"))
    assert classify([oom], FailureHistory()).kind is T
    once = FailureHistory().record_error(oom)
    assert classify([oom], once).kind is P
    assert classify([oom], once.record_error(oom)).kind is Decision.REPEATED


def test_a_repeat_is_matched_but_for_what_a_replay_changes_in_its_message():
    from deadpool_megatron.failure.classify import error_shape

    # CUDA's out-of-memory message names what the allocator had: a spare's differs
    oom = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a "
           "total capacity of 79.15 GiB of which {} is free. Process {} has 79.14 GiB memory "
           "in use.")  # fmt: skip
    once = FailureHistory().record_error(
        CudaError(2, oom.format("6.44 MiB", "pid 4242"), True, 10.0, where=(3, "backward"))
    )
    again = CudaError(5, oom.format("512 bytes", "pid 77"), True, 20.0, where=(3, "backward"))
    assert classify([again], once).kind is P
    address = "CUDA error: an illegal memory access was encountered at 0x{}"
    first = CudaError(1, address.format("7f3a2c000000"), False, 10.0, where=(7, "forward"))
    on_spare = CudaError(1, address.format("7f19e4000000"), False, 20.0, where=(7, "forward"))
    assert classify([on_spare], FailureHistory().record_error(first)).kind is Decision.REPEATED
    assert (
        error_shape("RuntimeError: refused by 10.0.0.3:29500")
        == "RuntimeError: refused by <address>"
    )
    # any other number a deterministic error computes again: one that changed is not a repeat
    history = FailureHistory().record_error(CollectiveError(1, LOCAL, 10.0, where=(5, "forward")))
    other = LOCAL.replace("512", "256")
    assert classify([CollectiveError(1, other, 20.0, where=(5, "forward"))], history).kind is T
    assert classify([CollectiveError(1, LOCAL, 20.0, where=(5, "forward"))], history).kind is P
