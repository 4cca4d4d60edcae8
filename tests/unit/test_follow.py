"""An agent's side of a recovery on a real in-process TCPStore: following one another node
coordinates (its ranks that exited 0 are reported finished, not lost, not fenced, and a
decision that the job finished ends it as succeeded), and the spares it counts free."""

import threading
import time
from types import SimpleNamespace

from deadpool_megatron.agent.hotswap import HotSwap, Run, Stop
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.membership import Member, Membership, MembershipStore
from deadpool_megatron.control.messages import Flag, PlanDecision, RankLost, RecoveryOrder
from deadpool_megatron.events import EventLog

JOB = "follow-test"


def _run(finished: set[int], workers: tuple[int, ...]):
    monitor = SimpleNamespace(
        finished=lambda r: r in finished,
        lost=lambda r: None,  # still running: the follower waits for it
    )
    nodes = SimpleNamespace(poll=lambda: [], is_lost=lambda node: False)
    return Run(dict.fromkeys(workers), None, monitor, None, None, nodes)


def test_a_follower_says_its_ranks_finished_and_ends_as_finished(kv):
    ctx = JobContext(kv, JOB)
    ctx.put(keys.recovery_order(JOB, 1), RecoveryOrder("rank 5 exited", (5,), by=2))
    finished = {0}  # rank 1 exits 0 while the follower polls
    swap = HotSwap(ctx, 0, _run(finished, (0, 1)), EventLog(None), "stop")
    got = {}
    follower = threading.Thread(target=lambda: got.update(stop=swap.follow(1)), daemon=True)
    follower.start()
    deadline = time.monotonic() + 10
    while ctx.get(keys.rank_lost(JOB, 1, 0), RankLost) is None:
        assert time.monotonic() < deadline, "rank 0 was never reported"
        time.sleep(0.01)
    assert ctx.get(keys.rank_lost(JOB, 1, 1), RankLost) is None  # running: nothing said yet
    finished.add(1)
    while ctx.get(keys.rank_lost(JOB, 1, 1), RankLost) is None:
        assert time.monotonic() < deadline, "rank 1 was never reported"
        time.sleep(0.01)
    for rank in (0, 1):
        assert ctx.get(keys.rank_lost(JOB, 1, rank), RankLost) == RankLost(
            "finished training", finished=True
        )
    assert follower.is_alive()  # it waits for the coordinator's word
    ctx.put(keys.recovery_plan(JOB, 1), PlanDecision(finished="ranks [0, 1, ...] finished"))
    follower.join(10)
    assert got["stop"] == Stop(False, "ranks [0, 1, ...] finished", finished=True)
    assert ctx.generation == 1


def test_spares_of_a_node_whose_lease_is_not_seen_yet_count_by_their_own_records(kv):
    # A failure in the job's first second: node 3's lease is not read yet. Its spare that
    # registered and beats is free; one still warming up is waited for; once the lease is
    # read and names neither (not alive), neither counts.
    ctx = JobContext(kv, JOB)
    members = tuple(Member(r, f"w{r}", (0, 0, r)) for r in range(6))
    MembershipStore(kv, JOB).create(Membership(0, members, ("spare-6",)))
    kv.set(keys.spare(JOB, "spare-6"), Flag("spare-6").encode())
    kv.set(keys.spare_heartbeat(JOB, "spare-6"), Flag("spare-6").encode())
    read = set()
    nodes = SimpleNamespace(
        node_of_spare=lambda sid: None, seen=lambda node: node in read, is_lost=lambda n: False,
        hosted_spares=lambda: [], host_of=lambda rank: 2, busy=lambda: {0, 1, 2},
        lost_nodes=lambda: set(),
    )  # fmt: skip
    run = SimpleNamespace(pool=SimpleNamespace(idle=[]), nodes=nodes, workers={},
                          coordinator=SimpleNamespace(claimer="node 2"))  # fmt: skip
    swap = HotSwap(ctx, 2, run, EventLog(None), "stop", {"spare-6": 3, "spare-7": 3})
    assert swap._free_spares({4})[0] == ["spare-6"]
    assert swap._starting() == ["spare-7"]
    read.add(3)
    assert swap._free_spares({4})[0] == [] and swap._starting() == []
