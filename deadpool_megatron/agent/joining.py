"""A node joining a running job (`deadpool-launch --join`): a fresh node brought in after the
launch, to refill the spare nodes that lost nodes used up. A months-long job loses a node
every few hours; its spare nodes cover the first `--spare-nodes` of those, and without new ones
the next loss would end the job.

The joining agent finds the job in its store, refuses to join one whose nodes were launched
with other flags (it would build other groups) or that is ending, and takes the next node
index past every launched node (`--nnodes + --spare-nodes` on, one counter the store adds).
It then runs as a spare node: the other agents find it at their next look at the job
(`Agent._watch_joined`), watch its lease like any node's, and its spares join the pool.
"""

from __future__ import annotations

import argparse
import logging
import socket

from ..agreement import refuse_unlike_launches
from ..config import DeadpoolConfig
from ..control import keys
from ..control.context import JobContext
from ..control.messages import Flag, NodeLaunch, RestartOrder
from ..control.store import StoreTimeout
from ..control.wait import wait_until
from ..errors import LaunchError
from .launches import agree_job_id, node_shape, open_store, recorded_launches

log = logging.getLogger("deadpool.launch")


def current_start(ctx: JobContext) -> str:
    """The job id of the job's current start: its own, or its newest checkpoint-restart's."""
    count, job = 0, ctx.job
    while (order := ctx.get(keys.restart(ctx.job, count + 1), RestartOrder)) is not None:
        count, job = count + 1, order.job
    return job


def claim_node(ctx: JobContext, mine: NodeLaunch, launched: int, timeout_s: float) -> int:
    """Compare this node's launch (`mine`, its node index not yet known) with the launched
    nodes' and take the next node index. Raises ConfigError naming every difference, or
    LaunchError when there is no such job to join or it is ending."""
    scope = ctx.job
    job = current_start(ctx)

    def read() -> dict[int, NodeLaunch]:
        found = recorded_launches(ctx, launched)
        return {n: launch for n, launch in found.items() if launch is not None}

    try:
        theirs = wait_until(lambda: read() or None, timeout_s, "the job's nodes' launches",
                            interval_s=0.2)  # fmt: skip
    except StoreTimeout:
        raise LaunchError(
            f"no job {scope!r} to join at the store {ctx.kv.endpoint}: none of its "
            f"{launched} launched nodes recorded its launch within {timeout_s:g} s "
            "(--deadpool-slow-phase-timeout); check --job-id, --master-addr, --master-port"
        ) from None
    if ctx.get(keys.job_finished(job), Flag) is not None or ctx.kv.add(keys.agents_left(job), 0):
        raise LaunchError(f"job {scope!r} is ending (its training finished): nothing to join")
    provisional = launched + ctx.kv.add(keys.joined_nodes(scope), 0)
    compared = {n: launch.as_compared() for n, launch in theirs.items()}
    refuse_unlike_launches({**compared, provisional: mine.as_compared()}, joining=provisional)
    node = launched + ctx.kv.add(keys.joined_nodes(scope), 1) - 1
    ctx.put(keys.node_launch(scope, node), NodeLaunch(node, mine.host, mine.shape, mine.flags))
    return node


def join(
    args: argparse.Namespace, protection: DeadpoolConfig, flags: dict | None
) -> tuple[int, str]:
    """Find the running job in its store and join it: (this node's index, the job id). The
    store connection is this call's own; the agent opens its own afterwards."""
    launched = args.nnodes + args.spare_nodes
    _, kv, port = open_store(args, protection, args.master_port)
    try:
        job = args.job_id or agree_job_id(kv, f"{args.master_addr}:{port}", launched,
                                          outlives=protection.deadpool_store == "etcd")  # fmt: skip
        ctx = JobContext(kv, job)
        mine = NodeLaunch(-1, socket.gethostname(), node_shape(args), flags)
        node = claim_node(ctx, mine, launched, protection.deadpool_slow_phase_timeout)
    finally:
        kv.close()
    log.info("job %s: this node joins as node %d, a spare node (%d launched)", job, node,
             launched)  # fmt: skip
    return node, job
