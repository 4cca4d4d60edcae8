"""A node joining a running job (agent/joining.py), on a real in-process store: it takes the
next index past the launched nodes, is refused when launched unlike them, when there is no such
job or it is ending, and joins a checkpoint-restarted job's current start; the other agents
watch it from its first lease on and wait for it at the job's end (NodeWatch)."""

from __future__ import annotations

import pytest

from deadpool_megatron.agent.joining import claim_node, current_start
from deadpool_megatron.agent.nodes import Hosted, Lease, NodeWatch
from deadpool_megatron.control import keys
from deadpool_megatron.control.context import JobContext
from deadpool_megatron.control.messages import Flag, NodeLaunch, RestartOrder
from deadpool_megatron.errors import ConfigError, LaunchError

JOB = "joining-test"
SHAPE = {"script": "pretrain_gpt.py", "nnodes": 2, "spare_nodes": 1, "nproc_per_node": 2,
         "spares": 0, "restart_policy": "hotswap", "max_restarts": 10}  # fmt: skip
FLAGS = {"train_iters": 20, "tensor_model_parallel_size": 1, "deadpool": True}


def _launched(ctx: JobContext, nodes: int = 3) -> None:
    for n in range(nodes):
        ctx.put(keys.node_launch(ctx.job, n), NodeLaunch(n, f"host{n}", SHAPE, FLAGS))


def _joining(shape=SHAPE, flags=FLAGS) -> NodeLaunch:
    return NodeLaunch(-1, "fresh-host", shape, flags)


def test_joining_nodes_take_the_indices_past_the_launched_ones_in_turn(kv):
    ctx = JobContext(kv, JOB)
    _launched(ctx)
    assert claim_node(ctx, _joining(), 3, timeout_s=1.0) == 3
    assert claim_node(ctx, _joining(), 3, timeout_s=1.0) == 4
    assert ctx.kv.add(keys.joined_nodes(JOB), 0) == 2
    recorded = ctx.get(keys.node_launch(JOB, 4), NodeLaunch)  # compared by the next to join
    assert (recorded.node, recorded.host, recorded.flags) == (4, "fresh-host", FLAGS)


def test_a_node_launched_unlike_the_job_is_refused_and_takes_no_index(kv):
    ctx = JobContext(kv, JOB)
    _launched(ctx)
    with pytest.raises(ConfigError, match=r"(?s)node 3, joining the job, was launched unlike "
                       r"its 3 launched node.*train-iters: nodes 0-2: 20; node 3: 40"):  # fmt: skip
        claim_node(ctx, _joining(flags={**FLAGS, "train_iters": 40}), 3, timeout_s=1.0)
    with pytest.raises(ConfigError, match=r"--nproc-per-node: nodes 0-2: 2; node 3: 4"):
        claim_node(ctx, _joining(shape={**SHAPE, "nproc_per_node": 4}), 3, timeout_s=1.0)
    assert ctx.kv.add(keys.joined_nodes(JOB), 0) == 0
    assert claim_node(ctx, _joining(), 3, timeout_s=1.0) == 3


def test_there_must_be_a_running_job_to_join(kv):
    ctx = JobContext(kv, JOB)
    with pytest.raises(LaunchError, match=r"no job 'joining-test' to join .* within 0.3 s"):
        claim_node(ctx, _joining(), 3, timeout_s=0.3)
    _launched(ctx)
    ctx.put(keys.job_finished(JOB), Flag("agent"))
    with pytest.raises(LaunchError, match="is ending"):
        claim_node(ctx, _joining(), 3, timeout_s=1.0)


def test_a_checkpoint_restarted_job_is_joined_in_its_current_start(kv):
    ctx = JobContext(kv, JOB)
    _launched(ctx)
    assert current_start(ctx) == JOB
    for count in (1, 2):
        ctx.put(keys.restart(JOB, count),
                RestartOrder(keys.restarted_job(JOB, count), "rank 1 failed", count))  # fmt: skip
    assert current_start(ctx) == keys.restarted_job(JOB, 2)
    ctx.put(keys.job_finished(JOB), Flag("agent"))  # the first start's end is no matter
    assert claim_node(ctx, _joining(), 3, timeout_s=1.0) == 3
    ctx.put(keys.job_finished(keys.restarted_job(JOB, 2)), Flag("agent"))
    with pytest.raises(LaunchError, match="is ending"):
        claim_node(ctx, _joining(), 3, timeout_s=1.0)


def test_a_joined_node_is_watched_from_its_first_lease_and_counted_at_the_end(kv):
    ctx = JobContext(kv, JOB)
    mine = Lease(ctx, 0, lambda: Hosted(0, (0, 1), ()), 0.5)
    watch = NodeWatch(ctx, 0, [0, 1, 2], 2.0, lambda: mine.renewed, 3)
    assert watch.members(3) == 3
    assert watch.watch(3) and not watch.watch(3) and not watch.watch(0)
    watch.poll()
    assert watch.members(3) == 3  # joined, but no lease yet: the end does not wait for it
    Lease(ctx, 3, lambda: Hosted(0, (), ("spare-3000", "spare-3001")), 0.5).renew()
    watch.poll()
    assert watch.members(3) == 4
    assert watch.hosted_spares() == ["spare-3000", "spare-3001"]
    assert watch.node_of_spare("spare-3001") == 3
