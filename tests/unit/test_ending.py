"""One node's end of a job (agent/ending.py) on a real in-process store: the last node to count
its ranks done says the job finished; a recovery ordered while a node waits is told its ranks
had finished, and an unrecoverable plan ends the wait; a checkpoint-restart ordered meanwhile
does too; node 0 hosting the TCPStore leaves last; in etcd the last agent to leave deletes the
job's keys, its restarts' included."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from deadpool_megatron.agent.ending import AGENTS_LEAVE_S, FINISH_TIMEOUT_S, Ending
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.etcd_store import EtcdKVStore
from deadpool_megatron.control.messages import (
    Flag,
    PlanDecision,
    RankLost,
    RecoveryOrder,
    RestartOrder,
)
from deadpool_megatron.control.store import StoreTimeout

JOB = "ending-test"


def _workers(*ranks: int, status: int | None = 0) -> dict:
    return {r: SimpleNamespace(proc=SimpleNamespace(poll=lambda: status)) for r in ranks}


def _ending(ctx: JobContext, node: int, **kw) -> Ending:
    given = dict(node_count=2, world_size=4, fault_scope=JOB, restarts=0, hosts_store=node == 0,
                 outlives=False)  # fmt: skip
    return Ending(ctx, node, **{**given, **kw})


def test_the_node_that_completes_the_count_says_the_job_finished(kv):
    ctx = JobContext(kv, JOB)
    first, last = _ending(ctx, 0), _ending(ctx, 1)
    waited: list = []
    t = threading.Thread(target=lambda: waited.append(first.wait(_workers(0, 1))))
    t.start()
    time.sleep(0.3)
    assert not waited and ctx.get(keys.job_finished(JOB), Flag) is None  # 2 of 4 ranks done
    assert isinstance(last.wait(_workers(2, 3)), Flag)
    t.join(5)
    assert isinstance(waited[0], Flag)


def test_a_recovery_ordered_while_waiting_is_told_the_ranks_finished(kv):
    ctx = JobContext(kv, JOB)
    ctx.put(keys.recovery_order(JOB, 1), RecoveryOrder("rank 3 exited", (3,), by=1))
    ctx.put(keys.recovery_plan(JOB, 1), PlanDecision(unrecoverable="no spare left"))
    got = _ending(ctx, 0).wait(_workers(0, 1))
    assert got.unrecoverable == "no spare left"
    for rank in (0, 1):
        told = ctx.get(keys.rank_lost(JOB, 1, rank), RankLost)
        assert told.finished and told.reason == "finished training"
    assert ctx.get(keys.rank_lost(JOB, 1, 2), RankLost) is None  # not this node's


def test_a_checkpoint_restart_ordered_meanwhile_ends_the_wait(kv):
    ctx = JobContext(kv, JOB)
    order = RestartOrder(keys.restarted_job(JOB, 1), "rank 2 failed", 1)
    ctx.put(keys.restart(JOB, 1), order)
    assert _ending(ctx, 1).wait(_workers(2, 3)) == order


def test_node_0_hosting_the_store_leaves_after_every_other_agent(kv):
    ctx = JobContext(kv, JOB)
    left: list[float] = []
    t = threading.Thread(target=lambda: (_ending(ctx, 0).leave(2), left.append(time.time())))
    t.start()
    time.sleep(0.3)
    assert not left  # node 1 has not left yet
    other = time.time()
    _ending(ctx, 1).leave(2)
    t.join(5)
    assert left and left[0] >= other
    # a lost node is not waited for: one member left of two launched
    alone = JobContext(kv, JOB + "-lost")
    _ending(alone, 0).leave(members=1)
    # a node that joined the job is: three members of two launched
    joined = JobContext(kv, JOB + "-joined")
    left.clear()
    t = threading.Thread(target=lambda: (_ending(joined, 0).leave(3), left.append(time.time())))
    t.start()
    _ending(joined, 1).leave(3)
    time.sleep(0.3)
    assert not left  # the joined node 2 has not left yet
    _ending(joined, 2).leave(3)
    t.join(5)
    assert left


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


def test_the_waits_give_up_at_their_limits_on_the_clock_they_are_given(kv, caplog):
    ctx = JobContext(kv, JOB)
    clock = FakeClock()
    with pytest.raises(StoreTimeout, match="every node's workers to succeed"):
        _ending(ctx, 0, clock=clock, sleep=clock.sleep).wait(_workers(0, 1))
    assert FINISH_TIMEOUT_S < clock.t < FINISH_TIMEOUT_S + 1
    clock.t = 0.0
    _ending(ctx, 0, clock=clock, sleep=clock.sleep).leave(2)  # node 1 never leaves
    assert AGENTS_LEAVE_S < clock.t < AGENTS_LEAVE_S + 1
    assert "closing the store anyway" in caplog.text


def test_in_etcd_the_last_agent_to_leave_deletes_the_jobs_keys(etcd_url):
    store = EtcdKVStore(etcd_url)
    try:
        ctx = JobContext(store, JOB)
        restarted = JobContext(store, keys.restarted_job(JOB, 1))
        ctx.put(keys.job_finished(JOB), Flag("agent"))
        restarted.put(keys.job_finished(restarted.job), Flag("agent"))
        _ending(ctx, 1, outlives=True, restarts=1).leave(2)
        assert ctx.get(keys.job_finished(JOB), Flag) is not None  # node 0 is still there
        _ending(ctx, 0, outlives=True, restarts=1).leave(2)
        assert ctx.get(keys.job_finished(JOB), Flag) is None
        assert restarted.get(keys.job_finished(restarted.job), Flag) is None
    finally:
        store.close()
