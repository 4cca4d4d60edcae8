"""The agents' comparison of their launches through an in-process store, on a fake clock:
alike launches go on, unlike ones are refused by every agent, a node that never starts is
named; node 0, which may host the store, waits for the others to have read before it ends."""

import pytest
from waiting import FakeClock

from deadpool_megatron.agent.launches import COMPARED_WAIT_S, compare_launches
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import NodeLaunch
from deadpool_megatron.errors import ConfigError, LaunchError

pytestmark = pytest.mark.timeout(60)

JOB = "job-7"
SHAPE = {"script": "pretrain_gpt.py", "nnodes": 2, "spare_nodes": 0, "nproc_per_node": 4,
         "spares": 1, "restart_policy": "hotswap", "max_restarts": 10}  # fmt: skip


def _launch(node: int, train_iters: int = 14) -> NodeLaunch:
    return NodeLaunch(node, f"host{node}", SHAPE, {"train_iters": train_iters})


def _compare(kv, node: int, clock: FakeClock, nodes: int = 2, train_iters: int = 14) -> int:
    return compare_launches(JobContext(kv, JOB), _launch(node, train_iters), nodes, 60.0,
                            clock=clock, sleep=clock.sleep)  # fmt: skip


def test_alike_launches_are_compared_and_counted(kv):
    clock = FakeClock()
    JobContext(kv, JOB).put(keys.node_launch(JOB, 1), _launch(1))
    assert _compare(kv, 0, clock) == 2
    assert clock.now == 0.0  # nothing to wait for
    assert kv.add(keys.launches_compared(JOB), 0) == 1


def test_unlike_launches_are_refused_and_node_0_waits_for_the_other_to_read(kv):
    clock = FakeClock()
    JobContext(kv, JOB).put(keys.node_launch(JOB, 1), _launch(1, train_iters=20))
    with pytest.raises(ConfigError, match="--train-iters: node 0: 14; node 1: 20"):
        _compare(kv, 0, clock)
    assert COMPARED_WAIT_S <= clock.now < COMPARED_WAIT_S + 1  # node 1 never compared here
    with pytest.raises(ConfigError, match="--train-iters: node 0: 14; node 1: 20"):
        _compare(kv, 1, clock, train_iters=20)  # node 1 comes to the same verdict


def test_node_0_ends_as_soon_as_every_agent_has_compared(kv):
    clock = FakeClock()
    JobContext(kv, JOB).put(keys.node_launch(JOB, 1), _launch(1, train_iters=20))
    kv.add(keys.launches_compared(JOB), 1)  # node 1 has read every launch
    with pytest.raises(ConfigError):
        _compare(kv, 0, clock)
    assert clock.now == 0.0


def test_a_node_that_never_starts_is_named_after_the_timeout(kv):
    clock = FakeClock()
    JobContext(kv, JOB).put(keys.node_launch(JOB, 2), _launch(2))
    with pytest.raises(LaunchError, match=r"node\(s\) \[1\] of 3 did not start their agent "
                                          r"within 60 s"):  # fmt: skip
        _compare(kv, 0, clock, nodes=3)
    assert 60.0 <= clock.now < 61.0
