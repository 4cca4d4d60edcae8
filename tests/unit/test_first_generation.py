"""An agent's view of generation 0 before it is recorded (agent/first_generation.py), on an
in-process store: a failure of a registered rank is held (its process fenced first when
alive) until the limit, a seat whose process died unregistered starts again, and generation
0 is recorded only when asked to and every rank has registered, by whichever agent is first."""

from __future__ import annotations

from dataclasses import astuple
from types import SimpleNamespace

import pytest

from deadpool_megatron.agent.first_generation import FirstGeneration, record_first_generation
from deadpool_megatron.agent.hotswap import Held, Run
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.membership import MembershipStore
from deadpool_megatron.control.messages import Flag, Registration
from deadpool_megatron.control.monitor import Detection
from deadpool_megatron.events import EventLog, read_events
from deadpool_megatron.failure.classify import Classification, Decision
from deadpool_megatron.failure.evidence import ProcessExited
from deadpool_megatron.topology import Topology

pytestmark = pytest.mark.timeout(60)

JOB = "first-gen"
LIMIT_S = 600.0


def _child(pid: int, local_rank: int = 1, alive: bool = True):
    return SimpleNamespace(proc=SimpleNamespace(pid=pid), local_rank=local_rank, index=pid,
                           alive=lambda: alive)  # fmt: skip


def _run() -> Run:
    # the node's processes; its watchers are not used here
    return Run({0: _child(100, 0), 1: _child(101)}, None, None, None, None, None)


def _detection(rank: int, at: float) -> Detection:
    c = Classification(rank, Decision.PERMANENT, "exited", ProcessExited(rank, -9, at))
    return Detection(c, (c.evidence,), at, None)


def _first(kv, tmp_path, started: list | None = None) -> FirstGeneration:
    def start_seat(rank: int, local_rank: int):
        started.append((rank, local_rank))
        return _child(200 + rank, local_rank)

    events = EventLog(str(tmp_path / "events.jsonl"))
    return FirstGeneration(JobContext(kv, JOB), Topology(2, 1, 1, 2), ["spare-2", "spare-3"],
                           LIMIT_S, start_seat, events)  # fmt: skip


def test_a_registered_ranks_failure_is_held_fenced_once_until_the_limit(kv, tmp_path, caplog):
    first = _first(kv, tmp_path)
    JobContext(kv, JOB).put(keys.registration(JOB, 0, 1), Registration("h", 101))
    run, fenced = _run(), []
    assert first.hold(_detection(1, 1000.0), None, run, lambda: fenced.append(1) or 0.25)
    held = run.held[1]
    assert isinstance(held, Held) and held.pid == 101 and held.detection.detected_at == 1000.0
    assert held.fence_s == 0.25  # what the fence said it took
    assert fenced == [1] and "its recovery waits for them (up to 600 s)" in caplog.text
    # later looks keep the first detection, and do not fence again
    assert first.hold(
        _detection(1, 1000.0 + LIMIT_S), run.held.pop(1), run, lambda: fenced.append(2) or 0.0
    )
    assert run.held[1] == held and fenced == [1]
    assert not first.hold(
        _detection(1, 1000.1 + LIMIT_S), run.held.pop(1), run, lambda: fenced.append(2) or 0.0
    )


def test_a_fenced_process_that_never_registered_is_held_without_the_wait_line(kv, tmp_path, caplog):
    first = _first(kv, tmp_path)
    run = _run()
    assert first.hold(_detection(1, 5.0), None, run, lambda: 0.0)
    assert 1 in run.held and "waits for them" not in caplog.text


def test_a_seat_whose_process_died_unregistered_starts_again(kv, tmp_path):
    started: list = []
    first = _first(kv, tmp_path, started)
    run = _run()
    assert not first.registered(1)
    first.relaunch(1, ProcessExited(1, -9, 0.0), run)
    assert started == [(1, 1)] and run.workers[1].proc.pid == 201 and run.relaunched == {1}
    first.events.close()
    (event,) = read_events(str(tmp_path / "events.jsonl"))
    assert event["event"] == "rank_relaunched" and event["rank"] == 1
    assert (event["old_pid"], event["pid"], event["returncode"]) == (101, 201, -9)


def test_generation_0_is_recorded_when_asked_once_every_rank_registered(kv, tmp_path):
    first = _first(kv, tmp_path)
    ctx = JobContext(kv, JOB)
    ctx.put(keys.registration(JOB, 0, 0), Registration("h", 100))
    assert not first.up([], record=True)  # rank 1 has not registered
    ctx.put(keys.registration(JOB, 0, 1), Registration("h", 101))
    assert not first.up([], record=False)  # only node 0, or an agent with a failure, records
    # this node's spare-2 has exited; spare-3 (another node's) registered in the store
    kv.set(keys.spare(JOB, "spare-3"), Flag("spare-3").encode())
    spare2 = SimpleNamespace(index=2, alive=lambda: False)
    assert first.up([spare2], record=True)
    assert MembershipStore(kv, JOB).current().spares == ("spare-3",)
    assert first.up([], record=False)  # recorded: up for everyone


def test_generation_0_is_recorded_once_every_rank_registered_by_whichever_agent_is_first(kv):
    # Two agents of a 2-node job (TP1 x PP2 x DP2): neither records while rank 3 has not
    # registered; then node 1's agent (deciding on a failure) records first, with the spares
    # that are alive, and node 0's poll finds it recorded (the first writer wins).
    topo = Topology(4, 1, 2, 2)
    ctx = JobContext(kv, JOB)
    for rank in (0, 1, 2):
        ctx.put(keys.registration(JOB, 0, rank), Registration(f"host{rank // 2}", 100 + rank))
    spares = ["spare-4", "spare-5"]
    alive = {"spare-4"}.__contains__
    assert not record_first_generation(ctx, topo, spares, alive)
    assert MembershipStore(kv, JOB).current() is None
    ctx.put(keys.registration(JOB, 0, 3), Registration("host1", 103))
    assert record_first_generation(JobContext(kv, JOB), topo, spares, alive)  # node 1's agent
    recorded = MembershipStore(kv, JOB).current()
    assert recorded.generation == 0 and recorded.spares == ("spare-4",)
    assert [(m.rank, m.coords) for m in recorded.ranks] == [
        (r, astuple(topo.coords(r))) for r in range(4)
    ]
    assert recorded.member(3).process_id == Registration("host1", 103).process_id
    # node 0's agent, a moment later and seeing both spares alive: the record stands as is
    assert record_first_generation(ctx, topo, spares, lambda sid: True)
    assert MembershipStore(kv, JOB).current() == recorded
