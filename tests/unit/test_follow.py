"""An agent following a recovery another node coordinates, on a real in-process TCPStore: its
ranks that exited 0 are reported finished (not lost, not fenced), and a decision that the
job finished ends it as succeeded."""

import threading
import time
from types import SimpleNamespace

from deadpool_megatron.agent.hotswap import HotSwap, Stop
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import PlanDecision, RankLost, RecoveryOrder
from deadpool_megatron.events import EventLog

JOB = "follow-test"


def _run(finished: set[int], workers: tuple[int, ...]):
    monitor = SimpleNamespace(
        finished=lambda r: r in finished,
        lost=lambda r: None,  # still running: the follower waits for it
    )
    nodes = SimpleNamespace(poll=lambda: [], is_lost=lambda node: False)
    return SimpleNamespace(workers=dict.fromkeys(workers), monitor=monitor, nodes=nodes,
                           lost_nodes=[], coordinator=None)  # fmt: skip


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
