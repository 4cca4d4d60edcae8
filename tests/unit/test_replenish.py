"""Spare replenishment: which spares a node owes its pool (pure), and the pool itself on real
child processes and a real in-process store: a spare that dies idle or a replaced worker is
followed by a fresh spare in the freed slot, with a unique index and pool-size events; a
suspect node starts nothing more."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deadpool_megatron.agent.children import Child
from deadpool_megatron.agent.pool import SparePool
from deadpool_megatron.agent.replenish import MAX_FAILED_STARTS, Replenisher, SpareStart
from deadpool_megatron.control import keys
from deadpool_megatron.control.messages import spare_id
from deadpool_megatron.events import EventLog, read_events

JOB = "pool-test"


def test_indices_are_past_every_initial_block_and_interleaved_by_node():
    # 3 nodes of 2 spare slots: initial spares are 0-5; node 1 replenishes with 7, 10, 13.
    r = Replenisher(True, first_index=3 * 2 + 1, stride=3)
    assert r.next_start() is None  # nothing owed
    r.lost(4)
    r.lost(2)
    assert r.next_start() == SpareStart(7, 4)
    assert r.next_start() == SpareStart(10, 2)
    assert r.next_start() is None
    r.lost(0)
    assert r.next_start() == SpareStart(13, 0)


def test_disabled_or_suspect_nodes_start_nothing():
    off = Replenisher(False, 4, 1)
    off.lost(1)
    assert off.next_start() is None
    r = Replenisher(True, 4, 1)
    r.lost(1)
    r.stop("rank 1 failed its health check")
    assert r.next_start() is None and r.owed == []
    r.lost(2)  # once suspect, always suspect
    assert r.next_start() is None


def test_fresh_spares_dying_before_they_are_ready_in_a_row_stop_replenishment():
    r = Replenisher(True, 4, 1)
    for _ in range(MAX_FAILED_STARTS - 1):
        r.spare_died(ready=False)
    r.spare_died(ready=True)  # a spare that was ready resets the count
    assert r.stopped is None
    for _ in range(MAX_FAILED_STARTS):
        r.spare_died(ready=False)
    assert r.stopped is not None and "before they were ready" in r.stopped


@pytest.fixture
def sleepers():
    started: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                start_new_session=True)  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _child(proc, index, local_rank, role="spare"):
    return Child(role, index, proc, None, local_rank=local_rank)


def _pool(tmp_path, kv, sleepers, spares, enabled=True):
    spawned: list[SpareStart] = []

    def spawn(start: SpareStart) -> Child:
        spawned.append(start)
        return _child(sleepers(), start.index, start.local_rank)

    events = EventLog(str(tmp_path / "events.jsonl"))
    pool = SparePool(0, spares, Replenisher(enabled, 2, 1), spawn, kv, JOB, events)
    return pool, spawned, tmp_path / "events.jsonl"


def test_a_spare_dying_idle_is_replaced_in_its_slot(tmp_path, kv, sleepers):
    a, b = _child(sleepers(), 0, 4), _child(sleepers(), 1, 5)
    kv.set(keys.spare(JOB, spare_id(1)), b"registered")
    kv.set(keys.spare_heartbeat(JOB, spare_id(1)), b"beating")
    pool, spawned, log = _pool(tmp_path, kv, sleepers, [a, b])
    b.proc.kill()
    b.proc.wait()
    pool.watch(iteration=3)
    assert kv.get(keys.spare(JOB, spare_id(1))) is None  # out of the pool for planners
    pool.refill()
    assert spawned == [SpareStart(2, 5)]
    assert pool.alive_ids() == (spare_id(0), spare_id(2)) and pool.size() == 2
    events = read_events(str(log))
    lost = [e for e in events if e["event"] == "spare_lost"]
    assert [(e["spare"], e["ready"]) for e in lost] == [(1, True)]
    assert [e["size"] for e in events if e["event"] == "spare_pool"] == [1, 2]
    pool.watch(iteration=4)  # a death is reported once
    pool.refill()
    assert len(spawned) == 1


def test_a_spare_that_refused_its_input_is_not_replaced(tmp_path, kv, sleepers):
    # Status 2: the spare found its flags or data wrong; a fresh one would be given the same.
    refusing = _child(subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"]), 0, 4)
    refusing.proc.wait()
    pool, spawned, log = _pool(tmp_path, kv, sleepers, [refusing])
    pool.watch(iteration=3)
    pool.refill()
    assert spawned == [] and pool.size() == 0
    (lost,) = [e for e in read_events(str(log)) if e["event"] == "spare_lost"]
    assert lost["how"] == "exited with status 2"


def test_a_replaced_worker_frees_its_slot_for_a_fresh_spare(tmp_path, kv, sleepers):
    spare = _child(sleepers(), 0, 4)
    worker = _child(sleepers(), 3, 3, role="worker")
    pool, spawned, log = _pool(tmp_path, kv, sleepers, [spare])
    assert pool.take(spare_id(0)) is spare and pool.idle == []
    pool.worker_lost(worker)
    pool.refill()
    assert spawned == [SpareStart(2, 3)]
    sizes = [e["size"] for e in read_events(str(log)) if e["event"] == "spare_pool"]
    assert sizes == [0, 1]


def test_an_unfit_node_or_a_disabled_pool_starts_nothing(tmp_path, kv, sleepers):
    pool, spawned, _ = _pool(tmp_path, kv, sleepers, [])
    pool.node_unfit("rank 3 failed its health check")
    pool.worker_lost(_child(sleepers(), 3, 3, role="worker"))
    pool.refill()
    off, off_spawned, _ = _pool(tmp_path, kv, sleepers, [], enabled=False)
    off.worker_lost(_child(sleepers(), 2, 2, role="worker"))
    off.refill()
    assert spawned == [] and off_spawned == []


def test_at_the_end_spares_still_warming_up_are_stopped(tmp_path, kv, sleepers):
    warm, cold = _child(sleepers(), 0, 4), _child(sleepers(), 1, 5)
    kv.set(keys.spare_heartbeat(JOB, spare_id(0)), b"beating")
    pool, _, _ = _pool(tmp_path, kv, sleepers, [warm, cold])
    pool.stop_warming()
    assert cold.proc.wait(timeout=10) != 0
    assert warm.alive()  # a ready spare sees the job end by itself
