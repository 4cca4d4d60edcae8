"""A worker's own failure reports on a real (in-process) TCPStore: the first report of a
generation is the one the agent classifies by; what the same process hits afterwards (its
replication thread losing the connections the failure shut down) does not overwrite it."""

import threading

from deadpool_megatron.config import JobConfig
from deadpool_megatron.control import keys
from deadpool_megatron.control.client import ControlClient
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import COLLECTIVE_ERROR, INJECTED_TRANSIENT, FailureReport
from deadpool_megatron.failure.injector import InjectedFault
from deadpool_megatron.failure.progress import ProgressBoard
from deadpool_megatron.process.guard import Guard
from deadpool_megatron.runtime import ProcessEnv

JOB = "guard-test"
PEER_LOSS = RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer")


def _guard(kv, rank=2):
    ctx = JobContext(kv, JOB)
    env = ProcessEnv.from_environ({"RANK": str(rank), "WORLD_SIZE": "4"})
    return Guard(JobConfig(), env, ctx, ControlClient(ctx, "local"), ProgressBoard()), ctx


def _report(kv, generation, rank=2):
    raw = kv.get(keys.report(JOB, generation, rank))
    return None if raw is None else FailureReport.decode(raw)


def test_the_first_report_of_a_generation_stands(kv):
    guard, ctx = _guard(kv)
    guard.report(InjectedFault("injected transient fault raise@2:5:forward"))
    guard.report(PEER_LOSS)  # the replication thread, after the training thread's abort
    r = _report(kv, 0)
    assert r.kind == INJECTED_TRANSIENT and "raise@2:5" in r.message
    ctx.advance(1)  # the next generation's failure is reported again
    guard.report(PEER_LOSS)
    assert _report(kv, 1).kind == COLLECTIVE_ERROR


def test_concurrent_reports_write_exactly_one(kv, caplog):
    caplog.set_level("INFO", logger="deadpool.worker")
    guard, _ = _guard(kv)
    errors = [InjectedFault(f"fault {i}") for i in range(8)]
    threads = [threading.Thread(target=guard.report, args=(e,)) for e in errors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r = _report(kv, 0)
    assert r.kind == INJECTED_TRANSIENT and r.message.startswith("InjectedFault: fault ")
    assert sum("not reported" in m for m in caplog.messages) == len(errors) - 1


def test_a_cuda_error_is_reported_as_one_with_where_its_rank_was(kv):
    from deadpool_megatron.control.messages import CUDA_ERROR

    guard, _ = _guard(kv)
    guard.progress.mark(7, "backward")
    guard.report(RuntimeError("CUDA error: an illegal memory access was encountered"))
    r = _report(kv, 0)
    assert r.kind == CUDA_ERROR and (r.iteration, r.phase) == (7, "backward")
    assert r.message == "RuntimeError: CUDA error: an illegal memory access was encountered"


def test_ranks_failing_at_one_point_wait_for_each_other_through_the_store(kv):
    """Rank 1 gets to the point first and waits; rank 2 arrives and neither waits further."""
    first = ControlClient(JobContext(kv, JOB), "local")
    second = ControlClient(JobContext(kv, JOB), "local")
    missing = []
    waiter = threading.Thread(
        target=lambda: missing.append(first.strike_together("5:optimizer", 1, (2,), 30.0))
    )
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # rank 2 is not there yet
    assert second.strike_together("5:optimizer", 2, (1,), 30.0) == ()
    waiter.join(10)
    assert missing == [()]


def test_a_rank_that_never_comes_to_the_point_is_not_waited_for_beyond_the_bound(kv):
    now = [0.0]
    client = ControlClient(JobContext(kv, JOB), "local")

    def sleep(s):
        now[0] += s

    assert client.strike_together("7:forward", 0, (1, 3), 20.0, clock=lambda: now[0],
                                  sleep=sleep) == (1, 3)  # fmt: skip
    assert 20.0 <= now[0] < 21.0


def test_an_own_error_in_a_recovery_is_reported_in_the_generation_it_recovered_into(kv):
    # The process is still in generation 0, stopping (ordered 1): `report` says nothing then
    # (what a recovery does to it is not new evidence), `report_recovery` speaks for
    # generation 1, the one the agent watches, with the iteration recovered from.
    guard, ctx = _guard(kv)
    ctx.see_order(1)
    guard.report(RuntimeError("a peer's abort, seen while stopping"))
    assert _report(kv, 0) is None
    guard.report_recovery(TypeError("jit_warmup() got an unexpected keyword"), 1, 7)
    r = _report(kv, 1)
    assert (r.kind, r.iteration, r.phase) == (COLLECTIVE_ERROR, 7, "recovery")
    assert r.message == "TypeError: jit_warmup() got an unexpected keyword"
    guard.report_recovery(RuntimeError("later"), 1, 7)  # one report per generation
    assert _report(kv, 1).message.startswith("TypeError")
    guard.report_recovery(InjectedFault("raise@2:7:recovery"), 2, 7)
    assert _report(kv, 2).kind == INJECTED_TRANSIENT
